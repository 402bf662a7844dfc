"""FP8 attention forward in Triton: e4m3 Q·Kᵀ (or INT8 Q·Kᵀ) and e4m3 P·V on the tensor cores (QGMMA / IMMA on
Hopper), softmax online in fp32 as in flash_kernel.py, whose band rule and walk split it shares.

Inputs come from fp8_quantize.quantize_qkv: q and k per-token scaled (one fp32 scale per row and head), v
per-channel scaled and stored transposed, vt [b, h_kv, d_v, s_k] (the P·V product's B operand is then K-major,
as FP8 MMAs require). A score is (q̂ · k̂) · q_scale_i · k_scale_j. P (in [0, 1]) goes to e4m3 times 448, so
that probabilities down to ~3e-5 stay normal numbers; the epilogue divides the 448 back out with the softmax
sum and applies V's channel scales.
"""
import triton
import triton.language as tl

from ..shared_kernels import online_softmax
from .flash_kernel import _head_bases, _key_span, _visible

@triton.jit
def _fp8_walk(acc, l_i, m_i, q, q_lo, qs2, k_base, ks_base, vt_base, stride_ks, stride_kss, stride_vd, lo, hi, rows,
              offs_n, offs_d, offs_dv, s_k, A, B, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
              MASK: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, INT8_QK: tl.constexpr,
              Q_LO: tl.constexpr):
    """The online softmax over key tiles [lo, hi); MASK tiles may cross the band's edge or the sequence's end.
    Q_LO: q's residual codes q_lo add their product into the same raw scores."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = k_base + cols[:, None].to(tl.int64) * stride_ks + offs_d[None, :]
        vt_ptrs = vt_base + offs_dv[:, None] * stride_vd + cols[None, :]
        if MASK:
            in_seq = cols < s_k
            k_ok = in_seq[:, None] & (offs_d < D)[None, :]
            vt_ok = (offs_dv < DV)[:, None] & in_seq[None, :]
            k = tl.load(k_ptrs, mask=k_ok, other=0.0)
            ks = tl.load(ks_base + cols * stride_kss, mask=in_seq, other=0.0)
            vt = tl.load(vt_ptrs, mask=vt_ok, other=0.0)
        else:
            k = tl.load(k_ptrs) if EVEN_D else tl.load(k_ptrs, mask=(offs_d < D)[None, :], other=0.0)
            ks = tl.load(ks_base + cols * stride_kss)
            vt = tl.load(vt_ptrs) if EVEN_DV else tl.load(vt_ptrs, mask=(offs_dv < DV)[:, None], other=0.0)
        if INT8_QK:
            qk = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
        else:
            qk = tl.dot(q, tl.trans(k))
            if Q_LO:
                qk = tl.dot(q_lo, tl.trans(k), qk)
        s = qk * qs2[:, None] * ks[None, :]  # log2 units: qs2 carries the softmax scale and log2 e
        if MASK:
            s = tl.where(_visible(rows, cols, s_k, A, B), s, float("-inf"))
        p, alpha, l_i, m_i = online_softmax(s, m_i, l_i)
        acc = tl.dot((p * 448.0).to(vt.dtype), tl.trans(vt), acc * alpha[:, None])
    return acc, l_i, m_i


@triton.jit
def flash_fp8_fwd_kernel(
    Q, QL, QS, K, KS, VT, VS, OUT, LSE,
    stride_qb, stride_qs, stride_qh, stride_qsb, stride_qss, stride_qsh,
    stride_kb, stride_ks, stride_kh, stride_ksb, stride_kss, stride_ksh,
    stride_vb, stride_vh, stride_vd, stride_vsb, stride_vsh,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    s_q, s_k, left, right, qk_scale,
    H_Q: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, INT8_QK: tl.constexpr, Q_LO: tl.constexpr,
):
    """A program owns BLOCK_M query rows of one head (heaviest causal tiles first) and walks their band of keys.
    Grid (b · H_Q · row blocks,): one axis (axis 1 stops at 65535), a head's row blocks adjacent. Q_LO: QL holds q's
    residual codes at Q's strides."""
    n_m = tl.cdiv(s_q, BLOCK_M)
    pid_m = n_m - 1 - tl.program_id(0) % n_m
    bh = tl.program_id(0) // n_m
    b64 = (bh // H_Q).to(tl.int64)
    h64 = (bh % H_Q).to(tl.int64)
    kvh = h64 // GROUP
    m_lo = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = m_lo + offs_m
    row_ok = rows < s_q
    q_offs = offs_m[:, None] * stride_qs + offs_d[None, :]
    q_ok = row_ok[:, None] & (offs_d < D)[None, :]
    q = tl.load(_head_bases(Q, b64, m_lo, h64, stride_qb, stride_qs, stride_qh) + q_offs, mask=q_ok, other=0.0)
    q_lo = q
    if Q_LO:
        q_lo = tl.load(_head_bases(QL, b64, m_lo, h64, stride_qb, stride_qs, stride_qh) + q_offs, mask=q_ok,
                       other=0.0)
    qs2 = tl.load(_head_bases(QS, b64, m_lo, h64, stride_qsb, stride_qss, stride_qsh) + offs_m * stride_qss,
                  mask=row_ok, other=0.0) * qk_scale
    first = m_lo * 0  # row 0 as a tensor (the interpreter's .to needs one)
    k_base = _head_bases(K, b64, first, kvh, stride_kb, stride_ks, stride_kh)
    ks_base = _head_bases(KS, b64, first, kvh, stride_ksb, stride_kss, stride_ksh)
    vt_base = VT + b64 * stride_vb + kvh * stride_vh

    A, B, start, full_lo, full_hi, end = _key_span(m_lo, s_q, s_k, left, right, BLOCK_M, BLOCK_N)
    EVEN_D: tl.constexpr = D == BLOCK_D
    EVEN_DV: tl.constexpr = DV == BLOCK_DV
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc, l_i, m_i = _fp8_walk(acc, l_i, m_i, q, q_lo, qs2, k_base, ks_base, vt_base, stride_ks, stride_kss, stride_vd,
                              start, full_lo, rows, offs_n, offs_d, offs_dv, s_k, A, B, D, DV, BLOCK_N, True, EVEN_D,
                              EVEN_DV, INT8_QK, Q_LO)
    acc, l_i, m_i = _fp8_walk(acc, l_i, m_i, q, q_lo, qs2, k_base, ks_base, vt_base, stride_ks, stride_kss, stride_vd,
                              full_lo, full_hi, rows, offs_n, offs_d, offs_dv, s_k, A, B, D, DV, BLOCK_N, False,
                              EVEN_D, EVEN_DV, INT8_QK, Q_LO)
    acc, l_i, m_i = _fp8_walk(acc, l_i, m_i, q, q_lo, qs2, k_base, ks_base, vt_base, stride_ks, stride_kss, stride_vd,
                              full_hi, end, rows, offs_n, offs_d, offs_dv, s_k, A, B, D, DV, BLOCK_N, True, EVEN_D,
                              EVEN_DV, INT8_QK, Q_LO)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    vs = tl.load(VS + b64 * stride_vsb + kvh * stride_vsh + offs_dv, mask=offs_dv < DV, other=0.0)
    out = acc * (1.0 / 448.0) / l_safe[:, None] * vs[None, :]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE + b64 * stride_lb + h64 * stride_lh + rows, lse, mask=row_ok)
    tl.store(_head_bases(OUT, b64, m_lo, h64, stride_ob, stride_os, stride_oh)
             + offs_m[:, None] * stride_os + offs_dv[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv < DV)[None, :])


