"""Paged GQA decode over FP8 / NVFP4 / MXFP4 caches for Hopper (sm_90) in Gluon: a deep cp.async ring, each warp
its own tokens.

The same problem and outputs as decode_kernel.paged_decode_split_kernel for the case the api gate sends here (a
quantised cache with d 128, at most 16 query rows per kv head (GQA group · s_q), no softcap or window; FP4 values
and block scales in packed rows): program (request · split, kv head) walks its split's tokens BLOCK_N = 4 · TPW at
a time and writes the split's partials, or with one split the final out / lse. Any page size: every token row is its
own cp.async.

Why this kernel (benchmarks/NOTES.md, "Session 19 on the H200"): the portable kernel reads FP8 at 62-65%
of the copy bandwidth. Its pipeliner waits for every copy at the top of each step (`cp.async.wait_group 0`), so a
program never overlaps its own loads with its math, and V reaches the P·V MMA as one-byte shared-memory gathers (its
reduction dim, the tokens, is strided). Here:
- the raw bytes of STAGES - 1 steps are always in flight (the ring waits for the oldest group only);
- each of the four warps owns TPW of a step's tokens and keeps its own running max, row sums and [16, 128]
  accumulator (split-K inside the program: no cross-warp softmax per step, no shared P); the warps' partials are
  combined once at the end;
- K and V are read from shared memory as 16-byte vectors in layouts (LK, LV) whose registers, after e4m3 -> fp16
  and a reshape that relabels the head dim, are exactly the mma.sync operand fragments (checked at compile time:
  `convert_layout(..., assert_trivial=True)`). The relabelling permutes the head dim: q's columns are loaded
  through sigma_k (the score dot runs over a permuted d, which changes nothing), and the output's columns are
  stored through sigma_v (P·V's columns come out permuted).
Dots run in fp16 (e4m3 -> fp16 is exact and one cvt per pair; q converts exactly within fp16's range, the
probabilities round to fp16, finer than bf16), accumulate in fp32; the softmax scale multiplies the fp32 scores.
Per-tensor scales multiply the scores and the output; per-page-head scales multiply each token's scores and
probabilities. Steps wholly inside the split and before every query row's position skip the mask.

FP4 (one kernel built per format): each token row's 64 value bytes and its block scales come in by cp.async, the
values as wide as their rows' pitch aligns them (a compile-time constant): 16 bytes for the 64-byte rows of a cache
whose block scales are a tensor apart (kv_format.py), 8 / 4 bytes for the 72 / 68-byte rows of the row layout.
NVFP4 reads them as 32-bit words and turns a word's eight e2m1 values into e4m3 bytes with two shift-and-mask pairs
(_e2m1_words: one cvt a pair to fp16, the columns relabelled once more by perm_c); MXFP4 uses Gluon's fp4_to_fp
(byte i holds values 2i and 2i + 1) and runs its dots in bf16 (its power-of-two scales may leave fp16's range). The
block scales multiply the values in the same registers.

Gluon's API changes between Triton releases: everything here is imported lazily (`available()`), and api.py only
dispatches here on sm_90 with a Triton in GLUON_TRITON_VERSIONS.
"""
from __future__ import annotations

import functools

import torch

from .decode_kernel import decode_outputs, part_strides

LOG2E = 1.4426950408889634
D = 128             # the head dim this kernel is written for
ROWS = 16           # query rows per program (GQA group · s_q, padded): one mma.sync M
WARPS = 4
GLUON_TRITON_VERSIONS = ("3.6",)  # Triton releases whose Gluon API this file was written and compiled against
# (configs.GLUON_TRITON_VERSIONS is the api gate's copy; tests check they agree)
MAX_INIT = -1.0e30  # finite running-max start: exp2(MAX_INIT - MAX_INIT) = 1 and exp2(-inf - MAX_INIT) = 0


def sigma_k(k: int) -> int:
    """The cache column the score dot's logical column k reads (LK's relabelling: see _layouts)."""
    return (k & 1) | (((k >> 3) & 15) << 1) | (((k >> 1) & 3) << 5)


def sigma_v(n: int) -> int:
    """The cache (and output) column P·V's logical column n holds (LV's relabelling)."""
    return ((n & 7) << 4) | (n >> 3)


def perm_c(c: int) -> int:
    """NVFP4: the head-dim column that column c of the decoded words holds (_e2m1_words); sigma_k / sigma_v compose
    with it."""
    return (c & ~7) | ((c >> 2) & 1) | ((c & 1) << 1) | (((c >> 1) & 1) << 2)


