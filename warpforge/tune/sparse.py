"""Sweep the sparse-attention kernels' tiles on this GPU at the bench's shape (b 1, 16 query heads, 2 kv heads,
d 128, blocks of 128, top 16, index d 32, bf16), each pass timed alone: the selection (block scores, top-k and the
block lists), the forward, dq, and dk/dv (with its CSR lists).

    warpforge tune sparse [--s 16384,65536] [--out tune_sparse.json]

Winners go into warpforge/ops/sparse/configs.py's TILES table, the numbers into benchmarks/NOTES.md.
"""
import argparse

import torch

from warpforge.bench.report import write_json
from warpforge.ops.sparse import configs, select, sparse_kernel as sk
from warpforge.tune.timing import time_candidate

C = configs.KernelCfg
# (block_m, block_n, warps, stages, tma): tma reads the walked K/V (fwd, dq) or q/do (dk/dv) through descriptors
FWD = [C(128, 128, 8, 3), C(128, 128, 8, 3, True), C(128, 128, 8, 2, True), C(128, 64, 8, 3), C(128, 64, 8, 3, True),
       C(64, 64, 4, 3), C(64, 64, 4, 3, True), C(128, 32, 4, 4)]
DQ = [C(128, 128, 8, 2), C(128, 128, 8, 2, True), C(128, 64, 8, 3), C(128, 64, 8, 3, True), C(64, 64, 4, 3, True),
      C(64, 128, 4, 2)]
DKDV = [C(64, 64, 4, 2, True), C(64, 64, 4, 2, True, True), C(64, 128, 8, 2, True, True), C(32, 64, 4, 2, True, True),
        C(64, 64, 4, 3, True), C(64, 64, 8, 2, True), C(32, 64, 4, 3, True),
        C(64, 128, 8, 2, True), C(128, 64, 8, 2, True), C(64, 64, 4, 2, False), C(32, 128, 8, 2, True)]
INDEX = [C(64, 64, 4, 2), C(128, 64, 8, 2), C(32, 64, 4, 2), C(64, 64, 4, 3)]


def bench(fn):
    return time_candidate(fn, warmup=10, rep=60)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune sparse")
    ap.add_argument("--s", default="16384,65536")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    h_q, h_kv, d, d_i, bs, topk = 16, 2, 128, 32, 128, 16
    dev = torch.device("cuda")
    base = configs.TILES.lookup(dev, 128)
    results = []
    for s in (int(v) for v in args.s.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(s)

        def rnd(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        q, k, v, do = rnd(1, s, h_q, d), rnd(1, s, h_kv, d), rnd(1, s, h_kv, d), rnd(1, s, h_q, d)
        iq, ik = rnd(1, s, h_kv, d_i), rnd(1, s, 1, d_i)
        scale = d ** -0.5
        nb_seq = select.blocks_per_sequence(None, 1, s, bs, dev)

        def selection(cfg):
            pooled = sk.pool_index_queries(iq, None, 1, s, bs)
            z = sk.index_block_scores(pooled, ik, None, 1, s, bs, True, d_i ** -0.5, cfg)
            return select.canonical(select.top_blocks(z, topk, True, masked=True), nb_seq, True)
        sel, n_sel = selection(base.index)
        offsets, qblocks = sk.kept_by(sel, causal=True)
        pairs = int(n_sel.sum()) * bs * bs + s * (bs + 1) // 2 * h_kv
        fwd_flops = 4.0 * d * pairs * (h_q // h_kv)

        def record(part, cfg, ms, flops):
            rate = flops / ms / 1e9 if flops else 0.0
            results.append(dict(s=s, part=part, cfg=list(cfg), ms=ms, tflops=rate))
            print(f"s {s} {part} {tuple(cfg)}: {ms:.3f} ms" + (f" {rate:.0f} TFLOP/s" if flops else ""), flush=True)
        for cfg in INDEX:
            ms = bench(lambda: selection(cfg))
            if ms is not None:
                record("selection", cfg, ms, 0)
        ms = bench(lambda: sk.kept_by(sel, causal=True))
        record("kept_by (CSR)", base.index, ms, 0)
        for cfg in FWD:
            ms = bench(lambda: sk.sparse_fwd(q, k, v, sel, n_sel, None, 1, s, bs, True, scale, cfg))
            if ms is not None:
                record("fwd", cfg, ms, fwd_flops)
        out, lse = sk.sparse_fwd(q, k, v, sel, n_sel, None, 1, s, bs, True, scale, base.fwd)
        for cfg in DQ:  # dq and dk/dv timed apart: a sweep of one with the other fixed
            ms = bench(lambda: sk.sparse_bwd(do, q, k, v, out, lse, sel, n_sel, offsets, qblocks, None, 1, s, bs, True,
                                             scale, cfg, base.dkdv))
            if ms is not None:
                record("bwd, dq swept", cfg, ms, 2.5 * fwd_flops)
        for cfg in DKDV:
            ms = bench(lambda: sk.sparse_bwd(do, q, k, v, out, lse, sel, n_sel, offsets, qblocks, None, 1, s, bs, True,
                                             scale, base.dq, cfg))
            if ms is not None:
                record("bwd, dkdv swept", cfg, ms, 2.5 * fwd_flops)
    if args.out:
        write_json({"sweep": "sparse", "results": results}, args.out)
    return 0
