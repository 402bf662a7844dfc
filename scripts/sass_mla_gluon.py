"""Compile the Hopper Gluon MLA decode (ops/mla/decode_gluon_kernel.py) for sm_90 on this machine (Triton 3.6: the
H200's) and count, per warpgroup, what one trip of its page loop (= one pair of pages) executes in SASS: warpgroup
bar.syncs, wgmma groups and waits, mbarrier waits / arrives, TMA issues, spill reloads / stores (LDL / STL), R2UR.

    PYTHONPATH=$PWD /work/venv36/bin/python scripts/sass_mla_gluon.py [--h-q 128] [--fmt nvfp4] [--dump out.sass]

"hot" counts one trip along the steady state (every page full, more pages to come): blocks a forward branch skips
that hold no HGMMA and no UTMALDG (the rows-past-the-end zeroing, the last pair's tail) and blocks only reached
by a jump (the else of `if more`) are left out; "all" counts the whole loop body. "EX2 before arrive": the MUFU.EX2
issued before the loop's first mbarrier arrive (each warpgroup's publish of its max and scale: sync0 / sync1; 2 are
the scale's, the rest P's). The loop holding the m64n256 P·V wgmma from registers that follows the score GEMM's
waits is told apart by the setmaxnreg before it: the worker (WG1) decreases to WG1_REGS, the default partition
(WG0) increases.
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OP = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Z0-9_]+)*)")
BRA = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")
KEYS = ("BAR.SYNC", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "HGMMA", "mbar wait", "mbar arrive", "UTMALDG", "LDL",
        "LDL.64", "STL", "LDS", "STS", "R2UR", "MUFU.EX2", "EX2 before arrive", "instr")


def sass_of(cubin: bytes) -> str:
    import triton
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def _count(lines):
    c = collections.Counter()
    arrived = False
    for line in lines:
        m = OP.match(line)
        if not m:
            continue
        op, mods = m.group(3), m.group(4)
        c["instr"] += 1
        full = op + mods
        if op == "BAR" and mods.startswith(".SYNC"):
            c["BAR.SYNC"] += 1
        elif op == "WARPGROUP":
            c["WARPGROUP" + mods.split(".LE")[0]] += 1
        elif op == "SYNCS" and "TRYWAIT" in mods:
            c["mbar wait"] += 1
        elif op == "SYNCS" and "ARRIVE" in mods:
            c["mbar arrive"] += 1
            arrived = True
        elif full.startswith("LDL"):
            c["LDL"] += 1
            if ".64" in mods:
                c["LDL.64"] += 1
        elif full in ("MUFU.EX2",):
            c[full] += 1
            if not arrived:   # the softmax's EX2 issued before its publish (the loop's first arrive: sync0 / sync1)
                c["EX2 before arrive"] += 1
        if op in ("HGMMA", "UTMALDG", "STL", "LDS", "STS", "R2UR"):
            c[op] += 1
    return c


def page_loops(sass: str):
    """[(name, {"all": Counter, "hot": Counter})] for the loops that hold wgmmas (the two warpgroups' page loops)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    exit_at = max(i for i, line in enumerate(lines) if re.search(r"\bEXIT\b", line))
    out = []
    for i, line in enumerate(lines):
        m = BRA.search(line)
        if not (m and i < exit_at and labels.get(m.group(1), i) < i):
            continue
        start = labels[m.group(1)]
        body = lines[start:i + 1]
        if sum("HGMMA" in x for x in body) < 8 or any("USETMAXREG" in x for x in body):
            continue   # not a page loop, or the partitions' dispatch loop around everything
        # which partition: the nearest setmaxnreg before the loop
        role = "?"
        for j in range(start, -1, -1):
            if "USETMAXREG" in lines[j]:
                role = "WG1 (worker)" if "DEALLOC" in lines[j] else "WG0 (default)"
                break
        cold = set()
        for j in range(start, i):
            mb = BRA.search(lines[j])
            if not mb or labels.get(mb.group(1), -1) <= j or labels[mb.group(1)] > i:
                continue   # backward, or out of the loop (the mbarrier retry stubs)
            region = range(j + 1, labels[mb.group(1)])
            conditional = bool(OP.match(lines[j]) and OP.match(lines[j]).group(2))
            text = "".join(lines[k] for k in region)
            if not conditional or ("HGMMA" not in text and "UTMALDG" not in text):
                cold.update(region)
        hot = [lines[k] for k in range(start, i + 1) if k not in cold]
        out.append((role, {"all": _count(body), "hot": _count(hot)}))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--h-q", type=int, default=128)
    ap.add_argument("--fmt", default="bf16", help="the cache format (bf16, fp8, nvfp4, mxfp4)")
    ap.add_argument("--dump", default=None, help="write the SASS here")
    args = ap.parse_args()
    from warpforge.ops import _gluon
    from warpforge.ops.mla import decode_gluon_kernel as dg
    from warpforge.ops.mla.kv_format import KV_FORMATS
    fmt = None if args.fmt == "bf16" else KV_FORMATS[args.fmt]._asdict()
    r = dg.compile_sm90(h_q=args.h_q, fmt=fmt)
    kernel = r.pop("kernel")
    use = _gluon.ptxas_usage(kernel.asm["ptx"])
    sass = sass_of(kernel.asm["cubin"])
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(sass)
    print(f"h_q {args.h_q} {args.fmt}: ptxas {use['registers']} registers, spills {use['spill_stores']}/"
          f"{use['spill_loads']} B, stack {use['stack_bytes']} B, shared {r['shared_bytes']} B, "
          f"{sum(1 for x in sass.splitlines() if OP.match(x))} SASS instructions")
    for role, counts in page_loops(sass):
        for kind in ("hot", "all"):
            c = counts[kind]
            print(f"  {role:14s} {kind:3s}: " + ", ".join(f"{k} {c[k]}" for k in KEYS))


if __name__ == "__main__":
    main()
