"""Evoformer attention in Triton: FlashAttention over the residues of each (batch, MSA row, head) with up to two
additive biases broadcast from [B, N_seq, H, N_res, N_res] (read through strides, 0 where broadcast, so the pair
bias is never expanded), forward and backward.

The backward is three deterministic passes: dk/dv (a program owns a key block and walks the queries), dq (a query
block walks the keys), and the pair bias's gradient, a sum over the MSA rows: a program owns a [queries, keys] tile
of one (batch, head) and walks the rows in order, recomputing the probabilities, so no [N_seq, H, N_res, N_res]
tensor and no float atomics (bitwise reproducible). On sm_90 the api hands the dq and pair-bias passes to one Gluon
pass (dq_dbias_gluon_kernel: each ds computed once), and can hand the forward and dk/dv to Gluon kernels too.

Layouts: q, k, v, out, do and the gradients contiguous [B, N_seq, N_res, H, D] (one set of strides); delta
[B, N_seq, H, N_res] and the forward's row statistics [2, B, N_seq, H, N_res] (lse2 in log2 units, then the row
scale: row_stats), indexed by the program's (b, s, h) row bsh = (b · N_seq + s) · H + h.

At the small head dims of these models (8-64) the matmuls are cheap and a score costs ~15 instructions, so the
kernels spend their care there: a bias that is the same for every query (the residue mask, stride 0 over the
queries: BIAS_KIND 2) is read as one vector per key block instead of a [rows, keys] tile; masks are compiled only
where N_res does not fill the tiles (EVEN_M / EVEN_N / EVEN_D); offsets inside one (b, s, h) slice are int32 from an
int64 base (api._check makes sure they fit: N_res · H · D and each bias's strides over the residues).
"""
import torch
import triton
import triton.language as tl

from ...runtime import cdiv, next_pow2
from ..shared_kernels import dot, online_softmax, triton_launch

LOG2E = 1.4426950408889634
BIAS_NONE, BIAS_TILE, BIAS_KEYS, BIAS_ROWS, BIAS_GIVEN = 0, 1, 2, 3, 4


@triton.jit
def _widen(x):
    """x in fp32; a bf16 x through its bits (the high half of an fp32's): one LOP3 for a high half of a register
    pair, where the compiler's cast takes a PRMT and a shift."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _bias_tile(BIAS, rows, cols, stride_i, stride_j, R, KIND: tl.constexpr, EVEN_M: tl.constexpr,
               EVEN_N: tl.constexpr):
    """The [rows, cols] tile of one bias (BIAS already at this (b, s, h)) in fp32, 0 past the residues; a [1, cols]
    row for a bias the same down the tile's rows (KIND 2: the residue mask, keys as columns), a [rows, 1] column for
    one the same along them (KIND 3: the mask with keys as rows); BIAS itself, a tile the caller loaded (KIND 4); 0
    without one."""
    if KIND == 1:
        ptrs = BIAS + rows[:, None] * stride_i + cols[None, :] * stride_j
        if EVEN_M and EVEN_N:
            tile = _widen(tl.load(ptrs))
        else:
            tile = _widen(tl.load(ptrs, mask=(rows < R)[:, None] & (cols < R)[None, :], other=0.0))
    elif KIND == 2:
        if EVEN_N:
            tile = _widen(tl.load(BIAS + cols * stride_j))[None, :]
        else:
            tile = _widen(tl.load(BIAS + cols * stride_j, mask=cols < R, other=0.0))[None, :]
    elif KIND == 3:
        if EVEN_M:
            tile = _widen(tl.load(BIAS + rows * stride_i))[:, None]
        else:
            tile = _widen(tl.load(BIAS + rows * stride_i, mask=rows < R, other=0.0))[:, None]
    elif KIND == 4:
        tile = BIAS
    else:
        tile = 0.0
    return tile


@triton.jit
def _scores(q, k, rows, cols, R, qk_scale, B1, b1_i, b1_j, B2, b2_i, b2_j, KIND1: tl.constexpr,
            KIND2: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    """(q · kᵀ · scale + biases) in log2 units (qk_scale = scale · log2 e), [rows, cols], -inf past the residues.
    B1 / B2 point at this (b, s, h)'s slice of each bias."""
    x = dot(q, tl.trans(k)) * qk_scale
    if KIND1 != 0 or KIND2 != 0:
        bias = _bias_tile(B1, rows, cols, b1_i, b1_j, R, KIND1, EVEN_M, EVEN_N) + \
            _bias_tile(B2, rows, cols, b2_i, b2_j, R, KIND2, EVEN_M, EVEN_N)
        x += bias * 1.4426950408889634
    if not EVEN_N:
        x = tl.where((cols < R)[None, :], x, float("-inf"))
    return x


