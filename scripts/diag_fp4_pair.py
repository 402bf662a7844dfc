"""Diagnose the NVFP4 pair's wrong output under CUDA-graph replay (issue 18; benchmarks/NOTES.md, session 42).

Session 42 on an H100: in the family bench's order (the row layout's graph replayed and scored, the score's fp32
reference computed on the GPU, then the pair's graph replayed) the pair's output was ~1e-37; eager calls, a lone
capture and the graphs replayed with nothing in between were right. Each check below prints one line, so that one
run tells which hypothesis holds:

  poison    every free byte of the caching allocator filled with NaN, then both graphs replayed: a launch that reads
            memory it does not own (past a tensor, or freed after the capture) comes out NaN or wrong
  reference the bench's order itself (rows, reference, pair), then the rows again: is it the pair, or any
            per-tensor-scale graph replayed after other work?
  scale     the V tensor scale doubled in place: a replay that reads it gives twice the output
  direct    the Gluon launch alone on the pair, its value copies 16 / 8 / 4 bytes wide, before and after other work
  eager     the pair called eagerly after all that (the same tensors)
  recapture the pair captured again now and replayed

    PYTHONPATH=. python scripts/diag_fp4_pair.py [--L 4096] [--b 64] [--fmt nvfp4]
"""
import argparse
import os

import torch

from warpforge.ops.paged import configs

os.environ[configs.GLUON_NVFP4_PAIR_ENV] = "1"   # the pair on the Gluon kernel (api.nvfp4_pair_held_back)

from warpforge.ops.paged import paged_decode_reference, plan, quantize_kv   # noqa: E402
from warpforge.ops.paged.kv_format import split_fp4   # noqa: E402
from warpforge.testing import captured   # noqa: E402


def cos_err(out, ref):
    a, b = out.float().flatten(), ref.float().flatten()
    return 1.0 - float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--b", type=int, default=64)
    ap.add_argument("--fmt", default="nvfp4")
    args = ap.parse_args(argv)
    b, h_q, h_kv, d, page, L, fmt = args.b, 32, 8, 128, 16, args.L, args.fmt
    dev = torch.device("cuda")
    max_pages = -(-L // page)
    pages = b * max_pages
    scale = torch.full((1,), 8.0 / (6 * 448), device=dev) if fmt == "nvfp4" else None
    q = torch.randn(b, 1, h_q, d, device=dev, dtype=torch.bfloat16)
    table = torch.randperm(pages, device=dev).view(b, max_pages).int()
    seqlens = torch.full((b,), L, dtype=torch.int32, device=dev)
    caches, first = {}, {}
    for name in ("k", "v"):
        vals = torch.randn(pages, page, h_kv, d, device=dev, dtype=torch.bfloat16)
        first[name] = vals[table[0].long()].float()
        caches[name] = quantize_kv(vals, fmt, scale=scale)[0]
        caches[name + "_pair"] = tuple(t.contiguous() for t in split_fp4(caches[name], d))
        del vals
    the_plan = plan(q, caches["k"], table, kv_format=fmt)
    v_scale = scale.clone() if scale is not None else None   # its own tensor: doubling it doubles the output
    sc = dict(k_scale=scale, v_scale=v_scale) if scale is not None else {}

    def step(layout):
        return lambda: the_plan.run(q, caches["k" + layout], caches["v" + layout], table, seqlens, backend="triton",
                                    **sc)

    graphs = {name: captured(step(layout)) for name, layout in (("rows", ""), ("pair", "_pair"))}

    def reference():
        local = torch.arange(max_pages, dtype=torch.int32, device=dev)[None]
        return paged_decode_reference(q[:1].float(), first["k"], first["v"], local, seqlens[:1],
                                      softmax_scale=d ** -0.5, kv_format="fp32")[0]
    ref = reference()   # computed now; recomputed below where the bench's order needs work in between

    def replay(name, tag):
        g, out = graphs[name]
        g.replay()
        torch.cuda.synchronize()
        print(f"{tag:10s} {name:5s} 1-cos {cos_err(out[:1], ref):.3e} |out| max {out.abs().max().item():.3e} "
              f"nan {bool(out.isnan().any())}", flush=True)
        return out.clone()

    replay("rows", "first")
    replay("pair", "first")
    # poison: every free block of the caching allocator, and as much fresh memory as fits, filled with NaN
    torch.cuda.synchronize()
    torch.cuda.empty_cache()   # the cached free blocks back to the driver, so that the fill below may take them
    free, _ = torch.cuda.mem_get_info()
    blocks = []
    for frac in (0.9, 0.5, 0.25):
        try:
            blocks.append(torch.full((int(free * frac) // 4,), float("nan"), device=dev))
            break
        except torch.OutOfMemoryError:
            continue
    stats = torch.cuda.memory_stats()
    print(f"poison: {sum(t.numel() * 4 for t in blocks) / 2**30:.1f} GiB filled; reserved "
          f"{stats['reserved_bytes.all.current'] / 2**30:.1f} GiB", flush=True)
    del blocks
    replay("rows", "poison")
    replay("pair", "poison")
    # the bench's order
    replay("rows", "reference")
    reference()
    replay("pair", "reference")
    replay("rows", "reference")
    if scale is not None:
        before = replay("pair", "scale x1")
        v_scale.mul_(2.0)
        after = replay("pair", "scale x2")
        print(f"scale     v_scale {v_scale.item():.4e}; pair out ratio x2/x1 "
              f"{(after.float().norm() / before.float().norm().clamp_min(1e-30)).item():.3f} (2 if the scale is read)")
        v_scale.div_(2.0)
    # the Gluon launch itself, one split, on the pair with its value copies 16 / 8 / 4 bytes wide (the rows': NVFP4 8,
    # MXFP4 4):
    # which width goes wrong after other work
    from warpforge.ops.paged import decode_gluon_kernel as dg
    from warpforge.ops.paged.decode_kernel import decode_outputs
    if dg.available():
        kp, kbs = caches["k_pair"]
        vp, vbs = caches["v_pair"]
        for vec in (16, 8, 4):
            out1, _, o_part, lse_part = decode_outputs(q, 1)
            kernel, grid, args, meta = dg.launch_args(q, kp, vp, table, seqlens, scale, v_scale, d ** -0.5, o_part,
                                                      lse_part, 1, configs.GLUON[fmt], {"nvfp4": 2, "mxfp4": 3}[fmt],
                                                      kbs, vbs)
            gl = dg._build({"nvfp4": 2, "mxfp4": 3}[fmt])[1]
            meta["CP"] = dg._layouts(gl, configs.GLUON[fmt].block_n // 4, {"nvfp4": 2, "mxfp4": 3}[fmt], vec)[5]
            graphs[f"vec{vec}"] = captured(lambda: (kernel[grid](*args, **meta), out1)[1])
            replay(f"vec{vec}", "direct")
            reference()
            replay(f"vec{vec}", "direct+ref")
    out = step("_pair")()
    torch.cuda.synchronize()
    print(f"eager     pair  1-cos {cos_err(out[:1], ref):.3e}")
    graphs["pair"] = captured(step("_pair"))
    replay("pair", "recapture")
    print("pointers: q", hex(q.data_ptr()), "scale", hex(scale.data_ptr()) if scale is not None else None,
          "k pair", [hex(t.data_ptr()) for t in caches["k_pair"]], "out", hex(graphs["pair"][1].data_ptr()))


if __name__ == "__main__":
    main()
