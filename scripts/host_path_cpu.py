"""The host path of an eager sparse-attention training step (selection, forward, backward) on this CPU, every Triton
launch a no-op: what Python and the tensor ops around the kernels cost, without a GPU. With `gluon` the Hopper
Gluon kernels' path is taken (their launchers stubbed, their descriptors not built), as on an H200.

    TRITON_INTERPRET=1 PYTHONPATH=. python scripts/host_path_cpu.py [gluon] [--s 16384]

Prints the time a step takes, the aten ops it runs (nested ones included: an upper bound on its GPU launches) and
cProfile's top functions. Launch costs are left out entirely (Triton's binding, the Launcher's key, the driver); the
GPU host's numbers differ (profile_case.py --host measures them there).
"""
import argparse
import cProfile
import io
import pstats
import time

import torch
import triton.runtime.interpreter as interpreter
import triton.runtime.jit as jit

import warpforge as wf
import warpforge.ops.sparse.api as api
from warpforge.ops.sparse import sparse_gluon_kernel


def _stub_launches(gluon):
    jit.JITFunction.__getitem__ = lambda self, grid: (lambda *a, **k: None)
    interpreter.InterpretedFunction.__getitem__ = lambda self, grid: (lambda *a, **k: None)
    if gluon:
        api.gluon_gate = lambda *a: True
        sparse_gluon_kernel.bwd_fits = lambda *a: True
        sparse_gluon_kernel.flash_fwd_gluon = lambda q, k, v, *a, **kw: (
            torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1]))
        sparse_gluon_kernel.flash_bwd_gluon = lambda do, q, k, v, *a, **kw: (
            torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path", nargs="?", default="portable", choices=("portable", "gluon"))
    ap.add_argument("--s", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    _stub_launches(args.path == "gluon")
    s, h_q, h_kv, d, d_i = args.s, 16, 2, 128, 64
    q = torch.randn(1, s, h_q, d, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(1, s, h_kv, d, dtype=torch.float16, requires_grad=True) for _ in range(2))
    iq = torch.randn(1, s, h_kv, d_i, dtype=torch.float16)
    ik = torch.randn(1, s, 1, d_i, dtype=torch.float16)
    do = torch.randn_like(q)

    def step():
        out = wf.sparse_attention(q, k, v, index_q=iq, index_k=ik, block_size=128, topk=16, backend="triton")
        return torch.autograd.grad(out, (q, k, v), do)
    for _ in range(5):
        step()
    t = time.perf_counter()
    for _ in range(args.iters):
        step()
    print(f"{args.path} step at s {s}, launches stubbed: {(time.perf_counter() - t) / args.iters * 1e3:.3f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    print("aten ops a step (nested ones included):", sum(1 for e in prof.events() if e.name.startswith("aten::")))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.iters):
        step()
    profiler.disable()
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(25)
    print(buf.getvalue()[buf.getvalue().find("ncalls"):].rstrip())


if __name__ == "__main__":
    main()
