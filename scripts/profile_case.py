"""Where a bench case's time goes: per implementation, the wall time of a call next to the GPU time of its
kernels (when the first is much larger, the call is bound by the host, not by the kernels), then its kernels
by total GPU time. --host: where the host's time goes instead: the time a call takes to enqueue its work (no sync)
beside its wall time, then cProfile's view of the enqueueing (top functions by own and by cumulative time).

    PYTHONPATH=. python scripts/profile_case.py --family moe --match "qwen3-30b-a3b T1 uniform" [--impl warpforge]
"""
import argparse
import cProfile
import io
import pstats
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from warpforge.bench.cases import select
from warpforge.profiling import kernel_table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", required=True)
    ap.add_argument("--match", required=True, help="regex on the case name")
    ap.add_argument("--impl", default=None, help="regex on the implementation name (default: all)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--host", action="store_true", help="the host's enqueue time and cProfile, not the kernels")
    args = ap.parse_args()
    args.iters = max(1, args.iters)
    device = torch.device("cuda")
    for case in select(args.family):
        if not re.search(args.match, case.name):
            continue
        setup = case.build(device, False)
        for name, fn in setup.impls.items():
            if args.impl and not re.search(args.impl, name):
                continue
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            if args.host:
                host_profile(f"{case.family} | {case.name} | {name}", fn, args.iters, args.top)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            wall = start.elapsed_time(end) / args.iters
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    fn()
                torch.cuda.synchronize()
            busy, calls, lines = kernel_table(prof, args.iters, args.top)
            print(f"\n{case.family} | {case.name} | {name}: {wall:.3f} ms a call, kernels {busy:.3f} ms "
                  f"({calls:.0f} launches a call)")
            print("\n".join(lines))
        del setup
        torch.cuda.empty_cache()


def host_profile(title, fn, iters, top):
    """A call's enqueue time (no sync; the median of iters) beside its wall time, then cProfile over iters calls."""
    enqueue = []
    t0 = time.perf_counter()
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        enqueue.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters
    enqueue.sort()
    print(f"\n{title}: wall {wall * 1e3:.3f} ms a call, enqueue median {enqueue[len(enqueue) // 2] * 1e3:.3f} ms "
          f"(min {enqueue[0] * 1e3:.3f})")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        text = buf.getvalue()
        print(f"--- by {key} (totals over {iters} calls)")
        print(text[text.find("ncalls"):].rstrip())


if __name__ == "__main__":
    main()
