"""Sweep the norm kernels' launch settings on this GPU at the bench's shapes (16k rows of 768 and of 4096, bf16), for
add_rms_norm (fp32 stream; first, the furthest from its bar), RMSNorm and LayerNorm, backward first (the part furthest
from the copy rate), then forward; within --budget seconds (the whole sweep took 16 s for 768 on the H200).

    warpforge tune norm [--shapes 16384x768,16384x4096] [--budget 100] [--out tune_norm.json]
    warpforge tune norm --eager-profile      # where an eager fwd+bwd call's host time goes

Backward: for each (warps, rows per tile) whose tile gives a thread 16 or 32 fp32 columns per tensor, the kernel is
compiled once and its registers read back; it is timed with as many programs per SM as those registers let reside
at once (one wave), prefetching the next tile; the three best are timed again with half the programs and without
the prefetch. Forward (add_rms_norm's too, "add_fwd"):
the few tiles near the last sweep's winners (benchmarks/NOTES.md, "Norms, session 10"). Timings are medians of
CUDA-graph replays. Winners go into warpforge/ops/norm/configs.py's NORM table (printed at the end in its form), the
numbers into benchmarks/NOTES.md. Bytes: forward reads x, writes y; backward reads x and dy, writes dx (2 bytes
each; the dw partials are not counted), so GB/s compares with the copy bandwidth `warpforge bench` measures.
"""
import argparse
import sys
import time

import torch

from warpforge.bench.report import write_json
from warpforge.ops import _op
from warpforge.ops.norm import configs, norm_kernel as nk
from warpforge.runtime import sm_count
from warpforge.tune.timing import time_candidate

N = configs.NormCfg
FWD_TILES = {1024: [(2, 2), (1, 2), (2, 4), (4, 4)], 4096: [(2, 1), (4, 1), (8, 1), (8, 2)]}


