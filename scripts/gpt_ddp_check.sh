#!/usr/bin/env bash
# The GPT's multi-GPU bar on a 2-GPU machine: the same preset, steps and global batch on 1 GPU and on 2 (DDP
# under torchrun); writes OUT/gpt-ddp.json with both loss curves, both tokens/s (median of the logged windows
# after warm-up) and the speedup.   bash scripts/gpt_ddp_check.sh OUT [PRESET STEPS [PRESET STEPS ...]]
# Needs the prepared data in WARPFORGE_CACHE for presets trained on Shakespeare. TRAIN_ARGS (e.g. "--compile
# graphs") go to every training run, single-GPU and DDP alike; DDP_ARGS (e.g. "--ddp-bucket-mb 100") to the DDP
# runs only.
# Each run's log lands in OUT/train-PRESET-{1,2}gpu.log. WORK=DIR keeps the runs there, and a single-GPU run
# already there is reused (to compare several DDP_ARGS).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1
shift
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(shakespeare 400 gpt2-124m 60)
export PYTHONUNBUFFERED=1
tmp=${WORK:-$(mktemp -d)}
mkdir -p "$tmp"
args=()
for ((i = 0; i < ${#runs[@]}; i += 2)); do
  preset=${runs[i]} steps=${runs[i + 1]}
  [ -f "$tmp/$preset-1/history.json" ] || CUDA_VISIBLE_DEVICES=0 python3 -m warpforge gpt train --preset "$preset" \
    --max-steps "$steps" --out "$tmp/$preset-1" ${TRAIN_ARGS:-} 2>&1 | tee "$out/train-$preset-1gpu.log" | tail -n 3
  rm -rf "$tmp/$preset-2"
  python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m warpforge gpt train --preset "$preset" \
    --max-steps "$steps" --out "$tmp/$preset-2" ${TRAIN_ARGS:-} ${DDP_ARGS:-} 2>&1 | tee "$out/train-$preset-2gpu.log" \
    | tail -n 3
  args+=("$preset" "$tmp/$preset-1" "$tmp/$preset-2")
done
python3 - "$out/gpt-ddp.json" "${args[@]}" <<'PY'
import json, os, statistics, sys, time
import torch
path, rest = sys.argv[1], sys.argv[2:]
report = {"machine": {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                      "torch": torch.__version__, "git_commit": os.environ.get("WARPFORGE_GIT_COMMIT"),
                      "train_args": os.environ.get("TRAIN_ARGS", ""),
                      "ddp_args": os.environ.get("DDP_ARGS", ""),
                      "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, "runs": {}}
for i in range(0, len(rest), 3):
    preset, one, two = rest[i:i + 3]
    h1, h2 = (json.load(open(os.path.join(d, "history.json"))) for d in (one, two))
    def tps(h):  # windows after the first quarter (compilation, warm-up)
        w = [e["tokens_per_s"] for e in h if "tokens_per_s" in e]
        return statistics.median(w[len(w) // 4:])
    def curve(h, key):
        return {e["step"]: e[key] for e in h if key in e}
    t1, t2 = curve(h1, "loss"), curve(h2, "loss")
    common = sorted(set(t1) & set(t2))
    v1, v2 = curve(h1, "val_loss"), curve(h2, "val_loss")
    r = {"tokens_per_s_1gpu": tps(h1), "tokens_per_s_2gpu": tps(h2), "speedup": tps(h2) / tps(h1),
         "train_loss_1gpu": [t1[s] for s in common], "train_loss_2gpu": [t2[s] for s in common], "steps": common,
         "mean_abs_train_loss_diff": statistics.mean(abs(t1[s] - t2[s]) for s in common) if common else None,
         "val_loss_1gpu": v1, "val_loss_2gpu": v2}
    report["runs"][preset] = r
    print(f"{preset}: 1 GPU {r['tokens_per_s_1gpu']:,.0f} tok/s, 2 GPUs {r['tokens_per_s_2gpu']:,.0f} tok/s "
          f"= {r['speedup']:.2f}x; mean |train loss diff| {r['mean_abs_train_loss_diff']}; val {v1} vs {v2}")
json.dump(report, open(path, "w"), indent=1)
PY
