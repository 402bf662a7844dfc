"""Sweep paged GQA decode tiles and split counts on this GPU (issue 18's shape: b 64, h_q 32, h_kv 8, d 128,
page 16, pages shuffled) at one cache length, each from a CUDA graph.

    warpforge tune paged [--L 4096] [--formats bf16,fp8,fp8mma,fp8gluon,nvfp4gluon] [--out tune_paged.json]

Prints each result as it lands; winners go into warpforge/ops/paged/configs.py's DECODE table with the numbers
in benchmarks/NOTES.md.
"""
import argparse
import dataclasses

import torch
import triton.testing

from warpforge.bench.report import write_json
from warpforge.ops.paged import KV_FORMATS, plan, quantize_kv
from warpforge.ops.paged.configs import PagedCfg

# (block_h, block_n, warps, stages, index_ahead)
TILES = [(16, 64, 4, 3, False), (16, 64, 4, 2, False), (16, 32, 4, 3, False), (16, 128, 4, 2, False),
         (16, 64, 4, 3, True), (16, 64, 4, 4, True), (16, 128, 4, 3, True), (16, 32, 4, 4, True),
         (16, 128, 8, 3, True), (16, 64, 8, 4, True)]
# (block_h, block_n, warps, stages, index_ahead, waves, fp16_math, prefetch): PagedCfg's fields
FP8_TILES = [(16, 128, 4, 2, False, 2, True), (16, 64, 4, 2, False, 2, True), (16, 128, 8, 2, False, 2, True),
             (16, 64, 4, 2, False, 2, True, True), (16, 64, 4, 1, False, 2, True, True),
             (16, 32, 4, 1, False, 2, True, True), (16, 64, 8, 1, False, 2, True, True)]
# fp8 on fp8 tensor cores (PagedCfg's fp8_mma and fp8_tokens_m, the tuples' last two fields): sm_90 compiles
# (Triton 3.6, GQA 4) 168 regs at 128-token steps, 126 at 64 (3 stages, page ids ahead: K copies two steps ahead),
# 223 with V prefetched in registers (128-token steps with the prefetch spill); fp8_mma 1 is the speed of one e4m3
# per q / p (its accuracy misses the bar on random data: 1 - cos 1.2e-3 emulated)
FP8_MMA_TILES = [(16, 128, 4, 2, False, 8, False, False, 2, True), (16, 128, 4, 3, True, 8, False, False, 2, True),
                 (16, 64, 4, 3, True, 8, False, False, 2, True), (16, 64, 4, 3, True, 8, False, True, 2, True),
                 (16, 64, 8, 3, True, 8, False, True, 2, True), (16, 128, 4, 3, True, 8, False, False, 1, True)]
# the Gluon kernel (decode_gluon_kernel.py; sm_90, Triton 3.6): block_n = 4 warps' tokens (64: 16 a warp, 128: 32),
# stages = the cp.async ring's slots. Session 19 (call3, one split): 128 / 2 slots 0.146 / 0.530 ms at L 4k / 16k,
# 128 / 3 slots 0.144 / 0.515; 64-token steps, a register cap of 168 (three programs per SM) and the page ids loaded
# a step ahead of their copies lost (benchmarks/NOTES.md); session 20: FP4 2 slots 0.188 ms (3 slots 0.283), and 3
# splits lost for both (FP8 0.174 vs 0.143), so the sweep stops at 2
GLUON_TILES = [PagedCfg(16, 128, 4, 3, gluon=True), PagedCfg(16, 128, 4, 2, gluon=True),
               PagedCfg(16, 64, 4, 4, gluon=True)]
FP4_TILES = [(16, 32, 4, 2, False), (16, 64, 4, 2, False, 2, True), (16, 32, 4, 1, False, 2, True, True),
             (16, 64, 4, 1, False, 2, True, True), (16, 64, 8, 1, False, 2, True, True),
             (16, 128, 8, 1, False, 2, True, True), (16, 32, 4, 2, False, 2, False, True)]

def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune paged")
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--bf16-tiles", type=int, default=None,
                    help="only the first N bf16 tiles (2 holds the table's (16, 64, 4, 2)): a quick bf16 anchor")
    args = ap.parse_args(argv)
    b, h_q, h_kv, d, page, L = 64, 32, 8, 128, 16, args.L
    results = []
    for fmt in args.formats.split(","):
        tiles = {"nvfp4": FP4_TILES, "mxfp4": FP4_TILES, "fp8": FP8_TILES, "fp8mma": FP8_MMA_TILES}.get(fmt, TILES)
        tiles = GLUON_TILES if fmt.endswith("gluon") else tiles
        tiles = tiles[:args.bf16_tiles] if fmt == "bf16" and args.bf16_tiles else tiles
        # "fp8mma": the fp8 cache with FP8_MMA_TILES; "<format>gluon": that cache with GLUON_TILES
        fmt = "fp8" if fmt == "fp8mma" else fmt[:-len("gluon")] if fmt.endswith("gluon") else fmt
        pages = b * (-(-L // page))
        # K and V separate tensors: one tensor for both would read V from L2 after K
        k_vals, v_vals = (torch.randn(pages, page, h_kv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        scale = None
        if fmt == "bf16":
            k_cache, v_cache = k_vals, v_vals
        else:
            (k_cache, scale), (v_cache, _) = quantize_kv(k_vals, fmt), quantize_kv(v_vals, fmt, scale=None)
        del k_vals, v_vals
        q = torch.randn(b, 1, h_q, d, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, -1)
        seqlens = torch.full((b,), L, device="cuda", dtype=torch.int32)
        base = plan(q, k_cache, table, kv_format=fmt)
        kv_bytes = 2.0 * b * L * h_kv * KV_FORMATS[fmt].width(d) * (1 if KV_FORMATS[fmt].quantized else 2)
        for t in tiles:
            cfg = t if isinstance(t, PagedCfg) else PagedCfg(*t)
            for splits in ((1, 2) if cfg.gluon else (1, 2, 4) if fmt != "bf16" else (1, 2, 4, 8)):
                p = dataclasses.replace(base, config=cfg, num_splits=splits)

                def run():
                    return p.run(q, k_cache, v_cache, table, seqlens, k_scale=scale, v_scale=scale)
                try:
                    run()
                    ms = triton.testing.do_bench_cudagraph(run, rep=30, return_mode="median")
                except Exception as exc:  # out of shared memory: not a candidate
                    print(f"{fmt} {t} splits {splits}: {type(exc).__name__} {str(exc)[:100]}", flush=True)
                    continue
                results.append(dict(fmt=fmt, cfg=list(t), splits=splits, ms=ms, tbps=kv_bytes / ms / 1e9))
                print(f"{fmt} {tuple(t)} splits {splits}: {ms:.4f} ms {kv_bytes / ms / 1e9:.2f} TB/s", flush=True)
        k_cache = v_cache = None
        torch.cuda.empty_cache()
    if args.out:
        write_json(results, args.out)


if __name__ == "__main__":
    main()