def _bwd_tiles(block: int) -> list[tuple[int, int]]:
    """(warps, rows per tile) giving each thread 16 or 32 fp32 columns of a tensor (fewer: too little in flight per
    program; 64 spilled in the last sweep, more registers than an SM's share)."""
    return [(w, r) for w in (1, 2, 4, 8, 16) for r in (1, 2, 4, 8) if 16 <= block * r // (32 * w) <= 32]


def _resident(compiled, warps: int) -> int:
    """Programs of this kernel that fit on one SM at once (registers, threads, shared memory), per an H100/H200."""
    regs = getattr(compiled, "n_regs", 0) or 255
    per_program = -(-regs // 8) * 8 * 32 * warps
    smem = compiled.metadata.shared + 1024
    return max(1, min(65536 // per_program, 2048 // (32 * warps), 233472 // smem, 32))


def _compiled_bwd(cfg, block, layer, add):
    """The compiled backward for this config, as the ops' launcher keeps it (keyed by device, meta values, args)."""
    launcher = _op._LAUNCHERS.get(id(nk.norm_bwd_kernel))
    meta = (cfg.block_rows, block, layer, add, add, cfg.prefetch, cfg.warps)
    for key, entry in (launcher.compiled.items() if launcher else ()):
        if key[1] == meta:
            return entry[0]
    return None


def eager_profile(calls: int = 200) -> None:
    """Where an eager fwd+bwd spends its host time on this machine (issue 20's eager line), at 16k x 768 bf16:
    - per op, the time per call back to back (synced once at the end: the host's cost when it is the bottleneck) and
      synced before every call (latency from an idle GPU, as the fused bench's "warpforge (eager)" row times it);
    - the same with autograd's multithreading off (the backward then runs on the calling thread, not handed to the
      engine's CUDA device thread and back), and two floors: an empty autograd.Function (one allocation each way, no
      kernel) and torch's own eager F.rms_norm;
    - what one allocation and one forward (no_grad) cost here;
    - a cProfile of rms_norm's calls, by own time;
    - torch.profiler's per-call counts of CUDA kernels and allocating ops for rms_norm and layer_norm."""
    import cProfile
    import pstats

    import warpforge as wf
    dev, bf = torch.device("cuda"), torch.bfloat16
    x = torch.randn(16384, 768, device=dev, dtype=bf, requires_grad=True)
    x32 = torch.randn(16384, 768, device=dev, requires_grad=True)
    w = torch.ones(768, device=dev, dtype=bf, requires_grad=True)
    w32 = torch.ones(768, device=dev, requires_grad=True)
    b = torch.zeros(768, device=dev, dtype=bf, requires_grad=True)
    gu = torch.randn(16384, 6144, device=dev, dtype=bf, requires_grad=True)

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, weight):
            return torch.empty_like(a)

        @staticmethod
        def backward(ctx, dy):
            return torch.empty_like(dy), None

    cases = {"rms_norm": (lambda: wf.rms_norm(x, w), (x, w)),
             "add_rms_norm": (lambda: wf.add_rms_norm(x32, x, w32, out_dtype=bf), (x32, x, w32)),
             "layer_norm": (lambda: wf.layer_norm(x, w, b), (x, w, b)),
             "swiglu": (lambda: wf.swiglu(gu), (gu,)),
             "floor: empty autograd.Function": (lambda: Empty.apply(x, w), (x,)),
             "torch eager F.rms_norm": (lambda: torch.nn.functional.rms_norm(x, (768,), w, 1e-6), (x, w))}

    def per_call(fn, sync_each):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            if sync_each:
                torch.cuda.synchronize()
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / calls * 1e3

    steps = {}
    for name, (fwd, inputs) in cases.items():
        outs = fwd()
        outs = outs if isinstance(outs, tuple) else (outs,)
        grads = tuple(torch.randn_like(o) for o in outs)

        def step(fwd=fwd, inputs=inputs, grads=grads):
            out = fwd()
            return torch.autograd.grad(out if isinstance(out, tuple) else (out,), inputs, grads)
        steps[name] = step
        for _ in range(20):
            step()
        times = [per_call(step, False), per_call(step, True)]
        with torch.autograd.set_multithreading_enabled(False):
            step()
            times += [per_call(step, False), per_call(step, True)]
        print(f"eager {name} fwd+bwd 16k: {times[0]:.3f} ms a call back to back, {times[1]:.3f} synced each; "
              f"multithreading off {times[2]:.3f} / {times[3]:.3f}", flush=True)
    with torch.no_grad():
        print(f"host: torch.empty_like(x) {per_call(lambda: torch.empty_like(x), False) * 1e3:.1f} us, "
              f"rms_norm forward (no_grad) {per_call(lambda: wf.rms_norm(x, w), False) * 1e3:.1f} us a call",
              flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        steps["rms_norm"]()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    sys.stdout.flush()
    try:
        from torch.profiler import ProfilerActivity, profile
        for name in ("rms_norm", "layer_norm"):
            n = 10
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    steps[name]()
                torch.cuda.synchronize()
            kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
            ops = {e.key: e.count / n for e in prof.key_averages()
                   if e.key.startswith(("aten::empty", "aten::zeros", "aten::fill_", "aten::copy_", "aten::to",
                                        "aten::new_empty", "aten::contiguous", "cuLaunch", "cudaLaunch",
                                        "cudaMemset", "cudaEvent", "cudaStream"))}
            print(f"{name} per fwd+bwd call: {kernels / n:.1f} GPU kernels; "
                  + ", ".join(f"{k} {v:g}" for k, v in sorted(ops.items())), flush=True)
    except Exception as exc:  # the profiler is a diagnostic: never the reason this step fails
        print(f"torch.profiler: {type(exc).__name__}: {str(exc)[:200]}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune norm")
    ap.add_argument("--shapes", default="16384x768,16384x4096")
    ap.add_argument("--budget", type=float, default=100.0,
                    help="seconds of sweeping; the backward stops 15 s before it so that the forward gets its turn")
    ap.add_argument("--out", default=None)
    ap.add_argument("--eager-profile", action="store_true",
                    help="instead of sweeping: time eager fwd+bwd calls and profile rms_norm's host time")
    args = ap.parse_args(argv)
    if args.eager_profile:
        eager_profile()
        return 0
    start = time.perf_counter()
    results, best = [], {}
    sms = sm_count(torch.device("cuda"))
    data = {}
    for shape in args.shapes.split(","):
        rows, n = (int(v) for v in shape.split("x"))
        x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        w = 1 + 0.1 * torch.randn(n, device="cuda", dtype=torch.bfloat16)
        b = 0.1 * torch.randn(n, device="cuda", dtype=torch.bfloat16)
        data[shape] = (x, torch.randn_like(x), w, b, n)

    def record(shape, name, part, cfg, ms, nbytes, note=""):
        if ms is None:
            return
        gbps = nbytes / ms / 1e6
        results.append(dict(shape=shape, op=name, part=part, cfg=list(cfg), ms=ms, gbps=gbps, note=note))
        print(f"{shape} {name} {part} {tuple(cfg)}: {ms * 1e3:.1f} us {gbps:.0f} GB/s {note}", flush=True)
        if (shape, name, part) not in best or ms < best[shape, name, part][1]:
            best[shape, name, part] = (cfg, ms)

    def out_of_time(reserve=0.0):
        return time.perf_counter() - start > args.budget - reserve

    for shape, (x, dy, w, b, n) in data.items():  # backward first
        block = nk._pow2(n)
        for name in ("add_rms_norm", "rms_norm", "layer_norm"):  # the one furthest from its bar first
            # add_rms_norm as the GPT and the bench run it: an fp32 residual stream (the sum and its gradient from
            # downstream in fp32) with a bf16 branch, whose gradient the kernel also writes ("add_bwd" in NORM)
            layer, add = name == "layer_norm", name == "add_rms_norm"
            xs, ws = (x.float(), w.float()) if add else (x, w)
            d_sum = torch.randn_like(xs) if add else None
            _, mean, rstd, _ = nk.norm_fwd(xs, ws, b, 1e-6, layer, None, None, N(4))
            nbytes = x.numel() * (4 + 2 + 4 + 4 + 2 if add else 3 * 2)

            def run(cfg, programs):
                return nk.norm_bwd(dy, xs, ws, mean, rstd, programs, layer, d_sum, cfg,
                                   dx2_dtype=torch.bfloat16 if add else None, launch=_op.cached_launch)

            def bwd(cfg, note=""):
                ms = time_candidate(lambda: run(cfg, cfg.programs_per_sm * sms), rep=20, graphed=True)
                record(shape, name, "bwd", cfg, ms, nbytes, note)
                return ms

            timed = []  # stage 1: each tile at the programs per SM its registers let reside, prefetching
            for warps, rows_per in _bwd_tiles(block):
                if out_of_time(15):
                    break
                probe = N(warps, 1, rows_per, True)
                try:
                    run(probe, sms)
                except Exception as exc:  # registers or shared memory: not a candidate
                    print(f"    {tuple(probe)}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                    continue
                compiled = _compiled_bwd(probe, block, layer, add)
                fit = _resident(compiled, warps) if compiled is not None else 4
                cfg = probe._replace(programs_per_sm=fit)
                ms = bwd(cfg, f"regs {getattr(compiled, 'n_regs', '?')} spills {getattr(compiled, 'n_spills', '?')}")
                if ms is not None:
                    timed.append((ms, cfg))
            for _, cfg in sorted(timed)[:3]:  # stage 2: the best three with half the programs, without prefetch
                for variant in {cfg._replace(programs_per_sm=max(1, cfg.programs_per_sm // 2)),
                                cfg._replace(prefetch=False)} - {cfg}:
                    if not out_of_time(15):
                        bwd(variant)
    for shape, (x, dy, w, b, n) in data.items():
        x32, w32 = x.float(), w.float()
        for name in ("add_rms_norm", "rms_norm", "layer_norm"):  # the one furthest from its bar first
            # add_rms_norm ("add_fwd" in NORM): an fp32 stream plus a bf16 branch, the sum stored in fp32, y in bf16
            layer, add = name == "layer_norm", name == "add_rms_norm"
            xs, ws, res = (x32, w32, x) if add else (x, w, None)
            nbytes = x.numel() * (4 + 2 + 4 + 2 if add else 2 * 2)
            for warps, rows_per in FWD_TILES.get(nk._pow2(n), [(4, 1), (8, 1)]):
                if out_of_time():
                    break
                cfg = N(warps, 4, rows_per)
                ms = time_candidate(lambda: nk.norm_fwd(xs, ws, b, 1e-6, layer, x.dtype if add else None, res, cfg),
                                    rep=20, graphed=True)
                record(shape, name, "fwd", cfg, ms, nbytes)
    print(f"\nbest ({time.perf_counter() - start:.0f} s{', budget reached' if out_of_time() else ''}):")
    for (shape, name, part), (cfg, ms) in sorted(best.items()):
        print(f"  {shape} {name} {part}: NormCfg{tuple(cfg)} {ms * 1e3:.1f} us")
    if args.out:
        write_json({"sweep": "norm", "results": results}, args.out)
    return 0