def _layouts(gl, tpw: int, code: int = 1, vec: int = 16):
    """(MMA, A, B, LK, LV, CP, CPS, SMEM, SMEM_S) for TPW tokens per warp and a cache format (kv_format.py's code).
    LK / LV hold a warp's [TPW, ·] K / V bytes with 32 (LK) or 16 (LV) consecutive head-dim values of a token in one
    thread's registers (FP8: that many bytes; FP4: half as many, two values a byte); decoded to 16-bit values and
    reshaped so that logical column k is head-dim column sigma_k(k) (sigma_v for V), they are the mma.sync B
    fragments of Kᵀ [128, TPW] and V [TPW, 128] with no data movement. CP / CPS: the cp.async layouts of the values
    (FP4: `vec` bytes a copy, what the rows' pitch aligns) and (FP4) the block scales; SMEM / SMEM_S their rings'
    layouts."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1], instr_shape=[1, 16, 8])
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    more = [[0, 16, 0]] if tpw == 32 else []
    warps = [[1, 0, 0], [2, 0, 0]]
    if code >= 2:   # FP4: 64 bytes of packed e2m1 a token row, then its block scales
        lk = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 8, 0]] + more,
            lane_bases=[[0, 0, 16], [0, 0, 32], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=warps, block_bases=[],
            shape=[WARPS, tpw, D // 2])
        lv = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 8, 0]] + more,
            lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32]], warp_bases=warps, block_bases=[],
            shape=[WARPS, tpw, D // 2])
        if code == 2:   # NVFP4: the same bytes as 32-bit words (_values decodes a word's eight values at once)
            lk = gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 1], [0, 0, 2], [0, 8, 0]] + more,
                lane_bases=[[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=warps, block_bases=[],
                shape=[WARPS, tpw, D // 8])
            lv = gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 1], [0, 1, 0], [0, 8, 0]] + more,
                lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 2], [0, 0, 4], [0, 0, 8]], warp_bases=warps, block_bases=[],
                shape=[WARPS, tpw, D // 8])
        cp = gl.BlockedLayout([1, 1, vec], [1, 32 // (64 // vec), 64 // vec], [WARPS, 1, 1], [2, 1, 0])
        n_scales = D // (16 if code == 2 else 32)
        cps = gl.BlockedLayout([1, 1, n_scales], [1, 32, 1], [WARPS, 1, 1], [2, 1, 0])   # a token's scales a thread
        smem = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
        return mma, a, b, lk, lv, cp, cps, smem, smem
    lk = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16], [0, 8, 0]] + more,
        lane_bases=[[0, 0, 32], [0, 0, 64], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=warps, block_bases=[],
        shape=[WARPS, tpw, D])
    lv = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 8, 0]] + more,
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]], warp_bases=warps, block_bases=[],
        shape=[WARPS, tpw, D])
    cp = gl.BlockedLayout([1, 1, 16], [1, 4, 8], [WARPS, 1, 1], [2, 1, 0])   # one 16-byte cp.async per thread
    # 16-byte chunks XOR-swizzled by the token row: the cp.async writes and LK / LV's reads are conflict-free
    smem = gl.SwizzledSharedLayout(16, 1, 8, order=[2, 1, 0])
    return mma, a, b, lk, lv, cp, cp, smem, smem


@functools.lru_cache(maxsize=None)
def _build(code: int = 1):
    """The kernel for one cache format (kv_format.py's code: 1 fp8, 2 nvfp4, 3 mxfp4)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    MAX_INIT_C = gl.constexpr(MAX_INIT)
    FP4 = gl.constexpr(code >= 2)
    NVFP4 = gl.constexpr(code == 2)
    BLK = gl.constexpr(16 if code == 2 else 32)      # FP4 values a block scale covers
    N_SCALES = gl.constexpr(D // BLK.value)
    # the dots' operand type: fp16 (finer than bf16) unless MXFP4, whose power-of-two block scales may leave fp16's
    # range
    DOT = gl.constexpr(gl.bfloat16 if code == 3 else gl.float16)

    @gluon.jit
    def _issue(K_CACHE, V_CACHE, k_ring, v_ring, slot, bt_row, n0, end, last_page, kvh,
               stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
               PAGE: gl.constexpr, TPW: gl.constexpr, CP: gl.constexpr, OFF64: gl.constexpr,
               KV_SAME_STRIDES: gl.constexpr):
        """cp.async of the K and V rows of tokens n0 .. n0 + 4 · TPW - 1 (warp w: n0 + w · TPW ..) into the ring's
        slot; tokens >= end are zero-filled, their page ids clamped. Element offsets in int32 unless OFF64 (a cache
        of 2^31 elements or more); V's computed apart only if its strides differ from K's."""
        w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, CP)))
        t = gl.arange(0, TPW, layout=gl.SliceLayout(0, gl.SliceLayout(2, CP)))
        d = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, CP)))
        tok = n0 + w[:, None] * TPW + t[None, :]
        ok = tok < end
        page = gl.load(bt_row + tok // PAGE, mask=ok, other=0)
        page = gl.minimum(gl.maximum(page, 0), last_page)
        row = tok % PAGE
        if OFF64:
            page = page.to(gl.int64)
            row = row.to(gl.int64)
            kvh = kvh.to(gl.int64)
        mask = ok[:, :, None] & (d >= 0)[None, None, :]   # Gluon does not broadcast masks
        k_off = page * stride_kp + row * stride_kt + kvh * stride_kh
        if KV_SAME_STRIDES:
            v_off = k_off
        else:
            v_off = page * stride_vp + row * stride_vt + kvh * stride_vh
        async_copy.async_copy_global_to_shared(k_ring.index(slot), K_CACHE + k_off[:, :, None] + d[None, None, :],
                                               mask=mask)
        async_copy.async_copy_global_to_shared(v_ring.index(slot), V_CACHE + v_off[:, :, None] + d[None, None, :],
                                               mask=mask)

    @gluon.jit
    def _fp4_rows(bt_row, n0, end, last_page, kvh, L: gl.constexpr, PAGE: gl.constexpr, TPW: gl.constexpr,
                  H_KV: gl.constexpr, OFF64: gl.constexpr):
        """(the (token, head) rows of head kvh's FP4 bytes for tokens n0 .., tokens < end) in SliceLayout(2, L): rows
        packed H_KV a token and PAGE tokens a page, their pitches constexpr so that the copies' alignment is known."""
        w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        t = gl.arange(0, TPW, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
        tok = n0 + w[:, None] * TPW + t[None, :]
        ok = tok < end
        page = gl.minimum(gl.maximum(gl.load(bt_row + tok // PAGE, mask=ok, other=0), 0), last_page)
        slot = page * PAGE + tok % PAGE
        if OFF64:
            slot = slot.to(gl.int64)
        return slot * H_KV + kvh, ok

    @gluon.jit
    def _issue_fp4(K_CACHE, V_CACHE, K_BS, V_BS, k_ring, v_ring, ks_ring, vs_ring, slot, bt_row, n0, end,
                   last_page, kvh, PAGE: gl.constexpr, TPW: gl.constexpr, H_KV: gl.constexpr, CP: gl.constexpr,
                   CPS: gl.constexpr, OFF64: gl.constexpr, VPITCH: gl.constexpr, SPITCH: gl.constexpr):
        """_issue for FP4 rows: their 64 value bytes (rows VPITCH bytes apart) and their block scales (K_BS / V_BS,
        rows SPITCH bytes apart) into the rings' slot (zeros past end)."""
        rows, ok = _fp4_rows(bt_row, n0, end, last_page, kvh, CP, PAGE, TPW, H_KV, OFF64)
        off = rows * VPITCH
        d = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, CP)))
        mask = ok[:, :, None] & (d >= 0)[None, None, :]
        async_copy.async_copy_global_to_shared(k_ring.index(slot), K_CACHE + off[:, :, None] + d[None, None, :],
                                               mask=mask)
        async_copy.async_copy_global_to_shared(v_ring.index(slot), V_CACHE + off[:, :, None] + d[None, None, :],
                                               mask=mask)
        rows, ok = _fp4_rows(bt_row, n0, end, last_page, kvh, CPS, PAGE, TPW, H_KV, OFF64)
        off = rows * SPITCH
        c = gl.arange(0, N_SCALES, layout=gl.SliceLayout(0, gl.SliceLayout(1, CPS)))
        mask = ok[:, :, None] & (c >= 0)[None, None, :]
        async_copy.async_copy_global_to_shared(ks_ring.index(slot), K_BS + off[:, :, None] + c[None, None, :],
                                               mask=mask)
        async_copy.async_copy_global_to_shared(vs_ring.index(slot), V_BS + off[:, :, None] + c[None, None, :],
                                               mask=mask)

    @gluon.jit
    def _perm_c(c):
        """perm_c on a tensor of columns."""
        return (c & ~7) | ((c >> 2) & 1) | ((c & 1) << 1) | (((c >> 1) & 1) << 2)

    @gluon.jit
    def _byte(x, k: gl.constexpr):
        return ((x >> (8 * k)) & 0xFF).to(gl.uint8)

    @gluon.jit
    def _e2m1_words(w):
        """[4, TPW, 16] words of packed e2m1 (byte i of word j: values 8j + 2i, low nibble, and 8j + 2i + 1) -> fp16
        [4, TPW, 128], value 8j + 4p + 2e + h at column 8j + 4h + 2p + e (perm_c). Each nibble s|ee|m becomes the
        e4m3 byte s|0 0 e e|m 0 0, its value times 2^-6 (subnormal m · 0.5 included): a word's four low nibbles by
        one shift-and-mask pair, its four high nibbles by another, then two bytes at a time to fp16 by one cvt (900
        instructions a step against fp4_to_fp's 1283: benchmarks/NOTES.md, session 20). The 2^6 goes into the block
        scales."""
        lo = ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080)   # byte i: value 8j + 2i
        hi = ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)          # byte i: value 8j + 2i + 1
        # bytes 2 and 3 moved down by umulhi(x, 2^16), not x >> 16: LLVM merges a shift into the byte extraction
        # and rebuilds the pair byte by byte (four instructions a pair); the multiply's high half it leaves alone
        lo_up = gl.umulhi(lo, 65536)
        hi_up = gl.umulhi(hi, 65536)
        # the last joined dim is the innermost register: bytes 2p, 2p + 1 of one word side by side, one cvt's pair
        x = gl.join(gl.join(gl.join(_byte(lo, 0), _byte(hi, 0)), gl.join(_byte(lo_up, 0), _byte(hi_up, 0))),
                    gl.join(gl.join(_byte(lo, 1), _byte(hi, 1)), gl.join(_byte(lo_up, 1), _byte(hi_up, 1))))
        x = x.to(gl.float8e4nv, bitcast=True).to(gl.float16)
        return gl.reshape(x, [x.shape[0], x.shape[1], 128])

    @gluon.jit
    def _values(tile, s_tile, L: gl.constexpr, TPW: gl.constexpr):
        """A warp tile's [4, TPW, 128] head-dim values in DOT, in L's registers (FP8: e4m3 · 1; FP4: e2m1 · its
        block's scale, NVFP4's e4m3 or MXFP4's e8m0), the per-tensor / per-token scales left to the caller."""
        if FP4:
            if NVFP4:   # values times 2^-6, the 2^6 put into the block scales
                x = _e2m1_words(tile._reinterpret(gl.uint32, [4, TPW, 16], tile.type.layout).load(L))
            else:
                x = gl.fp4_to_fp(tile.load(L), DOT, 2)   # byte i -> values 2i (low nibble), 2i + 1
            x4 = gl.reshape(x, [4, TPW, N_SCALES, BLK])
            L4: gl.constexpr = x4.type.layout
            sb = s_tile.load(gl.SliceLayout(3, L4))
            if NVFP4:
                sc = sb.to(gl.float8e4nv, bitcast=True).to(DOT) * 64.0
            else:
                sc = (sb.to(gl.uint16) << 7).to(gl.bfloat16, bitcast=True)   # e8m0: 2^(byte - 127)
            return gl.reshape(x4 * gl.expand_dims(sc, 3), [4, TPW, 128])
        else:
            return tile.load(L).to(DOT)

    @gluon.jit
    def _token_pages(bt_row, tok, ok, last_page, PAGE: gl.constexpr):
        """The page ids of tokens tok (0 where not ok), clamped to [0, last_page], as int64."""
        page = gl.load(bt_row + tok // PAGE, mask=ok, other=0)
        return gl.minimum(gl.maximum(page, 0), last_page).to(gl.int64)

    @gluon.jit
    def _step(k_tile, v_tile, ks_tile, vs_tile, qa, z, m_i, l_i, acc, n0, end, pos, s_scale, v_inv, K_SCALE, V_SCALE,
              bt_row, last_page, kvh64,
              stride_ksp, stride_ksh, stride_vsp, stride_vsh, PAGE: gl.constexpr, SCALE_MODE: gl.constexpr,
              TPW: gl.constexpr, MASKED: gl.constexpr, MMA: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
              LK: gl.constexpr, LV: gl.constexpr, Q_SHARED: gl.constexpr):
        """One step: each warp's scores for its TPW tokens (n0 + w · TPW ..), the online softmax, P·V into its
        accumulator. MASKED: tokens past end or a query row's position are kept out (else all are seen)."""
        kx = _values(k_tile, ks_tile, LK, TPW)
        kx = gl.reshape(gl.permute(gl.reshape(kx, [4, TPW, 4, 16, 2]), [0, 1, 3, 2, 4]), [4, TPW, 128])
        kb = gl.convert_layout(gl.permute(kx, [0, 2, 1]), B, assert_trivial=True)
        if Q_SHARED:   # q's fragments from shared memory each step (z: 0, but loop-variant, so not hoisted)
            qa = qa.index(z).load(A)
        s = mma_v2(qa, kb, gl.zeros([4, 16, TPW], gl.float32, MMA))
        TOK: gl.constexpr = gl.SliceLayout(1, MMA)     # [4, TPW]: per warp and token
        wt = gl.arange(0, 4, layout=gl.SliceLayout(1, TOK))
        tt = gl.arange(0, TPW, layout=gl.SliceLayout(0, TOK))
        tok = n0 + wt[:, None] * TPW + tt[None, :]
        t_ok = tok < end
        if SCALE_MODE == 2:   # per page and head: each token's K and V scales (1 past the end)
            pages = _token_pages(bt_row, tok, t_ok, last_page, PAGE)
            k_tok = gl.load(K_SCALE + pages * stride_ksp + kvh64 * stride_ksh, mask=t_ok, other=1.0)
            v_tok = gl.load(V_SCALE + pages * stride_vsp + kvh64 * stride_vsh, mask=t_ok, other=1.0)
            s = s * (s_scale * k_tok)[:, None, :]
        else:
            s = s * s_scale
        if MASKED:
            seen = t_ok[:, None, :] & (tok[:, None, :] <= pos[None, :, None])
            s = gl.where(seen, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=2))
        p = gl.exp2(s - m_new[:, :, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=2)
        if SCALE_MODE == 2:   # relative to the program's first page's (v_inv its reciprocal; the output takes it):
            # p · v_scale itself would sink into fp16's subnormals for small V (as in the portable kernel, NOTES
            # session 40). A reciprocal, not a division a token: div_rn took 235 of the loop's 2000 SASS instructions
            p = p * (v_tok * v_inv)[:, None, :]
        pa = gl.convert_layout(p.to(DOT), A, assert_trivial=True)
        vx = _values(v_tile, vs_tile, LV, TPW)
        vx = gl.reshape(gl.permute(gl.reshape(vx, [4, TPW, 8, 16]), [0, 1, 3, 2]), [4, TPW, 128])
        vb = gl.convert_layout(vx, B, assert_trivial=True)
        return m_new, l_i, mma_v2(pa, vb, acc * alpha[:, :, None])

    @gluon.jit
    def paged_decode_gluon_kernel(
        Q, K_CACHE, V_CACHE, K_BS, V_BS, BLOCK_TABLE, SEQLENS, K_SCALE, V_SCALE, O_PART, LSE_PART,
        stride_qb, stride_qs, stride_qh,
        stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
        stride_bt, stride_ksp, stride_ksh, stride_vsp, stride_vsh,
        stride_ob, stride_os, stride_oh,   # FINAL: out [b, s_q, h_q, d]; else partials [split, b, s_q · h_q, d]
        stride_ls, stride_lb,
        qk_scale, capacity, last_page, n_splits,
        H_Q: gl.constexpr, GROUP: gl.constexpr, S_Q: gl.constexpr, PAGE: gl.constexpr, SCALE_MODE: gl.constexpr,
        FINAL: gl.constexpr, TPW: gl.constexpr, STAGES: gl.constexpr, Q_SHARED: gl.constexpr,
        OFF64: gl.constexpr, KV_SAME_STRIDES: gl.constexpr, VPITCH: gl.constexpr, SPITCH: gl.constexpr,
        MMA: gl.constexpr, A: gl.constexpr, B: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr, CP: gl.constexpr,
        CPS: gl.constexpr, SMEM: gl.constexpr, SMEM_S: gl.constexpr,
    ):
        """Program (b · n_splits + split) · h_kv + kv head on one grid axis: a request's kv heads are neighbours in
        launch order, so they read the same token rows of the cache (h_kv · width bytes each) at about the same time
        (2-3% over the portable kernel's (b · n_splits + split, kv head) grid, session 19). SCALE_MODE: 0 none, 1 per
        tensor (K_SCALE / V_SCALE one element), 2 per page and head. Lengths are clamped to [0, capacity] and page
        ids to [0, last_page] (unchecked values under a CUDA-graph capture must not read outside the tensors)."""
        BLOCK_N: gl.constexpr = 4 * TPW
        H_KV: gl.constexpr = H_Q // GROUP
        work = gl.program_id(0) // H_KV
        kvh = gl.program_id(0) % H_KV
        split = work % n_splits
        b64 = (work // n_splits).to(gl.int64)
        kvh64 = kvh.to(gl.int64)
        length = gl.minimum(gl.maximum(gl.load(SEQLENS + b64), 0), capacity)
        per_split = gl.cdiv(gl.cdiv(length, n_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = gl.minimum(start + per_split, length)
        n_steps = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
        bt_row = BLOCK_TABLE + b64 * stride_bt

        if FP4:   # each token row's 64 value bytes, and its block scales in rings of their own
            k_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, 4, TPW, 64], SMEM)
            v_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, 4, TPW, 64], SMEM)
            ks_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, 4, TPW, N_SCALES], SMEM_S)
            vs_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, 4, TPW, N_SCALES], SMEM_S)
        else:
            k_ring = gl.allocate_shared_memory(K_CACHE.dtype.element_ty, [STAGES, 4, TPW, 128], SMEM)
            v_ring = gl.allocate_shared_memory(V_CACHE.dtype.element_ty, [STAGES, 4, TPW, 128], SMEM)
            ks_ring = k_ring
            vs_ring = v_ring
        for i in gl.static_range(STAGES - 1):
            if FP4:
                _issue_fp4(K_CACHE, V_CACHE, K_BS, V_BS, k_ring, v_ring, ks_ring, vs_ring, i, bt_row,
                           start + i * BLOCK_N, end, last_page, kvh, PAGE, TPW, H_KV, CP, CPS, OFF64, VPITCH, SPITCH)
            else:
                _issue(K_CACHE, V_CACHE, k_ring, v_ring, i, bt_row, start + i * BLOCK_N, end, last_page, kvh,
                       stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, PAGE, TPW, CP, OFF64,
                       KV_SAME_STRIDES)
            async_copy.commit_group()

        # q in DOT (fp16: exact from fp16, and from bf16 in fp16's range; MXFP4: bf16 q as it is), its columns
        # through sigma_k, the same 16 rows in every warp; the softmax scale (log2 units) multiplies the fp32 scores
        QL: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [4, 1, 1], [2, 1, 0])
        r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, QL)))
        k = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, QL)))
        col = (k & 1) | (((k >> 3) & 15) << 1) | (((k >> 1) & 3) << 5)   # sigma_k
        if NVFP4:
            col = _perm_c(col)
        r_ok = r < GROUP * S_Q
        q_row = b64 * stride_qb + (r // GROUP).to(gl.int64) * stride_qs + (kvh * GROUP + r % GROUP).to(gl.int64) * \
            stride_qh
        w0 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, QL)))
        q_mask = (w0 >= 0)[:, None, None] & r_ok[None, :, None] & (k >= 0)[None, None, :]
        q = gl.load(Q + q_row[None, :, None] + col[None, None, :] + 0 * w0[:, None, None], mask=q_mask, other=0.0)
        if Q_SHARED:   # each warp's copy of q in shared memory, its fragments loaded at each step's score dot
            qa = gl.allocate_shared_memory(DOT, [1, 4, 16, 128], gl.SwizzledSharedLayout(8, 1, 8, order=[2, 1, 0]))
            qa.index(0).store(q.to(DOT))
            gl.thread_barrier()
        else:
            qa = gl.convert_layout(q.to(DOT), A)

        ROW: gl.constexpr = gl.SliceLayout(2, MMA)     # [4, 16]: per warp and query row
        rs = gl.arange(0, 16, layout=gl.SliceLayout(0, ROW))
        pos = length - S_Q + rs // GROUP   # each query row's own position: it sees tokens <= pos
        s_scale = qk_scale
        v_s = 1.0
        if SCALE_MODE == 1:
            s_scale = qk_scale * gl.load(K_SCALE)
            v_s = gl.load(V_SCALE)
        if SCALE_MODE == 2:   # the first page's V scale: p takes the others relative to it (_step)
            page0 = gl.load(bt_row + start // PAGE, mask=start < end, other=0)
            page0 = gl.minimum(gl.maximum(page0, 0), last_page).to(gl.int64)
            v_s = gl.load(V_SCALE + page0 * stride_vsp + kvh64 * stride_vsh)
        v_inv = 1.0 / v_s
        m_i = gl.full([4, 16], MAX_INIT_C, gl.float32, ROW)
        l_i = gl.zeros([4, 16], gl.float32, ROW)
        acc = gl.zeros([4, 16, 128], gl.float32, MMA)
        # steps wholly before full_end need no mask: every token in the split, seen by every query row
        full_end = gl.minimum(end, length - S_Q + 1)
        for i in range(n_steps):
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()   # step i's bytes from every thread; step i - 1's slot read by every warp
            ahead = (i + STAGES - 1) % STAGES
            if FP4:
                _issue_fp4(K_CACHE, V_CACHE, K_BS, V_BS, k_ring, v_ring, ks_ring, vs_ring, ahead, bt_row,
                           start + (i + STAGES - 1) * BLOCK_N, end, last_page, kvh, PAGE, TPW, H_KV, CP, CPS, OFF64,
                           VPITCH, SPITCH)
            else:
                _issue(K_CACHE, V_CACHE, k_ring, v_ring, ahead, bt_row, start + (i + STAGES - 1) * BLOCK_N, end,
                       last_page, kvh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, PAGE, TPW,
                       CP, OFF64, KV_SAME_STRIDES)
            async_copy.commit_group()
            n0 = start + i * BLOCK_N
            cur = i % STAGES
            k_tile = k_ring.index(cur)
            v_tile = v_ring.index(cur)
            ks_tile = ks_ring.index(cur)
            vs_tile = vs_ring.index(cur)
            if n0 + BLOCK_N <= full_end:
                m_i, l_i, acc = _step(k_tile, v_tile, ks_tile, vs_tile, qa, i >> 30, m_i, l_i, acc, n0, end, pos,
                                      s_scale, v_inv, K_SCALE, V_SCALE, bt_row, last_page, kvh64, stride_ksp,
                                      stride_ksh, stride_vsp, stride_vsh, PAGE, SCALE_MODE, TPW, False, MMA, A, B,
                                      LK, LV, Q_SHARED)
            else:
                m_i, l_i, acc = _step(k_tile, v_tile, ks_tile, vs_tile, qa, i >> 30, m_i, l_i, acc, n0, end, pos,
                                      s_scale, v_inv, K_SCALE, V_SCALE, bt_row, last_page, kvh64, stride_ksp,
                                      stride_ksh, stride_vsp, stride_vsh, PAGE, SCALE_MODE, TPW, True, MMA, A, B,
                                      LK, LV, Q_SHARED)
        async_copy.wait_group(0)

        # the four warps' partials -> one: the common max, each warp's rescale, the sums
        m_all = gl.max(m_i, axis=0)
        w_scale = gl.exp2(m_i - m_all[None, :])
        l_all = gl.sum(l_i * w_scale, axis=0)
        out = gl.sum(acc * w_scale[:, :, None], axis=0)   # [16, 128] in SliceLayout(0, MMA)
        OUT: gl.constexpr = gl.SliceLayout(0, MMA)
        empty = l_all == 0.0
        l_safe = gl.where(empty, 1.0, l_all)
        norm = gl.convert_layout(v_s / l_safe, gl.SliceLayout(1, OUT))
        out = out * norm[:, None]
        ro = gl.arange(0, 16, layout=gl.SliceLayout(1, OUT))
        n = gl.arange(0, 128, layout=gl.SliceLayout(0, OUT))
        o_col = ((n & 7) << 4) | (n >> 3)   # sigma_v
        if NVFP4:
            o_col = _perm_c(o_col)
        j = ro // GROUP
        h = kvh * GROUP + ro % GROUP
        ro_ok = ro < GROUP * S_Q
        if FINAL:
            o_ptrs = O_PART + b64 * stride_ob + j[:, None].to(gl.int64) * stride_os + h[:, None].to(gl.int64) * \
                stride_oh
        else:
            orow = (j * H_Q + h).to(gl.int64)
            o_ptrs = O_PART + split.to(gl.int64) * stride_os + b64 * stride_ob + orow[:, None] * stride_oh
        gl.store(o_ptrs + o_col[None, :], out.to(O_PART.dtype.element_ty),
                 mask=ro_ok[:, None] & (n >= 0)[None, :])
        VEC: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        lse2 = gl.convert_layout(gl.where(empty, float("-inf"), m_all + gl.log2(l_safe)), VEC)
        rv = gl.arange(0, 16, layout=VEC)
        jv = rv // GROUP
        hv = kvh * GROUP + rv % GROUP
        if FINAL:
            gl.store(LSE_PART + b64 * stride_lb + hv * S_Q + jv, lse2 * 0.6931471805599453, mask=rv < GROUP * S_Q)
        else:
            gl.store(LSE_PART + split.to(gl.int64) * stride_ls + b64 * stride_lb + jv * H_Q + hv, lse2,
                     mask=rv < GROUP * S_Q)

    return paged_decode_gluon_kernel, gl


def available() -> bool:
    """This Triton's Gluon is one the kernel was written for (and imports)."""
    from .._gluon import builds
    return builds(_build, GLUON_TRITON_VERSIONS)


def _packed_rows(t) -> bool:
    """A [num_pages, page_size, h_kv, n] tensor whose (token, head) rows follow one another at one pitch
    (t.stride(2)), 16-byte aligned at the start: the FP4 copies address row (page · page_size + token) · h_kv +
    head."""
    p, ps, h, n = t.shape
    return (t.stride(3) == 1 and t.stride(2) >= n and t.stride(1) == h * t.stride(2) and
            (p <= 1 or t.stride(0) == ps * t.stride(1)) and t.data_ptr() % 16 == 0)


def cache_ok(k_cache, v_cache, code, k_bs=None, v_bs=None) -> bool:
    """Caches the kernel reads (code: the format's; k_bs / v_bs: FP4's block scales): FP8 16-byte aligned with
    16-byte aligned rows (its copies are 16 bytes); FP4 values and scales in packed rows (_packed_rows), K's
    pitches V's (the pitches are compile-time constants, so that the copies know the rows' alignment)."""
    if code >= 2:
        return (all(_packed_rows(t) for t in (k_cache, v_cache, k_bs, v_bs))
                and k_cache.stride() == v_cache.stride() and k_bs.stride() == v_bs.stride())
    return all(c.data_ptr() % 16 == 0 and c.stride(3) == 1 and all(st % 16 == 0 for st in c.stride()[:3])
               for c in (k_cache, v_cache))


def launch_args(q, k_cache, v_cache, block_table, cache_seqlens, k_scale, v_scale, softmax_scale, o_part, lse_part,
                num_splits, cfg, code=1, k_bs=None, v_bs=None):
    """(kernel, grid, args, constexpr kwargs) of one launch; shared by paged_decode_gluon and the compile check.
    code: the cache format's (kv_format.py: 1 fp8, 2 nvfp4, 3 mxfp4; the caches as cache_ok takes them).
    o_part / lse_part: out [b, s_q, h_q, d] / lse [b, h_q, s_q] when num_splits is 1, else the partials; cfg a
    configs.PagedCfg with gluon set (block_n = 4 · tokens per warp, stages). FP4: k_cache / v_cache the packed
    values [.., d / 2] and k_bs / v_bs the block scales [.., d / block] (kv_format.split_fp4), as cache_ok takes
    them."""
    tpw = cfg.block_n // 4
    kernel, gl = _build(code)
    b, s_q, h_q, _ = q.shape
    h_kv = k_cache.shape[2]
    final = num_splits == 1
    o_strides, l_strides = part_strides(o_part, lse_part, final)
    if k_scale is None:
        mode, k_scale, v_scale = 0, cache_seqlens, cache_seqlens   # pointers the kernel does not read
    else:
        mode = 1 if k_scale.numel() == 1 else 2

    def scale_strides(t):
        return (0, 0) if mode != 2 else (t.stride(0), t.stride(1))
    vpitch = spitch = 0
    if code >= 2:   # the values' copies as wide as the rows' pitch aligns them (64-byte rows: 16 bytes)
        vpitch, spitch = k_cache.stride(2), k_bs.stride(2)
    else:           # pointers the kernel does not read
        k_bs, v_bs = k_cache, v_cache
    mma, a, bl, lk, lv, cp, cps, smem, smem_s = _layouts(gl, tpw, code, min(16, vpitch & -vpitch) if vpitch else 16)
    args = (q, k_cache, v_cache, k_bs, v_bs, block_table, cache_seqlens, k_scale, v_scale, o_part, lse_part,
            q.stride(0), q.stride(1), q.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), block_table.stride(0), *scale_strides(k_scale), *scale_strides(v_scale),
            *o_strides, *l_strides,
            softmax_scale * LOG2E, block_table.shape[1] * k_cache.shape[1] if k_cache.shape[0] else 0,
            max(k_cache.shape[0] - 1, 0), num_splits)
    meta = dict(H_Q=h_q, GROUP=h_q // h_kv, S_Q=s_q, PAGE=k_cache.shape[1], SCALE_MODE=mode, FINAL=final, TPW=tpw,
                STAGES=cfg.stages, Q_SHARED=bool(cfg.q_shared),
                # element offsets past int32 (a tensor's span: its pages times their stride)
                OFF64=max(t.shape[0] * t.stride(0) for t in (k_cache, v_cache, k_bs, v_bs)) >= 2 ** 31,
                KV_SAME_STRIDES=k_cache.stride()[:3] == v_cache.stride()[:3], VPITCH=vpitch, SPITCH=spitch,
                MMA=mma, A=a, B=bl, LK=lk, LV=lv, CP=cp, CPS=cps, SMEM=smem, SMEM_S=smem_s, num_warps=WARPS)
    return kernel, (num_splits * b * h_kv, ), args, meta


