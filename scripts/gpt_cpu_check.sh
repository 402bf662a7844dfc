#!/usr/bin/env bash
# The GPT's CPU bar, as a user runs it: prepare, train the tiny preset, sample. Writes
#   benchmarks/results/cpu/gpt-tiny.json   (machine, wall time, loss curve, a sample)
# Usage: bash scripts/gpt_cpu_check.sh [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:-$(mktemp -d)/tiny}
export PYTHONUNBUFFERED=1
python -m warpforge gpt prepare
start=$(date +%s)
python -m warpforge gpt train --preset tiny --out "$run"
end=$(date +%s)
python -m warpforge gpt sample --ckpt "$run/ckpt.pt" --prompt "ROMEO." --tokens 300 --seed 1 | tee "$run/sample.txt"
python - "$run" "$((end - start))" <<'PY'
import json, os, platform, subprocess, sys, time
import torch
run, wall = sys.argv[1], int(sys.argv[2])
hist = json.load(open(os.path.join(run, "history.json")))
vals = [h for h in hist if "val_loss" in h]
first_under = next((h for h in vals if h["val_loss"] <= 2.2), None)
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
out = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                   "torch": torch.__version__, "python": platform.python_version(), "git_commit": commit,
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
       "preset": "tiny", "train_wall_s": wall, "final_val_loss": vals[-1]["val_loss"] if vals else None,
       "first_val_under_2.2": first_under, "history": hist,
       "sample": open(os.path.join(run, "sample.txt")).read()}
json.dump(out, open("benchmarks/results/cpu/gpt-tiny.json", "w"), indent=1)
print(f"train wall {wall}s, final val {out['final_val_loss']:.3f}, first <= 2.2: {first_under}")
PY
