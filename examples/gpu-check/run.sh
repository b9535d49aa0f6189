#!/usr/bin/env bash
# Issue 49's GPU acceptance run, for one lent GPU machine (README.md beside this file): the plugin's
# MPS daemon, MPS memory limits, the thread percentage's slowdown, the guard, and the advertised MiB
# against what one process can allocate. Results: $OUT/results.jsonl (one JSON object per step),
# $OUT/summary.txt (also printed), $OUT/performance-snippet.md (for docs/performance.md) and
# $OUT/logs.txt (plugin, MPS and nvidia-smi). Whole run under 9 minutes (a deadline bounds every step).
#
# It never changes MIG mode, never resets the GPU, never changes the compute mode: MPS runs in the
# GPU's current compute mode. Everything it starts (plugin, MPS daemon, test processes) is stopped by
# the EXIT trap.
set -euo pipefail

# ---------------------------------------------------------------------------------------------------
# Settings: change here (or set in the environment).
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
BIN_DIR=${BIN_DIR:-$REPO/target/gpu-check}
PLUGIN=${PLUGIN:-$BIN_DIR/gpuplace-device-plugin}
GPU_CHECK=${GPU_CHECK:-$BIN_DIR/gpu-check}
# The guard's own loop on real NVML (device-plugin/examples/guard_check.rs; stage.sh builds it)
GUARD_CHECK=${GUARD_CHECK:-$BIN_DIR/guard_check}
# The plugin's driver memory cap on one cgroup (device-plugin/examples/driver_limit_check.rs)
DRIVER_LIMIT_CHECK=${DRIVER_LIMIT_CHECK:-$BIN_DIR/driver_limit_check}
OUT=${OUT:-$REPO/target/gpu-check-out}
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
MPS_ROOT=$WORK/mps
PLUGIN_DIR=$WORK/device-plugins
# The device plugin's managed-MPS flags (being settled: edit these lines when they change). The
# plugin waits for a kubelet that never comes; it still supervises its MPS daemon meanwhile.
PLUGIN_ARGS=(serve --no-apiserver --mps-daemon --mps-root "$MPS_ROOT" --device-plugin-dir "$PLUGIN_DIR"
  --metrics-listen 127.0.0.1:19400)
# Extra plugin flags, e.g. the guard's (space-separated; set in the environment).
read -r -a PLUGIN_EXTRA_ARGS <<<"${PLUGIN_EXTRA_ARGS:-}"
# Seconds to wait for the plugin's MPS control pipe.
MPS_WAIT_S=${MPS_WAIT_S:-30}
# When the plugin's daemon does not come up: 1 = start `nvidia-cuda-mps-control -d` directly (recorded
# as mps_source "fallback") so the limit and compute checks still run in this one lease.
MPS_FALLBACK=${MPS_FALLBACK:-1}
# Memory limits: a process limited to LOW must fail to allocate LOW_ASK; one limited to HIGH allocates HIGH_ASK.
MEM_LOW_MIB=${MEM_LOW_MIB:-10240}
MEM_LOW_ASK_MIB=${MEM_LOW_ASK_MIB:-12288}
MEM_HIGH_MIB=${MEM_HIGH_MIB:-20480}
MEM_HIGH_ASK_MIB=${MEM_HIGH_ASK_MIB:-19456}
# Compute: the kernel's calibrated duration at 100 %, and the share compared with it.
SPIN_MS=${SPIN_MS:-1500}
SPIN_LOW_PCT=${SPIN_LOW_PCT:-30}
# Guard (step 6): a process granted GUARD_GRANT_MIB that allocates GUARD_ASK_MIB and holds it.
GUARD_GRANT_MIB=${GUARD_GRANT_MIB:-20480}
GUARD_ASK_MIB=${GUARD_ASK_MIB:-30000}
GUARD_HOLD_S=${GUARD_HOLD_S:-60}
GUARD_GRACE_S=${GUARD_GRACE_S:-30}
# >>> LEAD: how the plugin is told that PID $1 is granted $2 MiB (run with GUARD_PID, GUARD_MIB and
# MPS_PIPE set too). Empty: not wired; the step still runs and records whether the process was killed.
GUARD_GRANT_CMD=${GUARD_GRANT_CMD:-}
# The guard's grace in step 6 when guard_check runs it.
GUARD_CHECK_GRACE_S=${GUARD_CHECK_GRACE_S:-10}
# 1: the guard's process is an MPS client (then MPS's own limit would stop it first if one is set).
GUARD_USE_MPS=${GUARD_USE_MPS:-0}
# The whole run's budget in seconds (each step's timeout is cut to what is left).
BUDGET_S=${BUDGET_S:-510}
# ---------------------------------------------------------------------------------------------------

