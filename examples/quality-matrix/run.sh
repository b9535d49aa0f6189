#!/usr/bin/env bash
# Issue 50's quality matrix: every generated workload family at two strengths, in every arrival
# order, on flat and HGX boards; gpuplace against FGD and bestfit at 75/90/100/130 % arrival, with
# where each first turned a pod away and the pods each turned away between 75 and 100 %.
#
#   examples/quality-matrix/run.sh [OUT.md]      (default: target/quality-matrix.md)
#
# Needs a release build (cargo build --release). SEEDS (42-51), FAMILIES, ORDERS and BOARDS narrow
# it. One JSON line per policy and cell goes to OUT.jsonl beside the table.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
bin=${GPUPLACE:-$repo/target/release/gpuplace}
trace=${TRACE:-$repo/../shared/traces/alibaba-openb}
seeds=${SEEDS:-42-51}
out=${1:-$repo/target/quality-matrix.md}
jsonl=${out%.md}.jsonl
read -r -a families <<<"${FAMILIES:-default default+multigpu=30 default+multigpu=50 default+gpuspec=10 default+gpuspec=33 default+sharing=40 default+sharing=100 default+gangs=10 default+gangs=20 cpu050 cpu200}"
read -r -a orders <<<"${ORDERS:-shuffled shares-first bursts jobs-late}"
read -r -a boards <<<"${BOARDS:-flat hgx}"
: >"$jsonl"
{
  echo "Unallocated GPU % at 75 / 90 / 100 / 130 % arrival, mean over seeds $seeds; gpuplace's figure, then its difference from FGD and from bestfit (negative: gpuplace leaves less unallocated); \`1st out\` where each first turned a pod away (gpuplace / fgd / bestfit); \`out 75-100\` the pods each turned away between 75 and 100 %."
  echo
  echo "Command per cell: \`gpuplace simulate --trace ../shared/traces/alibaba-openb --workload W --policy fgd,bestfit,gpuplace --seeds $seeds --arrival A --boards B --json\` ($(git -C "$repo" rev-parse --short HEAD), $(date -u +%F))."
  echo
  echo "| workload | arrival | boards | @75 gp (−fgd, −bf) | @90 | @100 | @130 | 1st out gp/fgd/bf | out 75-100 gp/fgd/bf |"
  echo "|---|---|---|---|---|---|---|---|---|"
} >"$out"
for w in "${families[@]}"; do
  for a in "${orders[@]}"; do
    for b in "${boards[@]}"; do
      lines=$("$bin" simulate --trace "$trace" --workload "$w" --policy fgd,bestfit,gpuplace --seeds "$seeds" \
        --arrival "$a" --boards "$b" --json 2>/dev/null)
      printf '%s\n' "$lines" >>"$jsonl"
      python3 - "$w" "$a" "$b" <<PY >>"$out"
import json, sys
w, a, b = sys.argv[1:4]
r = {d["policy"]: d for d in map(json.loads, """$lines""".strip().splitlines())}
gp, fgd, bf = r["gpuplace"], r["fgd"], r["bestfit"]
def cell(c):
    u = lambda d: d["unallocated_gpu_pct"].get(str(c))
    g, f, x = u(gp), u(fgd), u(bf)
    if g is None: return "-"
    return f"{g:.2f} ({g - f:+.2f}, {g - x:+.2f})"
first = lambda d: "-" if d.get("first_refusal_pct") is None else f'{d["first_refusal_pct"]:.1f}'
print(f"| {w} | {a} | {b} | {cell(75)} | {cell(90)} | {cell(100)} | {cell(130)} | "
      f"{first(gp)} / {first(fgd)} / {first(bf)} | "
      f'{gp["refused_75_to_100"]:.1f} / {fgd["refused_75_to_100"]:.1f} / {bf["refused_75_to_100"]:.1f} |')
PY
    done
  done
done
cat "$out"
