"""Paged GQA decode in Triton: split-KV partial attention over the block table, then shared_kernels' combine.

A program owns one kv head of one request and BLOCK_H of the query rows that read it (GQA group · s_q rows,
r = j · GROUP + g, padded to an MMA tile), so every K/V byte is read once per split, and walks BLOCK_N cache
tokens at a time: token t is row t % PAGE of page block_table[b, t // PAGE], gathered per token, so any page size
works. The cache rows are dequantised in registers (FP8: e4m3 -> q's dtype; FP4: e2m1 times the block scales);
a per-token scale (FP8's per-tensor or per-page-head scale, NVFP4's tensor scale) is applied to the [rows,
tokens] scores and probabilities, not the [tokens, d] tile.

The schedule is static: each request's visible tokens are cut into `num_splits` equal BLOCK_N-aligned ranges,
num_splits planned from shapes only, so a step needs no host sync and can be captured in a CUDA graph.
INDEX_AHEAD loads each step's page ids one step early: the K/V copies then depend only on loop-carried values and
the pipeliner can issue them stages - 1 steps ahead instead of spending a stage on the page-id load. PREFETCH loads
the next step's raw bytes into registers while this step computes: Triton's pipeliner leaves a load whose consumer
is arithmetic (the dequantisation), not a dot, unpipelined, so quantised tiles would otherwise wait on memory every
step (MLA decode's register prefetch, benchmarks/NOTES.md).

FP8_MMA (fp8 caches, PagedCfg.fp8_mma): the e4m3 codes go straight into fp8 dots, no dequantisation in the loop:
q is rounded once per program to e4m3 with an fp32 scale per row, the probabilities (times V's per-token scales)
per row and step; FP8_MMA 2 adds each one's rounding error as a second e4m3 operand (two dots each), which keeps
the FP8 accuracy bar (benchmarks/NOTES.md, session 11). Triton 3.6 runs fp8 dots on sm_90 only as wgmma (M >= 64;
a 16-row mma.sync dot is upcast to fp16), so FP8_TOKENS_M computes Sᵀ = K·qᵀ and Oᵀ = Vᵀ·Pᵀ with the tokens as
M. K then reaches its wgmma from shared memory by cp.async; V (tokens, its reduction dim, not contiguous) is
transposed through registers, which the compiler does with byte stores, so PREFETCH loads V alone a step ahead.
"""
import torch
import triton
import triton.language as tl

from ..shared_kernels import (combine_splits, dot, e2m1_to_float, e2m1_words_to_halves, e4m3_pair,
                             online_softmax, tanh)

LOG2E = 1.4426950408889634


