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


def _py_calibration() -> float:
    """µs for a fixed pure-Python workload (calls, tuples, dict stores, attribute reads): compares this host's
    interpreter with the CPU where the stubbed harness runs (benchmarks/NOTES.md, "Norms eager path, round 2")."""
    class Box:
        a = 1

    def f(i, box=Box()):
        return (i, box.a, i + 1)

    def work():
        d = {}
        for i in range(1000):
            d[i & 63] = f(i)
        return d

    work()
    best = 1e9
    for _ in range(20):
        t0 = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def _host_info() -> None:
    import os
    import platform
    import sysconfig
    import threading
    info = [f"python {sys.version.split()[0]} ({platform.python_implementation()}, "
            f"{sysconfig.get_config_var('CONFIG_ARGS') or '?'})"[:200],
            f"gil {'off' if getattr(sys, '_is_gil_enabled', lambda: True)() is False else 'on'}, "
            f"switch interval {sys.getswitchinterval() * 1e3:g} ms, trace {sys.gettrace() is not None}, "
            f"profile {sys.getprofile() is not None}, threads {threading.active_count()} "
            f"({', '.join(t.name for t in threading.enumerate())[:120]})"]
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is not None:
        info.append("sys.monitoring tools: " + (", ".join(f"{i}={monitoring.get_tool(i)}" for i in range(6)
                                                         if monitoring.get_tool(i)) or "none"))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info.append(f"cpu {model or platform.processor()}, {cpus} usable of {os.cpu_count()}, load "
                f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}; torch {torch.__version__}")
    try:
        import triton
        info[-1] += f", triton {triton.__version__}"
    except ImportError:
        pass
    info.append(f"python calibration (a fixed pure-Python loop; this repo's 2-core CPU: see NOTES): "
                f"{_py_calibration():.0f} us")
    for line in info:
        print("host: " + line, flush=True)


