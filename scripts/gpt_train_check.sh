#!/usr/bin/env bash
# A GPT training bar as a user runs it: (prepare,) train a preset, sample. Writes RESULT_JSON (machine, wall
# time, loss curve, the first validation at or under BAR, a sample) and a PNG of the loss curve beside it.
#   bash scripts/gpt_train_check.sh tiny 2.2 benchmarks/results/cpu/gpt-tiny.json            (the CPU bar)
#   bash scripts/gpt_train_check.sh shakespeare 1.6 $OUT/gpt.json                            (the H200 bar)
# Extra arguments go to `warpforge gpt train` (e.g. --max-minutes: the preset's own time limit otherwise; the
# train summary line says whether the run finished or stopped at it). Set SKIP_PREPARE=1 where the data is
# already in WARPFORGE_CACHE (a GPU machine without network); WARPFORGE_GIT_COMMIT names the commit where there
# is no .git.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=$1 bar=$2 result=$3
shift 3
run=${RUN_DIR:-$(mktemp -d)/$preset}
export PYTHONUNBUFFERED=1
[ "${SKIP_PREPARE:-0}" = 1 ] || python3 -m warpforge gpt prepare
start=$(date +%s)
python3 -m warpforge gpt train --preset "$preset" --out "$run" "$@"
end=$(date +%s)
python3 -m warpforge gpt sample --ckpt "$run/ckpt.pt" --prompt "ROMEO." --tokens 300 --seed 1 | tee "$run/sample.txt" ||
  echo "(sampling failed: see the log)" > "$run/sample.txt"  # the training record is written regardless
python3 - "$run" "$((end - start))" "$preset" "$bar" "$result" <<'PY'
import json, os, platform, subprocess, sys, time
import torch
run, wall, preset, bar, result = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5]
hist = json.load(open(os.path.join(run, "history.json")))
vals = [h for h in hist if "val_loss" in h]
first_under = next((h for h in vals if h["val_loss"] <= bar), None)
commit = os.environ.get("WARPFORGE_GIT_COMMIT") or subprocess.run(
    ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
           "python": platform.python_version(), "git_commit": commit,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
if torch.cuda.is_available():
    machine["gpu"] = torch.cuda.get_device_name(0)
out = {"machine": machine, "preset": preset, "bar_val_loss": bar, "train_wall_s": wall,
       "final_val_loss": vals[-1]["val_loss"] if vals else None, f"first_val_under_{bar}": first_under,
       "history": hist, "sample": open(os.path.join(run, "sample.txt")).read()}
os.makedirs(os.path.dirname(os.path.abspath(result)), exist_ok=True)
json.dump(out, open(result, "w"), indent=1)
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    train = [h for h in hist if "loss" in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["step"] for h in train], [h["loss"] for h in train], label="train", lw=1)
    ax.plot([h["step"] for h in vals], [h["val_loss"] for h in vals], "o-", label="validation (held-out plays)")
    ax.axhline(bar, color="gray", ls="--", lw=1, label=f"bar {bar}")
    ax.set_xlabel("step"), ax.set_ylabel("nats / byte"), ax.legend()
    ax.set_title(f"warpforge GPT '{preset}' on {machine.get('gpu', machine['cpu'])}, {wall} s")
    fig.tight_layout()
    fig.savefig(os.path.splitext(result)[0] + ".png", dpi=110)
except ImportError:
    pass
print(f"train wall {wall}s, final val {out['final_val_loss']:.3f}, first <= {bar}: {first_under}")
PY
