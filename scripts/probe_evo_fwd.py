"""Ablations of the Evoformer forward at the bench's row shape (N_seq 512, N_res 384, 8 heads of 32, mask + pair
bias, gate): the library kernel's step with one part taken out at a time, and two program orders, to see what its
time is made of. Results are wrong on purpose in the ablations; only the times mean anything.

    python scripts/probe_evo_fwd.py [--maxnreg]

ABL 0 the full step (as evoformer_kernel.evo_fwd_kernel), 1 no exp2 (p = s - max), 2 the K / V tiles loaded once
before the loop, 3 no biases, 4 scores in natural units (q pre-scaled, the biases as the dot's accumulator, exp2 of
x · log2 e - max · log2 e: right, and slower); ORDER 0 a program per (b, s, h, query block) as the library, 1 a
program per (b, s, h) walking its query blocks in an outer loop, 2 the same as one flattened loop
(tl.range(flatten=True)). --maxnreg: ABL 0 at register caps (MAXNREG) instead.
"""
import math
import sys

import torch
import triton
import triton.language as tl

from warpforge.ops.evoformer import evoformer_kernel as ek
from warpforge.ops.shared_kernels import dot, online_softmax


@triton.jit
def _block_out(Q, K, V, GATE, OUT, LSE, B1, B2, base, bsh, m0, stride_r, b1_i, b1_j, b2_i, b2_j, R, qk_scale,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ABL: tl.constexpr):
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = ek._rows_tile(Q + base, rows, offs_d, stride_r, R, D, True, True)
    qs = (q.to(tl.float32) * (qk_scale * 0.6931471805599453)).to(q.dtype)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k0 = ek._rows_tile(K + base, tl.arange(0, BLOCK_N), offs_d, stride_r, R, D, True, True)
    v0 = ek._rows_tile(V + base, tl.arange(0, BLOCK_N), offs_d, stride_r, R, D, True, True)
    for n0 in range(0, R, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        if ABL == 2:
            k, v = k0, v0
        else:
            k = ek._rows_tile(K + base, cols, offs_d, stride_r, R, D, True, True)
            v = ek._rows_tile(V + base, cols, offs_d, stride_r, R, D, True, True)
        if ABL == 3:
            x = ek._scores(q, k, rows, cols, R, qk_scale, B1, b1_i, b1_j, B2, b2_i, b2_j, 0, 0, True, True)
        elif ABL == 4:  # scores in natural units: q pre-scaled, the biases as the dot's accumulator
            bias = ek._bias_tile(B2, rows, cols, b2_i, b2_j, R, 1, True, True) + \
                ek._bias_tile(B1, rows, cols, b1_i, b1_j, R, 2, True, True)
            x = dot(qs, tl.trans(k), bias)
        else:
            x = ek._scores(q, k, rows, cols, R, qk_scale, B1, b1_i, b1_j, B2, b2_i, b2_j, 2, 1, True, True)
        if ABL == 4:
            m_new = tl.maximum(m_i, tl.max(x, 1))
            m2 = m_new * 1.4426950408889634
            p = tl.math.exp2(x * 1.4426950408889634 - m2[:, None])
            alpha = tl.math.exp2(m_i * 1.4426950408889634 - m2)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        elif ABL == 1:
            m_new = tl.maximum(m_i, tl.max(x, 1))
            p = x - m_new[:, None]
            alpha = m_i - m_new
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        else:
            p, alpha, l_i, m_i = online_softmax(x, m_i, l_i)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
    if ABL == 4:
        lse = m_i + tl.math.log2(l_i) * 0.6931471805599453
    else:
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    tl.store(LSE + bsh * R + rows, lse)
    out = acc / l_i[:, None]
    gate = ek._rows_tile(GATE + base, rows, offs_d, stride_r, R, D, True, True).to(tl.float32)
    out = out / (1.0 + tl.math.exp2(-gate * 1.4426950408889634))
    ek._store_rows(OUT + base, out, rows, offs_d, stride_r, R, D, True, True)


@triton.jit
def probe_fwd_kernel(Q, K, V, GATE, OUT, LSE, B1, B2, stride_s, stride_r, b1_s, b1_j, b2_h, b2_i, S, R, scale,
                     H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     ABL: tl.constexpr, ORDER: tl.constexpr):
    bsh = tl.program_id(0).to(tl.int64)
    s = bsh // H
    h = bsh % H
    base = s * stride_s + h * D
    b1 = B1 + s * b1_s
    b2 = B2 + h * b2_h
    qk_scale = scale * 1.4426950408889634
    if ORDER == 0:
        _block_out(Q, K, V, GATE, OUT, LSE, b1, b2, base, bsh, tl.program_id(1) * BLOCK_M, stride_r, 0, b1_j, b2_i,
                   1, R, qk_scale, D, BLOCK_M, BLOCK_N, ABL)
    elif ORDER == 1:
        for m0 in range(0, R, BLOCK_M):
            _block_out(Q, K, V, GATE, OUT, LSE, b1, b2, base, bsh, m0, stride_r, 0, b1_j, b2_i, 1, R, qk_scale, D,
                       BLOCK_M, BLOCK_N, ABL)
    else:  # one loop over (query block, key block), the softmax state reset and the block stored in its branches
        NJ = R // BLOCK_N
        offs_d = tl.arange(0, D)
        rows = tl.arange(0, BLOCK_M)
        q = ek._rows_tile(Q + base, rows, offs_d, stride_r, R, D, True, True)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for t in tl.range(0, (R // BLOCK_M) * NJ, flatten=True):
            j = t % NJ
            rows = (t // NJ) * BLOCK_M + tl.arange(0, BLOCK_M)
            if j == 0:
                q = ek._rows_tile(Q + base, rows, offs_d, stride_r, R, D, True, True)
                m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_M], tl.float32)
                acc = tl.zeros([BLOCK_M, D], tl.float32)
            cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
            k = ek._rows_tile(K + base, cols, offs_d, stride_r, R, D, True, True)
            v = ek._rows_tile(V + base, cols, offs_d, stride_r, R, D, True, True)
            x = ek._scores(q, k, rows, cols, R, qk_scale, b1, 0, b1_j, b2, b2_i, 1, 2, 1, True, True)
            p, alpha, l_i, m_i = online_softmax(x, m_i, l_i)
            acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
            if j == NJ - 1:
                tl.store(LSE + bsh * R + rows, (m_i + tl.math.log2(l_i)) * 0.6931471805599453)
                out = acc / l_i[:, None]
                gate = ek._rows_tile(GATE + base, rows, offs_d, stride_r, R, D, True, True).to(tl.float32)
                out = out / (1.0 + tl.math.exp2(-gate * 1.4426950408889634))
                ek._store_rows(OUT + base, out, rows, offs_d, stride_r, R, D, True, True)


# (block_m, block_n, warps, stages, maxnreg): 64-row tiles at 119 registers run 4 programs an SM; <= 102 fits 5
MAXNREG = [(64, 64, 4, 3, None), (128, 32, 4, 3, None), (128, 32, 4, 3, 128), (128, 32, 4, 3, 120),
           (128, 32, 4, 3, 112), (128, 32, 4, 3, 104), (128, 32, 4, 4, 128), (128, 32, 4, 2, 128),
           (128, 64, 4, 3, 128), (128, 16, 4, 3, 128), (128, 16, 4, 3, 112), (64, 32, 4, 3, 96), (64, 32, 4, 3, 80),
           (128, 32, 8, 3, 64)]


def main():
    S, R, H, D = 512, 384, 8, 32
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, gate = (torch.randn(1, S, R, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    mask = torch.zeros(1, S, 1, 1, R, device="cuda", dtype=torch.bfloat16)
    pair = torch.randn(1, 1, H, R, R, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse = torch.empty_like(q), torch.empty(1, S, H, R, device="cuda")
    scale = 1.0 / math.sqrt(D)
    ref_out, _ = ek.evoformer_fwd(q, k, v, (mask.expand(1, S, H, R, R), pair.expand(1, S, H, R, R)), gate, scale,
                                  ek_tiles())
    regs = "--maxnreg" in sys.argv  # the register cap (more programs an SM) instead of the ablations
    for order in ((0,) if regs else (0, 1, 2)):
        for abl in ((0, 1, 2, 3, 4) if order == 0 and not regs else (0,)):
            for bm, bn, warps, stages, cap in (MAXNREG if regs else [(64, 64, 4, 3, None), (128, 64, 8, 3, None),
                                                                       (128, 64, 4, 3, None), (128, 32, 4, 3, None)]):
                if R % bm or R % bn:  # the probe's kernel has no masks: tiles must divide N_res
                    continue
                grid = (S * H, R // bm if order == 0 else 1)
                extra = {} if cap is None else dict(maxnreg=cap)

                def run():
                    probe_fwd_kernel[grid](q, k, v, gate, out, lse, mask, pair, q.stride(1), q.stride(2),
                                           mask.stride(1), mask.stride(4), pair.stride(2), pair.stride(3), S, R, scale,
                                           H=H, D=D, BLOCK_M=bm, BLOCK_N=bn, ABL=abl, ORDER=order, num_warps=warps,
                                           num_stages=stages, **extra)
                try:
                    out.zero_()  # a stale buffer would hide rows a tile leaves out
                    run()
                    ms = triton.testing.do_bench(run, warmup=10, rep=60)
                    err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm() if abl in (0, 4)
                           else float("nan"))
                    print(f"order {order} abl {abl} tile {(bm, bn, warps, stages)} maxnreg {cap}: {ms:.3f} ms  "
                          f"rel err {err:.1e}", flush=True)
                except Exception as exc:  # noqa: BLE001 - a probe: report and go on
                    print(f"order {order} abl {abl} tile {(bm, bn, warps, stages)}: failed {type(exc).__name__}: "
                          f"{str(exc)[:200]}", flush=True)


def ek_tiles():
    from warpforge.ops.evoformer import configs
    return configs.TILES.lookup(torch.device("cuda"), 32).fwd


if __name__ == "__main__":
    main()
