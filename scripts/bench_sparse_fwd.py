"""Sparse attention's forward alone on the GPU (issue 15's anchor shape: b 1, h 16 / 2, d 128, blocks of 128, top
16): the Gluon forward (WARPFORGE_SPARSE_GLUON=1), the portable kernel and FlexAttention's forward on the same block
mask, one process, do_bench over rotated inputs. Selection is done once outside the timed region.

    python scripts/bench_sparse_fwd.py [--s 16384,65536,131072]"""
import argparse
import os

import torch
import triton

from warpforge.bench import baselines
from warpforge.bench.sparse_cases import _flex_mask, _kept_pairs
from warpforge.ops.sparse import configs, select_blocks, sparse_attention
from warpforge.ops.sparse.select import blocks_per_sequence, canonical


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--s", default="16384,65536,131072")
    args = ap.parse_args()
    dev = torch.device("cuda")
    h_q, h_kv, d, block, topk = 16, 2, 128, 128, 16
    sizes = [int(x) for x in args.s.split(",")]
    first = sizes[0]
    for s in sizes:
        sets = [[torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16) for h in (h_q, h_kv, h_kv)]
                for _ in range(max(2, int(3e8 // (s * 20 * d * 2)) + 1))]
        iq = torch.randn(1, s, h_kv, 32, device=dev, dtype=torch.bfloat16)
        ik = torch.randn(1, s, 1, 32, device=dev, dtype=torch.bfloat16)
        idx = select_blocks(iq, ik, block_size=block, topk=topk)
        sel, n_sel = canonical(idx, blocks_per_sequence(None, 1, s, block, dev), True)
        flops = 4.0 * d * _kept_pairs(n_sel, s, block) * (h_q // h_kv)
        it = [0]

        def nxt():
            it[0] += 1
            return sets[it[0] % len(sets)]
        times = {}
        if s == first:  # the clocks up from idle before the first timing (a cold H200 reads the first case slow)
            os.environ[configs.GLUON_ENV] = "1"
            triton.testing.do_bench(lambda: sparse_attention(*nxt(), block_indices=idx), rep=1000)
        for name, flag in (("gluon", "1"), ("portable", "0"), ("gluon again", "1")):
            os.environ[configs.GLUON_ENV] = flag
            times[name] = triton.testing.do_bench(lambda: sparse_attention(*nxt(), block_indices=idx), rep=200)
        out_g = (os.environ.__setitem__(configs.GLUON_ENV, "1"), sparse_attention(*sets[0], block_indices=idx))[1]
        out_p = (os.environ.__setitem__(configs.GLUON_ENV, "0"), sparse_attention(*sets[0], block_indices=idx))[1]
        err = ((out_g.float() - out_p.float()).norm() / out_p.float().norm()).item()
        mask = _flex_mask(sel, n_sel, h_q, s, dev)
        views = [[t.transpose(1, 2).contiguous() for t in st] for st in sets]
        flex = baselines.flex_attention()
        times["flex"] = triton.testing.do_bench(
            lambda: flex(*views[(it.__setitem__(0, it[0] + 1) or it[0]) % len(views)], block_mask=mask,
                         enable_gqa=True), rep=200)
        print(f"s {s}: " + ", ".join(f"{k} {v:.3f} ms ({flops / v / 1e9:.0f} TFLOP/s)" for k, v in times.items())
              + f"; gluon vs portable rel L2 {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
