"""Where an eager Evoformer fwd+bwd call's host time goes (issue 16's triangle line is host-bound: session 33 measured
1.39 ms of enqueue against 0.90 ms of kernels on an H100). Each row is the median host time (µs) of one piece,
called with the GPU idle (a sync before every sample), at the bench's triangle shape with its biases (a -1e9 key
mask on the last residues, a learnable pair bias) and gate:

    PYTHONPATH=. python scripts/evo_host_breakdown.py [--shape triangle|row] [--reps 200]

A probe: its numbers go into benchmarks/NOTES.md by hand, with the run's log beside them.
"""
import argparse
import math
import statistics
import time

import torch

from warpforge.ops._op import cached_launch
from warpforge.ops.evoformer import api, configs, evoformer_kernel as ek
from warpforge.ops.evoformer import evoformer_attention, gluon_shared_kernel as gs

SHAPES = {"row": dict(S=512, R=384, H=8, D=32), "triangle": dict(S=384, R=384, H=4, D=32)}


def host_us(fn, reps, setup=None):
    """Median host time of fn() in µs, each sample started with the GPU idle; setup() (untimed) before each."""
    for _ in range(5):
        fn() if setup is None else fn(setup())
    times = []
    for _ in range(reps):
        arg = setup() if setup else None
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn() if arg is None else fn(arg)
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


class Empty(torch.autograd.Function):
    """The engine's floor: five inputs, one output, nothing computed."""
    @staticmethod
    def forward(ctx, q, k, v, g, pair):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, d):
        return d, d, d, d, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="triangle")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    S, R, H, D = (SHAPES[args.shape][key] for key in ("S", "R", "H", "D"))
    dev, dt = torch.device("cuda"), torch.bfloat16

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=dt).requires_grad_()
    q, k, v, g, do = (leaf(1, S, R, H, D) for _ in range(5))
    mask = torch.zeros(1, S, 1, 1, R, device=dev, dtype=dt)
    mask[..., R - max(1, R // 16):] = -1e9
    pair = leaf(1, 1, H, R, R)
    leaves = [q, k, v, g, pair]
    scale = 1.0 / math.sqrt(D)
    rows = []

    def row(name, us):
        rows.append((name, us))
        print(f"{name:44s} {us:8.1f} us", flush=True)

    print(f"{args.shape}: S {S} R {R} H {H} D {D}; gluon dq+dbias {configs.gluon_dq_dbias()}", flush=True)
    row("empty Function fwd+grad (engine floor)",
        host_us(lambda: torch.autograd.grad(Empty.apply(q, k, v, g, pair), leaves[:4], do), args.reps))

    def fwd():
        return evoformer_attention(q, k, v, [mask, pair], gate=g)
    with torch.no_grad():
        row("forward, no grad", host_us(fwd, args.reps))
    row("forward with grad", host_us(fwd, args.reps))
    row("forward + grad (the bench's call)", host_us(lambda: torch.autograd.grad(fwd(), leaves, do), args.reps))
    row("grad alone (after a forward)", host_us(lambda out: torch.autograd.grad(out, leaves, do), args.reps,
                                                setup=fwd))
    torch.autograd.set_multithreading_enabled(False)
    row("  same, multithreading off", host_us(lambda out: torch.autograd.grad(out, leaves, do), args.reps,
                                              setup=fwd))
    torch.autograd.set_multithreading_enabled(True)

    with torch.no_grad():
        out, lse = api._fwd_impl(q, k, v, mask, pair, g, scale)
        row("api._bwd_impl direct", host_us(lambda: api._bwd_impl(do, q, k, v, out, lse, mask, pair, g, scale,
                                                                  False, True, True), args.reps))
        full = (1, S, H, R, R)
        biases = (api._full(mask, full), api._full(pair, full))
        tiles = api._tiles(q)
        merged = api._dq_dbias_pass(q, biases, scale)
        dkdv = api._dkdv_pass(q, biases, scale)
        row("evoformer_bwd, passes given", host_us(lambda: ek.evoformer_bwd(
            do, q, k, v, out, lse, biases, g, scale, True, tiles, True, False, merged, dkdv, cached_launch), args.reps))
        row("  _dq_dbias_pass + _dkdv_pass (choice)", host_us(lambda: (api._dq_dbias_pass(q, biases, scale),
                                                                       api._dkdv_pass(q, biases, scale)), args.reps))
        if merged is not None:
            delta = torch.empty((1, S, H, R), device=dev, dtype=torch.float32)
            dq = torch.empty_like(q)
            row("  dq_dbias_gluon (one call)", host_us(lambda: merged(q, k, v, do, lse, delta, dq), args.reps))
            p, m = gs.split_biases(biases, S)
            row("    log2_biases", host_us(lambda: gs.log2_biases(p, m, 1, S, H, R, cached_launch), args.reps))
            p2, m2, _ = gs.log2_biases(p, m, 1, S, H, R, cached_launch)
            row("    6 TMA descriptors", host_us(lambda: (gs.row_descriptors(q, k, v, do),
                                                          gs.bias_descriptors(p2, m2)), args.reps))
        row("  _bias_args (transposed: the pair copy)", host_us(lambda: ek._bias_args(biases, q, transposed=True),
                                                                args.reps))
        dbias = torch.empty((1, H, R, R), device=dev, dtype=torch.float32)
        row("  _summed_to", host_us(lambda: api._summed_to(dbias, pair), args.reps))
        row("  torch.empty_like(q)", host_us(lambda: torch.empty_like(q), args.reps))
        row("  one small torch kernel (x.mul_(1.0))", host_us(lambda: dbias.mul_(1.0), args.reps))
        prep_args = dict(H=H, D=D, BLOCK_ROWS=ek.PREP_ROWS, BLOCK_D=32, HAS_GATE=True, WANT_DGATE=True)
        n_rows = S * R * H
        dgate, delta2, do2 = torch.empty_like(g), torch.empty_like(lse[0]), torch.empty_like(do)
        row("  one cached launch (bwd prep)", host_us(lambda: cached_launch(
            ek.evo_bwd_prep_kernel, ((n_rows + 63) // 64,), out, do, g, lse[1], do2, dgate, delta2, n_rows, S, R,
            **prep_args), args.reps))


if __name__ == "__main__":
    main()
