"""Block-sparse attention in Triton: the index branch's block scores, the sparse forward, its backward (dq, and
dk/dv without atomics), and the per-token statistics the index loss needs.

Selection is per (sequence, kv head g, query block i): `SEL[b, g, i, :NSEL[b, g, i]]` are the kept key blocks
other than i itself, ascending, each < i when causal (the launcher canonicalises them); the own block i is always
walked last, with the causal mask. Every pass walks whole key blocks in BLOCK_N sub-tiles (BLOCK_N divides the
block size), so a selected block costs the same as a dense one and nothing else is read.

The dk/dv pass owns a key sub-tile and walks, for each query head of its group, the query blocks that selected
its block (a CSR list built on the GPU from SEL: OFFSETS / QBLOCKS) and then its own block: gradients are summed
in registers over heads and query blocks, so the backward is deterministic (unless the table asks for dq by fp32
atomics inside that pass, `atomic_dq`, instead of the dq pass).

Layouts: tensors are addressed through strides; the batched [b, s, h, d] and the packed varlen [total, h, d]
forms share the kernels (varlen: stride_b = 0 and per-sequence offsets from cu_seqlens, clamped as in
ops/attention). Offsets that can pass 2^31 are taken in int64. Scores are kept in log2 units (exp2).

Queries may be the last `seqlen` of `seqlen_k` keys (batched form only: a context-parallel rank's chunk against
the keys up to it): off = seqlen_k - seqlen, a multiple of BS, is the position of query row 0. Query rows, lse,
SEL / NSEL and the query-block numbers in QBLOCKS are the queries'; key rows, key block numbers (SEL's entries,
OFFSETS' buckets, Z's columns) and causal masks are the keys' positions. Varlen passes seqlen_k = seqlen.
"""
import torch
import triton
import triton.language as tl

from ...runtime import ensure_tma_allocator, tma_compatible
from ..shared_kernels import seq_bounds, dot, online_softmax, softmax_delta_kernel, triton_launch

LOG2E = 1.4426950408889634


@triton.jit
def _rows(X, b64, start, h, stride_b, stride_s, stride_h, lo, offs, offs_d, limit, D: tl.constexpr):
    """Rows lo + offs (< limit) of head h, columns offs_d (< D): a [len(offs), len(offs_d)] tile, zeros outside."""
    base = X + b64 * stride_b + (start + lo).to(tl.int64) * stride_s + h.to(tl.int64) * stride_h
    ptrs = base + offs[:, None] * stride_s + offs_d[None, :]  # within a tile int32 offsets suffice
    ok = ((lo + offs) < limit)[:, None]
    if D != offs_d.shape[0]:  # a padded head dim
        ok = ok & (offs_d < D)[None, :]
    return tl.load(ptrs, mask=ok, other=0.0)


@triton.jit
def _head_desc(X, b64, start, h, s, stride_b, stride_s, stride_h, BLOCK: tl.constexpr, D: tl.constexpr):
    """A TMA descriptor over the rows [0, s) of one head (rows past s arrive as zeros)."""
    return tl.make_tensor_descriptor(X + b64 * stride_b + start.to(tl.int64) * stride_s + h.to(tl.int64) * stride_h,
                                     shape=[s, D], strides=[stride_s, 1], block_shape=[BLOCK, D])


@triton.jit
def _walked(src, X, b64, start, h, stride_b, stride_s, stride_h, lo, offs, offs_d, limit, D: tl.constexpr,
            USE_TMA: tl.constexpr):
    """A walked operand's tile: through the descriptor src (USE_TMA), or pointers from X (_rows)."""
    if USE_TMA:
        tile = src.load([lo, 0])
    else:
        tile = _rows(X, b64, start, h, stride_b, stride_s, stride_h, lo, offs, offs_d, limit, D)
    return tile


@triton.jit
def _tile_program(CU, seqlen, total, H: tl.constexpr, BLOCK: tl.constexpr, HEAVIEST_FIRST: tl.constexpr,
                  VARLEN: tl.constexpr):
    """A program over (b · H + head, tile of BLOCK rows), both folded into grid axis 0 (tile · (batch · H) + b · H +
    head), the only axis that takes 2^31 programs: axes 1 and 2 stop at 65535, which many packed sequences × heads,
    or a million tokens in 16-row tiles, would pass. Returns (b in int64, head, sequence start, length, first row).
    Neighbouring programs are the heads of one tile, so a group's K/V tiles are read while still in L2.
    HEAVIEST_FIRST: causal query tiles get heavier with their index, so the grid hands them out last-first."""
    n_tiles = tl.cdiv(seqlen, BLOCK)  # the grid's tiles per head: cdiv(max_seqlen, BLOCK)
    heads = tl.num_programs(0) // n_tiles  # batch · H
    tile = tl.program_id(0) // heads
    bh = tl.program_id(0) % heads
    if HEAVIEST_FIRST:
        tile = n_tiles - 1 - tile
    b = bh // H
    start, s = seq_bounds(CU, b, seqlen, total, VARLEN)
    return b.to(tl.int64), bh % H, start, s, tile * BLOCK


@triton.jit
def _kept_list(SEL, NSEL, b64, hk, i, stride_sb, stride_sh, stride_si, seqlen, H_KV: tl.constexpr,
               BS: tl.constexpr):
    """Query block i's kept blocks (other than its own): a pointer to the list, and its length."""
    sel_row = SEL + b64 * stride_sb + hk.to(tl.int64) * stride_sh + i.to(tl.int64) * stride_si
    return sel_row, tl.load(NSEL + (b64 * H_KV + hk) * tl.cdiv(seqlen, BS) + i)


# ----------------------------------------------------------------------------------------- index branch
@triton.jit
def pool_index_queries_kernel(
    IQ, P, CU, stride_b, stride_s, stride_pb, stride_pi, seqlen, total, bs, nb,
    HD: tl.constexpr, BLOCK_HD: tl.constexpr, BLOCK_T: tl.constexpr, VARLEN: tl.constexpr,
):
    """P[b, i, :] = the mean over query block i's tokens of IQ's h_kv · d_i packed columns, in fp32 (0 for a block
    past its sequence). One program a block (all of them on axis 0), its tokens summed in a fixed order:
    deterministic."""
    b = tl.program_id(0) // nb
    i = tl.program_id(0) % nb
    start, s = seq_bounds(CU, b, seqlen, total, VARLEN)
    lo = i * bs
    hi = tl.minimum(lo + bs, s)
    offs_t = tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_HD)
    base = IQ + b.to(tl.int64) * stride_b + start.to(tl.int64) * stride_s
    acc = tl.zeros([BLOCK_HD], dtype=tl.float32)
    for t in range(lo, hi, BLOCK_T):
        rows = t + offs_t
        x = tl.load(base + rows[:, None].to(tl.int64) * stride_s + offs_c[None, :],
                    mask=(rows < hi)[:, None] & (offs_c < HD)[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32), 0)
    mean = acc / tl.maximum(hi - lo, 1).to(tl.float32)
    tl.store(P + b.to(tl.int64) * stride_pb + i.to(tl.int64) * stride_pi + offs_c, mean, mask=offs_c < HD)