def eager_profile(calls: int = 100, rounds: int = 7, rows: int = 16384, device=None) -> None:
    """Where an eager fwd+bwd spends its host time on this machine (issue 20's eager line), at rows x 768 bf16. In
    order (the most telling first; every section guarded, a failure prints and moves on):
    - host: interpreter, threads, CPU, and a pure-Python calibration loop (compares hosts);
    - per op, interleaved over `rounds` rounds (min and median): fwd+bwd back to back (synced once at the end: host
      cost when the host is the bottleneck), synced before every call (latency from an idle GPU, as the fused bench
      times it), and back to back with autograd's multithreading off (backward on the calling thread, not handed to
      the engine's CUDA device thread); floors: an empty autograd.Function, torch's eager F.rms_norm / F.layer_norm;
    - launches per call by path, counted by the toolkit's Launcher ("c": Triton 3.6's C launch called directly,
      "run": through the launcher object, "triton": kernel[grid], Triton's own binding);
    - a breakdown, each part back to back, as host time to issue `calls` calls (no sync inside) and per call with the
      drain: forward alone (grad on / off), backward alone (autograd.grad on a saved graph), the op layers one by one
      (registered-op call, eager body, kernel helper), single Launcher launches, a bare launch of a trivial kernel
      (Launcher, kernel[grid], the C launch itself), and torch's own ops (allocation, device and stream queries, a
      tiny torch kernel);
    - torch.profiler: every host-side event per fwd+bwd call (count, self µs), allocator and CUDA API calls included;
    - CUDA sync debug mode over a few calls (any synchronizing torch op warns);
    - cProfile of rms_norm fwd+bwd calls: the full list by own time and by cumulative time (top 60 each). pstats
      keeps one entry per name, so the per-kernel `__triton_launcher.launch` modules show as one: the Launcher's
      counts above are the launches' truth."""
    import cProfile
    import pstats
    import statistics
    import warnings

    import warpforge as wf
    dev = torch.device(device or "cuda")
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    bf = torch.bfloat16
    try:
        _host_info()
    except Exception as exc:
        print(f"host: {type(exc).__name__}: {exc}")
    x = torch.randn(rows, 768, device=dev, dtype=bf, requires_grad=True)
    x32 = torch.randn(rows, 768, device=dev, requires_grad=True)
    w = torch.ones(768, device=dev, dtype=bf, requires_grad=True)
    w32 = torch.ones(768, device=dev, requires_grad=True)
    b = torch.zeros(768, device=dev, dtype=bf, requires_grad=True)
    gu = torch.randn(rows, 6144, device=dev, dtype=bf, requires_grad=True)
    F = torch.nn.functional

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
             "torch eager F.rms_norm": (lambda: F.rms_norm(x, (768,), w, 1e-6), (x, w)),
             "torch eager F.layer_norm": (lambda: F.layer_norm(x, (768,), w, b, 1e-5), (x, w, b))}

    def per_call(fn, n=calls, sync_each=False):
        """ms a call: fn n times back to back, synced once at the end (or before each call)."""
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            if sync_each:
                sync()
            fn()
        sync()
        return (time.perf_counter() - t0) / n * 1e3

    def issue(fn, n=calls):
        """(µs a call to issue n calls without a sync, µs a call with the drain at the end)."""
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6

    steps = {}
    for name, (fwd, inputs) in cases.items():
        outs = fwd()
        outs = outs if isinstance(outs, tuple) else (outs,)
        grads = tuple(torch.randn_like(o) for o in outs)

        def step(fwd=fwd, inputs=inputs, grads=grads):
            out = fwd()
            return torch.autograd.grad(out if isinstance(out, tuple) else (out,), inputs, grads)
        steps[name] = step
        for _ in range(10):
            step()
    print(f"\n== eager fwd+bwd at {rows} x 768, ms a call, interleaved over {rounds} rounds of {calls} calls: "
          "min / median", flush=True)
    times: dict = {}
    for _ in range(rounds):
        for name, step in steps.items():
            t = times.setdefault(name, ([], [], [], []))
            t[0].append(per_call(step))
            t[1].append(per_call(step, sync_each=True))
            with torch.autograd.set_multithreading_enabled(False):
                t[2].append(per_call(step))
                t[3].append(per_call(step, sync_each=True))
    for name, t in times.items():
        cols = [f"{min(v):.3f} / {statistics.median(v):.3f}" for v in t]
        print(f"eager {name}: back to back {cols[0]}, synced each {cols[1]}; multithreading off {cols[2]}, "
              f"synced {cols[3]}", flush=True)

    from warpforge.ops import _op
    try:
        _op.Launcher.counts = {}
        for name in ("rms_norm", "add_rms_norm", "layer_norm", "swiglu"):
            _op.Launcher.counts.clear()
            for _ in range(10):
                steps[name]()
            sync()
            print(f"launches per {name} fwd+bwd: " + ", ".join(
                f"{kernel} {path} {n / 10:g}" for (kernel, path), n in sorted(_op.Launcher.counts.items())),
                flush=True)
    except Exception as exc:
        print(f"launch counts: {type(exc).__name__}: {exc}")
    finally:
        _op.Launcher.counts = None

    print("\n== breakdown, each part back to back: us a call to issue (no sync) / with the drain", flush=True)
    try:
        _breakdown(issue, x, w, b, gu, dev, Empty)
    except Exception as exc:
        import traceback
        traceback.print_exc(limit=3)
        print(f"breakdown: {type(exc).__name__}: {exc}", flush=True)

    if cuda:
        try:
            from torch.profiler import ProfilerActivity, profile
            for name in ("rms_norm", "layer_norm"):
                n = 20
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
                    for _ in range(n):
                        steps[name]()
                    sync()
                events = prof.key_averages()
                kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
                host = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CUDA),
                              key=lambda e: -e.self_cpu_time_total)
                print(f"\n== torch.profiler, {name} per fwd+bwd call: {kernels / n:.1f} GPU kernels; host events "
                      "(count, self us, total us a call):", flush=True)
                for e in host[:30]:
                    print(f"  {e.key[:60]:60s} {e.count / n:5.1f} {e.self_cpu_time_total / n:8.1f} "
                          f"{e.cpu_time_total / n:8.1f}")
        except Exception as exc:  # the profiler is a diagnostic: never the reason this step fails
            print(f"torch.profiler: {type(exc).__name__}: {str(exc)[:200]}")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for name in ("rms_norm", "layer_norm", "swiglu"):
                        steps[name]()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = [str(c.message)[:120] for c in caught if "synchroniz" in str(c.message).lower()]
            print(f"\nsync debug mode over rms / layer / swiglu fwd+bwd: {len(syncs)} synchronizing ops"
                  + "".join(f"\n  {m}" for m in syncs[:5]), flush=True)
        except Exception as exc:
            print(f"sync debug: {type(exc).__name__}: {exc}")

    for label, mt in (("multithreading on", True), ("multithreading off", False)):
        prof = cProfile.Profile()
        with torch.autograd.set_multithreading_enabled(mt):
            prof.enable()
            for _ in range(calls):
                steps["rms_norm"]()
            sync()
            prof.disable()
        _print_profile(pstats.Stats(prof), f"{calls} rms_norm fwd+bwd calls ({label})", calls,
                       (("tottime", 60), ("cumulative", 60)) if mt else (("tottime", 30),))


