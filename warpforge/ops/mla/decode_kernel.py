"""MLA decode in Triton: paged split-KV partial attention, then a combine.

All h_q · s_q query rows of a request share one latent KV head, so a program takes BLOCK_H of those rows
as the M side of its matmuls and walks BLOCK_N cache tokens at a time. The tile it loads serves twice:
its first 512 columns are V. Token t of request b is row t % PAGE of page block_table[b, t // PAGE],
gathered per token, so any page size works.

Sparse variant: indices[b, j, :] lists the cache slots (page * PAGE + offset, -1 skipped) that query
position j reads; programs then own one position's heads, since their rows must share one token list.

The schedule is static: a request's tokens are cut into `num_splits` equal, BLOCK_N-aligned ranges, one per
program. num_splits comes from shapes alone (see `plan_num_splits`), never from cache_seqlens values, so
a decode step needs no host sync and can be captured in a CUDA graph.

The 512 latent columns are walked as four 128-wide chunks, each with its own accumulator: FP8 rows carry one
scale per chunk, which is then applied to the [rows, tokens] scores and probabilities instead of the
[tokens, 512] tile, leaving the tile a plain e4m3 -> bf16 conversion. FP4 rows (NVFP4, MXFP4; layouts in
kv_format.py) are dequantised per chunk in registers. All formats then run the same bf16/fp16 matmuls;
FP16_MATH runs a quantized cache's latent dots in fp16 (e4m3 -> fp16 is one hardware conversion per pair,
-> bf16 goes through fp32), and PREFETCH loads the next step's FP8 bytes while the current step computes
(Triton leaves a load with a register consumer unpipelined; benchmarks/NOTES.md has the measurements, and
those of a TMA-descriptor variant that lost to it). INDEX_AHEAD loads each step's page ids (or slots) one
step early: the tile copies then depend only on loop-carried values, so the pipeliner can issue them
`stages - 1` steps ahead instead of spending a stage on the index load.
"""
import torch
import triton
import triton.language as tl

from ..shared_kernels import combine_splits, dot, e2m1_to_float, e2m1_words_to_float, online_softmax

LOG2E = 1.4426950408889634


@triton.jit
def _fp8_chunk(codes, cache, rows64, tok_ok, row_stride, C: tl.constexpr, SCALE_OFF: tl.constexpr,
               OUT_DTYPE: tl.constexpr):
    """FP8 chunk C of the given rows from its raw e4m3 bytes: (values in OUT_DTYPE, the rows' scales)."""
    vals = codes.to(tl.float8e4nv, bitcast=True).to(OUT_DTYPE)  # exact: e4m3 fits bf16 and fp16
    scale_ptr = (cache + rows64 * row_stride + SCALE_OFF).to(tl.pointer_type(tl.float32))
    return vals, tl.load(scale_ptr + C, mask=tok_ok, other=0.0)


