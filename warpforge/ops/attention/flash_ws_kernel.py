"""FlashAttention forward on Hopper's asynchronous pipeline through Triton's automatic warp specialization.

The key walk is one `tl.range(..., warp_specialize=True)` loop over K/V tensor descriptors: at num_warps=4
Triton 3.6 (and 3.9) split it into a TMA producer and two consumer warpgroups, each owning half of the
BLOCK_M query rows (12 warps, `setmaxnreg`), FA3's structure. What the pass accepts shapes the kernel
(benchmarks/NOTES.md, "warp specialization"): the whole walk is a single loop (two loops in a row, specialized
or not, fail to compile), there is no early return, the loop body has no data-dependent branch (so a masked
problem, causal, windowed or with a ragged last block, applies its mask on every step), and what the loop
reads comes through descriptors (q too: a pointer load before the loop also stops it).

Batched [b, s, h, d] inputs only, head dims 64 / 128 (one descriptor block per row), 16-bit, TMA-aligned
strides: api.py sends everything else to the portable kernel (flash_kernel.py), whose output and lse this
matches, so the backward is shared.
"""
import torch
import triton
import triton.language as tl

from ...runtime import ensure_tma_allocator
from ..shared_kernels import dot
from .flash_kernel import LOG2E, _key_span, _softmax_step


@triton.jit
def flash_fwd_ws_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    s_q, s_k, left, right, qk_scale,
    H_Q: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    # grid (b · H_Q · row blocks,): one axis (axis 1 stops at 65535), a head's row blocks adjacent
    n_m = tl.cdiv(s_q, BLOCK_M)
    pid_m = n_m - 1 - tl.program_id(0) % n_m  # causal row blocks get heavier: the heaviest first
    bh = tl.program_id(0) // n_m
    b = (bh // H_Q).to(tl.int64)
    h = (bh % H_Q).to(tl.int64)
    kvh = h // GROUP
    m_lo = pid_m * BLOCK_M
    rows = m_lo + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = rows < s_q
    # q through a descriptor too: a pointer load before the loop stops the specialization (measured)
    q_desc = tl.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[s_q, D], strides=[stride_qs, 1],
                                       block_shape=[BLOCK_M, D])
    q = q_desc.load([m_lo, 0])  # rows past s_q arrive as zeros
    k_desc = tl.make_tensor_descriptor(K + b * stride_kb + kvh * stride_kh, shape=[s_k, D], strides=[stride_ks, 1],
                                       block_shape=[BLOCK_N, D])
    v_desc = tl.make_tensor_descriptor(V + b * stride_vb + kvh * stride_vh, shape=[s_k, D], strides=[stride_vs, 1],
                                       block_shape=[BLOCK_N, D])
    A, B, start, _, _, end = _key_span(m_lo, s_q, s_k, left, right, BLOCK_M, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=True):
        k = k_desc.load([start_n, 0])  # rows past s_k arrive as zeros (and are masked)
        v = v_desc.load([start_n, 0])
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, dot(q, tl.trans(k)), v, rows, start_n + offs_n, s_k, A, B,
                                      s_k - s_q, qk_scale, 0.0, 0.0, 0.0, MASKED, False, False)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(O + b * stride_ob + h * stride_oh + rows[:, None].to(tl.int64) * stride_os + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + b * stride_lb + h * stride_lh + rows, lse, mask=row_ok)


# ------------------------------------------------------------------------------------------ launch
def fits(q, k, v) -> bool:
    """Whether the warp-specialized forward takes these batched inputs (else the portable kernel runs)."""
    aligned = all(t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:-1]) for t in (q, k, v))
    return q.dim() == 4 and q.shape[-1] in (64, 128) and q.dtype in (torch.float16, torch.bfloat16) and aligned


def flash_fwd_ws(q, k, v, batch, s_q, s_k, sm_scale, left, right, cfg):
    """Returns (out like q, lse fp32 [b, h_q, s_q]); the caller checked fits(q, k, v). A sliding window goes to
    the portable kernel: on the H200 (Triton 3.6) this kernel gave NaN rows with window (20, 5), where the
    interpreter and the portable kernel are right (benchmarks/NOTES.md); full and causal masks are verified."""
    if left < s_k or 0 < right < s_k:
        from .flash_kernel import flash_fwd
        return flash_fwd(q, k, v, None, None, batch, s_q, s_k, sm_scale, left, right, cfg._replace(ws=False))
    h_q, d = q.shape[-2], q.shape[-1]
    out = torch.empty_like(q)
    lse = torch.empty((batch, h_q, s_q), device=q.device, dtype=torch.float32)
    if out.numel() == 0 or s_q == 0:
        lse.fill_(float("-inf"))
        return out.zero_(), lse
    ensure_tma_allocator(q.device)
    # masked unless every query sees every key of whole blocks
    masked = (left < s_k or right < s_k) or s_k % cfg.block_n != 0
    flash_fwd_ws_kernel[(triton.cdiv(s_q, cfg.block_m) * batch * h_q,)](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        s_q, s_k, left, right, sm_scale * LOG2E,
        H_Q=h_q, GROUP=h_q // k.shape[-2], D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MASKED=masked,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return out, lse
