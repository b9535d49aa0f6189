#!/usr/bin/env bash
# run.sh end to end without a GPU: a fake libcuda.so.1 (fake/libcuda.c, honouring the MPS variables
# as the MPS client does), fake nvidia-smi, nvidia-cuda-mps-control and device plugin, short timings.
# Checks that every step records a result and that the expected verdicts come out, with the guard
# simulated by GUARD_GRANT_CMD killing the process (and, in a second run, not wired at all).
# Usage: tests/dry-run.sh [path to gpu-check] (default: the release build in $CARGO_TARGET_DIR or target/).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
crate=$(cd "$here/.." && pwd)
gpu_check=${1:-${CARGO_TARGET_DIR:-$crate/target}/release/gpu-check}
[ -x "$gpu_check" ] || { echo "dry-run: build gpu-check first ($gpu_check)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin" "$tmp/lib"
cc -shared -fPIC -O1 -o "$tmp/lib/libcuda.so.1" "$here/fake/libcuda.c"
cc -shared -fPIC -O1 -o "$tmp/lib/libnvidia-ml.so.1" "$here/fake/nvml.c" -L"$tmp/lib" -l:libcuda.so.1
cp "$here/fake/nvidia-smi" "$here/fake/nvidia-cuda-mps-control" "$here/fake/gpuplace-device-plugin" "$tmp/bin/"
cp "$gpu_check" "$tmp/bin/gpu-check"

fail=0
check() { # $1: results file, $2: step, $3: expected `"pass":..` text
  if grep "\"step\":\"$2\"" "$1" | grep -q "$3"; then echo "ok: $2 $3"; else echo "FAIL: $2 has no $3"; fail=1; fi
}
run() { # $1: out folder; the rest: environment
  local out=$1
  shift
  env "$@" PATH="$tmp/bin:$PATH" LD_LIBRARY_PATH="$tmp/lib" BIN_DIR="$tmp/bin" OUT="$out" SPIN_MS=150 \
    GUARD_HOLD_S=8 GUARD_GRACE_S=2 MPS_WAIT_S=5 bash "$crate/run.sh"
}

# 1. The guard wired (simulated: the grant command kills the process).
# shellcheck disable=SC2016 # $1 is the grant command's own argument
run "$tmp/out1" GUARD_GRANT_CMD='kill -9 "$1"' >"$tmp/run1.log" 2>&1 || { cat "$tmp/run1.log"; exit 1; }
r=$tmp/out1/results.jsonl
for s in gpu discover context-overhead-plain max-alloc spin-plain plugin-mps mps-servers-before \
  context-overhead-mps mem-limit-low mem-limit-high spin-100 spin-low spin-100-again compute-share guard; do
  grep -q "\"step\":\"$s\"" "$r" || { echo "FAIL: no step $s"; fail=1; }
done
check "$r" mem-limit-low '"pass":true'
check "$r" mem-limit-high '"pass":true'
check "$r" compute-share '"pass":true'
check "$r" guard '"pass":true'
check "$r" discover '"advertised_mib":81559'
check "$r" plugin-mps '"plugin_alive":true'
check "$r" context-overhead-plain '"overhead_mib":512'
check "$r" context-overhead-mps '"overhead_mib":512'
check "$r" max-alloc '"largest_single_mib":810'
check "$r" spin-low '"sm_count":40'
# every line is JSON
python3 -c 'import json,sys; [json.loads(l) for l in open(sys.argv[1])]' "$r" && echo "ok: results.jsonl parses"
for f in summary.txt logs.txt performance-snippet.md; do [ -s "$tmp/out1/$f" ] || { echo "FAIL: $f empty"; fail=1; }; done
# nothing left running
if pgrep -f nvidia-cuda-mps-control-fake-daemon >/dev/null; then echo "FAIL: MPS daemon left running"; fail=1; fi

# 2. Not wired: the process is not killed, the step says so, and the run still ends.
run "$tmp/out2" >"$tmp/run2.log" 2>&1 || { cat "$tmp/run2.log"; exit 1; }
check "$tmp/out2/results.jsonl" guard '"wired":false'
check "$tmp/out2/results.jsonl" guard '"killed_by_guard":false'

# 3. The plugin's pipes outside --mps-root: found through the daemon's environment.
run "$tmp/out4" FAKE_PIPE_OUTSIDE=1 GUARD_GRACE_S=1 >"$tmp/run4.log" 2>&1 || { cat "$tmp/run4.log"; exit 1; }
check "$tmp/out4/results.jsonl" mps-servers-before '"mps_source":"plugin (pipe outside --mps-root, from /proc)"'
check "$tmp/out4/results.jsonl" mem-limit-high '"pass":true'

# 4. The plugin without the MPS flag: the fallback daemon runs the MPS steps.
cat >"$tmp/bin/gpuplace-device-plugin" <<'EOS'
#!/usr/bin/env bash
[ "$1" = discover ] && { echo '{"gpus": [{"memory_mib": 81559}]}'; exit 0; }
echo "error: unexpected argument '--mps-daemon' found" >&2; exit 2
EOS
run "$tmp/out3" >"$tmp/run3.log" 2>&1 || { cat "$tmp/run3.log"; exit 1; }
check "$tmp/out3/results.jsonl" plugin-mps '"plugin_alive":false'
check "$tmp/out3/results.jsonl" mps-servers-before '"mps_source":"fallback"'
check "$tmp/out3/results.jsonl" mem-limit-low '"pass":true'
if pgrep -f nvidia-cuda-mps-control-fake-daemon >/dev/null; then echo "FAIL: fallback MPS daemon left running"; fail=1; fi

echo "--- summary of the wired run:"
cat "$tmp/out1/summary.txt"
[ "$fail" = 0 ] && echo "dry run: all checks passed"
exit "$fail"
