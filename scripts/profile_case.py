"""Where a bench case's time goes: per implementation, the wall time of a call next to the GPU time of its
kernels (when the first is much larger, the call is bound by the host, not by the kernels), then its kernels
by total GPU time.

    PYTHONPATH=. python scripts/profile_case.py --family moe --match "qwen3-30b-a3b T1 uniform" [--impl warpforge]
"""
import argparse
import re

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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
