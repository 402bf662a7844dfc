"""Probe the Hopper Gluon paged decode kernel outside its tile table (issue 18; benchmarks/NOTES.md, session 20):
one launch per (format, slots, register cap) at the tune's shape (b 64, h_q 32 / h_kv 8, d 128, page 16, one
split), timed from a CUDA graph, with the compiled kernel's registers, spills and shared memory.

    python scripts/probe_paged_gluon.py [--L 4096] [--formats nvfp4,fp8] [--slots 2,3,4] [--maxnreg 0,168] [--planar]
                                        [--q-shared 0,1]

A register cap is a launch option here only (the kernel's tiles have none): this is for deciding whether one pays.
--planar also times each FP4 launch on the same bytes split into two tensors (the 64 value bytes of a row, its
block scales apart: 16-byte copies), and prints how far its output is from the row layout's.
"""
import argparse

import torch
import triton.testing

from warpforge.ops.paged import KV_FORMATS, quantize_kv
from warpforge.ops.paged.kv_format import split_fp4
from warpforge.ops.paged import decode_gluon_kernel as dg
from warpforge.ops.paged.configs import PagedCfg
from warpforge.ops.paged.decode_kernel import decode_outputs


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--formats", default="nvfp4,fp8")
    ap.add_argument("--slots", default="2,3,4")
    ap.add_argument("--maxnreg", default="0,168")
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--planar", action="store_true")
    ap.add_argument("--q-shared", default="0", help="0,1: q's fragments in registers / from shared memory (PagedCfg)")
    args = ap.parse_args(argv)
    b, h_q, h_kv, d, page, L = 64, 32, 8, 128, 16, args.L
    pages = b * (-(-L // page))
    for fmt in args.formats.split(","):
        code = KV_FORMATS[fmt].code
        k_vals, v_vals = (torch.randn(pages, page, h_kv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        (k_cache, scale), (v_cache, _) = quantize_kv(k_vals, fmt), quantize_kv(v_vals, fmt)
        del k_vals, v_vals
        q = torch.randn(b, 1, h_q, d, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, -1)
        seqlens = torch.full((b,), L, device="cuda", dtype=torch.int32)
        kv_bytes = 2.0 * b * L * h_kv * KV_FORMATS[fmt].width(d)
        _, _, o_part, lse_part = decode_outputs(q, 1)
        if KV_FORMATS[fmt].fp4:   # the kernel reads values and block scales apart: the row layout's views
            (kc, kbs), (vc, vbs) = split_fp4(k_cache, d), split_fp4(v_cache, d)
            layouts = [("rows", kc, vc, kbs, vbs)]
            if args.planar:   # the same bytes as two tensors a side (quantize_kv(..., split_scales=True))
                layouts.append(("planar", kc.contiguous(), vc.contiguous(), kbs.contiguous(), vbs.contiguous()))
        else:
            layouts = [("rows", k_cache, v_cache, None, None)]
        for slots, q_shared in ((sl, qs) for sl in map(int, args.slots.split(","))
                                for qs in map(int, args.q_shared.split(","))):
            for cap in map(int, args.maxnreg.split(",")):
                outs = []
                for name, kc, vc, kbs, vbs in layouts:
                    cfg = PagedCfg(16, args.block_n, 4, slots, gluon=True, q_shared=bool(q_shared))
                    kernel, grid, kargs, meta = dg.launch_args(q, kc, vc, table, seqlens, scale, scale, d ** -0.5,
                                                               o_part, lse_part, 1, cfg, code, kbs, vbs)
                    if cap:
                        meta["maxnreg"] = cap
                    try:
                        compiled = kernel[grid](*kargs, **meta)
                        outs.append(o_part.clone())
                        ms = triton.testing.do_bench_cudagraph(lambda: kernel[grid](*kargs, **meta), rep=30,
                                                               return_mode="median")
                    except Exception as exc:   # out of shared memory, say
                        print(f"{fmt} {name} slots {slots} q_shared {q_shared} maxnreg {cap}: {type(exc).__name__} "
                              f"{str(exc)[:120]}",
                              flush=True)
                        continue
                    print(f"{fmt} {name} block_n {args.block_n} slots {slots} q_shared {q_shared} maxnreg {cap}: "
                          f"{ms:.4f} ms "
                          f"{kv_bytes / ms / 1e9:.2f} TB/s, {compiled.n_regs} registers, {compiled.n_spills} spills, "
                          f"{compiled.metadata.shared} B shared", flush=True)
                if len(outs) == 2:
                    print(f"  planar vs rows: max |diff| {(outs[1].float() - outs[0].float()).abs().max().item():.3g}",
                          flush=True)
        k_cache = v_cache = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
