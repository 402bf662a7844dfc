"""Compile the MLA decode kernel for sm_90 on this machine (no GPU needed: Triton's wheel carries ptxas and
nvdisasm) and count its SASS instructions by opcode: how the cache tile moves (LDGSTS = cp.async into shared
memory, pipelined; LDG = plain loads into registers), conversions (F2F, F2FP, PRMT), spills (STL/LDL), MMAs.

    python scripts/sass_mla.py --fmt fp8 --fp16-math --block-n 32 [--dump out.sass]
"""
import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from warpforge.ops.mla import KV_FORMATS
from warpforge.ops.mla.decode_kernel import mla_decode_split_kernel

INT_ARGS = ("stride_qb", "stride_qs", "stride_qh", "row_stride", "stride_bt", "stride_ib", "stride_is",
            "stride_ps", "stride_pb", "stride_ls", "stride_lb", "rows_total", "topk")
ALIGNED = {"stride_qb", "stride_qs", "stride_qh", "row_stride", "stride_bt", "stride_ps", "stride_pb", "stride_ls",
           "stride_lb"}  # multiples of 16 in every real launch, as Triton's specialisation would see them


def compile_sm90(fmt, fp16_math, block_h, block_n, warps, stages, h_q, s_q, prefetch=False):
    kv = KV_FORMATS[fmt]
    quantized = kv.quantized
    sig = dict(Q="*bf16", CACHE="*u8" if quantized else "*bf16", BLOCK_TABLE="*i32", SEQLENS="*i32",
               INDICES="*fp32", TOPK_LEN="*fp32", KV_SCALE="*fp32", O_PART="*fp32", LSE_PART="*fp32")
    sig.update({name: "i32" for name in INT_ARGS})
    sig["qk_scale"] = "fp32"
    const = dict(H_Q=h_q, S_Q=s_q, PAGE=64, CAUSAL=False, KV_FMT=kv.code, GROUP=max(kv.group, 1),
                 SCALE_OFF=kv.scale_offset, ROPE_OFF=kv.rope_offset, SPARSE=False, HAS_TOPK_LEN=False,
                 BLOCK_H=block_h, BLOCK_N=block_n, FP16_MATH=fp16_math, FINAL=False,
                 PREFETCH=prefetch)
    sig.update({name: "constexpr" for name in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig)
             if sig[name].startswith("*") or name in ALIGNED}
    src = ASTSource(mla_decode_split_kernel, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def sass_of(kernel):
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="bf16", choices=list(KV_FORMATS))
    ap.add_argument("--fp16-math", action="store_true")
    ap.add_argument("--block-h", type=int, default=16)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--h-q", type=int, default=16)
    ap.add_argument("--s-q", type=int, default=1)
    ap.add_argument("--prefetch", action="store_true")
    ap.add_argument("--dump", default=None, help="write the SASS here")
    args = ap.parse_args()
    kernel = compile_sm90(args.fmt, args.fp16_math, args.block_h, args.block_n, args.warps, args.stages, args.h_q,
                          args.s_q, args.prefetch)
    sass = sass_of(kernel)
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(sass)
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    print(f"{args.fmt} fp16_math={args.fp16_math} prefetch={args.prefetch} BLOCK_H {args.block_h} "
          f"BLOCK_N {args.block_n} {args.warps} warps {args.stages} stages: {sum(ops.values())} instructions, "
          f"shared {kernel.metadata.shared} B")
    keys = ("UTMALDG", "LDGSTS", "LDG", "LDS", "LDSM", "STS", "STL", "LDL", "F2F", "F2FP", "PRMT", "HMMA", "HGMMA",
            "BAR")
    print("  " + ", ".join(f"{k} {ops[k]}" for k in keys))
    print("  top: " + ", ".join(f"{o} {c}" for o, c in ops.most_common(12)))


if __name__ == "__main__":
    main()
