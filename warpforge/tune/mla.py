"""Sweep MLA decode tiles and split counts on this GPU (FlashMLA's shapes at one cache length).

    warpforge tune mla [--L 8192] [--out tune_mla.json]

Prints each result as it lands (a run cut short still says something); winners go into
warpforge/ops/mla/configs.py's DECODE table with the numbers in benchmarks/NOTES.md.
"""
import argparse
import math

import torch
import triton
import triton.testing

from warpforge.bench.report import write_json
from warpforge.ops.mla import KV_FORMATS, nvfp4_tensor_scale, quantize_kv
from warpforge.ops.mla.configs import MLACfg
from warpforge.ops.mla.decode_kernel import mla_decode_fwd, plan_block_h, plan_num_splits
from warpforge.runtime import sm_count


def problem(b, L, h_q, fmt, page=64):
    lens = [L + 2 * i for i in range(b)]
    max_pages = -(-max(lens) // page)
    q = torch.randn(b, 1, h_q, 576, device="cuda", dtype=torch.bfloat16)
    kv_scale = nvfp4_tensor_scale(torch.full((1, 576), 6.0, device="cuda")) if fmt == "nvfp4" else None
    cache = quantize_kv(torch.randn(b * max_pages, page, 1, 576, device="cuda", dtype=torch.bfloat16), fmt, kv_scale)
    table = torch.randperm(b * max_pages, device="cuda").view(b, max_pages).int()
    return q, cache, table, torch.tensor(lens, dtype=torch.int32, device="cuda"), sum(lens), kv_scale


def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune mla")
    ap.add_argument("--L", type=int, default=8192)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="e.g. 16:fp8,128:bf16 (h_q:format) to sweep only those entries of the plan")
    ap.add_argument("--dequant", action="store_true",
                    help="sweep the quantized caches' dequantisation pass (configs.DEQUANT) instead of the decode tiles")
    args = ap.parse_args(argv)
    if args.dequant:
        return sweep_dequant(args.L, args.out)
    sms = sm_count(torch.device("cuda"))
    plans = {
        # a 7th field True: index_ahead (page ids a step early, so the tile copies run stages - 1 steps ahead)
        (16, "bf16"): [(16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 4, 3), (16, 32, 4, 4), (16, 64, 8, 3),
                       (16, 64, 4, 2, False, False, True), (16, 64, 4, 3, False, False, True),
                       (16, 32, 4, 4, False, False, True), (16, 32, 4, 3, False, False, True)],
        (16, "fp8"): [(16, 32, 4, 2), (16, 64, 4, 2), (16, 32, 4, 2, True), (16, 64, 4, 2, True),
                      (16, 64, 4, 3, True), (16, 32, 8, 2, True), (16, 16, 4, 2, True),  # True: fp16 math
                      (16, 32, 4, 2, True, True), (16, 32, 4, 3, True, True), (16, 32, 8, 2, True, True)],  # prefetch
        (16, "nvfp4"): [(16, 32, 4, 2), (16, 64, 4, 2), (16, 32, 4, 2, True), (16, 16, 4, 2)],
        (16, "mxfp4"): [(16, 32, 4, 2), (16, 64, 4, 2), (16, 32, 4, 2, True), (16, 16, 4, 2)],
        (128, "bf16"): [(64, 32, 8, 2), (64, 64, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (64, 64, 8, 1),
                        (64, 64, 8, 2, False, False, True), (64, 32, 8, 3, False, False, True),
                        (64, 32, 8, 4, False, False, True), (64, 16, 8, 4, False, False, True)],
        (128, "fp8"): [(64, 64, 8, 2), (64, 64, 8, 2, True), (64, 32, 8, 2, True)],
    }
    results = []
    for (h_q, fmt), cfgs in plans.items():
        if args.only and f"{h_q}:{fmt}" not in args.only.split(","):
            continue
        q, cache, table, lens, tokens, kv_scale = problem(128, args.L, h_q, fmt)
        row_bytes = KV_FORMATS[fmt].row_bytes
        for cfg in cfgs:
            cfg = MLACfg(*cfg)
            cfg = cfg._replace(block_h=plan_block_h(cfg.block_h, h_q))
            auto = plan_num_splits(128, h_q, table.shape[1] * 64, cfg.block_h, sms, waves=cfg.waves)
            for splits in sorted({auto, 2 * auto, max(1, auto // 2)}):
                def run():
                    return mla_decode_fwd(q, cache, table, lens, 1 / math.sqrt(576), False, KV_FORMATS[fmt], kv_scale,
                                          splits, cfg)
                try:
                    run()
                    ms = triton.testing.do_bench_cudagraph(run, rep=30, return_mode="median")
                except Exception as exc:
                    print(f"h{h_q} {fmt} {tuple(cfg)} splits {splits}: {type(exc).__name__} {str(exc)[:120]}", flush=True)
                    continue
                tbps = tokens * row_bytes / ms / 1e9
                tflops = 2 * h_q * tokens * 1088 / ms / 1e9
                results.append(dict(h_q=h_q, fmt=fmt, cfg=tuple(cfg), splits=splits, ms=ms, tbps=tbps, tflops=tflops))
                print(f"h{h_q} {fmt} {tuple(cfg)} splits {splits}: {ms:.3f} ms {tbps:.2f} TB/s {tflops:.0f} TFLOP/s",
                      flush=True)
        q = cache = table = None  # free this shape's cache before the next
        torch.cuda.empty_cache()
    if args.out:
        write_json(results, args.out)


def sweep_dequant(L, out_path):
    """dequant_kernel.py's pass alone (the bf16 kernel after it skipped) at b 128, h_q 128, each format: every
    DequantCfg candidate, TB/s over the bytes it reads and writes."""
    from warpforge.ops.mla.configs import DequantCfg
    from warpforge.ops.mla.dequant_kernel import mla_decode_dequantized, slice_requests
    results = []
    for fmt in ("fp8", "nvfp4", "mxfp4"):
        q, cache, table, lens, tokens, kv_scale = problem(128, L, 128, fmt)
        per_slice = slice_requests(128, table.shape[1] * 64)
        moved = tokens * (KV_FORMATS[fmt].row_bytes + 2 * 576)
        for pages, warps in ((1, 4), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8), (1, 2)):
            cfg = DequantCfg(pages, warps)

            def run():
                # the bf16 kernel skipped: empty results, which the slices' concatenation takes
                return mla_decode_dequantized(q, cache, table, lens, kv_scale, KV_FORMATS[fmt],
                                              lambda q_, *a: (q_.new_empty(0), q_.new_empty(0)), per_slice, cfg)
            run()
            ms = triton.testing.do_bench_cudagraph(run, rep=30, return_mode="median")
            results.append(dict(fmt=fmt, cfg=tuple(cfg), ms=ms, tbps=moved / ms / 1e9))
            print(f"dequant {fmt} {tuple(cfg)}: {ms:.3f} ms {moved / ms / 1e9:.2f} TB/s", flush=True)
        q = cache = table = None
        torch.cuda.empty_cache()
    if out_path:
        write_json(results, out_path)


if __name__ == "__main__":
    main()