export PATH=$PATH:/usr/local/nvidia/bin
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/nvidia/lib64:/usr/local/nvidia/lib
mkdir -p "$OUT" "$MPS_ROOT" "$PLUGIN_DIR"
RESULTS=$OUT/results.jsonl
SUMMARY=$OUT/summary.txt
LOGS=$OUT/logs.txt
SNIPPET=$OUT/performance-snippet.md
: >"$RESULTS"
: >"$SUMMARY"
: >"$LOGS"
DEADLINE=$((SECONDS + BUDGET_S))
PLUGIN_PID=
HOLD_PID=
GUARD_WRAP_PID=
MPS_PIPE=
MPS_PIPES=()

say() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }
log() { { printf '\n===== %s =====\n' "$1"; cat; } >>"$LOGS"; }
# A step's timeout: its own limit, cut to what is left of the budget (1 when under 5 s are left:
# never 0, which would mean no limit to timeout).
left() {
  local want=$1 rest=$((DEADLINE - SECONDS))
  if ((rest < 5)); then echo 1; elif ((want < rest)); then echo "$want"; else echo "$rest"; fi
}
# The last JSON object line of a file, or null.
last_json() { local l; l=$(grep '^{' "$1" 2>/dev/null | tail -n 1 || true); printf '%s' "${l:-null}"; }
# A top-level scalar of a gpu-check line (keys come sorted; nested objects come after the scalars used here).
jget() { printf '%s' "$1" | grep -o "\"$2\":[^,}]*" | head -n 1 | cut -d: -f2- | tr -d '"' || true; }
# Appends {"step":..,<fields>} to results.jsonl; fields: JSON text without braces.
record() { printf '{"step":"%s",%s}\n' "$1" "$2" >>"$RESULTS"; }
jstr() { printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g' | tr '\n\t' '  ')"; }
have() { command -v "$1" >/dev/null 2>&1; }
# PIDs whose command line contains $1 (pgrep -f where present).
pids_of() {
  if have pgrep; then pgrep -f -- "$1" | tr '\n' ' ' || true; return; fi
  local p
  for p in /proc/[0-9]*; do
    tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q -- "$1" && printf '%s ' "${p#/proc/}"
  done
  true
}
mps_ctl() { # $1: pipe dir, $2: command
  echo "$2" | CUDA_MPS_PIPE_DIRECTORY=$1 timeout 15 nvidia-cuda-mps-control 2>&1 || true
}
# Runs gpu-check with a timeout; output in $WORK/$1.out, exit status in RC, last JSON line in LINE.
gc() {
  local name=$1 t=$2
  shift 2
  RC=0
  if (($(left "$t") <= 1)); then RC=124; LINE=null; echo "(skipped: out of time)" >"$WORK/$name.out"; return; fi
  timeout "$(left "$t")" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" || RC=$?
  LINE=$(last_json "$WORK/$name.out")
  sed "s/^/[$name] /" "$WORK/$name.err" >>"$LOGS" || true
}

cleanup() {
  local rc=$?
  set +e
  for p in $HOLD_PID $GUARD_WRAP_PID; do kill "$p" 2>/dev/null; done
  if [ -n "$PLUGIN_PID" ]; then
    kill "$PLUGIN_PID" 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$PLUGIN_PID" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$PLUGIN_PID" 2>/dev/null
  fi
  for d in "${MPS_PIPES[@]}"; do
    [ -e "$d/control" ] && echo "quit ($d): $(mps_ctl "$d" quit)" | log "MPS quit"
  done
  sleep 1
  local left_over
  left_over=$(pids_of nvidia-cuda-mps)
  [ -n "$left_over" ] && echo "still running after quit: $left_over" | log "MPS left over"
  [ -f "$WORK/plugin.log" ] && log "plugin log" <"$WORK/plugin.log"
  for f in "$MPS_ROOT"/*/control.log "$MPS_ROOT"/*/server.log "$MPS_ROOT"/*.log "$WORK"/mps-fallback/log/*.log; do
    [ -f "$f" ] && log "MPS log ${f#"$WORK"/}" <"$f"
  done
  rm -rf "$WORK"
  echo "gpu-check run.sh: results in $OUT (exit $rc)"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for b in "$GPU_CHECK" "$PLUGIN"; do
  [ -x "$b" ] || { echo "run.sh: $b is missing or not executable (README.md: what to build and carry)" >&2; exit 1; }
done

# --- 0. The GPU as it is ------------------------------------------------------------------------
say "== gpu-check acceptance run, $(date -u +%FT%TZ), $(uname -n)"
SMI_Q=$(timeout "$(left 30)" nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,compute_mode,mig.mode.current \
  --format=csv,noheader 2>&1 || true)
timeout "$(left 30)" nvidia-smi 2>&1 | log "nvidia-smi" || true
say "GPU: $SMI_Q"
DRIVER=$(printf '%s' "$SMI_Q" | head -n 1 | cut -d, -f4 | tr -d ' ')
COMPUTE_MODE=$(printf '%s' "$SMI_Q" | head -n 1 | cut -d, -f6 | sed 's/^ *//')
MIG=$(printf '%s' "$SMI_Q" | head -n 1 | cut -d, -f7 | tr -d ' ')
MPS_CONTROL=$(command -v nvidia-cuda-mps-control || true)
MPS_BEFORE=$(pids_of nvidia-cuda-mps)
record gpu "\"nvidia_smi\":$(jstr "$SMI_Q"),\"driver\":$(jstr "$DRIVER"),\"compute_mode\":$(jstr "$COMPUTE_MODE"),\"mig\":$(jstr "$MIG"),\"mps_control\":$(jstr "$MPS_CONTROL"),\"mps_running_before\":$(jstr "$MPS_BEFORE")"
[ -n "$MPS_BEFORE" ] && say "WARNING: MPS processes were already running before this run: $MPS_BEFORE"
[ "$MIG" = "Enabled" ] && say "WARNING: MIG is enabled; CUDA sees MIG instances only, the figures below are not the whole GPU's"
say "driver $DRIVER, compute mode $COMPUTE_MODE (left as is), MPS control: ${MPS_CONTROL:-not found}"

# --- 1. What the plugin advertises (real NVML) ----------------------------------------------------
RC=0
timeout "$(left 60)" "$PLUGIN" discover --json >"$WORK/discover.json" 2>"$WORK/discover.err" || RC=$?
log "discover --json" <"$WORK/discover.json"
log "discover stderr" <"$WORK/discover.err"
ADVERTISED_MIB=$(grep -o '"memory_mib": *[0-9]*' "$WORK/discover.json" | head -n 1 | grep -o '[0-9]*$' || true)
record discover "\"rc\":$RC,\"advertised_mib\":${ADVERTISED_MIB:-null}"
say "1. plugin discover: rc $RC, advertised ${ADVERTISED_MIB:-?} MiB per GPU"

# --- 2. Without MPS: per-process overhead, what one process can allocate, full-speed kernel -------
gc ctx-plain 60 "$GPU_CHECK" context-overhead
record context-overhead-plain "\"rc\":$RC,\"result\":$LINE"
say "2a. context overhead without MPS: $(jget "$LINE" overhead_mib) MiB (rc $RC)"
if [ "$RC" = 2 ]; then say "gpu-check found no usable GPU: $(cat "$WORK/ctx-plain.err")"; exit 2; fi

gc max-alloc 120 "$GPU_CHECK" max-alloc
MAX_MIB=$(jget "$LINE" max_total_mib)
record max-alloc "\"rc\":$RC,\"advertised_mib\":${ADVERTISED_MIB:-null},\"result\":$LINE"
say "2b. one process allocated at most ${MAX_MIB:-?} MiB (largest single $(jget "$LINE" largest_single_mib) MiB) of ${ADVERTISED_MIB:-?} advertised; cuMemGetInfo free before $(jget "$LINE" cu_free_mib_before) of $(jget "$LINE" cu_total_mib) MiB"

gc spin-plain 120 "$GPU_CHECK" spin --ms "$SPIN_MS"
SPIN_ITERS=$(jget "$LINE" iters)
SPIN_BLOCKS=$(jget "$LINE" blocks)
PLAIN_MS=$(jget "$LINE" median_ms)
record spin-plain "\"rc\":$RC,\"result\":$LINE"
say "2c. spin without MPS: ${PLAIN_MS:-?} ms (iters ${SPIN_ITERS:-?}, blocks ${SPIN_BLOCKS:-?}, $(jget "$LINE" tflops) TFLOP/s FP32)"

# --- 3. The plugin's managed MPS daemon -----------------------------------------------------------
say "3. plugin: $PLUGIN ${PLUGIN_ARGS[*]} ${PLUGIN_EXTRA_ARGS[*]}"
"$PLUGIN" "${PLUGIN_ARGS[@]}" "${PLUGIN_EXTRA_ARGS[@]}" >"$WORK/plugin.log" 2>&1 &
PLUGIN_PID=$!
MPS_SOURCE=plugin
T0=$SECONDS
while ((SECONDS - T0 < MPS_WAIT_S)); do
  MPS_PIPE=$(find "$MPS_ROOT" -name control 2>/dev/null | head -n 1 || true)
  MPS_PIPE=${MPS_PIPE%/control}
  [ -n "$MPS_PIPE" ] && break
  kill -0 "$PLUGIN_PID" 2>/dev/null || break
  sleep 0.5
done
PLUGIN_ALIVE=false
kill -0 "$PLUGIN_PID" 2>/dev/null && PLUGIN_ALIVE=true
MPS_PIDS=$(pids_of nvidia-cuda-mps-control)
if [ -z "$MPS_PIPE" ]; then
  # A control daemon with its pipes elsewhere than under --mps-root: its environment says where.
  for p in $MPS_PIDS; do
    d=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | sed -n 's/^CUDA_MPS_PIPE_DIRECTORY=//p' | head -n 1 || true)
    d=${d:-/tmp/nvidia-mps}
    if [ -e "$d/control" ]; then MPS_PIPE=$d; MPS_SOURCE="plugin (pipe outside --mps-root, from /proc)"; break; fi
  done
fi
record plugin-mps "\"plugin_alive\":$PLUGIN_ALIVE,\"pipe_dir\":$(jstr "$MPS_PIPE"),\"waited_s\":$((SECONDS - T0)),\"mps_control_pids\":$(jstr "$MPS_PIDS"),\"plugin_log_tail\":$(jstr "$(tail -n 5 "$WORK/plugin.log")")"
if [ -n "$MPS_PIPE" ]; then
  MPS_PIPES+=("$MPS_PIPE")
  say "3. plugin's MPS daemon up in $((SECONDS - T0)) s: pipe $MPS_PIPE, nvidia-cuda-mps-control PIDs: ${MPS_PIDS:-none}"
else
  say "3. FAIL: no MPS control pipe under $MPS_ROOT after $((SECONDS - T0)) s (plugin alive: $PLUGIN_ALIVE); plugin log:"
  tail -n 5 "$WORK/plugin.log" | sed 's/^/   /' | tee -a "$SUMMARY"
  if [ "$MPS_FALLBACK" = 1 ] && [ -n "$MPS_CONTROL" ]; then
    MPS_SOURCE=fallback
    MPS_PIPE=$WORK/mps-fallback/pipe
    mkdir -p "$MPS_PIPE" "$WORK/mps-fallback/log"
    CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE CUDA_MPS_LOG_DIRECTORY=$WORK/mps-fallback/log timeout 15 nvidia-cuda-mps-control -d || true
    sleep 1
    MPS_PIPES+=("$MPS_PIPE")
    say "   fallback: started nvidia-cuda-mps-control -d ourselves (pipe $MPS_PIPE); PIDs: $(pids_of nvidia-cuda-mps-control)"
  fi
fi
if [ -n "$MPS_PIPE" ] && [ -e "$MPS_PIPE/control" ]; then
  SERVERS=$(mps_ctl "$MPS_PIPE" get_server_list)
  record mps-servers-before "\"mps_source\":\"$MPS_SOURCE\",\"get_server_list\":$(jstr "$SERVERS")"
  say "   get_server_list before any client: '${SERVERS}'"
else
  MPS_PIPE=
  record mps "\"ok\":false,\"why\":\"no MPS control daemon\""
  say "   no MPS daemon: the MPS steps (4, 5) are skipped"
fi

if [ -n "$MPS_PIPE" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE
  # --- 4a. Per-process overhead under MPS (and again without, in a child) -----------------------
  gc ctx-mps 60 "$GPU_CHECK" context-overhead
  record context-overhead-mps "\"rc\":$RC,\"mps_source\":\"$MPS_SOURCE\",\"result\":$LINE"
  SERVERS=$(mps_ctl "$MPS_PIPE" get_server_list)
  record mps-servers-after-client "\"get_server_list\":$(jstr "$SERVERS")"
  say "4a. context overhead under MPS: $(jget "$LINE" overhead_mib) MiB (rc $RC); MPS servers after a client: '${SERVERS}'"

  # --- 4b. Memory limits: HIGH holds while LOW is refused -------------------------------------
  T=$(left 150)
  HOLD_OUT=$WORK/mem-high.out
  CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=${MEM_HIGH_MIB}M timeout "$T" "$GPU_CHECK" alloc --mib "$MEM_HIGH_ASK_MIB" \
    --hold-s 120 >"$HOLD_OUT" 2>"$WORK/mem-high.err" &
  HOLD_PID=$!
  T0=$SECONDS
  while ((SECONDS - T0 < 60)) && ! grep -q '"allocated_mib"' "$HOLD_OUT" 2>/dev/null; do
    kill -0 "$HOLD_PID" 2>/dev/null || break
    sleep 0.2
  done
  HIGH=$(last_json "$HOLD_OUT")
  CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=${MEM_LOW_MIB}M gc mem-low 60 "$GPU_CHECK" alloc --mib "$MEM_LOW_ASK_MIB"
  LOW=$LINE
  LOW_RC=$RC
  timeout "$(left 20)" nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv 2>&1 | log "compute apps while both limits held" || true
  kill "$HOLD_PID" 2>/dev/null || true
  wait "$HOLD_PID" 2>/dev/null || true
  HOLD_PID=
  sed 's/^/[mem-high] /' "$WORK/mem-high.err" >>"$LOGS" || true
  LOW_GOT=$(jget "$LOW" allocated_mib)
  HIGH_GOT=$(jget "$HIGH" allocated_mib)
  LOW_PASS=false
  HIGH_PASS=false
  [ "$LOW_RC" = 1 ] && [ -n "$LOW_GOT" ] && ((LOW_GOT < MEM_LOW_ASK_MIB && LOW_GOT <= MEM_LOW_MIB)) && LOW_PASS=true
  [ "$(jget "$HIGH" ok)" = true ] && [ "$HIGH_GOT" = "$MEM_HIGH_ASK_MIB" ] && HIGH_PASS=true
  record mem-limit-low "\"limit_mib\":$MEM_LOW_MIB,\"ask_mib\":$MEM_LOW_ASK_MIB,\"expect\":\"refused\",\"pass\":$LOW_PASS,\"rc\":$LOW_RC,\"result\":$LOW"
  record mem-limit-high "\"limit_mib\":$MEM_HIGH_MIB,\"ask_mib\":$MEM_HIGH_ASK_MIB,\"expect\":\"allocated\",\"pass\":$HIGH_PASS,\"result\":$HIGH"
  say "4b. limit ${MEM_LOW_MIB}M asking ${MEM_LOW_ASK_MIB}: got ${LOW_GOT:-?} MiB then $(jget "$LOW" error) (rc $LOW_RC) -> $([ $LOW_PASS = true ] && echo PASS || echo FAIL)"
  say "    limit ${MEM_HIGH_MIB}M asking ${MEM_HIGH_ASK_MIB}, concurrently: got ${HIGH_GOT:-?} MiB -> $([ $HIGH_PASS = true ] && echo PASS || echo FAIL)"

  # --- 5. Compute share: the same work at 100 % and at SPIN_LOW_PCT % ---------------------------
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 gc spin-100 120 "$GPU_CHECK" spin --ms "$SPIN_MS" ${SPIN_BLOCKS:+--blocks "$SPIN_BLOCKS"}
  S100=$LINE
  ITERS=$(jget "$S100" iters)
  BLOCKS=$(jget "$S100" blocks)
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$SPIN_LOW_PCT gc spin-low 150 "$GPU_CHECK" spin --iters "${ITERS:-1000000}" --blocks "${BLOCKS:-528}"
  SLOW=$LINE
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 gc spin-100b 120 "$GPU_CHECK" spin --iters "${ITERS:-1000000}" --blocks "${BLOCKS:-528}"
  S100B=$LINE
  M100=$(jget "$S100B" median_ms)
  [ -n "$M100" ] || M100=$(jget "$S100" median_ms)
  MLOW=$(jget "$SLOW" median_ms)
  RATIO=$(awk -v a="${MLOW:-0}" -v b="${M100:-0}" 'BEGIN { if (b > 0 && a > 0) printf "%.2f", a / b; else print "null" }')
  SPIN_PASS=$(awk -v r="$RATIO" 'BEGIN { print (r != "null" && r + 0 >= 1.5) ? "true" : "false" }')
  record spin-100 "\"pct\":100,\"result\":$S100"
  record spin-low "\"pct\":$SPIN_LOW_PCT,\"result\":$SLOW"
  record spin-100-again "\"pct\":100,\"result\":$S100B"
  record compute-share "\"pct\":$SPIN_LOW_PCT,\"ms_100\":${M100:-null},\"ms_low\":${MLOW:-null},\"ratio\":$RATIO,\"expect\":\"ratio >= 1.5\",\"pass\":$SPIN_PASS,\"sm_count_seen_low\":$(jget "$SLOW" sm_count | grep . || echo null)"
  say "5. spin (same work, ${BLOCKS:-?} blocks): 100 % ${M100:-?} ms, ${SPIN_LOW_PCT} % ${MLOW:-?} ms -> ${RATIO}x slower -> $([ "$SPIN_PASS" = true ] && echo PASS || echo FAIL); SMs seen at ${SPIN_LOW_PCT} %: $(jget "$SLOW" sm_count)"
  unset CUDA_MPS_PIPE_DIRECTORY
fi

# --- 6. Guard -------------------------------------------------------------------------------------
# With guard_check (staged): the device plugin's guard loop on the real driver runs a process granted
# GUARD_GRANT_MIB that allocates GUARD_ASK_MIB, and must kill it after GUARD_CHECK_GRACE_S. Without it
# (or with GUARD_GRANT_CMD set): the process is started here and GUARD_GRANT_CMD tells a plugin.
GUARD_OUT=$WORK/guard.out
T=$(left $((GUARD_HOLD_S + 30)))
if ((T > GUARD_CHECK_GRACE_S)) && [ -x "$GUARD_CHECK" ] && [ -z "$GUARD_GRANT_CMD" ]; then
  GRC=0
  # shellcheck disable=SC2030 # the MPS pipe is for this subshell's process only
  (
    [ "$GUARD_USE_MPS" = 1 ] && [ -n "$MPS_PIPE" ] && export CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE
    exec timeout "$T" "$GUARD_CHECK" --gpu 0 --grant-mib "$GUARD_GRANT_MIB" --grace-s "$GUARD_CHECK_GRACE_S" \
      --timeout-s "$GUARD_HOLD_S" -- "$GPU_CHECK" alloc --mib "$GUARD_ASK_MIB" --hold-s "$GUARD_HOLD_S"
  ) >"$GUARD_OUT" 2>"$WORK/guard.err" || GRC=$?
  sed 's/^/[guard] /' "$GUARD_OUT" "$WORK/guard.err" >>"$LOGS" || true
  VERDICT=$(grep -m 1 '"event":"verdict"' "$GUARD_OUT" || true)
  KILLED=$(jget "$VERDICT" killed_by_guard)
  [ "$KILLED" = true ] || KILLED=false
  GALLOC=$(jget "$(grep '"allocated_mib"' "$GUARD_OUT" | tail -n 1 || true)" allocated_mib)
  record guard "\"wired\":true,\"via\":\"guard_check\",\"granted_mib\":$GUARD_GRANT_MIB,\"ask_mib\":$GUARD_ASK_MIB,\"allocated_mib\":${GALLOC:-null},\"grace_s\":$GUARD_CHECK_GRACE_S,\"max_used_mib\":$(jget "$VERDICT" max_used_mib | sed 's/^$/null/'),\"over_reported_s\":$(jget "$VERDICT" over_reported_s | sed 's/^$/null/'),\"killed_s\":$(jget "$VERDICT" killed_s | sed 's/^$/null/'),\"exit\":$GRC,\"killed_by_guard\":$KILLED,\"expect\":\"killed after the grace\",\"pass\":$KILLED"
  say "6. guard (guard_check on NVML): ${GUARD_ASK_MIB} MiB asked on a ${GUARD_GRANT_MIB} MiB grant; NVML showed $(jget "$VERDICT" max_used_mib) MiB; over reported at $(jget "$VERDICT" over_reported_s) s, killed at $(jget "$VERDICT" killed_s) s (grace ${GUARD_CHECK_GRACE_S} s) -> $([ "$KILLED" = true ] && echo "PASS (killed)" || echo "FAIL (not killed)")"
elif ((T > GUARD_GRACE_S)); then
  # shellcheck disable=SC2031 # as above
  (
    [ "$GUARD_USE_MPS" = 1 ] && [ -n "$MPS_PIPE" ] && export CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE
    exec timeout "$T" "$GPU_CHECK" alloc --mib "$GUARD_ASK_MIB" --hold-s "$GUARD_HOLD_S"
  ) >"$GUARD_OUT" 2>"$WORK/guard.err" &
  GUARD_WRAP_PID=$!
  T0=$SECONDS
  while ((SECONDS - T0 < 60)) && ! grep -q '"allocated_mib"' "$GUARD_OUT" 2>/dev/null; do
    kill -0 "$GUARD_WRAP_PID" 2>/dev/null || break
    sleep 0.2
  done
  GPID=$(jget "$(grep -m 1 '"event":"started"' "$GUARD_OUT" || true)" pid)
  GALLOC=$(jget "$(last_json "$GUARD_OUT")" allocated_mib)
  WIRED=false
  GRANT_OUT=
  if [ -n "$GUARD_GRANT_CMD" ] && [ -n "$GPID" ]; then
    WIRED=true
    GRANT_OUT=$(GUARD_PID=$GPID GUARD_MIB=$GUARD_GRANT_MIB MPS_PIPE=$MPS_PIPE timeout 20 bash -c "$GUARD_GRANT_CMD" _ "$GPID" "$GUARD_GRANT_MIB" 2>&1 || echo "(grant command failed: $?)")
  fi
  T1=$SECONDS
  GONE=false
  while ((SECONDS - T1 < GUARD_GRACE_S + 5)); do
    if [ -z "$GPID" ] || ! kill -0 "$GPID" 2>/dev/null; then GONE=true; break; fi
    sleep 0.5
  done
  GONE_AFTER=$((SECONDS - T1))
  GRC=0
  if [ "$GONE" = false ]; then kill "$GUARD_WRAP_PID" 2>/dev/null || true; fi
  wait "$GUARD_WRAP_PID" 2>/dev/null || GRC=$?
  GUARD_WRAP_PID=
  # killed: gone within the grace by a signal (timeout reports 128+signal, 137 for SIGKILL)
  KILLED=false
  [ "$GONE" = true ] && [ -n "$GPID" ] && ((GRC > 128)) && KILLED=true
  sed 's/^/[guard] /' "$WORK/guard.err" >>"$LOGS" || true
  record guard "\"wired\":$WIRED,\"granted_mib\":$GUARD_GRANT_MIB,\"ask_mib\":$GUARD_ASK_MIB,\"allocated_mib\":${GALLOC:-null},\"pid\":${GPID:-null},\"gone\":$GONE,\"gone_after_s\":$GONE_AFTER,\"grace_s\":$GUARD_GRACE_S,\"exit\":$GRC,\"killed_by_guard\":$KILLED,\"expect\":\"killed within grace\",\"pass\":$KILLED,\"grant_output\":$(jstr "$GRANT_OUT")"
  say "6. guard (wired: $WIRED): pid ${GPID:-?} allocated ${GALLOC:-?} MiB of a ${GUARD_GRANT_MIB} MiB grant; gone: $GONE after ${GONE_AFTER} s (exit $GRC) -> $([ $KILLED = true ] && echo "PASS (killed)" || echo "FAIL (not killed)")"
else
  record guard "\"skipped\":\"out of time\""
  say "6. guard: skipped (out of time)"
fi

# --- 7. Driver limits (R615+, cgroup v2) ----------------------------------------------------------
# With driver_limit_check (staged) and a driver that has per-cgroup memory limits: a cgroup of this
# run's own, capped at MEM_LOW_MIB through the plugin's backend call; a process in it asking
# MEM_LOW_ASK_MIB must fail, one asking DL_FITS_MIB must get it; the cap is cleared and the cgroup
# removed after.
DL_FITS_MIB=${DL_FITS_MIB:-9216}
DL_RESULT=skipped
if [ -x "$DRIVER_LIMIT_CHECK" ] && (($(left 60) > 30)); then
  DL_OFFER=$(timeout 20 "$DRIVER_LIMIT_CHECK" 2>>"$LOGS" || true)
  CG_FS=$(stat -fc %T /sys/fs/cgroup 2>/dev/null || echo unknown)
  if [ "$(jget "$DL_OFFER" supported)" = true ] && [ "$CG_FS" = cgroup2fs ]; then
    DL_CG=/sys/fs/cgroup/gpuplace-check-$$
    if mkdir "$DL_CG" 2>>"$LOGS"; then
      DL_SET=$(timeout 20 "$DRIVER_LIMIT_CHECK" --gpu 0 --cgroup "$DL_CG" --limit-mib "$MEM_LOW_MIB" 2>>"$LOGS" || true)
      # the process joins the capped cgroup, then becomes gpu-check ($0 is the cgroup)
      # shellcheck disable=SC2016 # expanded by that inner shell
      IN_CG=(bash -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$DL_CG")
      gc dl-over 60 "${IN_CG[@]}" "$GPU_CHECK" alloc --mib "$MEM_LOW_ASK_MIB"
      DL_OVER=$LINE; DL_OVER_RC=$RC
      gc dl-fits 60 "${IN_CG[@]}" "$GPU_CHECK" alloc --mib "$DL_FITS_MIB"
      DL_FITS=$LINE
      timeout 20 "$DRIVER_LIMIT_CHECK" --gpu 0 --cgroup "$DL_CG" --clear >>"$LOGS" 2>&1 || true
      rmdir "$DL_CG" 2>>"$LOGS" || true
      DL_OVER_GOT=$(jget "$DL_OVER" allocated_mib)
      DL_PASS=false
      [ "$(jget "$DL_SET" ok)" = true ] && [ "$DL_OVER_RC" = 1 ] && [ -n "$DL_OVER_GOT" ] && ((DL_OVER_GOT <= MEM_LOW_MIB)) &&
        [ "$(jget "$DL_FITS" allocated_mib)" = "$DL_FITS_MIB" ] && DL_PASS=true
      DL_RESULT="cap ${MEM_LOW_MIB} MiB: asked ${MEM_LOW_ASK_MIB}, got ${DL_OVER_GOT:-?} then $(jget "$DL_OVER" error); asked ${DL_FITS_MIB}, got $(jget "$DL_FITS" allocated_mib) ($DL_PASS)"
      record driver-limits "\"offer\":${DL_OFFER:-null},\"set\":${DL_SET:-null},\"over\":${DL_OVER:-null},\"fits\":${DL_FITS:-null},\"pass\":$DL_PASS"
    else
      DL_RESULT="no cgroup of our own under /sys/fs/cgroup (read-only?)"
      record driver-limits "\"offer\":$DL_OFFER,\"skipped\":\"cannot create a cgroup\""
    fi
  else
    DL_RESULT="not offered: $(jget "$DL_OFFER" detail) (cgroup fs $CG_FS)"
    record driver-limits "\"offer\":${DL_OFFER:-null},\"cgroup_fs\":$(jstr "$CG_FS"),\"skipped\":\"driver or cgroup v2 without limits\""
  fi
fi
say "7. driver limits: $DL_RESULT"

# --- 8. Results for docs/performance.md -----------------------------------------------------------
{
  echo "GPU acceptance (issue 49), $(date -u +%F), ${SMI_Q%%$'\n'*} (driver $DRIVER, compute mode $COMPUTE_MODE), MPS from the $MPS_SOURCE:"
  echo
  echo "| check | result |"
  echo "| --- | --- |"
  echo "| advertised memory (discover, NVML) | ${ADVERTISED_MIB:-?} MiB |"
  echo "| one process's allocation, no MPS | ${MAX_MIB:-?} MiB in all, largest single $(jget "$(last_json "$WORK/max-alloc.out")" largest_single_mib) MiB |"
  echo "| context overhead, no MPS / MPS | $(jget "$(last_json "$WORK/ctx-plain.out")" overhead_mib) / $(jget "$(last_json "$WORK/ctx-mps.out" 2>/dev/null)" overhead_mib) MiB |"
  echo "| ${MEM_LOW_MIB}M limit, asks ${MEM_LOW_ASK_MIB} MiB | ${LOW_GOT:-?} MiB, then $(jget "${LOW:-null}" error) (${LOW_PASS:-?}) |"
  echo "| ${MEM_HIGH_MIB}M limit, asks ${MEM_HIGH_ASK_MIB} MiB, concurrently | ${HIGH_GOT:-?} MiB (${HIGH_PASS:-?}) |"
  echo "| spin, 100 % / ${SPIN_LOW_PCT} % threads | ${M100:-?} / ${MLOW:-?} ms, ${RATIO:-?}x (${SPIN_PASS:-?}) |"
  echo "| guard, ${GUARD_ASK_MIB} MiB on a ${GUARD_GRANT_MIB} MiB grant | killed: ${KILLED:-?} (wired: ${WIRED:-?}) |"
  echo "| driver limits (nvmlDeviceSetMemoryLimits_v1 on a cgroup) | $DL_RESULT |"
} >"$SNIPPET"
say ""
tee -a "$SUMMARY" <"$SNIPPET"