@triton.jit
def _latent_chunk(cache, rows64, tok_ok, row_stride, C: tl.constexpr, KV_FMT: tl.constexpr, GROUP: tl.constexpr,
                  SCALE_OFF: tl.constexpr, OUT_DTYPE: tl.constexpr, WORDS: tl.constexpr = False):
    """Latent columns [128 C, 128 C + 128) of the given cache rows: (values [BLOCK_N, 128] in OUT_DTYPE, the
    rows' FP8 scales [BLOCK_N] for that chunk, or 1.0). FP8's scale is per row and chunk, so it is left for
    the caller to apply to the [rows, BLOCK_N] scores and probabilities (cheap) rather than to the tile: the
    tile is then a plain e4m3 -> bf16 conversion. FP4 scales (per 16 / 32) are applied here.
    KV_FMT: 0 bf16/fp16, 1 fp8 (e4m3 + fp32 per 128), 2 nvfp4 (e2m1 + e4m3 per 16, x kv_scale), 3 mxfp4
    (e2m1 + e8m0 per 32), with GROUP values per scale from SCALE_OFF on (kv_format.py). nvfp4's values come
    back without the cache-wide scale. WORDS: FP4 rows 4-byte aligned, read as 32-bit words
    (shared_kernels.e2m1_words_to_float)."""
    base = cache + rows64[:, None] * row_stride
    BLOCK_N: tl.constexpr = rows64.shape[0]
    scale = 1.0
    if KV_FMT == 0:
        vals = tl.load(base + C * 128 + tl.arange(0, 128)[None, :], mask=tok_ok[:, None], other=0.0)
    elif KV_FMT == 1:
        codes = tl.load(base + C * 128 + tl.arange(0, 128)[None, :], mask=tok_ok[:, None], other=0)
        vals, scale = _fp8_chunk(codes, cache, rows64, tok_ok, row_stride, C, SCALE_OFF, OUT_DTYPE)
    else:
        N_SCALES: tl.constexpr = 128 // GROUP
        sbytes = tl.load(base + SCALE_OFF + C * N_SCALES + tl.arange(0, N_SCALES)[None, :], mask=tok_ok[:, None],
                         other=0)
        if KV_FMT == 2:  # e2m1 x e4m3 is exact in bf16; the fp32 tensor scale is applied to scores and output
            scales = sbytes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            scales = tl.math.exp2(sbytes.to(tl.float32) - 127.0)
        if WORDS and KV_FMT == 2 and OUT_DTYPE == tl.float16:
            # fp16 all the way (FP16_MATH): e2m1 · 2^-14 times an e4m3 scale is a multiple of 2^-24 below 0.17 with
            # at most 6 significant bits, and times 2^14 at most 2688: exact in fp16, no fp32 round trip
            words = tl.load((base + C * 64).to(tl.pointer_type(tl.uint32)) + tl.arange(0, 16)[None, :],
                            mask=tok_ok[:, None], other=0)
            codes = e2m1_words_to_float(words, tl.float16)
            vals = tl.reshape(tl.reshape(codes, [BLOCK_N, N_SCALES, GROUP]) * scales.to(tl.float16)[:, :, None]
                              * 16384.0, [BLOCK_N, 128])
        else:
            if WORDS:  # rows 4-byte aligned: the chunk's 64 bytes as 16 words of eight values (values · 2^-14)
                words = tl.load((base + C * 64).to(tl.pointer_type(tl.uint32)) + tl.arange(0, 16)[None, :],
                                mask=tok_ok[:, None], other=0)
                codes = e2m1_words_to_float(words)
                if KV_FMT == 2:
                    scales = scales * 16384.0   # e4m3 block scales (<= 448): the 2^14 folded in
                else:   # MXFP4's scales reach 2^127: the values take the 2^14 (2^(byte - 113) overflows from 241)
                    codes = codes * 16384.0
            else:
                packed = tl.load(base + C * 64 + tl.arange(0, 64)[None, :], mask=tok_ok[:, None], other=0)
                codes = e2m1_to_float(tl.reshape(tl.join(packed & 15, packed >> 4), [BLOCK_N, 128]))  # low: even
            vals = tl.reshape(tl.reshape(codes, [BLOCK_N, N_SCALES, GROUP]) * scales[:, :, None],
                              [BLOCK_N, 128]).to(OUT_DTYPE)
    return vals, scale


@triton.jit
def _fp8_raw(cache, rows64, tok_ok, row_stride):
    """The four [BLOCK_N, 128] e4m3 chunks of the given rows as raw bytes (to be converted a step later)."""
    base = cache + rows64[:, None] * row_stride + tl.arange(0, 128)[None, :]
    m = tok_ok[:, None]
    return (tl.load(base, mask=m, other=0), tl.load(base + 128, mask=m, other=0),
            tl.load(base + 256, mask=m, other=0), tl.load(base + 384, mask=m, other=0))


@triton.jit
def _rope_block(cache, rows64, tok_ok, row_stride, KV_FMT: tl.constexpr, ROPE_OFF: tl.constexpr, D_R: tl.constexpr,
                OUT_DTYPE: tl.constexpr):
    """The [BLOCK_N, 64] rope part of the given cache rows (bf16 after the quantized latent, or q's dtype)."""
    ptr = cache + rows64[:, None] * row_stride + ROPE_OFF
    if KV_FMT != 0:
        ptr = ptr.to(tl.pointer_type(tl.bfloat16))
    return tl.load(ptr + tl.arange(0, D_R)[None, :], mask=tok_ok[:, None], other=0.0).to(OUT_DTYPE)