def paged_decode_gluon(q, k_cache, v_cache, block_table, cache_seqlens, k_scale, v_scale, softmax_scale, num_splits,
                       cfg, code=1, k_bs=None, v_bs=None):
    """The Gluon path of paged_decode_fwd (see api.gluon_gate; code: the cache format's): (out,
    lse) as the portable launcher returns them, through the same partials + combine_splits when num_splits > 1."""
    from ..shared_kernels import combine_splits
    b, s_q, h_q, d = q.shape
    out, lse, o_part, lse_part = decode_outputs(q, num_splits)
    if b == 0:
        return out, lse
    final = num_splits == 1
    kernel, grid, args, meta = launch_args(q, k_cache, v_cache, block_table, cache_seqlens, k_scale, v_scale,
                                           softmax_scale, o_part, lse_part, num_splits, cfg, code, k_bs, v_bs)
    kernel[grid](*args, **meta)
    if not final:
        combine_splits(o_part, lse_part, out, lse, h_q, s_q)
    return out, lse


# ------------------------------------------------------------------------------------ compile-only check
def compile_sm90(cfg, group=4, s_q=1, num_splits=1, page=16, scale_mode=1, code=1, arch=90):
    """Compile for sm_<arch> without a GPU (ops/_gluon.py): PTX features, warps, shared memory, the kernel. cfg: a
    configs.PagedCfg as a dict (its _asdict()); code: the cache format's (1 fp8, 2 nvfp4, 3 mxfp4)."""
    from types import SimpleNamespace

    from .._gluon import compile_report
    cfg = SimpleNamespace(**cfg)
    width, storage = (D, torch.float8_e4m3fn) if code == 1 else (D // 2 + D // (16 if code == 2 else 32), torch.uint8)
    b, h_kv, pages, max_pages = 2, 2, 8, 4
    h_q = group * h_kv
    q = torch.empty(b, s_q, h_q, D, dtype=torch.bfloat16)
    kc = torch.empty(pages, page, h_kv, width, dtype=storage)
    kc, kbs = (kc[..., :D // 2], kc[..., D // 2:]) if code >= 2 else (kc, None)   # FP4: kv_format.split_fp4
    if code >= 2:   # FP4 scales: NVFP4's per tensor, MXFP4 none
        scale_mode = 1 if code == 2 else 0
    table = torch.zeros(b, max_pages, dtype=torch.int32)
    lens = torch.zeros(b, dtype=torch.int32)
    _, _, o_part, lse_part = decode_outputs(q, num_splits)
    scale = [None, torch.ones(1), torch.ones(pages, h_kv)][scale_mode]
    kernel, grid, args, meta = launch_args(q, kc, kc, table, lens, scale, scale, D ** -0.5, o_part, lse_part,
                                           num_splits, cfg, code, kbs, kbs)
    return compile_report(kernel, args, grid, meta, arch)
