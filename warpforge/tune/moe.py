"""Sweep the MoE grouped-GEMM tiles on this GPU, per model shape and token count, and print the table entries.

    warpforge tune moe [--models mixtral,deepseek-v3,qwen3-30b-a3b] [--tokens 1,16,128,...]
                       [--w-format fp8] [--out tune_moe.json] [--budget-s 300]

The two GEMMs are tuned apart for each block_m (they share only align's block_m): the gate/up GEMM with its
SwiGLU epilogue over (BLOCK_N, BLOCK_K, warps, stages), the down GEMM with its scatter epilogue over the same
plus split-K. Each is timed as a replayed CUDA graph (decode runs that way), uniform routing (or --skew). The winners
become warpforge/ops/moe/configs.py's sm90 entries, with the numbers in benchmarks/NOTES.md.

--w-format fp8 tunes the FP8-weight GEMMs (e4m3, a scale per 128 x 128 block; BLOCK_K at most 128) and times the
winner with fp16 math off and on (moe_kernel.fp16_math): the entry's `fp8=` field.
"""
import argparse
import itertools
import os
import time

import torch
import triton
import triton.testing

from warpforge.bench.moe_cases import MODELS, _logits
from warpforge.bench.report import write_json
from warpforge.ops.moe import align, quantize_weights, route_reference
from warpforge.ops.moe.configs import MoECfg
from warpforge.ops.moe.moe_kernel import _moe_gemm


def candidates(tokens, fp8=False):
    """(block_ms, up tiles, down tiles, split_ks) worth trying at this token count (fp8: k at most 128)."""
    if fp8:
        bms, tiles, _, split_ks = candidates(tokens)
        tiles = sorted({(n, k, w, s) for n, _, w, s in tiles for k in (64, 128)})
        return bms, tiles, tiles, split_ks
    if tokens <= 64:
        # BLOCK_N 16 at T <= 4: more programs over the few experts touched (Qwen3 T1: 192 programs at 32, 1.5 waves)
        widths = (16, 32, 64, 128) if tokens <= 4 else (32, 64, 128)
        tiles = list(itertools.product(widths, (64, 128, 256), (4,), (3, 4, 5)))
        return (16, 32) if tokens > 16 else (16,), tiles, tiles, (1, 2, 4)
    if tokens <= 512:
        tiles = list(itertools.product((64, 128), (64, 128), (4, 8), (3, 4)))
        # 128: one row block per expert at Mixtral T 512 (each weight tile read once)
        return (16, 32, 64, 128) if tokens > 128 else (16, 32, 64), tiles, tiles, (1, 2)
    tiles = list(itertools.product((128, 256), (64,), (4, 8), (3, 4))) + [(64, 64, 4, 4), (128, 128, 8, 3)]
    return (64, 128), tiles, tiles, (1,)


def bench(fn):
    try:
        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    except Exception as exc:  # e.g. out of shared memory: a config too big for this GPU
        print(f"  skipped: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
        return float("inf")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune moe")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="1,16,128,512,2048,8192")
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new shapes after this long")
    ap.add_argument("--skew", action="store_true", help="Zipf(1.2) routing, as the bench's zipf cases")
    ap.add_argument("--w-format", choices=("bf16", "fp8"), default="bf16")
    args = ap.parse_args(argv)
    if args.w_format == "fp8" and os.environ.get("WARPFORGE_MOE_FP8_FP16"):
        raise SystemExit("warpforge tune moe --w-format fp8: unset WARPFORGE_MOE_FP8_FP16 (it would override the "
                         "fp16 / bf16 math this sweep compares)")
    t0 = time.time()
    results = []
    for model in args.models.split(","):
        e, k, h, i, route_kw = MODELS[model]
        torch.manual_seed(0)
        w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
        w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * i ** -0.5
        fp8 = args.w_format == "fp8"
        s13 = s2 = None
        if fp8:
            (w13, s13), (w2, s2) = quantize_weights(w13), quantize_weights(w2)
            w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
        for t in map(int, args.tokens.split(",")):
            if time.time() - t0 > args.budget_s:
                print("budget spent: stopping", flush=True)
                break
            hidden = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            logits = _logits(t, e, args.skew, torch.device("cuda"), torch.Generator().manual_seed(t))
            weights, ids = route_reference(logits, k, **route_kw)
            flat_w = weights.reshape(-1).float().contiguous()
            act = torch.empty(t * k, i, device="cuda", dtype=torch.bfloat16)
            out = torch.zeros(t, h, device="cuda", dtype=torch.float32)
            bms, up_tiles, down_tiles, split_ks = candidates(t, fp8)
            best = None
            for bm in bms:
                sched = align(ids, e, bm)

                def up(tile, fp16=fp8):
                    cfg = MoECfg(bm, tile, tile, fp8_fp16_math=fp16)
                    return bench(lambda: _moe_gemm(hidden, w13, act, (w13.stride(2), w13.stride(1)), sched, k, i, h,
                                                   cfg, a_by_token=True, swiglu=True, scale=s13))

                def down(tile, sk, fp16=fp8):
                    cfg = MoECfg(bm, tile, tile, sk, fp8_fp16_math=fp16)
                    return bench(lambda: _moe_gemm(act, w2, out, (w2.stride(2), w2.stride(1)), sched, k, h, i, cfg,
                                                   a_by_token=False, scatter=True, row_w=flat_w, scale=s2))
                up_ms, up_tile = min((up(tile), tile) for tile in up_tiles)
                down_ms, down_tile, sk = min((down(tile, sk), tile, sk) for tile in down_tiles for sk in split_ks)
                total = up_ms + down_ms
                print(f"{model} T{t} bm{bm}: up {up_tile} {up_ms * 1e3:.1f} us, down {down_tile} split {sk} "
                      f"{down_ms * 1e3:.1f} us", flush=True)
                fp16 = False
                if fp8:  # the winners again with fp16 math off: kept on only where it is faster
                    bf16_ms = up(up_tile, False) + down(down_tile, sk, False)
                    print(f"{model} T{t} bm{bm}: bf16 math {bf16_ms * 1e3:.1f} us", flush=True)
                    fp16, total = total < bf16_ms, min(total, bf16_ms)
                if best is None or total < best[0]:
                    best = (total, MoECfg(bm, up_tile, down_tile, sk, fp8_fp16_math=fp16), up_ms, down_ms)
            touched = torch.unique(ids).numel()
            floor_ms = touched * 3 * h * i * (1 if fp8 else 2) / 4.3e12 * 1e3
            total, cfg, up_ms, down_ms = best
            print(f"BEST {model} (E {e}, 2I {2 * i}, H {h}) T{t} {args.w_format}: {tuple(cfg)}  {total * 1e3:.1f} us "
                  f"(weight floor at 4.3 TB/s {floor_ms * 1e3:.1f} us)", flush=True)
            results.append(dict(model=model, shape=[e, 2 * i, h], tokens=t, w_format=args.w_format, cfg=list(cfg),
                                up_ms=up_ms, down_ms=down_ms, floor_ms=floor_ms))
            if args.out:
                write_json(results, args.out)
        w13 = w2 = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
