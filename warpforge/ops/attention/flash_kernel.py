"""FlashAttention forward and backward in Triton.

One program owns a tile of one (batch, head) and walks the other axis in blocks, keeping the softmax
online in fp32 (scores in log2 units so the inner loop uses exp2). Masks come from one rule: row r
may see column x iff  r + A <= x <= r + B  (forward: A = (s_k - s_q) - left, B = (s_k - s_q) + right;
the dk/dv pass flips it). `_span` cuts a walk into a masked head, an unmasked middle and a masked tail,
so most blocks of a causal or windowed problem pay for no mask at all.

Scores: s = q·kᵀ · scale, optionally tanh-capped (SOFTCAP: c · tanh(s / c), Gemma-2) and ALiBi-biased (ALIBI:
− slope_h · |i + s_k − s_q − j|); V (and so the output) may be narrower or wider than Q/K (DV, DeepSeek's
192 / 128). Without either score modifier the code is exactly the plain kernel's.

Layouts: every tensor is addressed through strides, so the batched [b, s, h, d] and the packed varlen
[total, h, d] forms share the kernels (varlen: stride_b = 0 and per-sequence offsets from cu_seqlens).
Offsets that can pass 2^31 (batch, sequence start, block start) are taken in int64.
"""
import torch
import triton
import triton.language as tl

from ...runtime import ensure_tma_allocator, tma_compatible
from ..shared_kernels import seq_bounds, dot, softmax_delta_kernel, tanh

LOG2E = 1.4426950408889634