@triton.jit
def _raw_tile(CACHE, BS, page, slot, kvh64, tok_ok, stride_p, stride_t, stride_h, bs_p, bs_t, bs_h, D: tl.constexpr,
              BLOCK_D: tl.constexpr, KV_FMT: tl.constexpr, GROUP: tl.constexpr, WORDS: tl.constexpr = False):
    """The stored bytes of one kv head's token rows (pages `page`, rows `slot`, int64), undecoded: (values or e4m3
    codes [BLOCK_N, BLOCK_D], a dummy) for KV_FMT 0 / 1; (packed e2m1 [BLOCK_N, BLOCK_D / 2], or under WORDS (rows
    4-byte aligned) the same bytes as uint32 words [BLOCK_N, BLOCK_D / 8], block-scale bytes [BLOCK_N, BLOCK_D /
    GROUP] from BS with strides bs_*) for FP4 (kv_format.py)."""
    base = CACHE + (page * stride_p + slot * stride_t + kvh64 * stride_h)[:, None]
    if KV_FMT < 2:
        offs = tl.arange(0, BLOCK_D)
        data = tl.load(base + offs[None, :], mask=tok_ok[:, None] & (offs < D)[None, :], other=0.0)
        sbytes = tl.zeros([1, 1], tl.uint8)
    else:
        if WORDS:
            cols = tl.arange(0, BLOCK_D // 8)
            data = tl.load(base.to(tl.pointer_type(tl.uint32)) + cols[None, :],
                           mask=tok_ok[:, None] & (cols < D // 8)[None, :], other=0)
        else:
            cols = tl.arange(0, BLOCK_D // 2)
            data = tl.load(base + cols[None, :], mask=tok_ok[:, None] & (cols < D // 2)[None, :], other=0)
        offs_s = tl.arange(0, BLOCK_D // GROUP)
        sbase = BS + (page * bs_p + slot * bs_t + kvh64 * bs_h)[:, None]
        sbytes = tl.load(sbase + offs_s[None, :], mask=tok_ok[:, None] & (offs_s < D // GROUP)[None, :], other=0)
    return data, sbytes


@triton.jit
def _step_bytes(K_CACHE, V_CACHE, K_BS, V_BS, bt_row, tok, end, last_page, kvh64, stride_kp, stride_kt, stride_kh,
                stride_vp, stride_vt, stride_vh, stride_kbp, stride_kbt, stride_kbh, stride_vbp, stride_vbt,
                stride_vbh, PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, KV_FMT: tl.constexpr,
                GROUP: tl.constexpr, WORDS: tl.constexpr = False):
    """The raw K and V bytes of tokens `tok` (those >= end masked off), page ids looked up and clamped here: the
    prefetch's load of a step ahead."""
    ok = tok < end
    page = tl.minimum(tl.maximum(tl.load(bt_row + tok // PAGE, mask=ok, other=0), 0), last_page).to(tl.int64)
    slot = (tok % PAGE).to(tl.int64)
    k_raw, k_sb = _raw_tile(K_CACHE, K_BS, page, slot, kvh64, ok, stride_kp, stride_kt, stride_kh, stride_kbp,
                            stride_kbt, stride_kbh, D, BLOCK_D, KV_FMT, GROUP, WORDS)
    v_raw, v_sb = _raw_tile(V_CACHE, V_BS, page, slot, kvh64, ok, stride_vp, stride_vt, stride_vh, stride_vbp,
                            stride_vbt, stride_vbh, D, BLOCK_D, KV_FMT, GROUP, WORDS)
    return k_raw, k_sb, v_raw, v_sb


@triton.jit
def _v_bytes(V_CACHE, bt_row, tok, end, last_page, kvh64, stride_vp, stride_vt, stride_vh, PAGE: tl.constexpr,
             D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The fp8 V codes of tokens `tok` (those >= end masked off): fp8_mma's register prefetch of V alone (K goes to
    a dot from shared memory, so the pipeliner copies it asynchronously; V reaches its dot through a transpose in
    registers, which no asynchronous copy can do)."""
    ok = tok < end
    page = tl.minimum(tl.maximum(tl.load(bt_row + tok // PAGE, mask=ok, other=0), 0), last_page).to(tl.int64)
    v_raw, _ = _raw_tile(V_CACHE, V_CACHE, page, (tok % PAGE).to(tl.int64), kvh64, ok, stride_vp, stride_vt,
                         stride_vh, 0, 0, 0, D, BLOCK_D, 1, 1)
    return v_raw


@triton.jit
def _decode_tile(data, sbytes, KV_FMT: tl.constexpr, GROUP: tl.constexpr, OUT_DTYPE: tl.constexpr,
                 WORDS: tl.constexpr = False):
    """_raw_tile's bytes as values in OUT_DTYPE: (the tile, the same) for KV_FMT 0 / 1 (e4m3 -> OUT_DTYPE; per-token
    scales are the caller's); for FP4 the even and the odd elements ([BLOCK_N, BLOCK_D / 2] each, block scales
    applied). Packed byte i holds elements 2i (low nibble) and 2i + 1, so the halves come without interleaving the
    nibbles (a join and reshape per tile, which the compiler routes through shared memory); the caller splits q
    and the output the same way. WORDS: FP4 bytes as _raw_tile's words (shared_kernels.e2m1_words_to_halves)."""
    if KV_FMT < 2:
        lo = data.to(OUT_DTYPE)
        hi = lo
    else:
        BLOCK_N: tl.constexpr = data.shape[0]
        N_SCALES: tl.constexpr = sbytes.shape[1]
        PER: tl.constexpr = GROUP // 2  # packed bytes per block scale
        if KV_FMT == 2:
            scales = sbytes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            scales = tl.math.exp2(sbytes.to(tl.float32) - 127.0)
        if WORDS:
            HALF: tl.constexpr = data.shape[1] * 4
            lo, hi = e2m1_words_to_halves(data)   # values · 2^-14
            if KV_FMT == 2:
                scales = scales * 16384.0   # e4m3 block scales (<= 448): the 2^14 folded in
            else:   # MXFP4's scales reach 2^127: the values take the 2^14 (2^(byte - 113) overflows from byte 241)
                lo = lo * 16384.0
                hi = hi * 16384.0
        else:
            HALF: tl.constexpr = data.shape[1]
            lo = e2m1_to_float(data & 15)
            hi = e2m1_to_float(data >> 4)
        lo = tl.reshape(tl.reshape(lo, [BLOCK_N, N_SCALES, PER]) * scales[:, :, None], [BLOCK_N, HALF])
        hi = tl.reshape(tl.reshape(hi, [BLOCK_N, N_SCALES, PER]) * scales[:, :, None], [BLOCK_N, HALF])
        if KV_FMT == 3 and OUT_DTYPE == tl.float16:
            # MXFP4's power-of-two scales reach past fp16: saturate, not inf (values an fp16 model wrote stay within
            # a rounding of themselves: 65504 quantises to 4 · 2^14 = 65536)
            lo = tl.minimum(tl.maximum(lo, -65504.0), 65504.0)
            hi = tl.minimum(tl.maximum(hi, -65504.0), 65504.0)
        lo = lo.to(OUT_DTYPE)
        hi = hi.to(OUT_DTYPE)
    return lo, hi


@triton.jit
def _fp8_step_t(q8, q8_lo, q_scale, k8, v8, ks, vs, tok, tok_ok, pos, window, acc_t, m_i, l_i, qk_scale, cap_in,
                cap_out, SCALED: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, FP8_MMA: tl.constexpr):
    """One step of the fp8 tensor-core path with the tokens as the MMAs' M (PagedCfg.fp8_tokens_m): scores
    Sᵀ [tokens, rows] = K codes · q8ᵀ, softmax down the columns, accᵀ [d, rows] += V codesᵀ · P8ᵀ. A GQA group's
    few query rows are the N side (8 or more), so a 64-row wgmma wastes nothing on padded rows."""
    st = dot(k8, tl.trans(q8))
    if FP8_MMA == 2:
        st = dot(k8, tl.trans(q8_lo), st)
    st = st * q_scale[None, :]
    if SCALED:
        st = st * ks[:, None]
    if SOFTCAP:
        st = cap_out * tanh(st * cap_in)
    else:
        st = st * qk_scale
    seen = tok_ok[:, None] & (tok[:, None] <= pos[None, :])
    if WINDOW:
        seen = seen & (tok[:, None] >= pos[None, :] - window)
    st = tl.where(seen, st, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, 0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(st - m_use[None, :])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 0)
    if SCALED:
        p = p * vs[:, None]
    p_max = tl.max(p, 0)
    p_scale = tl.where(p_max > 0.0, p_max / 448.0, 1.0)
    pf = p / p_scale[None, :]
    p8 = pf.to(tl.float8e4nv)
    v8t = tl.trans(v8)
    if FP8_MMA == 2:
        pv = dot(v8t, p8, dot(v8t, (pf - p8.to(tl.float32)).to(tl.float8e4nv)))
    else:
        pv = dot(v8t, p8)
    acc_t = acc_t * alpha[None, :] + pv * p_scale[None, :]
    return acc_t, m_new, l_i


@triton.jit
def paged_decode_split_kernel(
    Q, K_CACHE, V_CACHE, K_BS, V_BS, BLOCK_TABLE, SEQLENS, K_SCALE, V_SCALE, O_PART, LSE_PART,
    stride_qb, stride_qs, stride_qh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_kbp, stride_kbt, stride_kbh, stride_vbp, stride_vbt, stride_vbh,   # FP4: the block scales'
    stride_bt, stride_ksp, stride_ksh, stride_vsp, stride_vsh,
    stride_ob, stride_os, stride_oh,   # FINAL: out [b, s_q, h_q, d]; else partials [split, b, s_q · h_q, d]
    stride_ls, stride_lb,
    qk_scale, cap_in, cap_out, window, capacity, last_page, n_splits,
    H_Q: tl.constexpr, GROUP: tl.constexpr, S_Q: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, KV_FMT: tl.constexpr, FP4_GROUP: tl.constexpr, SCALED: tl.constexpr, SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FINAL: tl.constexpr,
    INDEX_AHEAD: tl.constexpr, FP16_MATH: tl.constexpr, PREFETCH: tl.constexpr, FP8_MMA: tl.constexpr = 0,
    FP8_TOKENS_M: tl.constexpr = False, FP4_WORDS: tl.constexpr = False,
):
    """Program (b · n_splits + split, kv head · row tile): the requests share grid axis 0 with the splits (it takes
    2^31 programs; axes 1 and 2 stop at 65535), in the launch order a (split, b, ·) grid had. FINAL (one split):
    O_PART / LSE_PART are out and lse themselves (lse natural-log [b, h_q, s_q]); else partial outputs and log2 lse
    per global row j · H_Q + h. Lengths are clamped to [0, capacity] (the table's tokens) and page numbers to
    [0, last_page]: the host checks them except under a CUDA-graph capture or torch.compile, and an unchecked value
    must not read outside the tensors."""
    split = tl.program_id(0) % n_splits
    b64 = (tl.program_id(0) // n_splits).to(tl.int64)
    TILES: tl.constexpr = (GROUP * S_Q + BLOCK_H - 1) // BLOCK_H
    kvh = tl.program_id(1) // TILES
    kvh64 = kvh.to(tl.int64)
    r_loc = (tl.program_id(1) % TILES) * BLOCK_H + tl.arange(0, BLOCK_H)  # r = j · GROUP + g
    r_ok = r_loc < GROUP * S_Q
    j = r_loc // GROUP
    h = kvh * GROUP + r_loc % GROUP
    length = tl.minimum(tl.maximum(tl.load(SEQLENS + b64), 0), capacity)
    pos = length - S_Q + j  # each query row's own position: it sees tokens <= pos
    lo = 0
    if WINDOW:
        lo = tl.maximum(length - S_Q - window, 0)  # no row sees a token before this
    per_split = tl.cdiv(tl.cdiv(length - lo, n_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, length)

    # FP4 caches work on the even and odd halves of the head dim (see _decode_tile): q's columns 2i and 2i + 1
    FP4: tl.constexpr = KV_FMT >= 2
    WIDTH: tl.constexpr = BLOCK_D // 2 if FP4 else BLOCK_D
    STEP: tl.constexpr = 2 if FP4 else 1
    offs_d = tl.arange(0, WIDTH) * STEP
    q_rows = Q + b64 * stride_qb + j[:, None].to(tl.int64) * stride_qs + h[:, None].to(tl.int64) * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=r_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    q_odd = q
    if FP4:
        q_odd = tl.load(q_rows + offs_d[None, :] + 1, mask=r_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    if FP16_MATH:  # a quantised cache's tiles and q meet in fp16 (see PagedCfg.fp16_math)
        q, q_odd = q.to(tl.float16), q_odd.to(tl.float16)
    q_scale = tl.full([BLOCK_H], 1.0, tl.float32)
    q_lo = q
    if FP8_MMA > 0:  # q as e4m3 with one fp32 scale per row (and, FP8_MMA 2, the rounding error as a second e4m3)
        q, q_lo, q_scale = e4m3_pair(q)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, WIDTH], tl.float32)
    acc_odd = tl.zeros([BLOCK_H, WIDTH if FP4 else 16], tl.float32)  # FP4 only
    acc_t = tl.zeros([WIDTH if FP8_TOKENS_M else 16, BLOCK_H], tl.float32)  # fp8_tokens_m only
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = BLOCK_TABLE + b64 * stride_bt
    v_ref = 1.0
    if SCALED:  # V's scales enter p relative to this program's first page's (its output takes v_ref): p · v_scale
        # itself would fall into fp16's subnormals for small V (|V| ~ 1e-3 under fp16 q: 1e-2 error, session 40)
        page0 = tl.load(bt_row + start // PAGE, mask=start < end, other=0)
        page0 = tl.minimum(tl.maximum(page0, 0), last_page).to(tl.int64)
        v_ref = tl.load(V_SCALE + page0 * stride_vsp + kvh64 * stride_vsh)
    v_inv = 1.0 / v_ref   # a multiply a token, not a division (the Gluon kernel's division cost 235 of 2000 SASS)
    page_next = 0
    if INDEX_AHEAD:  # the first step's page ids; each step then loads the next step's (see the module docstring)
        page_next = tl.load(bt_row + (start + offs_n) // PAGE, mask=start + offs_n < end, other=0)
    V_AHEAD: tl.constexpr = PREFETCH and FP8_MMA > 0  # fp8_mma prefetches V only (see _v_bytes)
    if V_AHEAD:
        v_next = _v_bytes(V_CACHE, bt_row, start + offs_n, end, last_page, kvh64, stride_vp, stride_vt, stride_vh,
                          PAGE, D, BLOCK_D)
    elif PREFETCH:  # the first step's bytes; each step then loads the next step's (see the module docstring)
        k_next, ks_next, v_next, vs_next = _step_bytes(K_CACHE, V_CACHE, K_BS, V_BS, bt_row, start + offs_n, end,
                                                       last_page, kvh64, stride_kp, stride_kt, stride_kh, stride_vp,
                                                       stride_vt, stride_vh, stride_kbp, stride_kbt, stride_kbh,
                                                       stride_vbp, stride_vbt, stride_vbh, PAGE, D, BLOCK_D, KV_FMT,
                                                       FP4_GROUP, FP4_WORDS)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        tok_ok = tok < end
        if INDEX_AHEAD:
            page = page_next
            page_next = tl.load(bt_row + (tok + BLOCK_N) // PAGE, mask=tok + BLOCK_N < end, other=0)
        else:
            page = tl.load(bt_row + tok // PAGE, mask=tok_ok, other=0)
        page = tl.minimum(tl.maximum(page, 0), last_page).to(tl.int64)
        if V_AHEAD:
            k_raw, k_sb = _raw_tile(K_CACHE, K_BS, page, (tok % PAGE).to(tl.int64), kvh64, tok_ok, stride_kp,
                                    stride_kt, stride_kh, stride_kbp, stride_kbt, stride_kbh, D, BLOCK_D, KV_FMT,
                                    FP4_GROUP)
            v_raw = v_next
            v_sb = k_sb
            v_next = _v_bytes(V_CACHE, bt_row, tok + BLOCK_N, end, last_page, kvh64, stride_vp, stride_vt, stride_vh,
                              PAGE, D, BLOCK_D)
        elif PREFETCH:
            k_raw, k_sb, v_raw, v_sb = k_next, ks_next, v_next, vs_next
            k_next, ks_next, v_next, vs_next = _step_bytes(K_CACHE, V_CACHE, K_BS, V_BS, bt_row, tok + BLOCK_N, end,
                                                           last_page, kvh64, stride_kp, stride_kt, stride_kh,
                                                           stride_vp, stride_vt, stride_vh, stride_kbp, stride_kbt,
                                                           stride_kbh, stride_vbp, stride_vbt, stride_vbh, PAGE, D,
                                                           BLOCK_D, KV_FMT, FP4_GROUP, FP4_WORDS)
        else:
            slot = (tok % PAGE).to(tl.int64)
            k_raw, k_sb = _raw_tile(K_CACHE, K_BS, page, slot, kvh64, tok_ok, stride_kp, stride_kt, stride_kh,
                                    stride_kbp, stride_kbt, stride_kbh, D, BLOCK_D, KV_FMT, FP4_GROUP, FP4_WORDS)
            v_raw, v_sb = _raw_tile(V_CACHE, V_BS, page, slot, kvh64, tok_ok, stride_vp, stride_vt, stride_vh,
                                    stride_vbp, stride_vbt, stride_vbh, D, BLOCK_D, KV_FMT, FP4_GROUP, FP4_WORDS)
        if FP8_TOKENS_M:
            ks = l_i  # dummies
            vs = l_i
            if SCALED:
                ks = tl.load(K_SCALE + page * stride_ksp + kvh64 * stride_ksh, mask=tok_ok, other=0.0)
                vs = tl.load(V_SCALE + page * stride_vsp + kvh64 * stride_vsh, mask=tok_ok, other=0.0) * v_inv
            acc_t, m_i, l_i = _fp8_step_t(q, q_lo, q_scale, k_raw, v_raw, ks, vs, tok, tok_ok, pos, window, acc_t,
                                          m_i, l_i, qk_scale, cap_in, cap_out, SCALED, SOFTCAP, WINDOW, FP8_MMA)
        else:
            if FP8_MMA > 0:  # the e4m3 codes go to the tensor cores as they are (q's dtype is e4m3 here)
                k, k_odd, v, v_odd = k_raw, k_raw, v_raw, v_raw
            else:
                k, k_odd = _decode_tile(k_raw, k_sb, KV_FMT, FP4_GROUP, q.dtype, FP4_WORDS)
                v, v_odd = _decode_tile(v_raw, v_sb, KV_FMT, FP4_GROUP, q.dtype, FP4_WORDS)
            if FP4:
                s = dot(q_odd, tl.trans(k_odd), dot(q, tl.trans(k)))
            elif FP8_MMA == 2:
                s = dot(q, tl.trans(k), dot(q_lo, tl.trans(k)))
            else:
                s = dot(q, tl.trans(k))
            if FP8_MMA > 0:
                s = s * q_scale[:, None]
            if SCALED:  # per-token dequantisation scales, on the scores and probabilities
                ks = tl.load(K_SCALE + page * stride_ksp + kvh64 * stride_ksh, mask=tok_ok, other=0.0)
                vs = tl.load(V_SCALE + page * stride_vsp + kvh64 * stride_vsh, mask=tok_ok, other=0.0) * v_inv
                s = s * ks[None, :]
            if SOFTCAP:
                s = cap_out * tanh(s * cap_in)
            else:
                s = s * qk_scale
            seen = tok_ok[None, :] & (tok[None, :] <= pos[:, None])
            if WINDOW:
                seen = seen & (tok[None, :] >= pos[:, None] - window)
            p, alpha, l_i, m_i = online_softmax(tl.where(seen, s, float("-inf")), m_i, l_i)
            if SCALED:
                p = p * vs[None, :]
            if FP8_MMA > 0:  # p (times V's scales) as e4m3 with one scale per row and step; FP8_MMA 2 adds its error
                p_max = tl.max(p, 1)
                p_scale = tl.where(p_max > 0.0, p_max / 448.0, 1.0)
                pf = p / p_scale[:, None]
                p8 = pf.to(tl.float8e4nv)
                if FP8_MMA == 2:
                    pv = dot(p8, v, dot((pf - p8.to(tl.float32)).to(tl.float8e4nv), v))
                else:
                    pv = dot(p8, v)
                acc = acc * alpha[:, None] + pv * p_scale[:, None]
            else:
                acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
        if FP4:
            acc_odd = dot(p.to(v.dtype), v_odd, acc_odd * alpha[:, None])

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
    if FP8_TOKENS_M:
        acc = tl.trans(acc_t)
    out = acc * (v_ref / l_safe)[:, None]
    out_odd = acc_odd * (v_ref / l_safe)[:, None]
    if FINAL:
        o_ptrs = O_PART + b64 * stride_ob + j[:, None].to(tl.int64) * stride_os + h[:, None].to(tl.int64) * stride_oh
        tl.store(LSE_PART + b64 * stride_lb + h * S_Q + j, lse2 * 0.6931471805599453, mask=r_ok)
    else:
        row = (j * H_Q + h).to(tl.int64)
        o_ptrs = O_PART + split.to(tl.int64) * stride_os + b64 * stride_ob + row[:, None] * stride_oh
        tl.store(LSE_PART + split.to(tl.int64) * stride_ls + b64 * stride_lb + row, lse2, mask=r_ok)
    tl.store(o_ptrs + offs_d[None, :], out.to(O_PART.dtype.element_ty), mask=r_ok[:, None] & (offs_d < D)[None, :])
    if FP4:
        tl.store(o_ptrs + offs_d[None, :] + 1, out_odd.to(O_PART.dtype.element_ty),
                 mask=r_ok[:, None] & (offs_d < D)[None, :])


# ------------------------------------------------------------------------------------------ launch
def block_d(d, fmt):
    """The padded head dim a program works in: the next power of two, at least 16 (an MMA's K), for FP4 at least 32
    (its halves of BLOCK_D / 2 columns are the dots' K)."""
    return max(32 if fmt.fp4 else 16, triton.next_power_of_2(d))


def plan_block_h(block_h, rows):
    """A program's query rows: at most the table's block_h, no more than the rows need (a power of two >= 16)."""
    return min(block_h, max(16, triton.next_power_of_2(rows)))


def plan_num_splits(batch, h_kv, row_tiles, max_tokens, sm_count, min_tokens_per_split=256, waves=2):
    """About `waves` programs per SM, from shapes only: a request's tokens split until (b · h_kv · row tiles ·
    splits) fills the GPU, but no split shorter than min_tokens_per_split."""
    programs = batch * h_kv * row_tiles
    want = max(1, round(waves * sm_count / max(programs, 1)))
    return max(1, min(want, triton.cdiv(max_tokens, min_tokens_per_split)))


def decode_outputs(q, num_splits):
    """(out [b, s_q, h_q, d] in q's dtype, lse [b, h_q, s_q] fp32, o_part, lse_part): what a split kernel writes:
    out and lse themselves with one split, else fp32 partials [split, b, s_q · h_q, d] and [split, b, s_q · h_q]
    (log2) for combine_splits."""
    b, s_q, h_q, d = q.shape
    out = torch.empty((b, s_q, h_q, d), device=q.device, dtype=q.dtype)
    lse = torch.empty((b, h_q, s_q), device=q.device, dtype=torch.float32)
    if num_splits == 1:
        return out, lse, out, lse
    return (out, lse, torch.empty((num_splits, b, s_q * h_q, d), device=q.device, dtype=torch.float32),
            torch.empty((num_splits, b, s_q * h_q), device=q.device, dtype=torch.float32))


def part_strides(o_part, lse_part, final):
    """The split kernels' output strides: (b, s, h) of o_part and (split, b) of lse_part, as FINAL reads them (out
    [b, s_q, h_q, d] with lse [b, h_q, s_q]) or not (the partials: s is the split, h the row)."""
    if final:
        return (o_part.stride(0), o_part.stride(1), o_part.stride(2)), (0, lse_part.stride(0))
    return (o_part.stride(1), o_part.stride(0), o_part.stride(2)), (lse_part.stride(0), lse_part.stride(1))


def paged_decode_fwd(q, k_cache, v_cache, block_table, cache_seqlens, k_scale, v_scale, fmt, softmax_scale,
                     softcap, window, num_splits, cfg, k_bs=None, v_bs=None):
    """(out [b, s_q, h_q, d] in q's dtype, lse [b, h_q, s_q] natural-log). k_scale / v_scale: fp32 tensors with
    (page, head) strides taken from their shape ([num_pages, h_kv], or one element: strides 0), or None. FP4: the
    caches hold the packed values ([.., d / 2]) and k_bs / v_bs the block scales ([.., d / block], any strides):
    kv_format.split_fp4 of a row-format cache, or a split cache's two tensors."""
    b, s_q, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    group = h_q // h_kv
    out, lse, o_part, lse_part = decode_outputs(q, num_splits)
    if b == 0:
        return out, lse
    rows = group * s_q
    block_h = plan_block_h(cfg.block_h, rows)
    tiles = triton.cdiv(rows, block_h)
    final = num_splits == 1
    o_strides, l_strides = part_strides(o_part, lse_part, final)
    scaled = k_scale is not None

    def scale_strides(t):
        return (0, 0) if t is None or t.numel() == 1 else (t.stride(0), t.stride(1))
    if k_bs is None:   # no block scales: pointers the kernel does not read
        k_bs, v_bs = k_cache, v_cache
    grid = (num_splits * b, h_kv * tiles)  # the batch on axis 0 (see the kernel)
    paged_decode_split_kernel[grid](
        q, k_cache, v_cache, k_bs, v_bs, block_table, cache_seqlens, k_scale if scaled else lse,
        v_scale if scaled else lse, o_part, lse_part,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), *k_bs.stride()[:3], *v_bs.stride()[:3], block_table.stride(0), *scale_strides(k_scale), *scale_strides(v_scale),
        *o_strides, *l_strides,
        softmax_scale * LOG2E, softmax_scale / softcap if softcap else 0.0, softcap * LOG2E if softcap else 0.0,
        window if window is not None else 0,
        block_table.shape[1] * k_cache.shape[1] if k_cache.shape[0] else 0, max(k_cache.shape[0] - 1, 0), num_splits,
        H_Q=h_q, GROUP=group, S_Q=s_q, D=d, BLOCK_D=block_d(d, fmt), PAGE=k_cache.shape[1],
        KV_FMT=fmt.code, FP4_GROUP=max(fmt.group, 1), SCALED=scaled, SOFTCAP=bool(softcap),
        WINDOW=window is not None, BLOCK_H=block_h, BLOCK_N=cfg.block_n, FINAL=final, INDEX_AHEAD=cfg.index_ahead,
        FP16_MATH=(cfg.fp16_math and fmt.name in ("fp8", "nvfp4") and q.dtype == torch.bfloat16
                   and not (cfg.fp8_mma and fmt.name == "fp8")),
        PREFETCH=cfg.prefetch, FP8_MMA=cfg.fp8_mma if fmt.name == "fp8" else 0,
        FP8_TOKENS_M=bool(cfg.fp8_mma and cfg.fp8_tokens_m and fmt.name == "fp8"),
        # FP4 values as 32-bit words where every token row starts 4-byte aligned (shared_kernels.e2m1_words_to_halves)
        FP4_WORDS=fmt.fp4 and all(t.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in t.stride()[:3])
                                  for t in (k_cache, v_cache)),
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    if not final:
        combine_splits(o_part, lse_part, out, lse, h_q, s_q)
    return out, lse
