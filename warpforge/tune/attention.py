"""Sweep block sizes for the attention kernels on this GPU and print the best per head dim.

    warpforge tune attention [--out tune.json] [--dims 128,64] [--shape b,s,h]

The winners go into warpforge/ops/attention/configs.py by hand (with the numbers in benchmarks/NOTES.md):
a small table keyed by arch and head dim, not an autotuner on the hot path.
"""
import argparse
import math

import torch
import triton
import triton.testing

from warpforge.bench.report import write_json
from warpforge.ops.attention.configs import KernelCfg as C
from warpforge.ops.attention.flash_kernel import flash_bwd, flash_fwd
from warpforge.ops.attention.flash_ws_kernel import flash_fwd_ws


def timed(fn):
    try:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    except Exception as exc:  # out of shared memory / registers: not a candidate
        return float("inf") if "resources" in str(exc).lower() or "memory" in str(exc).lower() else \
            _report(exc)


def _report(exc):
    print("   error:", type(exc).__name__, str(exc)[:160])
    return float("inf")


def sweep(b, s, h, d, causal, parts):
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    right = 0 if causal else 1 << 30
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    tiles_fwd = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 2), (128, 64, 8, 3),
                 (128, 128, 8, 2), (128, 128, 8, 3), (64, 128, 4, 2), (64, 128, 4, 3), (128, 64, 4, 3)]
    fwd_space = [C(*t, tma=tma) for t in tiles_fwd for tma in (False, True)] if "fwd" in parts else \
        [C(128, 128, 8, 3, tma=True)]
    if "fwd" in parts and d in (64, 128):  # the warp-specialized forward: 4 warps become a producer + 2 consumers
        fwd_space += [C(128, bn, 4, st, tma=True, ws=True) for bn in (64, 128) for st in (2, 3)]
    res = {"shape": dict(b=b, s=s, h=h, d=d, causal=causal), "fwd": [], "dkdv": [], "dq": []}
    for cfg in fwd_space:
        ms = timed(lambda: flash_fwd_ws(q, k, v, b, s, s, scale, 1 << 30, right, cfg) if cfg.ws else
                   flash_fwd(q, k, v, None, None, b, s, s, scale, 1 << 30, right, cfg))
        res["fwd"].append((cfg, ms, flops / ms / 1e9))
    res["fwd"].sort(key=lambda r: r[1])
    best_fwd = res["fwd"][0][0]
    out, lse = flash_fwd(q, k, v, None, None, b, s, s, scale, 1 << 30, right, best_fwd._replace(ws=False))
    bwd_flops = 2.5 * flops
    dq_default = C(128, 64, 8, 3)
    tiles_dkdv = [(32, 64, 4, 2), (32, 64, 4, 3), (64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 8, 3),
                  (32, 128, 8, 2), (128, 128, 8, 2)]
    tiles_dkdv += [(128, 64, 8, 2)]
    dkdv_space = [C(*t, atomic_dq=a, tma=tma) for t in tiles_dkdv for a in (False, True) for tma in (False, True)
                  if not (a and tma)]
    for cfg in dkdv_space:
        ms = timed(lambda: flash_bwd(do, q, k, v, out, lse, None, None, b, s, s, scale, 1 << 30, right, cfg,
                                     dq_default))
        res["dkdv"].append((cfg, ms, bwd_flops / ms / 1e9))
    res["dkdv"].sort(key=lambda r: r[1])
    best_split = next(c for c, _, _ in res["dkdv"] if not c.atomic_dq)
    dq_tiles = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                (128, 32, 8, 3)]
    dq_space = [C(*t, tma=tma) for t in dq_tiles for tma in (False, True)]
    for cfg in dq_space:
        ms = timed(lambda: flash_bwd(do, q, k, v, out, lse, None, None, b, s, s, scale, 1 << 30, right,
                                     best_split, cfg))
        res["dq"].append((cfg, ms, bwd_flops / ms / 1e9))
    res["dq"].sort(key=lambda r: r[1])
    for part in ("fwd", "dkdv", "dq"):
        print(f"d{d} {part}: best", [(tuple(c), round(ms, 3), round(tf)) for c, ms, tf in res[part][:5]],
              flush=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune attention")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--parts", default="fwd,bwd", help="fwd: sweep the forward too (else the sm90 pick)")
    ap.add_argument("--shape", default=None, help="b,s,h instead of the per-dim default (e.g. 16,1024,12: the "
                                                  "gpt2-124m training step)")
    args = ap.parse_args(argv)
    results = []
    for d in map(int, args.dims.split(",")):
        b, s, h = (4, 8192, 16) if d == 128 else (8, 4096, 32) if d == 64 else (4, 4096, 16)
        if args.shape:
            b, s, h = map(int, args.shape.split(","))
        results.append(sweep(b, s, h, d, True, args.parts.split(",")))
    if args.out:
        write_json(results, args.out)


if __name__ == "__main__":
    main()
