"""Compare two `warpforge bench --json` results case by case (same machine, ideally the same device call):

    python scripts/bench_compare.py BEFORE.json AFTER.json [--impl warpforge] [--tolerance 0.03]

Prints, for every case both ran, the implementation's time before and after and the ratio, and exits 1 when any
case got slower by more than the tolerance (a refactor's "behaviour unchanged" check).
"""
import argparse
import json
import sys


def times(path, impl):
    with open(path) as f:
        rows = json.load(f)["rows"]
    return {r["case"]: r["ms"] for r in rows if r["impl"] == impl and r.get("ms")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--impl", default="warpforge", help="the implementation compared (default: warpforge)")
    ap.add_argument("--tolerance", type=float, default=0.03, help="slower by more than this fails (default 0.03)")
    args = ap.parse_args()
    before, after = times(args.before, args.impl), times(args.after, args.impl)
    slower = 0
    for case in sorted(set(before) & set(after)):
        ratio = after[case] / before[case]
        flag = "SLOWER" if ratio > 1 + args.tolerance else ""
        slower += bool(flag)
        print(f"{case:60s} {before[case]:9.4f} -> {after[case]:9.4f} ms  {ratio:5.3f}x time  {flag}")
    missing = sorted(set(before) ^ set(after))
    if missing:
        print("only in one of the two:", ", ".join(missing))
    print(f"{slower} case(s) slower by more than {100 * args.tolerance:.0f}%")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
