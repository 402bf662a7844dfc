#!/usr/bin/env bash
# On a GPU machine, from a checkout with torch and Triton installed (no network needed):
#   bash scripts/gpu_check.sh OUT_DIR [families...]
# 1. the whole test suite compiled on the GPU (bf16 included, gpu-marked shapes included),
# 2. `warpforge bench --json OUT_DIR/<family>.json --plot OUT_DIR/<family>.png` for each family.
# Set QUICK=1 for the headline cases only, TUNE=attention,mla,moe,moe_wgrad,lce (any of them; TUNE=1
# means attention) to run those sweeps first (their JSON and logs land in OUT_DIR), SKIP_TESTS=1 to skip the
# tests, MATCH=REGEX to bench only matching cases, COMPARE=DIR (a checkout of an earlier commit) to bench each
# family there first, in the same call, and compare case by case (scripts/bench_compare.py, 3% tolerance).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out}}
shift || true
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
status=0
tune=${TUNE:-}
[ "$tune" = 1 ] && tune=attention
for t in ${tune//,/ }; do
  python3 -m warpforge tune "${t//_/-}" --out "$out/tune_$t.json" 2>&1 | tee "$out/tune_$t.log" | grep -v "^  skipped" || status=1
done
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # compile-bound: spread the test files' kernels over the CPU cores when pytest-xdist is there
  par=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-8}")
  python3 -m pytest -q $par tests 2>&1 | tee "$out/tests.log" | tail -n 25 || status=1
fi
families=("$@")
[ ${#families[@]} -gt 0 ] || families=($(python3 -m warpforge bench --list | awk '{print $1}' | sort -u))
for f in "${families[@]}"; do
  if [ -n "${COMPARE:-}" ]; then
    (cd "$COMPARE" && PYTHONPATH=$COMPARE python3 -m warpforge bench --family "$f" $([ "${QUICK:-0}" = 1 ] && echo --quick) \
      ${MATCH:+--match "$MATCH"} --json "$out/before-$f.json" > "$out/bench-before-$f.log" 2>&1) || true
  fi
  python3 -m warpforge bench --family "$f" $([ "${QUICK:-0}" = 1 ] && echo --quick) --json "$out/$f.json" --plot "$out/$f.png" \
    ${MATCH:+--match "$MATCH"} 2>&1 | tee "$out/bench-$f.log" | grep -v '^\[' || status=1
  if [ -n "${COMPARE:-}" ]; then
    python3 scripts/bench_compare.py "$out/before-$f.json" "$out/$f.json" | tee "$out/compare-$f.log" || status=1
  fi
done
exit $status