# ------------------------------------------------------------------------------------------ launch
def _block(d):
    """The padded width a head dim is tiled with: a power of two, at least 32 (an FP8 MMA's smallest K)."""
    return max(32, triton.next_power_of_2(d))


def flash_fp8_fwd(qkv, sm_scale, left, right, cfg, out, lse):
    """Fills out [b, s_q, h_q, d_v] and lse [b, h_q, s_q] (natural log) from a QuantizedQKV."""
    q, k, vt = qkv.q, qkv.k, qkv.v_t
    b, s_q, h_q, d = q.shape
    s_k, h_kv, dv = k.shape[1], k.shape[2], vt.shape[2]
    q_lo = qkv.q_lo
    flash_fp8_fwd_kernel[(triton.cdiv(s_q, cfg.block_m) * b * h_q,)](
        q, q_lo if q_lo is not None else q, qkv.q_scale, k, qkv.k_scale, vt, qkv.v_scale, out, lse,
        *q.stride()[:3], *qkv.q_scale.stride(), *k.stride()[:3], *qkv.k_scale.stride(),
        *vt.stride()[:3], *qkv.v_scale.stride()[:2], *out.stride()[:3], *lse.stride()[:2],
        s_q, s_k, left, right, sm_scale * 1.4426950408889634,
        H_Q=h_q, GROUP=h_q // h_kv, D=d, DV=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_block(d),
        BLOCK_DV=_block(dv), INT8_QK=qkv.qk_format == "int8", Q_LO=q_lo is not None, num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