@triton.jit
def kept_by_kernel(SEL, OFFSETS, QBLOCKS, nqb, nkb, q_off, stride_sg, stride_si,
                   TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, CAUSAL: tl.constexpr,
                   FILL: tl.constexpr):
    """The kept lists the other way round, for key block j of list group bg (program bg · nkb + j): the query blocks
    i whose SEL[bg, i, :TOPK] holds j, ascending. FILL 0 counts them into OFFSETS[key + 1]; FILL 1 (after the
    cumulative sum) writes them to QBLOCKS[OFFSETS[key]:], each row's place the count of hits before it (a scan
    over the row tiles in order). A causal list of query block i holds key blocks < i + q_off only: the walk starts
    at the first row that can hold j."""
    pid = tl.program_id(0)
    j = pid % nkb
    key = pid.to(tl.int64)  # = bg · nkb + j
    rows_of = SEL + (pid // nkb).to(tl.int64) * stride_sg
    i_lo = tl.maximum(j - q_off + 1, 0) if CAUSAL else 0
    offs_i = tl.arange(0, BLOCK_I)
    offs_t = tl.arange(0, BLOCK_T)
    if FILL:
        dst = QBLOCKS + tl.load(OFFSETS + key)
    n = tl.full([], 0, tl.int32)
    for i0 in range(i_lo, nqb, BLOCK_I):
        rows = i0 + offs_i
        tile = tl.load(rows_of + rows[:, None].to(tl.int64) * stride_si + offs_t[None, :],
                       mask=(rows < nqb)[:, None] & (offs_t < TOPK)[None, :], other=-1)
        hit = tl.max((tile == j).to(tl.int32), 1)
        if FILL:
            tl.store(dst + n + tl.cumsum(hit, 0) - hit, rows, mask=hit > 0)
        n += tl.sum(hit, 0)
    if not FILL:
        tl.store(OFFSETS + key + 1, n)


@triton.jit
def top_finish_kernel(VALS, IDX, SEL, NSEL, rows, k, TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                      ROWS: tl.constexpr):
    """A top-k's output as the kernels' lists, ROWS rows a program: VALS / IDX [rows, k] (torch.topk's values and
    indices) -> SEL [rows, TOPK] int32, the indices of finite values ascending then -1, and NSEL [rows] their count."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK_T)
    live = r < rows
    at = r[:, None].to(tl.int64) * k + c[None, :]
    inside = live[:, None] & (c < k)[None, :]
    vals = tl.load(VALS + at, mask=inside, other=float("-inf"))
    none = 2147483647  # sorts after every block index
    idx = tl.where(vals == float("-inf"), none, tl.load(IDX + at, mask=inside, other=0).to(tl.int32))
    idx = tl.sort(idx, 1)
    tl.store(SEL + r[:, None].to(tl.int64) * TOPK + c[None, :], tl.where(idx == none, -1, idx),
             mask=live[:, None] & (c < TOPK)[None, :])
    tl.store(NSEL + r, tl.sum((idx != none).to(tl.int32), 1), mask=live)


@triton.jit
def _tf32_part(x):
    """x with its low 13 mantissa bits cleared: exactly a TF32 value, so the tensor cores take it unrounded."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def index_scores_kernel(
    PQ, IK, Z, CU,
    stride_pb, stride_ph, stride_pi, stride_kb, stride_ks,
    stride_zb, stride_zh, stride_zi,
    seqlen, seqlen_k, total, scale,
    H_KV: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr, BS: tl.constexpr, BLOCK_Q: tl.constexpr,
    KCHUNK: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, SPLIT_TF32: tl.constexpr,
):
    """Z[b, g, i, j] = max over key block j's keys u of pq[b, g, i] · ik[u] · scale, for the BLOCK_Q query blocks i
    and the KCHUNK key blocks j of this program, where a query block can select j (j < i + off_b when causal, off_b
    the query blocks' offset, else j != i + off_b; the rest stays -inf, so the scores need no candidate mask). One
    key block's tile serves all BLOCK_Q pooled queries in one MMA; the grid spreads the key blocks over programs (one
    program walking every key block left the GPU nearly idle: 22 ms at 64k).

    The dot is fp32-exact, so the selection ranks blocks as the fp32 reference does (bf16 scores ranked near-tied
    blocks apart). SPLIT_TF32 (16-bit keys: each is exactly a TF32 value): the pooled query is split into three
    TF32 parts that sum to it exactly, so three TF32 tensor-core MMAs form every product exactly, summed in fp32
    (the CUDA-core fp32 dot they replace took 2.5 ms at 64k tokens on an H200). fp32 keys take the fp32 dot."""
    b = tl.program_id(0) // H_KV  # the heads on axis 0 (see _tile_program)
    g = tl.program_id(0) % H_KV
    i0 = tl.program_id(1) * BLOCK_Q
    j0 = tl.program_id(2) * KCHUNK
    start, s = seq_bounds(CU, b, seqlen, total, VARLEN)
    off_b = (seqlen_k - seqlen) // BS
    s_k = s + off_b * BS
    nb = tl.cdiv(s, BS)
    nkb = tl.cdiv(s_k, BS)
    if CAUSAL:  # blocks before the tile's last one
        j_end = tl.minimum(tl.minimum(j0 + KCHUNK, i0 + BLOCK_Q - 1 + off_b), nkb)
    else:
        j_end = tl.minimum(j0 + KCHUNK, nkb)
    if (i0 >= nb) | (j0 >= j_end):
        return
    b64 = b.to(tl.int64)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_n = tl.arange(0, BS)
    offs_d = tl.arange(0, BLOCK_DI)
    rows = i0 + offs_q
    pq_ptrs = PQ + b64 * stride_pb + g.to(tl.int64) * stride_ph + rows[:, None].to(tl.int64) * stride_pi + \
        offs_d[None, :]
    pq = tl.load(pq_ptrs, mask=(rows < nb)[:, None] & (offs_d < DI)[None, :], other=0.0)
    if SPLIT_TF32:
        pq_hi = _tf32_part(pq)
        rest = pq - pq_hi  # exact: at most 13 significant bits
        pq_mid = _tf32_part(rest)
        pq_lo = rest - pq_mid  # exact, and a TF32 value
    z_rows = Z + b64 * stride_zb + g.to(tl.int64) * stride_zh + rows.to(tl.int64) * stride_zi
    for j in range(j0, j_end):
        ik = tl.trans(_rows(IK, b64, start, g * 0, stride_kb, stride_ks, 0, j * BS, offs_n, offs_d, s_k,
                            DI).to(tl.float32))
        if SPLIT_TF32:  # the small parts first
            sc = tl.dot(pq_lo, ik, input_precision="tf32")
            sc = tl.dot(pq_mid, ik, sc, input_precision="tf32")
            sc = tl.dot(pq_hi, ik, sc, input_precision="tf32")
        else:
            sc = dot(pq, ik)
        sc = tl.where((j * BS + offs_n < s_k)[None, :], sc, float("-inf"))
        ok = rows < nb
        if CAUSAL:
            ok = ok & (j < rows + off_b)
        else:  # a block's own score is never a candidate (it is always kept)
            ok = ok & (j != rows + off_b)
        tl.store(z_rows + j, tl.max(sc, 1) * scale, mask=ok)


