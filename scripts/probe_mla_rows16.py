"""Probe the Gluon MLA kernel for <= 16 rows (ops/mla/decode_rows16_gluon_kernel.py) outside its constants (issue
13): one launch per (L, slots, register cap, splits) at the bench's shape (b 128, h_q 16, s_q 1, page 64, FP8),
timed from a CUDA graph (the combine included when split), beside the bf16 cache through the planned kernel.

    python scripts/probe_mla_rows16.py [--L 4096,16384] [--slots 2,3,4] [--maxnreg 168,0] [--splits 2,3,4]
"""
import argparse

import torch
import triton.testing

import warpforge as wf
from warpforge.ops.mla import decode_rows16_gluon_kernel as d16
from warpforge.ops.mla import mla_decode_reference


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", default="4096,16384")
    ap.add_argument("--slots", default="2,3,4")
    ap.add_argument("--maxnreg", default="-1", help="register caps; -1 the kernel's own (MAX_REGS), 0 none")
    ap.add_argument("--splits", default="2,3,4")
    ap.add_argument("--row-bytes", default="656", help="the cache's row stride (768: rows 128-byte aligned)")
    ap.add_argument("--pages", default="random", help="random or sequential page ids")
    args = ap.parse_args(argv)
    b, h_q, page = 128, 16, 64
    for L in map(int, args.L.split(",")):
        pages = b * (-(-L // page))
        if args.pages == "random":
            table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, -1)
        else:
            table = torch.arange(pages, device="cuda", dtype=torch.int32).view(b, -1)
        seqlens = torch.full((b,), L, device="cuda", dtype=torch.int32)
        q = torch.randn(b, 1, h_q, 576, device="cuda", dtype=torch.bfloat16)
        caches = {}
        for rb in map(int, args.row_bytes.split(",")):
            caches[rb] = torch.zeros(pages, page, 1, rb, device="cuda", dtype=torch.uint8)[..., :656]
        cache = caches[min(caches)]
        for p0 in range(0, pages, 4096):
            cache[p0:p0 + 4096] = wf.mla.quantize_kv(torch.randn(min(4096, pages - p0), page, 1, 576, device="cuda",
                                                                 dtype=torch.bfloat16), "fp8")
        bf16 = torch.randn(pages, page, 1, 576, device="cuda", dtype=torch.bfloat16)
        plan = wf.mla.plan(q, bf16, table)
        ms = triton.testing.do_bench_cudagraph(lambda: plan.run(q, bf16, table, seqlens), rep=30, return_mode="median")
        print(f"L {L} bf16 (planned, splits {plan.num_splits}): {ms:.4f} ms {b * L * 1152 / ms / 1e9:.2f} TB/s",
              flush=True)
        bf16 = None
        bf16_ms = ms
        # accuracy on the first 8 requests against the fp32 reference on the dequantised cache
        out, lse = d16.mla_decode_rows16_gluon(q[:8], cache, table[:8], seqlens[:8], 576 ** -0.5, False, 2, 2)
        ref, ref_lse = mla_decode_reference(q[:8].float(), cache, table[:8], seqlens[:8], kv_format="fp8")
        cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0).item()
        rel = ((lse - ref_lse).abs() / ref_lse.abs().clamp(min=1)).max().item()
        print(f"L {L} fp8 rows16 vs reference: 1 - cos {1 - cos:.2e}, lse rel {rel:.2e}", flush=True)
        for rb in caches:
            caches[rb].copy_(cache)
        for slots, rb in ((sl, rb) for sl in map(int, args.slots.split(",")) for rb in caches):
            cache = caches[rb]
            own = d16.MAX_REGS
            for cap in map(int, args.maxnreg.split(",")):
                d16.MAX_REGS = own if cap < 0 else (cap or None)   # a module constant: the launches read it
                for splits in map(int, args.splits.split(",")):
                    def run():
                        return d16.mla_decode_rows16_gluon(q, cache, table, seqlens, 576 ** -0.5, False, splits, slots)
                    try:
                        run()
                        ms = triton.testing.do_bench_cudagraph(run, rep=30, return_mode="median")
                    except Exception as exc:   # out of shared memory, say
                        print(f"L {L} slots {slots} maxnreg {cap} splits {splits}: {type(exc).__name__} "
                              f"{str(exc)[:120]}", flush=True)
                        continue
                    print(f"L {L} fp8 {args.pages} row {rb} B slots {slots} "
                          f"maxnreg {cap} splits {splits}: {ms:.4f} ms "
                          f"{b * L * 656 / ms / 1e9:.2f} TB/s, {bf16_ms / ms:.3f}x bf16", flush=True)
        cache = caches = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
