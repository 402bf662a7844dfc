"""Probe (issue 13): mma.sync throughput on sm_90 for fp16 (m16n8k16) against e4m3 (m16n8k32), as Gluon's mma_v2
emits them, to decide whether MLA decode at h_q 16 can take its scores straight from the e4m3 cache codes (NOTES,
session 21). Each program loops ITERS times over four independent [64, 64] accumulators (4 warps, register
operands), so the tensor pipe, not latency, should bound it.

    python scripts/probe_mma_sync_fp8.py [--iters 4096] [--programs-per-sm 4]
"""
import argparse

import torch
import triton.testing
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


@gluon.jit
def mma_loop(X, O, ITERS: gl.constexpr, K: gl.constexpr, MMA: gl.constexpr, A: gl.constexpr, B: gl.constexpr):
    BL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
    c = gl.arange(0, K, layout=gl.SliceLayout(0, BL))
    x = gl.load(X + r[:, None] * K + c[None, :])
    a = gl.convert_layout(x, A)
    rb = gl.arange(0, K, layout=gl.SliceLayout(1, BL))
    cb = gl.arange(0, 64, layout=gl.SliceLayout(0, BL))
    b = gl.convert_layout(gl.load(X + rb[:, None] * 64 + cb[None, :]), B)
    # distinct starts: identical chains would be merged into one by the compiler
    acc0 = gl.full([64, 64], 0.0, gl.float32, MMA)
    acc1 = gl.full([64, 64], 1.0, gl.float32, MMA)
    acc2 = gl.full([64, 64], 2.0, gl.float32, MMA)
    acc3 = gl.full([64, 64], 3.0, gl.float32, MMA)
    for _ in range(ITERS):
        acc0 = mma_v2(a, b, acc0)
        acc1 = mma_v2(a, b, acc1)
        acc2 = mma_v2(a, b, acc2)
        acc3 = mma_v2(a, b, acc3)
    acc = acc0 + acc1 + acc2 + acc3
    ro = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    co = gl.arange(0, 64, layout=gl.SliceLayout(0, MMA))
    gl.store(O + gl.program_id(0) * 4096 + ro[:, None] * 64 + co[None, :], acc)


def layouts(k_width):
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    return (mma, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=k_width),
            gl.DotOperandLayout(operand_index=1, parent=mma, k_width=k_width))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=4096)
    ap.add_argument("--programs-per-sm", type=int, default=4)
    args = ap.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms * args.programs_per_sm
    out = torch.empty(programs, 64, 64, device="cuda")
    for name, dtype, k_width in (("fp16 m16n8k16", torch.float16, 2), ("e4m3 m16n8k32", torch.float8_e4m3fn, 4)):
        k = 64   # the reduction per mma_v2 call: 4 (fp16) or 2 (e4m3) instructions deep
        x = (torch.randn(64 * k, device="cuda") * 0.1).to(dtype)
        mma, a, b = layouts(k_width)

        def run():
            mma_loop[(programs,)](x, out, args.iters, k, mma, a, b, num_warps=4)
        run()
        ms = triton.testing.do_bench(run, rep=50)
        flops = 2.0 * 64 * 64 * k * 4 * args.iters * programs
        print(f"{name}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s ({programs} programs, {args.iters} iterations)",
              flush=True)


if __name__ == "__main__":
    main()