@triton.jit
def _span(lo, hi_last, A, B, n_other, BLOCK: tl.constexpr):
    """Blocks of the other axis seen by rows [lo, hi_last]: [start, full_lo) masked, [full_lo, full_hi)
    needs no mask, [full_hi, end) masked."""
    start = tl.maximum(lo + A, 0)
    start = (start // BLOCK) * BLOCK
    # >= start: rows that see nothing (causal with s_q > s_k, a narrow window) would give a negative end, and Triton's
    # integer division truncates toward zero, so full_hi below would round up to 0 and walk [end, 0) unmasked
    end = tl.maximum(tl.minimum(hi_last + B + 1, n_other), start)
    full_lo = tl.maximum(hi_last + A, start)
    full_lo = tl.minimum(((full_lo + BLOCK - 1) // BLOCK) * BLOCK, end)
    full_hi = tl.minimum(lo + B + 1, end)
    full_hi = tl.maximum((full_hi // BLOCK) * BLOCK, full_lo)
    return start, full_lo, full_hi, end


@triton.jit
def _key_span(m_lo, s_q, s_k, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The band of keys that query rows [m_lo, m_lo + BLOCK_M) see, bottom-right aligned: (A, B) of the
    rule and the masked / unmasked split of the walk (see _span)."""
    A = (s_k - s_q) - left
    B = (s_k - s_q) + right
    hi_last = tl.minimum(m_lo + BLOCK_M, s_q) - 1
    start, full_lo, full_hi, end = _span(m_lo, hi_last, A, B, s_k, BLOCK_N)
    return A, B, start, full_lo, full_hi, end


@triton.jit
def _load_tile(src, blk, start, offs_rows, offs_d, stride, limit, D: tl.constexpr, MASK: tl.constexpr,
               EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows [start, start + BLOCK) of one head: through the TMA descriptor `src` (rows past the end arrive
    as zeros), or from `blk`, a pointer to the tile's first row, masking rows >= limit when MASK and
    columns >= D when the head dim is padded."""
    if USE_TMA:
        tile = src.load([start, 0])
    else:
        ptrs = blk + offs_rows[:, None] * stride + offs_d[None, :]
        if MASK:
            ok = ((start + offs_rows) < limit)[:, None]
            if not EVEN_D:
                ok = ok & (offs_d < D)[None, :]
            tile = tl.load(ptrs, mask=ok, other=0.0)
        elif EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)
    return tile


@triton.jit
def _query_tile(cu_q, cu_k, seqlen_q, seqlen_k, total_q, total_k, H_Q: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_M: tl.constexpr, VARLEN: tl.constexpr):
    """This program's (batch, head, kv head) in int64, (q start, s_q, k start, s_k) and first query row. Grid
    (b · H_Q · row blocks,): the (batch, head) pairs and their row blocks share axis 0 (axis 1 stops at 65535), a
    pair's blocks adjacent (they read the same keys). Causal row blocks get heavier with their index, so the grid
    hands out the heaviest first."""
    n_m = tl.cdiv(seqlen_q, BLOCK_M)
    pid_m = n_m - 1 - tl.program_id(0) % n_m
    bh = tl.program_id(0) // n_m
    b = bh // H_Q
    h = bh % H_Q
    q_start, s_q = seq_bounds(cu_q, b, seqlen_q, total_q, VARLEN)
    k_start, s_k = seq_bounds(cu_k, b, seqlen_k, total_k, VARLEN)
    return (b.to(tl.int64), h.to(tl.int64), (h // GROUP).to(tl.int64), q_start, s_q, k_start, s_k,
            pid_m * BLOCK_M)


@triton.jit
def _head_bases(X, b64, start, h64, stride_b, stride_s, stride_h):
    """A pointer to row `start` of head h64 of batch b64 (int64 offsets)."""
    return X + b64 * stride_b + start.to(tl.int64) * stride_s + h64 * stride_h


@triton.jit
def _next_kv(k_src, v_src, k_blk, v_blk, start_n, offs_n, offs_d, offs_dv, stride_kn, stride_vn, s_k,
             D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr,
             EVEN_DV: tl.constexpr, USE_TMA: tl.constexpr):
    """The K and V tiles at start_n, and the pointers moved on to the next tile."""
    k = _load_tile(k_src, k_blk, start_n, offs_n, offs_d, stride_kn, s_k, D, MASK, EVEN_D, USE_TMA)
    v = _load_tile(v_src, v_blk, start_n, offs_n, offs_dv, stride_vn, s_k, DV, MASK, EVEN_DV, USE_TMA)
    if not USE_TMA:
        k_blk += BLOCK_N * stride_kn
        v_blk += BLOCK_N * stride_vn
    return k, v, k_blk, v_blk


@triton.jit
def _tile_start(src, lo, stride, USE_TMA: tl.constexpr):
    """A pointer to row `lo`, where a pointer walk starts. With TMA the descriptor addresses rows by
    itself and this is a dummy 0 (descriptors are only ever passed into helpers, never returned)."""
    if USE_TMA:
        start = lo * 0
    else:
        start = src + lo.to(tl.int64) * stride
    return start


@triton.jit
def _lse_log2(lse):
    """The forward's lse (natural log) in log2 units for exp2; -inf marks a query that saw nothing, and +inf
    makes all its probabilities 0."""
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def _visible(rows, cols, limit, A, B):
    """[rows, cols] mask of the band rule: col < limit and row + A <= col <= row + B."""
    return (cols[None, :] < limit) & (cols[None, :] >= rows[:, None] + A) & (cols[None, :] <= rows[:, None] + B)


@triton.jit
def _modded(qk, qs, ks, diag, qk_scale, cap_in, cap_out, slope2, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
            KEYS_FIRST: tl.constexpr = False):
    """Scores in log2 units from q·kᵀ [len(qs), len(ks)] (k·qᵀ [len(ks), len(qs)] when KEYS_FIRST; query
    positions qs, key positions ks): scaled, or tanh-capped (cap_in = scale / c, cap_out = c · log2 e); minus
    slope2 · |q + diag − k| with ALIBI (slope2 = the head's slope · log2 e). Also returns tanh's value, which
    the backward's chain rule needs."""
    if SOFTCAP:
        t = tanh(qk * cap_in)
        s = cap_out * t
    else:
        t = qk
        s = qk * qk_scale
    if ALIBI:
        if KEYS_FIRST:
            s -= slope2 * tl.abs(qs[None, :] + diag - ks[:, None]).to(tl.float32)
        else:
            s -= slope2 * tl.abs(qs[:, None] + diag - ks[None, :]).to(tl.float32)
    return s, t


@triton.jit
def _head_slope(SLOPES, b64, h64, stride_sb, stride_sh, ALIBI: tl.constexpr):
    """The ALiBi slope of head h64 (batch b64) times log2 e, or 0."""
    if ALIBI:
        slope2 = tl.load(SLOPES + b64 * stride_sb + h64 * stride_sh) * 1.4426950408889634
    else:
        slope2 = 0.0
    return slope2


# ------------------------------------------------------------------------------- a query tile's walk
@triton.jit
def _walk_keys(acc, l_i, m_i, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, lo, hi, rows, offs_n,
               offs_d, offs_dv, s_k, A, B, diag, qk_scale, cap_in, cap_out, slope2, D: tl.constexpr, DV: tl.constexpr,
               BLOCK_N: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
               USE_TMA: tl.constexpr, DQ: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """A query tile's walk over the key tiles [lo, hi): the forward's online softmax into (acc, l_i, m_i), or
    (DQ) the backward's dq into acc, l_i and m_i passing through. k_src/v_src are tensor descriptors (USE_TMA)
    or base pointers; do, lse2 and delta are read by DQ only."""
    k_blk = _tile_start(k_src, lo, stride_kn, USE_TMA)
    v_blk = _tile_start(v_src, lo, stride_vn, USE_TMA)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k, v, k_blk, v_blk = _next_kv(k_src, v_src, k_blk, v_blk, start_n, offs_n, offs_d, offs_dv, stride_kn,
                                      stride_vn, s_k, D, DV, BLOCK_N, MASK, EVEN_D, EVEN_DV, USE_TMA)
        qk = dot(q, tl.trans(k))
        if DQ:
            acc = _dq_step(acc, qk, k, v, do, lse2, delta, rows, cols, s_k, A, B, diag, qk_scale, cap_in, cap_out,
                           slope2, MASK, SOFTCAP, ALIBI)
        else:
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, rows, cols, s_k, A, B, diag, qk_scale, cap_in,
                                          cap_out, slope2, MASK, SOFTCAP, ALIBI)
    return acc, l_i, m_i


@triton.jit
def _attend_keys(acc, l_i, m_i, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, m_lo, s_q, s_k, left, right,
                 rows, offs_n, offs_d, offs_dv, qk_scale, cap_in, cap_out, slope2, D: tl.constexpr,
                 DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, USE_TMA: tl.constexpr, DQ: tl.constexpr, SOFTCAP: tl.constexpr,
                 ALIBI: tl.constexpr):
    """A query tile against its band of keys (forward, or DQ): the masked head, the unmasked middle and the
    masked tail of the walk, K and V read through TMA descriptors made here (they are passed into helpers,
    never returned) or through pointers from k_base / v_base."""
    EVEN_D: tl.constexpr = D == BLOCK_D
    EVEN_DV: tl.constexpr = DV == BLOCK_DV
    A, B, start, full_lo, full_hi, end = _key_span(m_lo, s_q, s_k, left, right, BLOCK_M, BLOCK_N)
    if USE_TMA:
        k_src = tl.make_tensor_descriptor(k_base, shape=[s_k, D], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_base, shape=[s_k, DV], strides=[stride_vs, 1],
                                          block_shape=[BLOCK_N, BLOCK_DV])
    else:
        k_src = k_base
        v_src = v_base
    diag = s_k - s_q
    acc, l_i, m_i = _walk_keys(acc, l_i, m_i, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, start, full_lo,
                               rows, offs_n, offs_d, offs_dv, s_k, A, B, diag, qk_scale, cap_in, cap_out, slope2, D,
                               DV, BLOCK_N, True, EVEN_D, EVEN_DV, USE_TMA, DQ, SOFTCAP, ALIBI)
    acc, l_i, m_i = _walk_keys(acc, l_i, m_i, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, full_lo,
                               full_hi, rows, offs_n, offs_d, offs_dv, s_k, A, B, diag, qk_scale, cap_in, cap_out,
                               slope2, D, DV, BLOCK_N, False, EVEN_D, EVEN_DV, USE_TMA, DQ, SOFTCAP, ALIBI)
    acc, l_i, m_i = _walk_keys(acc, l_i, m_i, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, full_hi, end,
                               rows, offs_n, offs_d, offs_dv, s_k, A, B, diag, qk_scale, cap_in, cap_out, slope2, D,
                               DV, BLOCK_N, True, EVEN_D, EVEN_DV, USE_TMA, DQ, SOFTCAP, ALIBI)
    return acc, l_i, m_i


@triton.jit
def _softmax_step(acc, l_i, m_i, qk, v, rows, cols, s_k, A, B, diag, qk_scale, cap_in, cap_out, slope2,
                  MASK: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """The forward's online-softmax update with one key tile's scores."""
    MODDED: tl.constexpr = SOFTCAP or ALIBI
    if MODDED:
        qk, _ = _modded(qk, rows, cols, diag, qk_scale, cap_in, cap_out, slope2, SOFTCAP, ALIBI)
    if MASK:
        if not MODDED:
            qk = qk * qk_scale
        qk = tl.where(_visible(rows, cols, s_k, A, B), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
        p = tl.math.exp2(qk - m_use[:, None])
    elif MODDED:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = m_new
        p = tl.math.exp2(qk - m_use[:, None])
    else:
        # scale and shift in one FMA per score: on Hopper the non-matmul work is what limits
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_use = m_new
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _dq_step(dq, qk, k, v, do, lse2, delta, rows, cols, s_k, A, B, diag, qk_scale, cap_in, cap_out, slope2,
             MASK: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """dq += ds · k for one key tile, ds = p · (do · vᵀ − delta) (times tanh's derivative with SOFTCAP)."""
    s, t = _modded(qk, rows, cols, diag, qk_scale, cap_in, cap_out, slope2, SOFTCAP, ALIBI)
    p = tl.math.exp2(s - lse2[:, None])
    if MASK:
        visible = _visible(rows, cols, s_k, A, B)
        p = tl.where(visible, p, 0.0)
    dp = dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return dq + dot(ds.to(k.dtype), k)


# ---------------------------------------------------------------------------------------- backward
@triton.jit
def _dkdv_inner(dk, dv, k, v, q_src, do_src, dq_base, lse_base, delta_base, stride_qs, stride_dos,
                stride_dqs, lo, hi, key_rows, offs_m, offs_d, offs_dv, s_q, A, B, diag, qk_scale, sm_scale, cap_in,
                cap_out, slope2, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
                EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr,
                SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    # Transposed view: this program owns keys (rows), and walks queries (columns).
    # q_src/do_src are tensor descriptors (USE_TMA) or base pointers.
    q_blk = _tile_start(q_src, lo, stride_qs, USE_TMA)
    do_blk = _tile_start(do_src, lo, stride_dos, USE_TMA)
    if ATOMIC_DQ:
        dq_blk = dq_base + lo.to(tl.int64) * stride_dqs
    for start_m in range(lo, hi, BLOCK_M):
        cols = start_m + offs_m
        q = _load_tile(q_src, q_blk, start_m, offs_m, offs_d, stride_qs, s_q, D, MASK, EVEN_D, USE_TMA)
        do = _load_tile(do_src, do_blk, start_m, offs_m, offs_dv, stride_dos, s_q, DV, MASK, EVEN_DV, USE_TMA)
        if not USE_TMA:
            q_blk += BLOCK_M * stride_qs
            do_blk += BLOCK_M * stride_dos
        if MASK:
            lse = tl.load(lse_base + cols, mask=cols < s_q, other=float("inf"))
            delta = tl.load(delta_base + cols, mask=cols < s_q, other=0.0)
        else:
            lse = tl.load(lse_base + cols)
            delta = tl.load(delta_base + cols)
        lse2 = _lse_log2(lse)
        qkT = dot(k, tl.trans(q))
        sT, tT = _modded(qkT, cols, key_rows, diag, qk_scale, cap_in, cap_out, slope2, SOFTCAP, ALIBI, True)
        pT = tl.math.exp2(sT - lse2[None, :])
        if MASK:
            visible = _visible(key_rows, cols, s_q, A, B)
            pT = tl.where(visible, pT, 0.0)
        dv += dot(pT.to(do.dtype), do)
        dpT = dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)
        dsT = dsT.to(q.dtype)
        dk += dot(dsT, q)
        if ATOMIC_DQ:
            # dq = scale * ds @ k, summed over key blocks by fp32 atomics: five matmuls instead of seven
            dq_part = dot(tl.trans(dsT), k) * sm_scale
            dq_ptrs = dq_blk + offs_m[:, None] * stride_dqs + offs_d[None, :]
            if MASK:
                ld_mask = (cols < s_q)[:, None] & (offs_d < D)[None, :]
                tl.atomic_add(dq_ptrs, dq_part, mask=ld_mask, sem="relaxed")
            elif EVEN_D:
                tl.atomic_add(dq_ptrs, dq_part, sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq_part, mask=(offs_d < D)[None, :], sem="relaxed")
            dq_blk += BLOCK_M * stride_dqs
    return dk, dv


@triton.jit
def flash_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_OUT, DQ_ACC, cu_q, cu_k, SLOPES,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh, stride_sb, stride_sh,
    seqlen_q, seqlen_k, total_q, total_k, left, right, qk_scale, sm_scale, cap_in, cap_out,
    H_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    VARLEN: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
):
    """One program per (key block, kv head): dk/dv sum over the whole GQA group in-program (no atomics). Grid
    (b · H_KV · key blocks,): the heads and their key blocks share axis 0 (axis 1 stops at 65535), a head's blocks
    adjacent."""
    n_n = tl.cdiv(seqlen_k, BLOCK_N)
    pid_n = tl.program_id(0) % n_n
    pid_bh = tl.program_id(0) // n_n
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    q_start, s_q = seq_bounds(cu_q, b, seqlen_q, total_q, VARLEN)
    k_start, s_k = seq_bounds(cu_k, b, seqlen_k, total_k, VARLEN)
    n_lo = pid_n * BLOCK_N
    if n_lo >= s_k:
        return
    EVEN_D: tl.constexpr = D == BLOCK_D
    EVEN_DV: tl.constexpr = DV == BLOCK_DV
    b64 = b.to(tl.int64)
    kvh64 = kvh.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_rows = n_lo + offs_n
    k_mask = (key_rows < s_k)[:, None] & (offs_d < D)[None, :]
    v_mask = (key_rows < s_k)[:, None] & (offs_dv < DV)[None, :]
    row0 = (k_start + n_lo).to(tl.int64)
    k = tl.load(K + b64 * stride_kb + row0 * stride_ks + kvh64 * stride_kh
                + offs_n[:, None] * stride_ks + offs_d[None, :], mask=k_mask, other=0.0)
    v = tl.load(V + b64 * stride_vb + row0 * stride_vs + kvh64 * stride_vh
                + offs_n[:, None] * stride_vs + offs_dv[None, :], mask=v_mask, other=0.0)

    # Query i sees key j iff j - diag - right <= i <= j - diag + left.
    diag = s_k - s_q
    A = -diag - right
    B = -diag + left
    hi_last = tl.minimum(n_lo + BLOCK_N, s_k) - 1
    start, full_lo, full_hi, end = _span(n_lo, hi_last, A, B, s_q, BLOCK_M)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    q_seq = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs
    do_seq = DO + b64 * stride_dob + q_start.to(tl.int64) * stride_dos
    dq_seq = DQ_ACC + b64 * stride_dqb + q_start.to(tl.int64) * stride_dqs
    for g in range(GROUP):
        h = (kvh * GROUP + g).to(tl.int64)
        q_src = q_seq + h * stride_qh
        do_src = do_seq + h * stride_doh
        dq_base = dq_seq + h * stride_dqh
        if USE_TMA:
            q_src = tl.make_tensor_descriptor(q_src, shape=[s_q, D], strides=[stride_qs, 1],
                                              block_shape=[BLOCK_M, BLOCK_D])
            do_src = tl.make_tensor_descriptor(do_src, shape=[s_q, DV], strides=[stride_dos, 1],
                                               block_shape=[BLOCK_M, BLOCK_DV])
        lse_base = LSE + b64 * stride_lb + h * stride_lh + q_start
        delta_base = DELTA + b64 * stride_lb + h * stride_lh + q_start
        slope2 = _head_slope(SLOPES, b64, h, stride_sb, stride_sh, ALIBI)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, dq_base, lse_base, delta_base, stride_qs, stride_dos,
                             stride_dqs, start, full_lo, key_rows, offs_m, offs_d, offs_dv, s_q, A, B, diag, qk_scale,
                             sm_scale, cap_in, cap_out, slope2, D, DV, BLOCK_M, True, EVEN_D, EVEN_DV, ATOMIC_DQ,
                             USE_TMA, SOFTCAP, ALIBI)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, dq_base, lse_base, delta_base, stride_qs, stride_dos,
                             stride_dqs, full_lo, full_hi, key_rows, offs_m, offs_d, offs_dv, s_q, A, B, diag,
                             qk_scale, sm_scale, cap_in, cap_out, slope2, D, DV, BLOCK_M, False, EVEN_D, EVEN_DV,
                             ATOMIC_DQ, USE_TMA, SOFTCAP, ALIBI)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, dq_base, lse_base, delta_base, stride_qs, stride_dos,
                             stride_dqs, full_hi, end, key_rows, offs_m, offs_d, offs_dv, s_q, A, B, diag, qk_scale,
                             sm_scale, cap_in, cap_out, slope2, D, DV, BLOCK_M, True, EVEN_D, EVEN_DV, ATOMIC_DQ,
                             USE_TMA, SOFTCAP, ALIBI)

    dk = dk * sm_scale
    tl.store(DK + b64 * stride_dkb + row0 * stride_dks + kvh64 * stride_dkh
             + offs_n[:, None] * stride_dks + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=k_mask)
    tl.store(DV_OUT + b64 * stride_dvb + row0 * stride_dvs + kvh64 * stride_dvh
             + offs_n[:, None] * stride_dvs + offs_dv[None, :], dv.to(DV_OUT.dtype.element_ty), mask=v_mask)


# --------------------------------------------------------------------- forward, and the backward's dq
@triton.jit
def flash_query_kernel(
    Q, K, V, OUT, LSE, DO, DELTA, cu_q, cu_k, SLOPES,
    stride_qb, stride_qs, stride_qh,  # the query side this program owns: q, out (o or dq), do
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_kb, stride_ks, stride_kh,  # the key side it walks
    stride_vb, stride_vs, stride_vh,
    stride_lb, stride_lh, stride_sb, stride_sh,
    seqlen_q, seqlen_k, total_q, total_k, left, right, qk_scale, sm_scale, cap_in, cap_out,
    H_Q: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    VARLEN: tl.constexpr, USE_TMA: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DQ: tl.constexpr,
):
    """A program owns BLOCK_M query rows of one head and walks their keys: the forward (OUT = o, LSE written),
    or with DQ the backward's dq (OUT = dq; reads do, the forward's lse and delta)."""
    b64, h64, kvh, q_start, s_q, k_start, s_k, m_lo = _query_tile(cu_q, cu_k, seqlen_q, seqlen_k, total_q, total_k,
                                                                   H_Q, GROUP, BLOCK_M, VARLEN)
    if m_lo >= s_q:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = m_lo + offs_m
    q = tl.load(_head_bases(Q, b64, q_start + m_lo, h64, stride_qb, stride_qs, stride_qh)
                + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=(rows < s_q)[:, None] & (offs_d < D)[None, :], other=0.0)
    k_base = _head_bases(K, b64, k_start, kvh, stride_kb, stride_ks, stride_kh)
    v_base = _head_bases(V, b64, k_start, kvh, stride_vb, stride_vs, stride_vh)
    slope2 = _head_slope(SLOPES, b64, h64, stride_sb, stride_sh, ALIBI)
    stat = b64 * stride_lb + h64 * stride_lh + q_start + rows  # lse / delta of these rows
    if DQ:
        do = tl.load(_head_bases(DO, b64, q_start + m_lo, h64, stride_dob, stride_dos, stride_doh)
                     + offs_m[:, None] * stride_dos + offs_dv[None, :],
                     mask=(rows < s_q)[:, None] & (offs_dv < DV)[None, :], other=0.0)
        lse2 = _lse_log2(tl.load(LSE + stat, mask=rows < s_q, other=float("inf")))
        delta = tl.load(DELTA + stat, mask=rows < s_q, other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # lse2 stands in for the forward's l_i and m_i
        acc, _, _ = _attend_keys(acc, lse2, lse2, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, m_lo,
                                 s_q, s_k, left, right, rows, tl.arange(0, BLOCK_N), offs_d, offs_dv, qk_scale,
                                 cap_in, cap_out, slope2, D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, True,
                                 SOFTCAP, ALIBI)
        out = acc * sm_scale
        offs_out = offs_d
        OUT_W: tl.constexpr = D
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        # q and l_i stand in for dq's do, lse2 and delta
        acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, q, l_i, l_i, k_base, v_base, stride_ks, stride_vs, m_lo, s_q,
                                     s_k, left, right, rows, tl.arange(0, BLOCK_N), offs_d, offs_dv, qk_scale,
                                     cap_in, cap_out, slope2, D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA,
                                     False, SOFTCAP, ALIBI)
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
        tl.store(LSE + stat, lse, mask=rows < s_q)
        offs_out = offs_dv
        OUT_W: tl.constexpr = DV
    tl.store(_head_bases(OUT, b64, q_start + m_lo, h64, stride_ob, stride_os, stride_oh)
             + offs_m[:, None] * stride_os + offs_out[None, :], out.to(OUT.dtype.element_ty),
             mask=(rows < s_q)[:, None] & (offs_out < OUT_W)[None, :])


# ------------------------------------------------------------------------------------------ launch
def _layout(t, varlen):
    """(stride_b, stride_s, stride_h) of a [b, s, h, d] or packed [total, h, d] tensor."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _block(d):
    """The padded width a head dim is tiled with: a power of two, at least 16 (the smallest MMA K)."""
    return max(16, triton.next_power_of_2(d))


class ScoreMod:
    """The scores' optional modifiers as the kernels take them: softcap c (0 = none) and per-head ALiBi slopes
    (an fp32 tensor [h_q] or [b, h_q], or None)."""

    def __init__(self, sm_scale, softcap=0.0, slopes=None):
        self.softcap, self.alibi = softcap > 0, slopes is not None
        self.cap_in = sm_scale / softcap if self.softcap else 0.0
        self.cap_out = softcap * LOG2E if self.softcap else 0.0
        self.slopes = slopes
        self.strides = (0, 0) if slopes is None else ((0, slopes.stride(0)) if slopes.dim() == 1 else
                                                       (slopes.stride(0), slopes.stride(1)))

    def pointer(self, fallback):
        return self.slopes if self.alibi else fallback


def flash_fwd(q, k, v, cu_q, cu_k, batch, max_q, max_k, sm_scale, left, right, cfg, mod=None):
    """Returns (out [.., h_q, d_v] in q's dtype, lse fp32: [b, h_q, s_q] or [h_q, total_q] when varlen)."""
    mod = mod or ScoreMod(sm_scale)
    h_q = q.shape[-2]
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    if cu_q is not None:
        lse = torch.empty((h_q, q.shape[0]), device=q.device, dtype=torch.float32)
    else:
        lse = torch.empty((batch, h_q, max_q), device=q.device, dtype=torch.float32)
    if out.numel() == 0 or max_q == 0:
        lse.fill_(float("-inf"))
        out.zero_()
        return out, lse
    use_tma = cfg.tma and tma_compatible(k, v)
    if use_tma:
        ensure_tma_allocator(q.device)
    # q and lse stand in for the dq pass's do and delta
    _query_pass(q, k, v, out, lse, q, lse, cu_q, cu_k, batch, max_q, max_k, sm_scale, left, right, cfg, use_tma, mod,
                dq_pass=False)
    return out, lse


def _query_pass(q, k, v, out, lse, do, delta, cu_q, cu_k, batch, max_q, max_k, sm_scale, left, right, cfg, use_tma,
                mod, dq_pass):
    """One launch of flash_query_kernel: the forward (out = o, lse written) or the dq pass (out = dq)."""
    varlen = cu_q is not None
    h_q, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    stride_lb, stride_lh = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    flash_query_kernel[(triton.cdiv(max_q, cfg.block_m) * batch * h_q,)](
        q, k, v, out, lse, do, delta, cu_q if varlen else q, cu_k if varlen else q, mod.pointer(lse),
        *_layout(q, varlen), *_layout(out, varlen), *_layout(do, varlen), *_layout(k, varlen), *_layout(v, varlen),
        stride_lb, stride_lh, *mod.strides,
        max_q, max_k, q.shape[0], k.shape[0], left, right, sm_scale * LOG2E, sm_scale, mod.cap_in, mod.cap_out,
        H_Q=h_q, GROUP=h_q // k.shape[-2], D=d, DV=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_block(d),
        BLOCK_DV=_block(dv), VARLEN=varlen, USE_TMA=use_tma, SOFTCAP=mod.softcap, ALIBI=mod.alibi, DQ=dq_pass,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )


def flash_bwd(do, q, k, v, out, lse, cu_q, cu_k, batch, max_q, max_k, sm_scale, left, right, cfg_dkdv,
              cfg_dq, mod=None):
    mod = mod or ScoreMod(sm_scale)
    varlen = cu_q is not None
    h_q, d, dv_dim = q.shape[-2], q.shape[-1], v.shape[-1]
    h_kv = k.shape[-2]
    group = h_q // h_kv
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0 or max_q == 0 or max_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    stride_lb, stride_lh = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    delta = torch.empty_like(lse)
    cu_q_arg = cu_q if varlen else q
    cu_k_arg = cu_k if varlen else q
    bd, bdv = _block(d), _block(dv_dim)
    pre_bm = 64
    softmax_delta_kernel[(batch * h_q, triton.cdiv(max_q, pre_bm))](
        out, do, delta, cu_q_arg, *_layout(out, varlen), *_layout(do, varlen), stride_lb, stride_lh, max_q,
        q.shape[0], H_Q=h_q, DV=dv_dim, BLOCK_M=pre_bm, BLOCK_DV=bdv, VARLEN=varlen,
    )
    atomic_dq = cfg_dkdv.atomic_dq
    dkdv_tma = cfg_dkdv.tma and tma_compatible(q, do)
    dq_tma = cfg_dq.tma and tma_compatible(k, v)
    if dkdv_tma or dq_tma:
        ensure_tma_allocator(q.device)
    # fp32 accumulator for the atomic dq path (a dummy otherwise); contiguous like q
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if atomic_dq else dq
    slopes = mod.pointer(delta)
    flash_bwd_dkdv_kernel[(triton.cdiv(max_k, cfg_dkdv.block_n) * batch * h_kv,)](
        q, k, v, do, lse, delta, dk, dv, dq_acc, cu_q_arg, cu_k_arg, slopes,
        *_layout(q, varlen), *_layout(k, varlen), *_layout(v, varlen), *_layout(do, varlen),
        *_layout(dk, varlen), *_layout(dv, varlen), *_layout(dq_acc, varlen), stride_lb, stride_lh, *mod.strides,
        max_q, max_k, q.shape[0], k.shape[0], left, right, sm_scale * LOG2E, sm_scale, mod.cap_in, mod.cap_out,
        H_KV=h_kv, GROUP=group, D=d, DV=dv_dim, BLOCK_M=cfg_dkdv.block_m, BLOCK_N=cfg_dkdv.block_n, BLOCK_D=bd,
        BLOCK_DV=bdv, VARLEN=varlen, ATOMIC_DQ=atomic_dq, USE_TMA=dkdv_tma, SOFTCAP=mod.softcap, ALIBI=mod.alibi,
        num_warps=cfg_dkdv.warps, num_stages=cfg_dkdv.stages,
    )
    if atomic_dq:
        dq.copy_(dq_acc)
        return dq, dk, dv
    _query_pass(q, k, v, dq, lse, do, delta, cu_q, cu_k, batch, max_q, max_k, sm_scale, left, right, cfg_dq, dq_tma,
                mod, dq_pass=True)
    return dq, dk, dv