@triton.jit
def index_stats_kernel(
    Q, K, LSE, IQ, IK, SEL, NSEL, CU, MASS, ARG,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_lb, stride_lh,
    stride_iqb, stride_iqs, stride_iqh, stride_ikb, stride_iks,
    stride_sb, stride_sh, stride_si,
    stride_mb, stride_mh, stride_mt,
    seqlen, seqlen_k, total, qk_scale,
    H_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr,
    BLOCK_DI: tl.constexpr, BS: tl.constexpr, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
):
    """For query rows t of a BLOCK_M tile and group g, per kept-block slot c (0..TOPK-1 the selected blocks, TOPK
    the own block): MASS[., g, t, c] = the group's mean attention probability on block c's keys (from the forward's
    lse), ARG[., g, t, c] = the flat key row (b · seqlen_k + u, or start + u when varlen) of the key u that
    maximises iq[t, g] · ik[u] over block c's visible keys; -1 / 0 in unused slots."""
    b64, g, start, s, m_lo = _tile_program(CU, seqlen, total, H_KV, BLOCK_M, False, VARLEN)
    if m_lo >= s:
        return
    off = seqlen_k - seqlen  # the queries' position (0 when VARLEN)
    s_k = s + off
    i = m_lo // BS
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_di = tl.arange(0, BLOCK_DI)
    t = m_lo + offs_m
    t_ok = t < s
    tp = t + off
    iq = _rows(IQ, b64, start, g, stride_iqb, stride_iqs, stride_iqh, m_lo, offs_m, offs_di, s, DI)
    if VARLEN:
        flat0 = start.to(tl.int64)
    else:
        flat0 = b64 * seqlen_k
    sel_row, n_sel = _kept_list(SEL, NSEL, b64, g, i, stride_sb, stride_sh, stride_si, seqlen, H_KV, BS)
    out_rows = b64 * stride_mb + g.to(tl.int64) * stride_mh + (start + t).to(tl.int64) * stride_mt
    for c in range(0, TOPK + 1):
        if c < n_sel:
            j = tl.load(sel_row + c)
        else:
            j = i + off // BS
        if (c < n_sel) | (c == TOPK):
            mass = tl.zeros([BLOCK_M], tl.float32)
            best = tl.full([BLOCK_M], float("-inf"), tl.float32)
            arg = tl.zeros([BLOCK_M], tl.int64)
            for n0 in range(j * BS, j * BS + BS, BLOCK_N):
                u = n0 + offs_n
                ok = t_ok[:, None] & (u < s_k)[None, :]
                if CAUSAL:
                    ok = ok & (u[None, :] <= tp[:, None])
                k_ik = _rows(IK, b64, start, g * 0, stride_ikb, stride_iks, 0, n0, offs_n, offs_di, s_k, DI)
                sc = tl.where(ok, dot(iq, tl.trans(k_ik)), float("-inf"))
                tile_best = tl.max(sc, 1)
                tile_arg = tl.argmax(sc, 1).to(tl.int64) + n0
                take = tile_best > best
                arg = tl.where(take, tile_arg, arg)
                best = tl.where(take, tile_best, best)
                k = _rows(K, b64, start, g, stride_kb, stride_ks, stride_kh, n0, offs_n, offs_d, s_k, D)
                for hh in range(0, GROUP):
                    h = g * GROUP + hh
                    q = _rows(Q, b64, start, h, stride_qb, stride_qs, stride_qh, m_lo, offs_m, offs_d, s, D)
                    lse = tl.load(LSE + b64 * stride_lb + h.to(tl.int64) * stride_lh + (start + t).to(tl.int64),
                                  mask=t_ok, other=float("inf"))
                    p = tl.math.exp2(dot(q, tl.trans(k)) * qk_scale - lse[:, None] * 1.4426950408889634)
                    mass += tl.sum(tl.where(ok, p, 0.0), 1)
            tl.store(MASS + out_rows + c, mass / GROUP, mask=t_ok)
            tl.store(ARG + out_rows + c, tl.where(best == float("-inf"), -1, arg + flat0), mask=t_ok)
        else:
            tl.store(MASS + out_rows + c, tl.zeros([BLOCK_M], tl.float32), mask=t_ok)
            tl.store(ARG + out_rows + c, tl.full([BLOCK_M], -1, tl.int64), mask=t_ok)


