"""Where a bench case's host time goes: the time a call takes to enqueue its work (no sync) beside its wall time
(synced), then cProfile's view of the enqueueing (top functions by own time and by cumulative time). A call whose
enqueue time approaches its wall time is bound by the host: its kernels wait on Python.

    PYTHONPATH=. python scripts/host_profile.py --family sparse --match "s16k" --impl '^warpforge$'
"""
import argparse
import cProfile
import io
import pstats
import re
import time

import torch

from warpforge.bench.cases import select


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", required=True)
    ap.add_argument("--match", required=True, help="regex on the case name")
    ap.add_argument("--impl", default=None, help="regex on the implementation name (default: all)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=35)
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
            enqueue = []
            t0 = time.perf_counter()
            for _ in range(args.iters):
                t = time.perf_counter()
                fn()
                enqueue.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.iters
            enqueue.sort()
            print(f"\n{case.family} | {case.name} | {name}: wall {wall * 1e3:.3f} ms a call, enqueue median "
                  f"{enqueue[len(enqueue) // 2] * 1e3:.3f} ms (min {enqueue[0] * 1e3:.3f})")
            prof = cProfile.Profile()
            torch.cuda.synchronize()
            prof.enable()
            for _ in range(args.iters):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
                text = buf.getvalue()
                print(f"--- by {key} (totals over {args.iters} calls)")
                print(text[text.find("ncalls"):].rstrip())
        del setup
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