@triton.jit
def _step_index(bt_row, idx_row, n0, offs_n, end, last_page, PAGE: tl.constexpr, SPARSE: tl.constexpr):
    """Where the step at token n0 reads: each token's page id (dense, clamped to [0, last_page]) or cache slot
    (sparse, -1 skipped; the caller skips slots past the cache). The host checks both except under a CUDA-graph
    capture or torch.compile, where an unchecked value must still not read outside the cache."""
    tok = n0 + offs_n
    if SPARSE:
        index = tl.load(idx_row + tok, mask=tok < end, other=-1)
    else:
        index = tl.load(bt_row + tok // PAGE, mask=tok < end, other=0)
        index = tl.minimum(tl.maximum(index, 0), last_page)
    return index


@triton.jit
def _chunk_scores(s, q_c, lat_c, scale_c, ROW_SCALE: tl.constexpr):
    """s += q_c · lat_cᵀ, each token's column times its chunk scale when ROW_SCALE (FP8)."""
    if ROW_SCALE:
        return s + dot(q_c, tl.trans(lat_c)) * scale_c[None, :]
    return dot(q_c, tl.trans(lat_c), s)


@triton.jit
def _chunk_update(acc_c, alpha, p, lat_c, scale_c, ref_inv_c, ROW_SCALE: tl.constexpr, REL_SCALE: tl.constexpr):
    """acc_c = alpha · acc_c + p · lat_c, p's columns times the tokens' chunk scales when ROW_SCALE (FP8). Under
    REL_SCALE (fp16 P·V) the scales enter relative to the program's reference (_scale_refs; ref_inv_c its
    reciprocal): p times a scale of ~|latent| / 448 underflows fp16 at small latents. The output then takes the
    reference in fp32."""
    if ROW_SCALE:
        if REL_SCALE:
            p = p * (scale_c * ref_inv_c)[None, :]
        else:
            p = p * scale_c[None, :]
    return dot(p.to(lat_c.dtype), lat_c, acc_c * alpha[:, None])


@triton.jit
def _scale_refs(CACHE, bt_row, idx_row, start, end, offs_n, last_page, slots, row_stride, PAGE: tl.constexpr,
                SPARSE: tl.constexpr, SCALE_OFF: tl.constexpr):
    """FP8's four reference chunk scales of a program: the largest of its first step's tokens (1 where that is 0,
    an all-zero chunk; the rows16 Gluon kernel takes the same)."""
    index = _step_index(bt_row, idx_row, start, offs_n, end, last_page, PAGE, SPARSE)
    tok = start + offs_n
    ok = tok < end
    if SPARSE:
        ok = ok & (index >= 0) & (index < slots)
        rows64 = tl.maximum(index, 0).to(tl.int64)
    else:
        rows64 = index.to(tl.int64) * PAGE + (tok % PAGE)
    ptr = (CACHE + rows64 * row_stride + SCALE_OFF).to(tl.pointer_type(tl.float32))
    ref0 = tl.max(tl.load(ptr, mask=ok, other=0.0), 0)
    ref1 = tl.max(tl.load(ptr + 1, mask=ok, other=0.0), 0)
    ref2 = tl.max(tl.load(ptr + 2, mask=ok, other=0.0), 0)
    ref3 = tl.max(tl.load(ptr + 3, mask=ok, other=0.0), 0)
    return (tl.where(ref0 > 0.0, ref0, 1.0), tl.where(ref1 > 0.0, ref1, 1.0), tl.where(ref2 > 0.0, ref2, 1.0),
            tl.where(ref3 > 0.0, ref3, 1.0))


@triton.jit
def mla_decode_split_kernel(
    Q, CACHE, BLOCK_TABLE, SEQLENS, INDICES, TOPK_LEN, KV_SCALE, O_PART, LSE_PART,
    stride_qb, stride_qs, stride_qh,
    row_stride, stride_bt, stride_ib, stride_is,
    stride_ps, stride_pb,  # partials: [split, b, rows, 512] and [split, b, rows]
    stride_ls, stride_lb,
    rows_total, topk, qk_scale, capacity, last_page, slots,
    H_Q: tl.constexpr, S_Q: tl.constexpr, PAGE: tl.constexpr, CAUSAL: tl.constexpr, KV_FMT: tl.constexpr,
    GROUP: tl.constexpr, SCALE_OFF: tl.constexpr, ROPE_OFF: tl.constexpr, SPARSE: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP16_MATH: tl.constexpr, FINAL: tl.constexpr, PREFETCH: tl.constexpr, INDEX_AHEAD: tl.constexpr,
    FP4_WORDS: tl.constexpr = False,
):
    """Dense: program (b · row tiles + row tile, split) over the query rows r = j * H_Q + h, walking the block table.
    SPARSE: program ((b * S_Q + j) · head tiles + head tile, split) walks indices[b, j, :] (slots; -1 skipped).
    The requests share grid axis 0 with the tiles: it takes 2^31 programs, axes 1 and 2 stop at 65535.
    FINAL (one split): O_PART / LSE_PART are the outputs themselves, out [b, s_q, h_q, 512] in q's dtype and
    lse [b, h_q, s_q] in natural log, and no combine runs."""
    D_V: tl.constexpr = 512
    D_R: tl.constexpr = 64
    # the row tiles of one (split, request) are neighbours in launch order, so the second reads its cache tiles from
    # L2 (the Gluon kernel measured 0.952 -> 0.875 ms at h_q 128, L 8k, from the same reorder)
    if SPARSE:
        n_tiles = tl.cdiv(H_Q, BLOCK_H)
    else:
        n_tiles = tl.cdiv(rows_total, BLOCK_H)
    tile = tl.program_id(0) % n_tiles
    req = tl.program_id(0) // n_tiles  # b (dense) or b * S_Q + j (sparse)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    if SPARSE:
        b = req // S_Q
        j0 = req % S_Q
        h = tile * BLOCK_H + tl.arange(0, BLOCK_H)
        r_ok = h < H_Q
        j = tl.zeros([BLOCK_H], tl.int32) + j0
        r = j0 * H_Q + h
        if HAS_TOPK_LEN:
            length = tl.minimum(tl.maximum(tl.load(TOPK_LEN + b), 0), topk)
        else:
            length = topk
    else:
        b = req
        r = tile * BLOCK_H + tl.arange(0, BLOCK_H)  # query row = j * H_Q + h
        r_ok = r < rows_total
        j = r // H_Q
        h = r % H_Q
        length = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), capacity)  # the table's tokens (see _step_index)
    b64 = b.to(tl.int64)
    per_split = tl.cdiv(tl.cdiv(length, n_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    offs_c = tl.arange(0, 128)
    q_rows = (Q + b64 * stride_qb + j.to(tl.int64) * stride_qs + h.to(tl.int64) * stride_qh)[:, None]
    q_mask = r_ok[:, None]
    # the latent in four 128-wide chunks (FP8's scale groups), each with its own accumulator
    q0 = tl.load(q_rows + offs_c[None, :], mask=q_mask, other=0.0)
    q1 = tl.load(q_rows + 128 + offs_c[None, :], mask=q_mask, other=0.0)
    q2 = tl.load(q_rows + 256 + offs_c[None, :], mask=q_mask, other=0.0)
    q3 = tl.load(q_rows + 384 + offs_c[None, :], mask=q_mask, other=0.0)
    q_rope = tl.load(q_rows + D_V + tl.arange(0, D_R)[None, :], mask=q_mask, other=0.0)
    if CAUSAL and not SPARSE:
        visible = length - S_Q + 1 + j  # per row, bottom-right aligned
    else:
        visible = tl.zeros([BLOCK_H], tl.int32) + length

    if KV_FMT == 2:
        latent_scale = tl.load(KV_SCALE)  # nvfp4's cache-wide scale
    else:
        latent_scale = 1.0
    ROW_SCALE: tl.constexpr = KV_FMT == 1
    dt = q0.dtype
    if FP16_MATH:  # quantized caches: latent dots in fp16 (e4m3 -> fp16 is one conversion per pair, bf16 three)
        dt = tl.float16
        q0, q1, q2, q3 = q0.to(dt), q1.to(dt), q2.to(dt), q3.to(dt)

    REL_SCALE: tl.constexpr = ROW_SCALE and dt == tl.float16
    ref0, ref1, ref2, ref3 = 1.0, 1.0, 1.0, 1.0
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    idx_row = INDICES + b64 * stride_ib + j0.to(tl.int64) * stride_is if SPARSE else INDICES
    bt_row = BLOCK_TABLE + b64 * stride_bt
    raw0, raw1, raw2, raw3 = 0, 0, 0, 0
    index_next = 0
    if REL_SCALE:
        ref0, ref1, ref2, ref3 = _scale_refs(CACHE, bt_row, idx_row, start, end, offs_n, last_page, slots, row_stride,
                                             PAGE, SPARSE, SCALE_OFF)
    inv0, inv1, inv2, inv3 = 1.0 / ref0, 1.0 / ref1, 1.0 / ref2, 1.0 / ref3
    if INDEX_AHEAD:  # the first step's page ids (slots, when sparse); each step then loads the next step's
        index_next = _step_index(bt_row, idx_row, start, offs_n, end, last_page, PAGE, SPARSE)
    if PREFETCH:  # FP8, dense (launcher): the first step's bytes before the loop, each step loads the next's
        ptok = start + offs_n
        pok = ptok < end
        ppage = tl.minimum(tl.maximum(tl.load(bt_row + ptok // PAGE, mask=pok, other=0), 0), last_page)
        raw0, raw1, raw2, raw3 = _fp8_raw(CACHE, ppage.to(tl.int64) * PAGE + (ptok % PAGE), pok, row_stride)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        tok_ok = tok < end
        if INDEX_AHEAD:
            index = index_next
            index_next = _step_index(bt_row, idx_row, n0 + BLOCK_N, offs_n, end, last_page, PAGE, SPARSE)
        else:
            index = _step_index(bt_row, idx_row, n0, offs_n, end, last_page, PAGE, SPARSE)
        if SPARSE:
            tok_ok = tok_ok & (index >= 0) & (index < slots)
            rows64 = tl.maximum(index, 0).to(tl.int64)
        else:
            rows64 = index.to(tl.int64) * PAGE + (tok % PAGE)
        if PREFETCH:
            cur0, cur1, cur2, cur3 = raw0, raw1, raw2, raw3
            ntok = tok + BLOCK_N
            nok = ntok < end
            npage = tl.minimum(tl.maximum(tl.load(bt_row + ntok // PAGE, mask=nok, other=0), 0), last_page)
            raw0, raw1, raw2, raw3 = _fp8_raw(CACHE, npage.to(tl.int64) * PAGE + (ntok % PAGE), nok, row_stride)
            lat0, sc0 = _fp8_chunk(cur0, CACHE, rows64, tok_ok, row_stride, 0, SCALE_OFF, dt)
            lat1, sc1 = _fp8_chunk(cur1, CACHE, rows64, tok_ok, row_stride, 1, SCALE_OFF, dt)
            lat2, sc2 = _fp8_chunk(cur2, CACHE, rows64, tok_ok, row_stride, 2, SCALE_OFF, dt)
            lat3, sc3 = _fp8_chunk(cur3, CACHE, rows64, tok_ok, row_stride, 3, SCALE_OFF, dt)
        else:
            lat0, sc0 = _latent_chunk(CACHE, rows64, tok_ok, row_stride, 0, KV_FMT, GROUP, SCALE_OFF,
                                          dt, FP4_WORDS)
            lat1, sc1 = _latent_chunk(CACHE, rows64, tok_ok, row_stride, 1, KV_FMT, GROUP, SCALE_OFF,
                                          dt, FP4_WORDS)
            lat2, sc2 = _latent_chunk(CACHE, rows64, tok_ok, row_stride, 2, KV_FMT, GROUP, SCALE_OFF,
                                          dt, FP4_WORDS)
            lat3, sc3 = _latent_chunk(CACHE, rows64, tok_ok, row_stride, 3, KV_FMT, GROUP, SCALE_OFF,
                                          dt, FP4_WORDS)
        rope = _rope_block(CACHE, rows64, tok_ok, row_stride, KV_FMT, ROPE_OFF, D_R, q_rope.dtype)
        s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        s = _chunk_scores(s, q0, lat0, sc0, ROW_SCALE)
        s = _chunk_scores(s, q1, lat1, sc1, ROW_SCALE)
        s = _chunk_scores(s, q2, lat2, sc2, ROW_SCALE)
        s = _chunk_scores(s, q3, lat3, sc3, ROW_SCALE)
        s = (s * latent_scale + dot(q_rope, tl.trans(rope))) * qk_scale
        ok = tok_ok[None, :] & (tok[None, :] < visible[:, None])
        p, alpha, l_i, m_new = online_softmax(tl.where(ok, s, float("-inf")), m_i, l_i)
        acc0 = _chunk_update(acc0, alpha, p, lat0, sc0, inv0, ROW_SCALE, REL_SCALE)
        acc1 = _chunk_update(acc1, alpha, p, lat1, sc1, inv1, ROW_SCALE, REL_SCALE)
        acc2 = _chunk_update(acc2, alpha, p, lat2, sc2, inv2, ROW_SCALE, REL_SCALE)
        acc3 = _chunk_update(acc3, alpha, p, lat3, sc3, inv3, ROW_SCALE, REL_SCALE)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    norm = (latent_scale / l_safe)[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))  # log2 units until the combine
    o_ptrs = O_PART + split.to(tl.int64) * stride_ps + b64 * stride_pb + r[:, None].to(tl.int64) * D_V + \
        offs_c[None, :]
    o_dtype = O_PART.dtype.element_ty
    if REL_SCALE:
        acc0, acc1, acc2, acc3 = acc0 * ref0, acc1 * ref1, acc2 * ref2, acc3 * ref3
    tl.store(o_ptrs, (acc0 * norm).to(o_dtype), mask=r_ok[:, None])
    tl.store(o_ptrs + 128, (acc1 * norm).to(o_dtype), mask=r_ok[:, None])
    tl.store(o_ptrs + 256, (acc2 * norm).to(o_dtype), mask=r_ok[:, None])
    tl.store(o_ptrs + 384, (acc3 * norm).to(o_dtype), mask=r_ok[:, None])
    if FINAL:
        tl.store(LSE_PART + b64 * stride_lb + h * S_Q + j, lse2 * 0.6931471805599453, mask=r_ok)
    else:
        tl.store(LSE_PART + split.to(tl.int64) * stride_ls + b64 * stride_lb + r, lse2, mask=r_ok)


# ------------------------------------------------------------------------------------------ launch
def plan_block_h(block_h, rows):
    """A program's query rows: the table's block_h, but no more than the rows (rounded up to a power of two, at
    least 16, the smallest MMA tile)."""
    return min(block_h, max(16, triton.next_power_of_2(rows)))


def plan_num_splits(batch, rows, max_tokens, block_h, sm_count, min_tokens_per_split=256, waves=2):
    """About `waves` (request, split, row-tile) programs per SM, decided from shapes only: fewer, longer
    programs win once every SM has work (benchmarks/NOTES.md, MLA)."""
    tiles = batch * triton.cdiv(rows, block_h)
    want = max(1, round(waves * sm_count / max(tiles, 1)))
    return max(1, min(want, triton.cdiv(max_tokens, min_tokens_per_split)))


def decode_outputs(q, num_splits):
    """(out [b, s_q, h_q, 512] in q's dtype, lse [b, h_q, s_q] fp32, o_part, lse_part): what a split kernel writes,
    shared by every MLA launcher. With one split the kernel writes out and lse itself (o_part = out as [1, b, rows,
    512], lse_part = lse: no partials, no combine pass); else fp32 partials [split, b, rows, 512] and [split, b, rows]
    (log2) for combine_splits."""
    b, s_q, h_q, _ = q.shape
    out = torch.empty((b, s_q, h_q, 512), device=q.device, dtype=q.dtype)
    lse = torch.empty((b, h_q, s_q), device=q.device, dtype=torch.float32)
    if num_splits == 1:
        return out, lse, out.unsqueeze(0), lse
    rows = s_q * h_q
    return (out, lse, torch.empty((num_splits, b, rows, 512), device=q.device, dtype=torch.float32),
            torch.empty((num_splits, b, rows), device=q.device, dtype=torch.float32))


def split_decode(q, num_splits, launch):
    """(out, lse) of a split kernel: the outputs (decode_outputs), launch(o_part, lse_part, final) unless the batch
    is empty, and combine_splits when split. Every MLA launcher's common path."""
    b, s_q, h_q, _ = q.shape
    out, lse, o_part, lse_part = decode_outputs(q, num_splits)
    if b == 0:
        return out, lse
    launch(o_part, lse_part, num_splits == 1)
    if num_splits > 1:
        combine_splits(o_part, lse_part, out, lse, h_q, s_q)
    return out, lse


def fp4_words(fmt, cache) -> bool:
    """Whether the kernels read an FP4 cache's latents as 32-bit words (_latent_chunk's WORDS): every row starts
    4-byte aligned."""
    return fmt.code >= 2 and cache.stride(1) % 4 == 0 and cache.data_ptr() % 4 == 0


def mla_decode_fwd(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, fmt, kv_scale,
                   num_splits, cfg, indices=None, topk_length=None):
    """fmt: the cache's kv_format.KVFormat; cfg: a configs.MLACfg whose block_h fits the rows (plan_block_h);
    num_splits from plan_num_splits."""
    b, s_q, h_q, _ = q.shape
    rows = s_q * h_q
    block_h, block_n, warps, stages, fp16_math, prefetch, index_ahead = cfg[:7]
    cache = kv_cache.view(torch.uint8) if fmt.quantized else kv_cache

    def launch(o_part, lse_part, final):
        scale_arg = kv_scale if kv_scale is not None else lse_part  # a pointer the other formats never read
        row_stride = kv_cache.stride(1)  # rows of one page are contiguous: row = page * PAGE + offset
        sparse = indices is not None
        # the requests (b, or b · s_q sparse) folded into grid axis 0 with the row tiles: axes 1, 2 stop at 65535
        if sparse:
            grid = (triton.cdiv(h_q, block_h) * b * s_q, num_splits)
            idx, topk = indices, indices.shape[-1]
        else:
            grid = (triton.cdiv(rows, block_h) * b, num_splits)
            idx, topk = lse_part, 0  # unused
        dummy = lse_part  # a pointer for arguments the chosen mode never reads
        mla_decode_split_kernel[grid](
            q, cache, block_table if block_table is not None else dummy,
            cache_seqlens if cache_seqlens is not None else dummy, idx,
            topk_length if topk_length is not None else dummy, scale_arg, o_part, lse_part,
            q.stride(0), q.stride(1), q.stride(2),
            row_stride, block_table.stride(0) if block_table is not None else 0,
            idx.stride(0) if sparse else 0, idx.stride(1) if sparse else 0,
            o_part.stride(0), o_part.stride(1), 0 if final else lse_part.stride(0),
            lse_part.stride(0 if final else 1),
            rows, topk, softmax_scale * LOG2E,
            block_table.shape[1] * kv_cache.shape[1] if block_table is not None and kv_cache.shape[0] else 0,
            max(kv_cache.shape[0] - 1, 0), kv_cache.shape[0] * kv_cache.shape[1],
            H_Q=h_q, S_Q=s_q, PAGE=kv_cache.shape[1], CAUSAL=causal, KV_FMT=fmt.code, GROUP=max(fmt.group, 1),
            SCALE_OFF=fmt.scale_offset, ROPE_OFF=fmt.rope_offset, SPARSE=sparse,
            HAS_TOPK_LEN=topk_length is not None,
            BLOCK_H=block_h, BLOCK_N=block_n, FP16_MATH=fp16_math and fmt.quantized, FINAL=final,
            PREFETCH=prefetch and fmt.name == "fp8" and not sparse, num_warps=warps,
            INDEX_AHEAD=index_ahead, num_stages=stages,
            FP4_WORDS=fp4_words(fmt, cache),
        )
    return split_decode(q, num_splits, launch)