# ---------------------------------------------------------------------------------------- attention
# Each pass walks its kept blocks as one flat loop of BLOCK-row tiles (step -> block list entry step // SUB, tile
# step % SUB), so the pipeliner overlaps loads across block boundaries; the own block, masked, is a second loop.
@triton.jit
def _tile_fwd(acc, l_i, m_i, q, k_src, v_src, K, V, b64, start, hk, stride_kb, stride_ks, stride_kh, stride_vb,
              stride_vs, stride_vh, n0, t, s, offs_n, offs_d, offs_dv, qk_scale, D: tl.constexpr, DV: tl.constexpr,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr):
    """The online softmax over the keys [n0, n0 + BLOCK_N) (t: the query rows' positions, s: the keys' count)."""
    k = _walked(k_src, K, b64, start, hk, stride_kb, stride_ks, stride_kh, n0, offs_n, offs_d, s, D, USE_TMA)
    v = _walked(v_src, V, b64, start, hk, stride_vb, stride_vs, stride_vh, n0, offs_n, offs_dv, s, DV, USE_TMA)
    sc = dot(q, tl.trans(k)) * qk_scale
    if MASK:
        u = n0 + offs_n
        ok = (u < s)[None, :]
        if CAUSAL:
            ok = ok & (u[None, :] <= t[:, None])
        sc = tl.where(ok, sc, float("-inf"))
    p, alpha, l_i, m_new = online_softmax(sc, m_i, l_i)
    acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _own_end(i, t, BS: tl.constexpr, CAUSAL: tl.constexpr):
    """The end of the own block's keys a query tile (at positions t) sees; i: the own block's key block."""
    hi = i * BS + BS
    if CAUSAL:
        hi = tl.minimum(hi, tl.max(t, 0) + 1)
    return hi


