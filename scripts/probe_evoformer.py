"""Where the Evoformer kernels' time goes at the bench's row shape (N_seq 512, N_res 384, 8 heads of 32, bf16):
each pass timed alone (torch.profiler, CUDA times of 20 calls) with the pair bias as the bench passes it (a
[rows, keys] tile per program), with a pair bias that is one row of keys (no tile traffic, BIAS_KEYS), and
without biases.

    python scripts/probe_evoformer.py [--shape row|triangle|extra]

A probe: its numbers go into benchmarks/NOTES.md by hand, with the run's log beside them.
"""
import argparse
import math
from collections import defaultdict

import torch

import triton.testing

from warpforge.ops.evoformer import api, configs, evoformer_kernel as ek
from warpforge.ops.evoformer.fwd_gluon_kernel import fwd_gluon

SHAPES = {"row": dict(S=512, R=384, H=8, D=32), "triangle": dict(S=384, R=384, H=4, D=32),
          "extra": dict(S=5120, R=384, H=8, D=8)}


def kernel_times(fn, reps=20):
    """{"i:kernel": mean ms a call} over `reps` calls, the i-th launch of a call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    evs = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA and "evo_" in ev.name]
    evs.sort(key=lambda ev: ev.time_range.start)
    per_call = len(evs) // reps
    out = defaultdict(float)
    for i, ev in enumerate(evs):  # the i-th launch of each call: dk/dv and dq are both evo_bwd_kernel
        out[f"{i % per_call}:{ev.name.split('_kernel')[0]}"] += ev.device_time_total / 1e3 / reps
    return dict(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="row")
    ap.add_argument("--groups", type=int, default=None,
                    help="the merged dq + pair-bias pass's MSA-row groups (default: gluon_shared_kernel.groups)")
    args = ap.parse_args()
    if args.groups:
        from warpforge.ops.evoformer import dq_dbias_gluon_kernel
        dq_dbias_gluon_kernel.groups = lambda BH, NI, S, n_sm: args.groups
    S, R, H, D = (SHAPES[args.shape][key] for key in ("S", "R", "H", "D"))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v, do, gate = (rnd(1, S, R, H, D) for _ in range(5))
    full = (1, S, H, R, R)
    mask = torch.zeros(1, S, 1, 1, R, device="cuda", dtype=torch.bfloat16).expand(full)
    pair = rnd(1, 1, H, R, R)
    variants = {"pair tile": (mask, pair.expand(full)), "gluon": (mask, pair.expand(full)),
                "pair as key row": (mask, pair[..., :1, :].expand(full)), "mask only": (mask,), "no bias": ()}
    scale = 1.0 / math.sqrt(D)
    tiles = configs.TILES.lookup(torch.device("cuda"), ek._block(D))
    print(f"{args.shape}: S {S} R {R} H {H} D {D}; tiles {tiles}", flush=True)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    for name, biases in variants.items():
        merged = api._dq_dbias_pass(q, biases, scale) if name == "gluon" else None
        dkdv = api._dkdv_pass(q, biases, scale) if name == "gluon" else None
        if name == "gluon" and merged is None:
            print(f"{name:16s}: not taken here (configs.gluon_dq_dbias, gluon_shared_kernel.fits, available)",
                  flush=True)
            continue

        def forward():
            if name == "gluon":  # the Gluon forward (fwd_gluon_kernel) and dq + pair-bias pass
                return fwd_gluon(q, k, v, biases, gate, scale, n_sm)
            return ek.evoformer_fwd(q, k, v, biases, gate, scale, tiles.fwd)
        out, lse = forward()
        fwd = kernel_times(forward)

        def backward():
            return ek.evoformer_bwd(do, q, k, v, out, lse, biases, gate, scale, True, tiles, dq_dbias=merged,
                                    dkdv=dkdv)
        bwd = kernel_times(backward)
        whole = triton.testing.do_bench(backward, warmup=5, rep=50)  # with the host-side torch ops between
        parts = "  ".join(f"{key.replace('evo_', '')} {ms:.3f}" for key, ms in {**fwd, **bwd}.items())
        print(f"{name:16s}: fwd {sum(fwd.values()):.3f} ms, bwd {sum(bwd.values()):.3f} ms (whole {whole:.3f}) | "
              f"{parts}", flush=True)


if __name__ == "__main__":
    main()
