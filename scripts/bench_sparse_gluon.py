"""Sparse attention's kernels alone on the GPU (issue 15's anchor shape: b 1, h 16 / 2, d 128, blocks of 128, top 16),
the selection done once outside the timed region: the Gluon kernels (WARPFORGE_SPARSE_GLUON=1), the portable ones and
FlexAttention on the same block mask, one process, do_bench over rotated inputs. --bwd times forward+backward.
--pattern local keeps each query block's 16 nearest earlier blocks instead of the index branch's (random) choice:
the same work, with the blocks a program walks (and the dQ rows the backward adds into) close together, so the two
patterns' difference is what locality (L2) is worth.

    python scripts/bench_sparse_gluon.py [--s 16384,65536,131072] [--bwd] [--gluon-only] [--pattern local]"""
import argparse
import os

import torch
import triton

from warpforge.bench import baselines
from warpforge.bench.sparse_cases import _flex_mask, _kept_pairs
from warpforge.ops.sparse import configs, select_blocks, sparse_attention
from warpforge.ops.sparse.select import blocks_per_sequence, canonical

H_Q, H_KV, D, BLOCK, TOPK = 16, 2, 128, 128, 16


def _sets(s, dev, bwd):
    """Input sets rotated past L2 (~300 MB of them), each [q, k, v (, do)] in [b, s, h, d] and Flex's [b, h, s, d]."""
    n = max(2, int(3e8 // (s * 20 * D * 2)) + 1)
    ours, flex = [], []
    for _ in range(n):
        t = [torch.randn(1, s, h, D, device=dev, dtype=torch.bfloat16, requires_grad=bwd) for h in (H_Q, H_KV, H_KV)]
        t += [torch.randn(1, s, H_Q, D, device=dev, dtype=torch.bfloat16)] if bwd else []
        ours.append(t)
        flex.append([x.detach().transpose(1, 2).contiguous().requires_grad_(bwd and i < 3) for i, x in enumerate(t)])
    return ours, flex


def _step(attn, bwd):
    """One call: attn(q, k, v) -> out, then (bwd) its gradients for q, k, v."""
    def run(t):
        out = attn(*t[:3])
        if bwd:
            torch.autograd.grad(out, t[:3], t[3])
        return out
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--s", default="16384,65536,131072")
    ap.add_argument("--bwd", action="store_true", help="forward+backward (default: forward)")
    ap.add_argument("--gluon-only", action="store_true", help="time the Gluon kernels alone (knob sweeps)")
    ap.add_argument("--pattern", default="index", choices=("index", "local"),
                    help="the index branch's selection (random inputs: scattered blocks) or the nearest blocks")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for n, s in enumerate(int(x) for x in args.s.split(",")):
        ours, flex_sets = _sets(s, dev, args.bwd)
        iq = torch.randn(1, s, H_KV, 32, device=dev, dtype=torch.bfloat16)
        ik = torch.randn(1, s, 1, 32, device=dev, dtype=torch.bfloat16)
        idx = select_blocks(iq, ik, block_size=BLOCK, topk=TOPK)
        if args.pattern == "local":  # query block i keeps blocks i - 16 .. i - 1 (the canonical step drops those < 0)
            i = torch.arange(idx.shape[2], device=dev, dtype=torch.int32).view(1, 1, -1, 1)
            idx = (i - TOPK + torch.arange(TOPK, device=dev, dtype=torch.int32)).clamp_min(-1).expand_as(idx).contiguous()
        sel, n_sel = canonical(idx, blocks_per_sequence(None, 1, s, BLOCK, dev), True)
        flops = 4.0 * D * _kept_pairs(n_sel, s, BLOCK) * (H_Q // H_KV) * (3.5 if args.bwd else 1.0)
        mask = _flex_mask(sel, n_sel, H_Q, s, dev)
        flex = baselines.flex_attention()
        impls = {"gluon": ("1", _step(lambda q, k, v: sparse_attention(q, k, v, block_indices=idx), args.bwd), ours),
                 "portable": ("0", _step(lambda q, k, v: sparse_attention(q, k, v, block_indices=idx), args.bwd), ours),
                 "flex": (None, _step(lambda q, k, v: flex(q, k, v, block_mask=mask, enable_gqa=True), args.bwd),
                          flex_sets)}
        order = ["gluon", "portable", "flex", "gluon"]  # Gluon twice: a clock ramp or a drift shows as a difference
        if args.gluon_only:
            order = ["gluon", "gluon"]
        times = {}
        for i, name in enumerate(order):
            flag, run, sets = impls[name]
            if flag is not None:
                os.environ[configs.GLUON_ENV] = flag
            it = iter(range(1 << 30))
            if n == 0 and i == 0:  # the clocks up from idle before the first timing
                triton.testing.do_bench(lambda: run(sets[next(it) % len(sets)]), rep=1000)
            ms = triton.testing.do_bench(lambda: run(sets[next(it) % len(sets)]), rep=300)
            times[name if name not in times else name + " again"] = ms
        what = "fwd+bwd" if args.bwd else "fwd"
        if args.gluon_only:
            print(f"s {s} {what} ({args.pattern}): " + ", ".join(f"{k} {v:.3f} ms ({flops / v / 1e9:.0f} TFLOP/s)"
                                               for k, v in times.items()), flush=True)
            continue
        os.environ[configs.GLUON_ENV] = "1"
        out_g = _step(lambda q, k, v: sparse_attention(q, k, v, block_indices=idx), False)(ours[0])
        os.environ[configs.GLUON_ENV] = "0"
        out_p = _step(lambda q, k, v: sparse_attention(q, k, v, block_indices=idx), False)(ours[0])
        err = ((out_g.float() - out_p.float()).norm() / out_p.float().norm()).item()
        print(f"s {s} {what}: " + ", ".join(f"{k} {v:.3f} ms ({flops / v / 1e9:.0f} TFLOP/s)" for k, v in times.items())
              + f"; gluon / flex {times['flex'] / times['gluon']:.2f}x; out gluon vs portable rel L2 {err:.2e}",
              flush=True)


if __name__ == "__main__":
    main()