@triton.jit
def _rows_tile(X, rows, offs_d, stride_r, R, D: tl.constexpr, EVEN_R: tl.constexpr, EVEN_D: tl.constexpr):
    """[rows, BLOCK_D] of X (already at this (b, s, h)), 0 past the residues and the head dim."""
    ptrs = X + rows[:, None] * stride_r + offs_d[None, :]
    if EVEN_R and EVEN_D:
        tile = tl.load(ptrs)
    elif EVEN_R:
        tile = tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)
    else:
        tile = tl.load(ptrs, mask=(rows < R)[:, None] & (offs_d < D)[None, :], other=0.0)
    return tile


@triton.jit
def _store_rows(X, tile, rows, offs_d, stride_r, R, D: tl.constexpr, EVEN_R: tl.constexpr, EVEN_D: tl.constexpr):
    ptrs = X + rows[:, None] * stride_r + offs_d[None, :]
    tile = tile.to(X.dtype.element_ty)
    if EVEN_R and EVEN_D:
        tl.store(ptrs, tile)
    else:
        tl.store(ptrs, tile, mask=(rows < R)[:, None] & (offs_d < D)[None, :])


@triton.jit
def _program_bsh(bsh, S, H: tl.constexpr):
    """(b, s, h) in int64 of the row bsh = (b · S + s) · H + h."""
    bsh = bsh.to(tl.int64)
    return bsh // H // S, (bsh // H) % S, bsh % H


@triton.jit
def _slice(BLOCK: tl.constexpr, S, H: tl.constexpr, stride_b, stride_s, stride_h, B1, b1_b, b1_s, b1_h, B2, b2_b, b2_s,
           b2_h):
    """This program's row bsh (int64), the first residue of its BLOCK-residue tile, the element offset of (b, s, h)
    in q's layout and each bias's pointer at (b, s, h). Grid (B · S · H, tiles): the rows on axis 0, which takes
    2^31 - 1 programs (axis 1 stops at 65535, which 2 x 5120 extra-MSA rows x 8 heads pass)."""
    bsh = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    b, s, h = _program_bsh(bsh, S, H)
    return (bsh, start, b * stride_b + s * stride_s + h * stride_h, B1 + (b * b1_b + s * b1_s + h * b1_h),
            B2 + (b * b2_b + s * b2_s + h * b2_h))


# 2^14: a row maximum (log2 units) from which fp32's spacing (2^-9 there) rounds m + log2(l) by up to ~0.07% of p
BIG_MAX2 = tl.constexpr(16384.0)


@triton.jit
def row_stats(m, l):
    """(l, or 1 where the row saw nothing; lse2; the row's scale) of a finished row (m its maximum, log2 units, l its
    sum): what the forward stores for the backward, which computes p' = 2^(x − lse2) and takes p = p' · scale by
    scaling the row's do and delta (evo_bwd_prep_kernel). Ordinary rows: lse2 = m + log2(l), scale 1. A row whose
    maximum is huge (a fully masked row under OpenFold's -1e9 bias: m ~ -1.4e9, where fp32's spacing is 128)
    cannot hold m + log2(l) to better than ±64 in the exponent, so p' would be off by up to 2^64: there lse2 = m
    (exact, so p' ≤ 1 as in the forward) and scale = 1 / l. Rows that saw nothing: lse2 -inf (p 0), scale 1.
    fwd_gluon_kernel repeats this in Gluon."""
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    big = tl.abs(m) >= BIG_MAX2
    lse2 = tl.where(empty, float("-inf"), tl.where(big, m, m + tl.math.log2(l_safe)))
    return l_safe, lse2, tl.where(big & ~empty, 1.0 / l_safe, 1.0)


