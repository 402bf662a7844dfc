"""Sweep the norm kernels' launch settings on this GPU at the bench's shape (16k rows of 768, bf16; also 4096 wide):
warps and rows per tile for the forward, and with them programs per SM for the backward, for RMSNorm and LayerNorm.

    warpforge tune norm [--shapes 16384x768,16384x4096] [--out tune_norm.json]

Winners go into warpforge/ops/norm/configs.py's NORM table, the numbers into benchmarks/NOTES.md. Bytes moved: the
forward reads x and writes y, the backward reads x and dy and writes dx (2 bytes each), so GB/s is against the copy
bandwidth `warpforge bench` measures.
"""
import argparse
import itertools

import torch

from warpforge.bench.report import write_json
from warpforge.ops.norm import configs, norm_kernel as nk
from warpforge.runtime import sm_count
from warpforge.tune.timing import time_candidate

N = configs.NormCfg


def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune norm")
    ap.add_argument("--shapes", default="16384x768,16384x4096")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = []
    sms = sm_count(torch.device("cuda"))
    for shape in args.shapes.split(","):
        rows, n = (int(v) for v in shape.split("x"))
        x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        w = torch.ones(n, device="cuda", dtype=torch.bfloat16)
        b = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
        nbytes_fwd, nbytes_bwd = 2 * x.numel() * 2, 3 * x.numel() * 2
        for layer in (False, True):
            name = "layer_norm" if layer else "rms_norm"
            for warps, block_rows in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16)):
                cfg = N(warps, 4, block_rows)
                ms = time_candidate(lambda: nk.norm_fwd(x, w, b, 1e-6, layer, None, None, cfg), rep=50, graphed=True)
                if ms is not None:
                    results.append(dict(shape=shape, op=name, part="fwd", cfg=list(cfg), ms=ms,
                                        gbps=nbytes_fwd / ms / 1e6))
                    print(f"{shape} {name} fwd {tuple(cfg)}: {ms * 1e3:.1f} us {nbytes_fwd / ms / 1e6:.0f} GB/s",
                          flush=True)
            _, mean, rstd, _ = nk.norm_fwd(x, w, b, 1e-6, layer, None, None, N(4))
            for warps, block_rows, per_sm in itertools.product((1, 4, 8), (1, 2, 4, 8), (2, 4, 8, 16)):
                cfg = N(warps, per_sm, block_rows)
                ms = time_candidate(lambda: nk.norm_bwd(dy, x, w, mean, rstd, per_sm * sms, layer, None, cfg),
                                    rep=50, graphed=True)
                if ms is not None:
                    results.append(dict(shape=shape, op=name, part="bwd", cfg=list(cfg), ms=ms,
                                        gbps=nbytes_bwd / ms / 1e6))
                    print(f"{shape} {name} bwd {tuple(cfg)}: {ms * 1e3:.1f} us {nbytes_bwd / ms / 1e6:.0f} GB/s",
                          flush=True)
    if args.out:
        write_json({"sweep": "norm", "results": results}, args.out)
    return 0