def _print_profile(stats, title, calls, sorts) -> None:
    """pstats' entries in µs per fwd+bwd call (its own listing rounds to ms): calls per fwd+bwd, own µs, cumulative
    µs, function."""
    rows = []
    for (path, line, func), (_, nc, tt, ct, _) in stats.stats.items():
        where = func if path == "~" else f"{'/'.join(path.split('/')[-3:])}:{line}({func})"
        rows.append((nc / calls, tt / calls * 1e6, ct / calls * 1e6, where))
    total = sum(r[1] for r in rows)
    for key, top in sorts:
        index = 1 if key == "tottime" else 2
        print(f"\n== cProfile of {title}, by {key}: {total:.1f} us own time a call in all; calls a call, own us, "
              "cumulative us", flush=True)
        for n, tt, ct, where in sorted(rows, key=lambda r: -r[index])[:top]:
            print(f"  {n:6.1f} {tt:8.2f} {ct:8.2f}  {where[:110]}")
    sys.stdout.flush()


def _breakdown(issue, x, w, b, gu, dev, Empty) -> None:
    """Each part of an eager rms_norm / layer_norm call alone, back to back (see eager_profile)."""
    import triton
    import triton.language as tl

    import warpforge as wf
    from warpforge.ops import _op
    from warpforge.ops.norm import api
    from warpforge.ops.swiglu import api as swiglu_api
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    @triton.jit
    def touch_kernel(X, n):
        tl.store(X + tl.program_id(0), n)

    rows = x.shape[0]
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    dy = torch.randn_like(xd)
    parts = []

    def add(label, fn):
        parts.append((label, fn))

    for name, layer in (("rms_norm", False), ("layer_norm", True)):
        fwd = (lambda: wf.layer_norm(x, w, b)) if layer else (lambda: wf.rms_norm(x, w))
        inputs = (x, w, b) if layer else (x, w)
        saved = fwd()
        saved_mt = fwd()

        def bwd(saved=saved, inputs=inputs):
            return torch.autograd.grad(saved, inputs, dy, retain_graph=True)

        def bwd_st(saved=saved_mt, inputs=inputs):
            with torch.autograd.set_multithreading_enabled(False):
                return torch.autograd.grad(saved, inputs, dy, retain_graph=True)

        with torch.no_grad():
            _, mean, rstd = api._norm_fwd_eager(xd, wd, bd if layer else None, 1e-6, layer, None)
        cfg_f = api._cfg(xd, api._FWD_KIND[layer])[0]
        cfg_b, programs = api._cfg(xd, api._BWD_KIND[layer])
        bias = bd if layer else None

        def no_grad(fn):
            def run():
                with torch.no_grad():
                    return fn()
            return run

        add(f"{name} fwd+bwd (autograd.grad)", lambda fwd=fwd, inputs=inputs: torch.autograd.grad(fwd(), inputs, dy))
        add(f"{name} fwd, grad on (output dropped)", fwd)
        add(f"{name} fwd, no_grad", no_grad(fwd))
        add(f"{name} bwd alone: autograd.grad, saved graph", bwd)
        add(f"{name} bwd alone, multithreading off", bwd_st)
        add(f"{name} fwd: registered-op caller (no checks), no_grad",
            no_grad(lambda layer=layer, bias=bias: api._norm_fwd(xd, wd, bias, 1e-6, layer, None)))
        add(f"{name} fwd: eager body _norm_fwd_eager",
            lambda layer=layer, bias=bias: api._norm_fwd_eager(xd, wd, bias, 1e-6, layer, None))
        add(f"{name} fwd: norm_fwd (allocations + launch)",
            lambda layer=layer, bias=bias, cfg=cfg_f: nk.norm_fwd(xd, wd, bias, 1e-6, layer, None, None, cfg,
                                                                 _op.cached_launch))
        add(f"{name} bwd: registered-op caller _norm_bwd",
            lambda layer=layer, mean=mean, rstd=rstd: api._norm_bwd(dy, xd, wd, mean, rstd, layer))
        add(f"{name} bwd: eager body _norm_bwd_eager",
            lambda layer=layer, mean=mean, rstd=rstd: api._norm_bwd_eager(dy, xd, wd, mean, rstd, layer))
        add(f"{name} bwd: norm_bwd (allocations + 2 launches)",
            lambda layer=layer, mean=mean, rstd=rstd, cfg=cfg_b, programs=programs:
            nk.norm_bwd(dy, xd, wd, mean, rstd, programs, layer, None, cfg, None, None, _op.cached_launch))
        if not layer:
            y = torch.empty_like(xd)
            br = cfg_f.block_rows
            add("rms_norm: one Launcher launch of norm_fwd_kernel (outputs preallocated)",
                lambda y=y, rstd=rstd, br=br, cfg=cfg_f: _op.cached_launch(
                    nk.norm_fwd_kernel, ((rows + br - 1) // br,), xd, xd, y, wd, wd, y, rstd, rstd, rows, 768, 1e-6,
                    BLOCK_R=br, BLOCK=1024, LAYER=False, ADD=False, num_warps=cfg.warps))
            grid, _ = nk.bwd_programs(rows, programs, cfg_b.block_rows)
            part = torch.empty(grid * 768, device=dev, dtype=torch.float32)
            dw = torch.empty_like(wd)
            block_p = min(nk.next_pow2(grid), 512)
            add("rms_norm: one Launcher launch of part_sum_kernel",
                lambda part=part, dw=dw, grid=grid, block_p=block_p: _op.cached_launch(
                    nk.part_sum_kernel, (24, 1), part, dw, dw, grid, 768, BLOCK_P=block_p, BLOCK_N=32,
                    num_warps=8 if block_p >= 256 else 4))
    gud = gu.detach()
    dout = torch.randn(rows, 3072, device=dev, dtype=gu.dtype)
    add("swiglu fwd, no_grad", lambda: swiglu_api._swiglu_fwd_impl(gud))
    add("swiglu bwd body", lambda: swiglu_api._swiglu_bwd_impl(dout, gud))
    # a trivial kernel: the launch alone
    sink = torch.zeros(4, device=dev, dtype=torch.int32)
    touch = _op.Launcher(touch_kernel)
    touch((1,), sink, 3)
    touch((1,), sink, 3)
    add("trivial kernel: Launcher (toolkit, cached)", lambda: touch((1,), sink, 3))
    add("trivial kernel: kernel[grid] (Triton's own binding)", lambda: touch_kernel[(1,)](sink, 3))
    entry = next(iter(touch.compiled.values()), None)
    if entry is not None:
        _, run, raw, function, packed, tail, _, stream = entry
        s = stream(torch.cuda.current_device()) if dev.type == "cuda" else 0
        ptr = sink.data_ptr()
        if raw is not None:
            add("trivial kernel: the C launch alone (ints)", lambda: run.launch(
                1, 1, 1, s, function, raw[0], raw[1], None, None, packed, None, None, None, ptr, 3, *tail))
        add("trivial kernel: compiled.run (launcher object)", lambda: run(
            1, 1, 1, s, function, packed, None, None, None, sink, 3, *tail))
    add("torch.empty_like(x)", lambda: torch.empty_like(xd))
    add("torch.empty(rows, fp32)", lambda: torch.empty(rows, device=dev, dtype=torch.float32))
    add("x.contiguous()", xd.contiguous)
    add("torch.neg(w) (a tiny torch kernel)", lambda: torch.neg(wd))
    add("torch F.rms_norm fwd (detached inputs)", lambda: torch.nn.functional.rms_norm(xd, (768,), wd, 1e-6))
    add("Empty.apply + grad (the floor)", lambda: torch.autograd.grad(Empty.apply(x, w), (x,), dy))
    if dev.type == "cuda":
        add("torch.cuda.current_device()", torch.cuda.current_device)
        add("torch._C._cuda_getDevice()", torch._C._cuda_getDevice)
        add("torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0))
        add("torch.cuda.current_stream()", torch.cuda.current_stream)
    add("torch.compiler.is_compiling()", torch.compiler.is_compiling)
    add("_get_current_dispatch_mode()", _get_current_dispatch_mode)
    add("x.data_ptr()", xd.data_ptr)
    add("x.device", lambda: xd.device)
    for label, fn in parts:
        fn()
        best = min((issue(fn, 50) for _ in range(5)), key=lambda v: v[0])
        print(f"  {label:68s} {best[0]:8.1f} / {best[1]:8.1f}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune norm")
    ap.add_argument("--shapes", default="16384x768,16384x4096")
    ap.add_argument("--budget", type=float, default=100.0,
                    help="seconds of sweeping; the backward stops 15 s before it so that the forward gets its turn")
    ap.add_argument("--out", default=None)
    ap.add_argument("--eager-profile", action="store_true",
                    help="instead of sweeping: where eager fwd+bwd calls spend their host time (timings, launch "
                         "paths, a breakdown, torch.profiler, cProfile)")
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
        block = nk.next_pow2(n)
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
            for warps, rows_per in FWD_TILES.get(nk.next_pow2(n), [(4, 1), (8, 1)]):
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