@triton.jit
def evo_fwd_kernel(
    Q, K, V, GATE, OUT, LSE, ROW_SCALE, B1, B2,
    stride_b, stride_s, stride_r, stride_h,
    b1_b, b1_s, b1_h, b1_i, b1_j, b2_b, b2_s, b2_h, b2_i, b2_j,
    S, R, scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KIND1: tl.constexpr, KIND2: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_GATE: tl.constexpr,
):
    """out = softmax(q · kᵀ · scale + biases) · v, times sigmoid(gate) with HAS_GATE (GATE laid out as q)."""
    bsh, m0, base, B1, B2 = _slice(BLOCK_M, S, H, stride_b, stride_s, stride_h, B1, b1_b, b1_s, b1_h, B2, b2_b,
                                   b2_s, b2_h)
    qk_scale = scale * 1.4426950408889634
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _rows_tile(Q + base, rows, offs_d, stride_r, R, D, EVEN_M, EVEN_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, R, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = _rows_tile(K + base, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)
        v = _rows_tile(V + base, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)
        x = _scores(q, k, rows, cols, R, qk_scale, B1, b1_i, b1_j, B2, b2_i, b2_j, KIND1, KIND2, EVEN_M, EVEN_N)
        p, alpha, l_i, m_i = online_softmax(x, m_i, l_i)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
    l_safe, lse2, row_scale = row_stats(m_i, l_i)
    if EVEN_M:
        tl.store(LSE + bsh * R + rows, lse2)
        tl.store(ROW_SCALE + bsh * R + rows, row_scale)
    else:
        tl.store(LSE + bsh * R + rows, lse2, mask=rows < R)
        tl.store(ROW_SCALE + bsh * R + rows, row_scale, mask=rows < R)
    out = acc / l_safe[:, None]
    if HAS_GATE:
        gate = _rows_tile(GATE + base, rows, offs_d, stride_r, R, D, EVEN_M, EVEN_D).to(tl.float32)
        out = out / (1.0 + tl.math.exp2(-gate * 1.4426950408889634))
    _store_rows(OUT + base, out, rows, offs_d, stride_r, R, D, EVEN_M, EVEN_D)


@triton.jit
def evo_bwd_prep_kernel(OUT, DOUT, GATE, ROW_SCALE, DO, DGATE, DELTA, n_rows, S, R, H: tl.constexpr, D: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr,
                        WANT_DGATE: tl.constexpr):
    """Per row (b, s, r, h) of the [B, S, R, H, D] tensors: delta = Σ_d out · d_out and the gradient reaching the
    attention, do = d_out (times sigmoid(gate) with a gate), both times the forward's row scale (row_stats: 1 but
    for rows with a huge maximum), and with a gate the gate's gradient, d_out · out · (1 − sigmoid(gate)). out is
    the gated output, so out · d_out is also the ungated pair's product and nothing ungated needs keeping. delta
    and ROW_SCALE are [B, S, H, R] (row (b · S + s) · H + h, column r)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (rows < n_rows)[:, None] & (offs_d < D)[None, :]
    offs = rows[:, None] * D + offs_d[None, :]
    out = tl.load(OUT + offs, mask=ok, other=0.0).to(tl.float32)
    d_out = tl.load(DOUT + offs, mask=ok, other=0.0).to(tl.float32)
    h = rows % H
    r = (rows // H) % R
    bs = rows // H // R
    stat = (bs * H + h) * R + r
    row_scale = tl.load(ROW_SCALE + stat, mask=rows < n_rows, other=1.0)
    tl.store(DELTA + stat, tl.sum(out * d_out, 1) * row_scale, mask=rows < n_rows)
    if HAS_GATE:
        sig = 1.0 / (1.0 + tl.math.exp2(-tl.load(GATE + offs, mask=ok, other=0.0).to(tl.float32)
                                        * 1.4426950408889634))
        tl.store(DO + offs, (d_out * sig * row_scale[:, None]).to(DO.dtype.element_ty), mask=ok)
        if WANT_DGATE:
            tl.store(DGATE + offs, (d_out * out * (1.0 - sig)).to(DGATE.dtype.element_ty), mask=ok)
    else:
        tl.store(DO + offs, (d_out * row_scale[:, None]).to(DO.dtype.element_ty), mask=ok)


@triton.jit
def _grad_rows(Q, DO, LSE, DELTA, bsh, rows, offs_d, stride_r, R, D: tl.constexpr, EVEN_R: tl.constexpr,
               EVEN_D: tl.constexpr):
    """A query block's q, do, lse (log2; +inf for rows that saw nothing, so their p is 0) and delta (Q and DO at
    this (b, s, h))."""
    q = _rows_tile(Q, rows, offs_d, stride_r, R, D, EVEN_R, EVEN_D)
    do = _rows_tile(DO, rows, offs_d, stride_r, R, D, EVEN_R, EVEN_D)
    if EVEN_R:
        lse = tl.load(LSE + bsh * R + rows)
        delta = tl.load(DELTA + bsh * R + rows)
    else:
        lse = tl.load(LSE + bsh * R + rows, mask=rows < R, other=float("-inf"))
        delta = tl.load(DELTA + bsh * R + rows, mask=rows < R, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse)
    return q, do, lse2, delta


@triton.jit
def _dscores(q, k, v, do, lse2, delta, rows, cols, R, qk_scale, B1, b1_i, b1_j, B2, b2_i, b2_j,
             KIND1: tl.constexpr, KIND2: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
             KEY_ROWS: tl.constexpr = False):
    """(p, ds = p · (do · vᵀ − delta)) of a [rows, cols] tile: the softmax's gradient w.r.t. the scores. KEY_ROWS:
    (pᵀ, dsᵀ), [cols, rows], keys as rows, the biases given transposed (_bias_args(transposed=True)).
    The exponent is clamped at 0 (p <= 1, exact in real arithmetic): in a row under a huge finite mask bias (lse2 =
    the forward's maximum, row_stats) a score the backward rounds one fp32 step above the forward's would give
    2^128 = inf, and NaN in ds."""
    if KEY_ROWS:
        x = _scores(k, q, cols, rows, R, qk_scale, B1, b1_i, b1_j, B2, b2_i, b2_j, KIND1, KIND2, EVEN_N, EVEN_M)
        p = tl.math.exp2(tl.minimum(x - lse2[None, :], 0.0))
        ds = p * (dot(v, tl.trans(do)) - delta[None, :])
    else:
        x = _scores(q, k, rows, cols, R, qk_scale, B1, b1_i, b1_j, B2, b2_i, b2_j, KIND1, KIND2, EVEN_M, EVEN_N)
        p = tl.math.exp2(tl.minimum(x - lse2[:, None], 0.0))
        ds = p * (dot(do, tl.trans(v)) - delta[:, None])
    return p, ds


@triton.jit
def _walk_queries(Q, DO, LSE, DELTA, DQ_ACC, k, v, bsh, n0, cols, offs_d, stride_r, R, qk_scale, B1, b1_i, b1_j, B2,
                  b2_i, b2_j, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  KIND1: tl.constexpr, KIND2: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                  EVEN_D: tl.constexpr, SUM_DQ: tl.constexpr, KEY_ROWS: tl.constexpr = False):
    """(dk, dv) of the key block at n0 (k, v its tiles) over every query block of one (b, s, h) (Q, DO at it). SUM_DQ:
    also adds each query block's ds · k into DQ_ACC (fp32, at this (b, s, h), the key block n0 = 0 storing), which
    the caller's program alone touches. KEY_ROWS (not with SUM_DQ): the step computed transposed, keys as rows
    (_dscores' pᵀ and dsᵀ), so they are the dots' A operands straight from the registers instead of transposes
    through shared memory; the biases then come transposed (B1 / B2 with their strides swapped, the mask a KIND 3
    column)."""
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for m0 in range(0, R, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        q, do, lse2, delta = _grad_rows(Q, DO, LSE, DELTA, bsh, rows, offs_d, stride_r, R, D, EVEN_M, EVEN_D)
        p, ds = _dscores(q, k, v, do, lse2, delta, rows, cols, R, qk_scale, B1, b1_i, b1_j, B2, b2_i, b2_j,
                         KIND1, KIND2, EVEN_M, EVEN_N, KEY_ROWS)
        if KEY_ROWS:
            dv = dot(p.to(do.dtype), do, dv)
            dk = dot(ds.to(q.dtype), q, dk)
        else:
            dv = dot(tl.trans(p.to(do.dtype)), do, dv)
            dk = dot(tl.trans(ds.to(q.dtype)), q, dk)
        if SUM_DQ:
            dq = dot(ds.to(k.dtype), k)
            if n0 > 0:
                dq += _rows_tile(DQ_ACC, rows, offs_d, stride_r, R, D, EVEN_M, EVEN_D)
            _store_rows(DQ_ACC, dq, rows, offs_d, stride_r, R, D, EVEN_M, EVEN_D)
            tl.debug_barrier()  # the next key block's threads read what these wrote
    return dk, dv


@triton.jit
def evo_bwd_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DK, DV, B1, B2,
    stride_b, stride_s, stride_r, stride_h,
    b1_b, b1_s, b1_h, b1_i, b1_j, b2_b, b2_s, b2_h, b2_i, b2_j,
    S, R, scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KIND1: tl.constexpr, KIND2: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
    DQ_PASS: tl.constexpr, KEY_ROWS: tl.constexpr = False,
):
    """Program (b · s · h, block). DQ_PASS False: a key block walks the query blocks for its dk and dv; True: a
    query block walks the key blocks for its dq. Each gradient has one writer: deterministic, no atomics."""
    BLOCK: tl.constexpr = BLOCK_M if DQ_PASS else BLOCK_N
    bsh, start, base, B1, B2 = _slice(BLOCK, S, H, stride_b, stride_s, stride_h, B1, b1_b, b1_s, b1_h, B2, b2_b,
                                      b2_s, b2_h)
    qk_scale = scale * 1.4426950408889634
    offs_d = tl.arange(0, BLOCK_D)
    if DQ_PASS:
        rows = start + tl.arange(0, BLOCK_M)
        q, do, lse2, delta = _grad_rows(Q + base, DO + base, LSE, DELTA, bsh, rows, offs_d, stride_r, R, D, EVEN_M,
                                        EVEN_D)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(0, R, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            k = _rows_tile(K + base, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)
            v = _rows_tile(V + base, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)
            p, ds = _dscores(q, k, v, do, lse2, delta, rows, cols, R, qk_scale, B1, b1_i, b1_j, B2, b2_i, b2_j,
                             KIND1, KIND2, EVEN_M, EVEN_N)
            dq = dot(ds.to(k.dtype), k, dq)
        _store_rows(DQ + base, dq * scale, rows, offs_d, stride_r, R, D, EVEN_M, EVEN_D)
    else:
        n0 = start
        cols = n0 + tl.arange(0, BLOCK_N)
        k = _rows_tile(K + base, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)
        v = _rows_tile(V + base, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)
        dk, dv = _walk_queries(Q + base, DO + base, LSE, DELTA, DQ, k, v, bsh, n0, cols, offs_d, stride_r, R, qk_scale,
                               B1, b1_i, b1_j, B2, b2_i, b2_j, D, BLOCK_M, BLOCK_N, BLOCK_D, KIND1, KIND2, EVEN_M,
                               EVEN_N, EVEN_D, False, KEY_ROWS)
        _store_rows(DK + base, dk * scale, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)
        _store_rows(DV + base, dv, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)


@triton.jit
def evo_bwd_fused_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DQ_ACC, DK, DV, B1, B2,
    stride_b, stride_s, stride_r, stride_h,
    b1_b, b1_s, b1_h, b1_i, b1_j, b2_b, b2_s, b2_h, b2_i, b2_j,
    S, R, scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KIND1: tl.constexpr, KIND2: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
):
    """Program b · s · h: dk, dv and dq of one (b, s, h) from one walk over its scores (the two-pass backward
    computes every score twice). Key blocks outside, their dk and dv in registers; query blocks inside, each
    block's dq summed over the key blocks in DQ_ACC (fp32, laid out as q), which only this program touches, so the
    sum is in a fixed order (deterministic) and stays in L1/L2; at the end dq · scale goes to DQ."""
    bsh, _, base, B1, B2 = _slice(0, S, H, stride_b, stride_s, stride_h, B1, b1_b, b1_s, b1_h, B2, b2_b, b2_s,
                                  b2_h)
    qk_scale = scale * 1.4426950408889634
    offs_d = tl.arange(0, BLOCK_D)
    for n0 in range(0, R, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = _rows_tile(K + base, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)
        v = _rows_tile(V + base, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)
        dk, dv = _walk_queries(Q + base, DO + base, LSE, DELTA, DQ_ACC + base, k, v, bsh, n0, cols, offs_d, stride_r,
                               R, qk_scale, B1, b1_i, b1_j, B2, b2_i, b2_j, D, BLOCK_M, BLOCK_N, BLOCK_D, KIND1, KIND2,
                               EVEN_M, EVEN_N, EVEN_D, True)
        _store_rows(DK + base, dk * scale, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)
        _store_rows(DV + base, dv, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)
    for m0 in range(0, R, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        dq = _rows_tile(DQ_ACC + base, rows, offs_d, stride_r, R, D, EVEN_M, EVEN_D)
        _store_rows(DQ + base, dq * scale, rows, offs_d, stride_r, R, D, EVEN_M, EVEN_D)


@triton.jit
def evo_bwd_dbias_kernel(
    Q, K, V, DO, LSE, DELTA, DBIAS, B1, B2,
    stride_b, stride_s, stride_r, stride_h,
    b1_b, b1_s, b1_h, b1_i, b1_j, b2_b, b2_s, b2_h, b2_i, b2_j,
    db_b, db_h, db_i,
    S, R, scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KIND1: tl.constexpr, KIND2: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
):
    """d(pair bias)[b, h, i, j] = Σ_s ds[b, s, h, i, j], the rows walked in order (deterministic). A bias of KIND 4
    is a [R, R] tile bias the same for every MSA row (the pair bias): its tile is read once, before the walk."""
    b = (tl.program_id(2) // H).to(tl.int64)
    h = (tl.program_id(2) % H).to(tl.int64)
    qk_scale = scale * 1.4426950408889634
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if KIND1 == 4:
        src1 = _bias_tile(B1 + b * b1_b + h * b1_h, rows, cols, b1_i, b1_j, R, 1, EVEN_M, EVEN_N)
    if KIND2 == 4:
        src2 = _bias_tile(B2 + b * b2_b + h * b2_h, rows, cols, b2_i, b2_j, R, 1, EVEN_M, EVEN_N)
    for s in range(0, S):
        s64 = s + b * 0  # an int64 tensor in both the compiler and the interpreter
        bsh = (b * S + s64) * H + h
        base = b * stride_b + s64 * stride_s + h * stride_h
        if KIND1 != 4:
            src1 = B1 + b * b1_b + s64 * b1_s + h * b1_h
        if KIND2 != 4:
            src2 = B2 + b * b2_b + s64 * b2_s + h * b2_h
        q, do, lse2, delta = _grad_rows(Q + base, DO + base, LSE, DELTA, bsh, rows, offs_d, stride_r, R, D, EVEN_M,
                                        EVEN_D)
        k = _rows_tile(K + base, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)
        v = _rows_tile(V + base, cols, offs_d, stride_r, R, D, EVEN_N, EVEN_D)
        p, ds = _dscores(q, k, v, do, lse2, delta, rows, cols, R, qk_scale, src1, b1_i, b1_j, src2, b2_i, b2_j,
                         KIND1, KIND2, EVEN_M, EVEN_N)
        acc += ds
    ptrs = DBIAS + b * db_b + h * db_h + rows[:, None] * db_i + cols[None, :]
    if EVEN_M and EVEN_N:
        tl.store(ptrs, acc.to(DBIAS.dtype.element_ty))
    else:
        tl.store(ptrs, acc.to(DBIAS.dtype.element_ty), mask=(rows < R)[:, None] & (cols < R)[None, :])


# ------------------------------------------------------------------------------------------ launch
def _block(d):
    return max(16, next_pow2(d))


def _bias_args(biases, dummy, transposed=False):
    """(pointer, 5 strides, kind) per bias slot, broadcast dims at stride 0; `dummy` stands in for no bias. A bias
    with stride 0 over the queries is read as one row of keys (BIAS_KEYS). transposed: for a step computed with keys
    as rows, each bias's [R, R] transposed: the mask (a key row) becomes a column (BIAS_ROWS), a bias shared by the
    MSA rows (the pair bias) is copied transposed once (at most [B, 1, H, R, R]) so that its tiles stay coalesced,
    others are read through swapped strides."""
    args, kinds = [], []
    for i in range(2):
        bias = biases[i] if i < len(biases) else None
        if bias is None:
            args += [dummy, 0, 0, 0, 0, 0]
            kinds.append(BIAS_NONE)
            continue
        keys_row = bias.stride(3) == 0
        kinds.append((BIAS_ROWS if transposed else BIAS_KEYS) if keys_row else BIAS_TILE)
        if transposed:
            if not keys_row and (bias.stride(1) == 0 or bias.shape[1] == 1):  # one copy of each distinct [R, R]
                one = bias[tuple(slice(0, 1) if bias.stride(i) == 0 else slice(None) for i in range(3))]
                bias = one.transpose(3, 4).contiguous().expand(bias.shape).transpose(3, 4)
            bias = bias.transpose(3, 4)
        args += [bias, *bias.stride()]  # api._check keeps (R - 1) · (|st[3]| + |st[4]|) under 2^31: int32 offsets
    return args, kinds


def _regs(cfg):
    """The launch's register cap, where the tile has one (the interpreter ignores it)."""
    return {} if cfg.maxnreg is None else dict(maxnreg=cfg.maxnreg)


def _shape_flags(R, D, cfg):
    return dict(EVEN_M=R % cfg.block_m == 0, EVEN_N=R % cfg.block_n == 0, EVEN_D=_block(D) == D)


def evoformer_fwd(q, k, v, biases, gate, scale, cfg, launch=triton_launch):
    """(out like q, the row statistics [2, B, S, H, R] fp32: row_stats's lse2, then its row scale). biases: expanded
    views [B, S, H, R, R] (stride 0 where broadcast); gate None or laid out as q (out is then the gated output). launch: how a kernel is launched (shared_kernels'
    triton_launch; api passes the cached launcher)."""
    B, S, R, H, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((2, B, S, H, R), device=q.device, dtype=torch.float32)
    if q.numel():
        bias_args, (kind1, kind2) = _bias_args(biases, q)
        b1, b2 = bias_args[:6], bias_args[6:]
        launch(evo_fwd_kernel, (B * S * H, cdiv(R, cfg.block_m)),
            q, k, v, q if gate is None else gate, out, lse[0], lse[1], b1[0], b2[0], q.stride(0), q.stride(1),
            q.stride(2), q.stride(3), *b1[1:], *b2[1:],
            S, R, scale, H=H, D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_block(D), KIND1=kind1,
            KIND2=kind2, **_shape_flags(R, D, cfg), HAS_GATE=gate is not None, num_warps=cfg.warps,
            num_stages=cfg.stages, **_regs(cfg))
    return out, lse


PREP_ROWS = 64


def evoformer_bwd(d_out, q, k, v, out, lse, biases, gate, scale, want_dbias, tiles, want_dgate=True, fused=False,
                  dq_dbias=None, dkdv=None, launch=triton_launch, dbias_dtype=torch.float32):
    """(dq, dk, dv, dgate (None without a gate or without want_dgate), and with want_dbias the scores' gradient
    summed over N_seq (in fp32), [B, H, R, R] in dbias_dtype: the gradient of a pair bias [B, 1, H, R, R], else
    None). out is the forward's (gated) output, d_out its gradient. fused: dk, dv and dq from evo_bwd_fused_kernel
    (one walk over the scores, tiles.fused's tile) instead of the dk/dv and dq passes. dq_dbias: a callable (q, k,
    v, do, lse, delta, dq) -> the summed gradient (in dbias_dtype) that writes dq too (the Hopper pass,
    dq_dbias_gluon_kernel), replacing the dq and pair-bias passes (with want_dbias, not fused). dkdv: a callable
    (q, k, v, do, lse, delta, dk, dv) that writes dk and dv (dkdv_gluon_kernel), replacing the dk/dv pass (not
    fused)."""
    B, S, R, H, D = q.shape
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    want_dgate = want_dgate and gate is not None
    dgate = torch.empty_like(gate) if want_dgate else None
    merged = dq_dbias is not None and want_dbias and not fused and q.numel() > 0  # (dq_dbias returns its own)
    # the dbias pass writes every [R, R] element of each (b, h): no memset needed, except for an empty N_seq
    dbias = torch.empty((B, H, R, R), device=q.device, dtype=dbias_dtype) if want_dbias and not merged else None
    if not q.numel():
        return (dq.zero_(), dk.zero_(), dv.zero_(), dgate.zero_() if want_dgate else None,
                dbias.zero_() if want_dbias else None)
    delta = torch.empty((B, S, H, R), device=q.device, dtype=torch.float32)
    do = torch.empty_like(d_out)  # d_out times the row scale (and the gate's sigmoid): written even without a gate
    n_rows = B * S * R * H
    launch(evo_bwd_prep_kernel, (cdiv(n_rows, PREP_ROWS),),
        out, d_out, q if gate is None else gate, lse[1], do, dgate if want_dgate else q, delta, n_rows, S, R, H=H,
        D=D,
        BLOCK_ROWS=PREP_ROWS, BLOCK_D=next_pow2(D), HAS_GATE=gate is not None, WANT_DGATE=want_dgate)
    strides = (q.stride(0), q.stride(1), q.stride(2), q.stride(3))
    bias_args, (kind1, kind2) = _bias_args(biases, q)
    b1, b2 = bias_args[:6], bias_args[6:]
    if fused:
        cfg = tiles.fused or tiles.dkdv
        dq_acc = torch.empty(q.shape, device=q.device, dtype=torch.float32)  # q's strides: q is contiguous
        launch(evo_bwd_fused_kernel, (B * S * H,),
            q, k, v, do, lse, delta, dq, dq_acc, dk, dv, b1[0], b2[0], *strides, *b1[1:], *b2[1:], S, R, scale,
            H=H, D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_block(D), KIND1=kind1, KIND2=kind2,
            **_shape_flags(R, D, cfg), num_warps=cfg.warps, num_stages=cfg.stages)
    passes = []  # the portable (tile, dq pass?) launches the callables leave
    if not fused:
        if dkdv is not None:
            dkdv(q, k, v, do, lse, delta, dk, dv)
        else:
            passes.append((tiles.dkdv, False))
        if not merged:
            passes.append((tiles.dq, True))
    for cfg, dq_pass in passes:
        key_rows = cfg.key_rows and not dq_pass
        args, kinds = _bias_args(biases, q, transposed=True) if key_rows else (bias_args, (kind1, kind2))
        launch(evo_bwd_kernel, (B * S * H, cdiv(R, cfg.block_m if dq_pass else cfg.block_n)),
            q, k, v, do, lse, delta, dq, dk, dv, args[0], args[6], *strides, *args[1:6], *args[7:], S, R, scale,
            H=H, D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_block(D), KIND1=kinds[0], KIND2=kinds[1],
            **_shape_flags(R, D, cfg), DQ_PASS=dq_pass, KEY_ROWS=key_rows, num_warps=cfg.warps,
            num_stages=cfg.stages, **_regs(cfg))
    cfg = tiles.dbias
    if merged:
        dbias = dq_dbias(q, k, v, do, lse, delta, dq)
    elif want_dbias:
        db = dbias
        launch(evo_bwd_dbias_kernel, (cdiv(R, cfg.block_m), cdiv(R, cfg.block_n), B * H),
            q, k, v, do, lse, delta, db, b1[0], b2[0], *strides, *b1[1:], *b2[1:],
            db.stride(0), db.stride(1), db.stride(2), S, R, scale,
            H=H, D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_block(D),
            KIND1=BIAS_GIVEN if kind1 == BIAS_TILE and (b1[2] == 0 or S == 1) else kind1,
            KIND2=BIAS_GIVEN if kind2 == BIAS_TILE and (b2[2] == 0 or S == 1) else kind2,
            **_shape_flags(R, D, cfg), num_warps=cfg.warps, num_stages=cfg.stages, **_regs(cfg))
    return dq, dk, dv, dgate, dbias
