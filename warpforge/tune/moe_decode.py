"""Sweep the one-launch MoE decode kernel's tiles (ops/moe/decode_kernel.py, configs.DECODE) on this GPU: each
candidate DecodeTile against the gathered path (configs.DECODE off) at the family bench's own decode cases (their
setup, CUDA-graph replay and rotated activations, `warpforge bench --family moe`), in one process, outputs checked
against the case's reference first.

    warpforge tune moe-decode [--models mixtral,deepseek-v3,qwen3-30b-a3b] [--tokens 1,4,16] [--out tune.json]

FP8 weights are swept for Mixtral and DeepSeek-V3 (the bench's FP8 cases). The winners go into configs.DECODE, the
numbers into benchmarks/NOTES.md.
"""
import argparse
import time
from unittest import mock

import torch

from warpforge.bench.moe_cases import MODELS, moe_setup
from warpforge.bench.report import write_json
from warpforge.ops.moe import configs
from warpforge.tune.timing import time_candidate

D = configs.DecodeTile
CANDIDATES = {
    "n16": D(16, 128, 256, 4, 4), "n32": D(32, 128, 256, 4, 4), "n64": D(64, 128, 256, 4, 4),
    "n128": D(128, 128, 256, 4, 3), "n32_k256": D(32, 256, 256, 4, 3), "n32_h128": D(32, 128, 128, 4, 4),
    "n32_w8": D(32, 128, 256, 8, 4), "n64_k64": D(64, 64, 256, 4, 5),
}
FP8_MODELS = ("mixtral", "deepseek-v3")


def _time_case(device, model, t, fp8, tile):
    """(ms of the case's graphed warpforge call with configs.DECODE giving `tile` everywhere (None: off), its error
    against the case's reference, the case's tolerance)."""
    with mock.patch.object(configs, "DECODE", configs.DECODE.map(lambda _: tile)):
        setup = moe_setup(device, False, model=model, t=t, skew=False, fp8=fp8)
        fn = setup.impls["warpforge"]
        setup.reset()
        err = float(setup.score(fn()))
        ms = time_candidate(fn, rep=100) if err <= setup.tol else None
    return ms, err, setup.tol


def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune moe-decode")
    ap.add_argument("--models", default="mixtral,deepseek-v3,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("warpforge tune moe-decode: needs a CUDA GPU")
    dev = torch.device("cuda")
    rows, t0 = [], time.time()
    for model in args.models.split(","):
        if model not in MODELS:
            raise SystemExit(f"unknown model {model!r}: one of {', '.join(MODELS)}")
        for fp8 in (False, True) if model in FP8_MODELS else (False,):
            for t in map(int, args.tokens.split(",")):
                name = f"{model} T{t}{' fp8' if fp8 else ''}"
                base, _, _ = _time_case(dev, model, t, fp8, None)
                print(f"{name:24s} gathered  {base:8.4f} ms" if base else f"{name:24s} gathered  failed", flush=True)
                rows.append(dict(model=model, tokens=t, fp8=fp8, candidate="gathered", ms=base))
                for cand, tile in CANDIDATES.items():
                    ms, err, tol = _time_case(dev, model, t, fp8, tile)
                    if ms is None:
                        print(f"{name:24s} {cand:9s} WRONG or failed: error {err:.1e} (tolerance {tol:.0e})",
                              flush=True)
                    else:
                        print(f"{name:24s} {cand:9s} {ms:8.4f} ms  {base / ms if base else 0:.3f}x gathered  "
                              f"err {err:.1e}", flush=True)
                    rows.append(dict(model=model, tokens=t, fp8=fp8, candidate=cand, tile=list(tile), ms=ms,
                                     error=err))
    print(f"[{time.time() - t0:.0f} s]")
    if args.out:
        write_json({"sweep": "moe-decode", "rows": rows}, args.out)


if __name__ == "__main__":
    main()
