"""The instruction mix of each loop in a kernel's sm_90 SASS, from PTX written by `scripts/compile_sm90.py --ptx-dir`
(no GPU needed): ptxas from the Triton wheel (the PTX's .maxnreg honoured), cuobjdump, then for every backward
branch the instructions between its target and itself, counted by opcode.

    python scripts/sass_loops.py DIR/evoformer-0-evo_fwd_kernel.ptx [more.ptx ...] [--min 60]

A probe: compare one kernel's loop before and after a change (session 33: the Evoformer's d 32 forward 491 -> 447).
"""
import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton


def sass(ptx_path: str) -> str:
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        args = [os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-O3", ptx_path, "-o", cubin]
        cap = re.search(r"\.maxnreg (\d+)", open(ptx_path).read())
        subprocess.run(args + (["--maxrregcount", cap.group(1)] if cap else []), check=True, capture_output=True)
        return subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout


def loops(text: str):
    """[(start address, [opcodes])] for each backward branch's body."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+([^;]+);", line) for line in text.splitlines()) if m]
    found = []
    for addr, op in ins:
        target = re.search(r"BRA (0x[0-9a-f]+)", op)
        if target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            found.append((start, [re.sub(r"^@!?U?P\w+ ", "", o).split()[0].split(".")[0] for a, o in ins
                                  if start <= a <= addr]))
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ptx", nargs="+")
    ap.add_argument("--min", type=int, default=60, help="skip loops shorter than this")
    args = ap.parse_args()
    for path in args.ptx:
        for start, ops in loops(sass(path)):
            if len(ops) >= args.min:
                mix = ", ".join(f"{k} {n}" for k, n in collections.Counter(ops).most_common(10))
                print(f"{os.path.basename(path)} loop at {start:#x}: {len(ops)} instructions | {mix}")


if __name__ == "__main__":
    main()