@triton.jit
def sparse_fwd_kernel(
    Q, K, V, O, LSE, SEL, NSEL, CU,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    stride_sb, stride_sh, stride_si,
    seqlen, seqlen_k, total, qk_scale,
    H_Q: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr, USE_TMA: tl.constexpr, LONGER_KEYS: tl.constexpr,
):
    """Program (query tile, b · H_Q + h): out and lse (natural log) of its rows over the kept blocks."""
    SUB: tl.constexpr = BS // BLOCK_N
    b64, h, start, s, m_lo = _tile_program(CU, seqlen, total, H_Q, BLOCK_M, True, VARLEN)
    hk = h // GROUP
    if m_lo >= s:
        return
    if LONGER_KEYS:  # the queries' position among the keys
        off = seqlen_k - seqlen
    else:  # a constant: the s_q == s_k build compiles as it did before keys could be longer
        off = 0
    s_k = s + off
    i = m_lo // BS
    own = i + off // BS  # the query block as a key block
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    t = m_lo + offs_m
    tp = t + off
    q = _rows(Q, b64, start, h, stride_qb, stride_qs, stride_qh, m_lo, offs_m, offs_d, s, D)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    sel_row, n_sel = _kept_list(SEL, NSEL, b64, hk, i, stride_sb, stride_sh, stride_si, seqlen, H_Q // GROUP, BS)
    if USE_TMA:  # K and V through descriptors over the kv head's rows (made here: a helper cannot return one)
        k_src = _head_desc(K, b64, start, hk, s_k, stride_kb, stride_ks, stride_kh, BLOCK_N, D)
        v_src = _head_desc(V, b64, start, hk, s_k, stride_vb, stride_vs, stride_vh, BLOCK_N, DV)
    else:
        k_src = K
        v_src = V
    for step in range(0, n_sel * SUB):
        n0 = tl.load(sel_row + step // SUB) * BS + (step % SUB) * BLOCK_N
        # causal: a selected block lies before the query block, so it is whole and wholly visible
        acc, l_i, m_i = _tile_fwd(acc, l_i, m_i, q, k_src, v_src, K, V, b64, start, hk, stride_kb, stride_ks,
                                  stride_kh, stride_vb, stride_vs, stride_vh, n0, tp, s_k, offs_n, offs_d, offs_dv,
                                  qk_scale, D, DV, not CAUSAL, False, USE_TMA)
    for n0 in range(own * BS, _own_end(own, tp, BS, CAUSAL), BLOCK_N):
        acc, l_i, m_i = _tile_fwd(acc, l_i, m_i, q, k_src, v_src, K, V, b64, start, hk, stride_kb, stride_ks,
                                  stride_kh, stride_vb, stride_vs, stride_vh, n0, tp, s_k, offs_n, offs_d, offs_dv,
                                  qk_scale, D, DV, True, CAUSAL, USE_TMA)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    t_ok = t < s
    o_ptrs = O + b64 * stride_ob + (start + t).to(tl.int64)[:, None] * stride_os + h.to(tl.int64) * stride_oh + \
        offs_dv[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=t_ok[:, None] & (offs_dv < DV)[None, :])
    tl.store(LSE + b64 * stride_lb + h.to(tl.int64) * stride_lh + (start + t).to(tl.int64), lse, mask=t_ok)


@triton.jit
def _tile_dq(dq, q, do, lse2, delta, k_src, v_src, K, V, b64, start, hk, stride_kb, stride_ks, stride_kh,
             stride_vb, stride_vs, stride_vh, n0, t, s, offs_n, offs_d, offs_dv, qk_scale, D: tl.constexpr,
             DV: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr):
    """dq += ds · k over the keys [n0, n0 + BLOCK_N), ds = p · (do · vᵀ − delta) (t: the query rows' positions,
    s: the keys' count)."""
    k = _walked(k_src, K, b64, start, hk, stride_kb, stride_ks, stride_kh, n0, offs_n, offs_d, s, D, USE_TMA)
    v = _walked(v_src, V, b64, start, hk, stride_vb, stride_vs, stride_vh, n0, offs_n, offs_dv, s, DV, USE_TMA)
    p = tl.math.exp2(dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
    if MASK:
        u = n0 + offs_n
        ok = (u < s)[None, :]
        if CAUSAL:
            ok = ok & (u[None, :] <= t[:, None])
        p = tl.where(ok, p, 0.0)
    ds = p * (dot(do, tl.trans(v)) - delta[:, None])
    return dot(ds.to(k.dtype), k, dq)


@triton.jit
def sparse_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, SEL, NSEL, CU,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_sb, stride_sh, stride_si,
    seqlen, seqlen_k, total, qk_scale, sm_scale,
    H_Q: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr, USE_TMA: tl.constexpr, LONGER_KEYS: tl.constexpr,
):
    """Program (query tile, b · H_Q + h): dq of its rows (dq has strides of its own: q may be a view of a packed
    qkv; do and out share O's)."""
    SUB: tl.constexpr = BS // BLOCK_N
    b64, h, start, s, m_lo = _tile_program(CU, seqlen, total, H_Q, BLOCK_M, True, VARLEN)
    hk = h // GROUP
    if m_lo >= s:
        return
    if LONGER_KEYS:  # the queries' position among the keys
        off = seqlen_k - seqlen
    else:  # a constant: the s_q == s_k build compiles as it did before keys could be longer
        off = 0
    s_k = s + off
    i = m_lo // BS
    own = i + off // BS  # the query block as a key block
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    t = m_lo + offs_m
    t_ok = t < s
    tp = t + off
    q = _rows(Q, b64, start, h, stride_qb, stride_qs, stride_qh, m_lo, offs_m, offs_d, s, D)
    do = _rows(DO, b64, start, h, stride_ob, stride_os, stride_oh, m_lo, offs_m, offs_dv, s, DV)
    row_l = b64 * stride_lb + h.to(tl.int64) * stride_lh + (start + t).to(tl.int64)
    lse2 = tl.load(LSE + row_l, mask=t_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + row_l, mask=t_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    sel_row, n_sel = _kept_list(SEL, NSEL, b64, hk, i, stride_sb, stride_sh, stride_si, seqlen, H_Q // GROUP, BS)
    if USE_TMA:
        k_src = _head_desc(K, b64, start, hk, s_k, stride_kb, stride_ks, stride_kh, BLOCK_N, D)
        v_src = _head_desc(V, b64, start, hk, s_k, stride_vb, stride_vs, stride_vh, BLOCK_N, DV)
    else:
        k_src = K
        v_src = V
    for step in range(0, n_sel * SUB):
        n0 = tl.load(sel_row + step // SUB) * BS + (step % SUB) * BLOCK_N
        dq = _tile_dq(dq, q, do, lse2, delta, k_src, v_src, K, V, b64, start, hk, stride_kb, stride_ks, stride_kh,
                      stride_vb, stride_vs, stride_vh, n0, tp, s_k, offs_n, offs_d, offs_dv, qk_scale, D, DV,
                      not CAUSAL, False, USE_TMA)
    for n0 in range(own * BS, _own_end(own, tp, BS, CAUSAL), BLOCK_N):
        dq = _tile_dq(dq, q, do, lse2, delta, k_src, v_src, K, V, b64, start, hk, stride_kb, stride_ks, stride_kh,
                      stride_vb, stride_vs, stride_vh, n0, tp, s_k, offs_n, offs_d, offs_dv, qk_scale, D, DV, True,
                      CAUSAL, USE_TMA)
    dq_ptrs = DQ + b64 * stride_dqb + (start + t).to(tl.int64)[:, None] * stride_dqs + \
        h.to(tl.int64) * stride_dqh + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=t_ok[:, None] & (offs_d < D)[None, :])


@triton.jit
def _tile_dkdv(dk, dv, k, v, q_src, do_src, Q, DO, LSE, DELTA, DQ32, b64, start, h, stride_qb, stride_qs, stride_qh,
               stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_aqb, stride_aqs, stride_aqh, m0, u, s,
               offs_m, offs_d, offs_dv, qk_scale, sm_scale, D: tl.constexpr, DV: tl.constexpr, MASK: tl.constexpr,
               USE_TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """dk, dv of a key tile (rows u) from the queries [m0, m0 + BLOCK_M) of head h; with ATOMIC_DQ also this tile's
    share of those queries' dq, added into the fp32 DQ32 (no separate dq pass: 5 matmuls a tile pair instead of 7,
    at the price of float atomics). Queries past the sequence get lse +inf, so p = 0 there without a mask; MASK is
    the causal mask of the own block. u: the keys' positions less the queries' offset (query rows' own frame), s:
    the queries' count."""
    t = m0 + offs_m
    t_ok = t < s
    q = _walked(q_src, Q, b64, start, h, stride_qb, stride_qs, stride_qh, m0, offs_m, offs_d, s, D, USE_TMA)
    do = _walked(do_src, DO, b64, start, h, stride_ob, stride_os, stride_oh, m0, offs_m, offs_dv, s, DV, USE_TMA)
    row_l = b64 * stride_lb + h.to(tl.int64) * stride_lh + (start + t).to(tl.int64)
    lse2 = tl.load(LSE + row_l, mask=t_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + row_l, mask=t_ok, other=0.0)
    p = tl.math.exp2(dot(k, tl.trans(q)) * qk_scale - lse2[None, :])  # [keys, queries]
    if MASK:
        p = tl.where(u[:, None] <= t[None, :], p, 0.0)
    dv = dot(p.to(do.dtype), do, dv)
    ds = p * (dot(v, tl.trans(do)) - delta[None, :])
    if ATOMIC_DQ:
        dq_part = dot(tl.trans(ds.to(k.dtype)), k) * sm_scale
        rows = (start + t).to(tl.int64)[:, None] * stride_aqs
        tl.atomic_add(DQ32 + b64 * stride_aqb + rows + h.to(tl.int64) * stride_aqh + offs_d[None, :], dq_part,
                      mask=t_ok[:, None] & (offs_d < D)[None, :])
    return dot(ds.to(q.dtype), q, dk), dv


@triton.jit
def sparse_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_OUT, DQ32, OFFSETS, QBLOCKS, CU,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, stride_aqb, stride_aqs, stride_aqh,
    seqlen, seqlen_k, total, qk_scale, sm_scale,
    H_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr, USE_TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    """Program (key tile, b · H_KV + g): dk, dv of its rows, summed over g's query heads and over the query blocks
    that kept its block (QBLOCKS[OFFSETS[key] : OFFSETS[key + 1]], key = (b · H_KV + g) · n_key_blocks + j) and the
    query block it is (none for keys before the queries: zeros unless a query block kept them). dk / dv have strides
    of their own (k / v may be views of a packed qkv)."""
    SUB: tl.constexpr = BS // BLOCK_M
    off = seqlen_k - seqlen  # the queries' position (0 when VARLEN)
    b64, g, start, s_k, n_lo = _tile_program(CU, seqlen_k, total, H_KV, BLOCK_N, False, VARLEN)
    if n_lo >= s_k:
        return
    s = s_k - off
    j = n_lo // BS
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    u = n_lo + offs_n
    k = _rows(K, b64, start, g, stride_kb, stride_ks, stride_kh, n_lo, offs_n, offs_d, s_k, D)
    v = _rows(V, b64, start, g, stride_vb, stride_vs, stride_vh, n_lo, offs_n, offs_dv, s_k, DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    key = (b64 * H_KV + g) * tl.cdiv(seqlen_k, BS) + j
    lo = tl.load(OFFSETS + key)
    hi = tl.load(OFFSETS + key + 1)
    if CAUSAL:  # in the own block, no query before the tile's first key sees it
        own_lo = j * BS + ((n_lo - j * BS) // BLOCK_M) * BLOCK_M
    else:
        own_lo = j * BS
    # as query rows: an empty range for a key block before the queries (off is a multiple of BS)
    own_lo = tl.maximum(own_lo, off) - off
    own_hi = tl.maximum(j * BS + BS, off) - off
    u_q = u - off
    for hh in range(0, GROUP):
        h = g * GROUP + hh
        if USE_TMA:  # the walked q and do through descriptors (sm_90: pointer tiles spill at d 128)
            q_src = _head_desc(Q, b64, start, h, s, stride_qb, stride_qs, stride_qh, BLOCK_M, D)
            do_src = _head_desc(DO, b64, start, h, s, stride_ob, stride_os, stride_oh, BLOCK_M, DV)
        else:
            q_src = Q
            do_src = DO
        for step in range(lo * SUB, hi * SUB):  # the query blocks that kept this block
            m0 = tl.load(QBLOCKS + step // SUB) * BS + (step % SUB) * BLOCK_M
            dk, dv = _tile_dkdv(dk, dv, k, v, q_src, do_src, Q, DO, LSE, DELTA, DQ32, b64, start, h, stride_qb,
                                stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_aqb,
                                stride_aqs, stride_aqh, m0, u_q, s, offs_m, offs_d, offs_dv, qk_scale, sm_scale, D, DV,
                                False, USE_TMA, ATOMIC_DQ)
        for m0 in range(own_lo, own_hi, BLOCK_M):  # its own block
            dk, dv = _tile_dkdv(dk, dv, k, v, q_src, do_src, Q, DO, LSE, DELTA, DQ32, b64, start, h, stride_qb,
                                stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_aqb,
                                stride_aqs, stride_aqh, m0, u_q, s, offs_m, offs_d, offs_dv, qk_scale, sm_scale, D, DV,
                                CAUSAL, USE_TMA, ATOMIC_DQ)
    u_ok = (u < s_k)[:, None]
    rows = (start + u).to(tl.int64)[:, None]
    tl.store(DK + b64 * stride_dkb + rows * stride_dks + g.to(tl.int64) * stride_dkh + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=u_ok & (offs_d < D)[None, :])
    tl.store(DV_OUT + b64 * stride_dvb + rows * stride_dvs + g.to(tl.int64) * stride_dvh + offs_dv[None, :],
             dv.to(DV_OUT.dtype.element_ty), mask=u_ok & (offs_dv < DV)[None, :])


# ------------------------------------------------------------------------------------------ launch
def _bd(d):
    return max(16, triton.next_power_of_2(d))


def _use_tma(cfg, d, d_v, *walked):
    """Whether a pass reads its walked operands through TMA descriptors: the config asks, the head dims need no
    padding, and the tensors are aligned for descriptors (then the in-kernel descriptors' scratch is set up)."""
    tma = cfg.tma and d == _bd(d) and d_v == _bd(d_v) and tma_compatible(*walked)
    if tma:
        ensure_tma_allocator(walked[0].device)
    return tma


def _seq_args(x, cu, batch, max_s):
    """(stride_b, stride_s, stride_h) of a [b, s, h, d] or packed [total, h, d] tensor."""
    if cu is not None:
        return 0, x.stride(0), x.stride(1)
    return x.stride(0), x.stride(1), x.stride(2)


def _lse_strides(lse, cu):
    return (0, lse.stride(0)) if cu is not None else (lse.stride(0), lse.stride(1))


def _tf32_split(index_k):
    """Whether the block scores take the three-part TF32 dot: 16-bit keys (exactly TF32 values) where TF32 MMAs
    exist (sm_80 on, or the interpreter on CPU tensors)."""
    if index_k.dtype not in (torch.float16, torch.bfloat16):
        return False
    return index_k.device.type != "cuda" or torch.cuda.get_device_capability(index_k.device)[0] >= 8


def kept_by(sel, n_key_blocks=None, causal=False, launch=triton_launch):
    """(offsets int32 [b · h_kv · nkb + 1], qblocks int32 [b · h_kv · nqb · topk]) from canonical lists sel
    [b, h_kv, nqb, topk] (select.canonical's form): key block (b, g, j)'s query blocks are
    qblocks[offsets[key] : offsets[key + 1]], key = (b · h_kv + g) · nkb + j, ascending (the entries past offsets[-1]
    are unused). nkb: the number of key blocks, the number of query blocks by default (more: the queries are the
    last blocks of the keys). causal: the lists were made causal (query block i's entries lie before key block
    i + nkb - nqb), so a key block's walk skips the query blocks that cannot hold it (an entry breaking that is not
    found). Each program scans the lists of every query block that can hold its key block: ~nkb · nqb · topk / 2
    entries a pass over a causal group, read from L2 (~4 GB a pass at 1M tokens; the 1M step did not slow: 195 ->
    193 ms, H200, benchmarks/NOTES.md session 27). Four launches (the zeros, the count, its running sum, the fill)
    where sorting the entries by key took a dozen: an eager training step is host-bound at 16k tokens."""
    b, h_kv, nqb, topk = sel.shape
    nkb = nqb if n_key_blocks is None else n_key_blocks
    groups = b * h_kv
    offsets = torch.zeros(groups * nkb + 1, device=sel.device, dtype=torch.int32)
    qblocks = torch.empty(groups * nqb * topk, device=sel.device, dtype=torch.int32)
    if offsets.numel() == 1 or qblocks.numel() == 0:
        return offsets, qblocks
    sel = sel.reshape(groups, nqb, topk)
    if sel.stride(2) != 1:
        sel = sel.contiguous()
    meta = dict(TOPK=topk, BLOCK_T=triton.next_power_of_2(topk), CAUSAL=causal, num_warps=4)
    meta["BLOCK_I"] = max(16, min(128, 2048 // meta["BLOCK_T"]))
    args = (sel, offsets, qblocks, nqb, nkb, nkb - nqb, sel.stride(0), sel.stride(1))
    launch(kept_by_kernel, (groups * nkb,), *args, FILL=False, **meta)
    offsets.cumsum_(0)
    launch(kept_by_kernel, (groups * nkb,), *args, FILL=True, **meta)
    return offsets, qblocks


def top_blocks(z, topk, launch=triton_launch):
    """(sel int32 [b, h_kv, nqb, topk], n_sel int32 [b, h_kv, nqb]) from the index scores z [b, h_kv, nqb, nb], -inf
    wherever a block is not a candidate (index_block_scores' output): each query block's top-k candidates ascending,
    -1 padded, and their count. select.top_blocks' result (and n_sel) in one launch after the top-k where that
    takes five tensor ops and two more for the counts: an eager training step is host-bound at 16k tokens."""
    b, h_kv, nqb, nb = z.shape
    k = min(topk, nb)
    # the kernel sorts k-wide lists (a topk past the blocks compiles no topk-wide sort); -1s pad them to topk
    sel = torch.empty((b, h_kv, nqb, max(k, 1)), device=z.device, dtype=torch.int32)
    n_sel = torch.empty((b, h_kv, nqb), device=z.device, dtype=torch.int32)
    rows = b * h_kv * nqb
    if rows and k == 0:
        sel.fill_(-1)
        n_sel.zero_()
    elif rows:
        vals, idx = z.topk(k, dim=-1)
        block_t = triton.next_power_of_2(k)
        per = max(1, min(64, 2048 // block_t))
        launch(top_finish_kernel, (triton.cdiv(rows, per),), vals, idx, sel, n_sel, rows, k, TOPK=k, BLOCK_T=block_t,
               ROWS=per, num_warps=4)
    if sel.shape[-1] < topk:
        sel = torch.nn.functional.pad(sel, (0, topk - sel.shape[-1]), value=-1)
    return sel, n_sel


def pool_index_queries(index_q, cu, batch, max_s, block_size, launch=triton_launch):
    """[batch, h_kv, nb, d_i] fp32 (a view): each query block's mean index query, 0 for blocks past a sequence."""
    h_kv, d_i = index_q.shape[-2], index_q.shape[-1]
    nb = triton.cdiv(max_s, block_size)
    pooled = torch.empty((batch, nb, h_kv, d_i), device=index_q.device, dtype=torch.float32)  # every block written
    if pooled.numel():
        iq = index_q if index_q.stride(-1) == 1 and index_q.stride(-2) == d_i else index_q.contiguous()
        sb, ss, _ = _seq_args(iq, cu, batch, max_s)
        launch(pool_index_queries_kernel, (batch * nb,),
               iq, pooled, cu if cu is not None else pooled, sb, ss, pooled.stride(0), pooled.stride(1), max_s,
               iq.shape[0], block_size, nb, HD=h_kv * d_i, BLOCK_HD=triton.next_power_of_2(h_kv * d_i),
               BLOCK_T=max(1, min(32, 4096 // triton.next_power_of_2(h_kv * d_i))), VARLEN=cu is not None)
    return pooled.permute(0, 2, 1, 3)


def index_block_scores(pooled_q, index_k, cu, batch, max_s, block_size, causal, scale, cfg, max_s_k=None,
                       launch=triton_launch):
    """Z [batch, h_kv, nb, nkb] fp32 from the pooled index queries [batch, h_kv, nb, d_i] (-inf where a block is
    not a candidate). max_s_k: index_k's length when the queries are its last max_s tokens (batched form only)."""
    h_kv, nb, d_i = pooled_q.shape[1], pooled_q.shape[2], pooled_q.shape[3]
    max_s_k = max_s if max_s_k is None else max_s_k
    nkb = triton.cdiv(max_s_k, block_size)
    z = torch.full((batch, h_kv, nb, nkb), float("-inf"), device=pooled_q.device, dtype=torch.float32)
    if batch == 0 or nb == 0:
        return z
    sk = _seq_args(index_k, cu, batch, max_s)
    block_q = min(cfg.block_m, max(16, triton.next_power_of_2(nb)))
    kchunk = 8
    launch(index_scores_kernel, (batch * h_kv, triton.cdiv(nb, block_q), triton.cdiv(nkb, kchunk)),
           pooled_q, index_k, z, cu if cu is not None else z, pooled_q.stride(0), pooled_q.stride(1),
           pooled_q.stride(2), sk[0], sk[1], z.stride(0), z.stride(1), z.stride(2), max_s, max_s_k, index_k.shape[0],
           scale, H_KV=h_kv, DI=d_i, BLOCK_DI=_bd(d_i), BS=block_size, BLOCK_Q=block_q, KCHUNK=kchunk, CAUSAL=causal,
           VARLEN=cu is not None, SPLIT_TF32=_tf32_split(index_k), num_warps=cfg.warps, num_stages=cfg.stages)
    return z


def sparse_fwd(q, k, v, sel, n_sel, cu, batch, max_s, block_size, causal, scale, cfg, max_s_k=None):
    """(out like q with v's head dim, lse fp32: [b, h_q, s] batched, [h_q, total] varlen). max_s_k: k's length when
    the queries are its last max_s positions (batched form only)."""
    h_q, d = q.shape[-2], q.shape[-1]
    h_kv, d_v = k.shape[-2], v.shape[-1]
    out = torch.empty((*q.shape[:-1], d_v), device=q.device, dtype=q.dtype)
    lse = torch.empty((h_q, q.shape[0]) if cu is not None else (batch, h_q, max_s), device=q.device,
                      dtype=torch.float32)
    if batch == 0 or max_s == 0:
        return out, lse
    block_m, block_n = min(cfg.block_m, block_size), min(cfg.block_n, block_size)
    tma = _use_tma(cfg, d, d_v, k, v)
    sparse_fwd_kernel[(triton.cdiv(max_s, block_m) * batch * h_q,)](  # see _tile_program
        q, k, v, out, lse, sel, n_sel, cu if cu is not None else lse,
        *_seq_args(q, cu, batch, max_s), *_seq_args(k, cu, batch, max_s), *_seq_args(v, cu, batch, max_s),
        *_seq_args(out, cu, batch, max_s), *_lse_strides(lse, cu), sel.stride(0), sel.stride(1), sel.stride(2),
        max_s, max_s if max_s_k is None else max_s_k, q.shape[0], scale * LOG2E,
        H_Q=h_q, GROUP=h_q // h_kv, D=d, DV=d_v, BLOCK_D=_bd(d), BLOCK_DV=_bd(d_v), BS=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, CAUSAL=causal, VARLEN=cu is not None, USE_TMA=tma,
        LONGER_KEYS=max_s_k is not None and max_s_k != max_s, num_warps=cfg.warps, num_stages=cfg.stages)
    return out, lse


def _row_dots(out, do, cu, batch, max_s, lse):
    """delta = rowsum(out · do) in fp32, laid out like lse: the shared kernel attention's backward runs too."""
    delta = torch.empty_like(lse)
    h, d_v = out.shape[-2], out.shape[-1]
    if delta.numel():
        block_t = 64
        softmax_delta_kernel[(batch * h, triton.cdiv(max_s, block_t))](
            out, do, delta, cu if cu is not None else lse, *_seq_args(out, cu, batch, max_s),
            *_seq_args(do, cu, batch, max_s), *_lse_strides(lse, cu), max_s, out.shape[0], H_Q=h, DV=d_v,
            BLOCK_M=block_t, BLOCK_DV=_bd(d_v), VARLEN=cu is not None)
    return delta


def sparse_bwd(do, q, k, v, out, lse, sel, n_sel, offsets, qblocks, cu, batch, max_s, block_size, causal, scale,
               cfg_dq, cfg_dkdv, max_s_k=None):
    """(dq, dk, dv). offsets / qblocks: the CSR lists of the query blocks that kept each key block. max_s_k: as in
    sparse_fwd."""
    h_q, d = q.shape[-2], q.shape[-1]
    h_kv, d_v = k.shape[-2], v.shape[-1]
    max_s_k = max_s if max_s_k is None else max_s_k
    # fresh contiguous gradients (empty_like of a view of a packed qkv would be laid out unlike it)
    dq, dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    if batch == 0 or max_s == 0 or h_q == 0:  # no queries: the keys (before them, or of no head) get no gradient
        return dq, dk.zero_(), dv.zero_()
    delta = _row_dots(out, do, cu, batch, max_s, lse)
    common = dict(H_Q=h_q, GROUP=h_q // h_kv, D=d, DV=d_v, BLOCK_D=_bd(d), BLOCK_DV=_bd(d_v), BS=block_size,
                  CAUSAL=causal, VARLEN=cu is not None)
    cu_arg = cu if cu is not None else lse
    strides = (*_seq_args(q, cu, batch, max_s), *_seq_args(k, cu, batch, max_s), *_seq_args(v, cu, batch, max_s),
               *_seq_args(do, cu, batch, max_s), *_lse_strides(lse, cu))
    atomic = cfg_dkdv.atomic_dq
    dq32 = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if atomic else lse  # lse: never written
    if not atomic:
        block_m, block_n = min(cfg_dq.block_m, block_size), min(cfg_dq.block_n, block_size)
        tma = _use_tma(cfg_dq, d, d_v, k, v)
        sparse_dq_kernel[(triton.cdiv(max_s, block_m) * batch * h_q,)](  # see _tile_program
            q, k, v, do, lse, delta, dq, sel, n_sel, cu_arg, *strides, *_seq_args(dq, cu, batch, max_s),
            sel.stride(0), sel.stride(1), sel.stride(2),
            max_s, max_s_k, q.shape[0], scale * LOG2E, scale, BLOCK_M=block_m, BLOCK_N=block_n, **common, USE_TMA=tma,
            LONGER_KEYS=max_s_k != max_s, num_warps=cfg_dq.warps, num_stages=cfg_dq.stages)
    common["H_KV"] = common.pop("H_Q") // common["GROUP"]
    block_m, block_n = min(cfg_dkdv.block_m, block_size), min(cfg_dkdv.block_n, block_size)
    tma = _use_tma(cfg_dkdv, d, d_v, q, do)
    sparse_dkdv_kernel[(triton.cdiv(max_s_k, block_n) * batch * h_kv,)](  # see _tile_program: over the keys
        q, k, v, do, lse, delta, dk, dv, dq32, offsets, qblocks, cu_arg, *strides, *_seq_args(dk, cu, batch, max_s),
        *_seq_args(dv, cu, batch, max_s), *(_seq_args(dq32, cu, batch, max_s) if atomic else (0, 0, 0)),
        max_s, max_s_k, q.shape[0], scale * LOG2E, scale, BLOCK_M=block_m, BLOCK_N=block_n, **common, USE_TMA=tma,
        ATOMIC_DQ=atomic, num_warps=cfg_dkdv.warps, num_stages=cfg_dkdv.stages)
    if atomic:
        dq.copy_(dq32)
    return dq, dk, dv


def index_stats(q, k, lse, index_q, index_k, sel, n_sel, cu, batch, max_s, block_size, causal, scale, cfg,
                max_s_k=None):
    """(mass fp32, arg int64), [b, h_kv, s, topk + 1] batched or [1, h_kv, total, topk + 1] varlen: see
    index_stats_kernel. max_s_k: as in sparse_fwd (k and index_k that long)."""
    h_q, d = q.shape[-2], q.shape[-1]
    h_kv, d_i = k.shape[-2], index_q.shape[-1]
    topk = sel.shape[-1]
    rows = (1, h_kv, q.shape[0]) if cu is not None else (batch, h_kv, max_s)
    mass = torch.zeros(*rows, topk + 1, device=q.device, dtype=torch.float32)
    arg = torch.full((*rows, topk + 1), -1, device=q.device, dtype=torch.int64)
    if batch == 0 or max_s == 0:
        return mass, arg
    block_m, block_n = min(cfg.block_m, block_size), min(cfg.block_n, block_size)
    sm = 0 if cu is not None else mass.stride(0)
    index_stats_kernel[(triton.cdiv(max_s, block_m) * batch * h_kv,)](  # see _tile_program
        q, k, lse, index_q, index_k, sel, n_sel, cu if cu is not None else lse, mass, arg,
        *_seq_args(q, cu, batch, max_s), *_seq_args(k, cu, batch, max_s), *_lse_strides(lse, cu),
        *_seq_args(index_q, cu, batch, max_s), *_seq_args(index_k, cu, batch, max_s)[:2],
        sel.stride(0), sel.stride(1), sel.stride(2), sm, mass.stride(1), mass.stride(2),
        max_s, max_s if max_s_k is None else max_s_k, q.shape[0], scale * LOG2E,
        H_KV=h_kv, GROUP=h_q // h_kv, D=d, BLOCK_D=_bd(d), DI=d_i, BLOCK_DI=_bd(d_i), BS=block_size, TOPK=topk,
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, VARLEN=cu is not None, num_warps=cfg.warps,
        num_stages=cfg.stages)
    return mass, arg
