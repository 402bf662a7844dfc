"""MLA decode of at most 16 query rows a request (h_q · s_q <= 16: 16-head shards at s_q 1) over an FP8 cache, for
Hopper (sm_90) in Gluon: one warpgroup; the scores by e4m3 wgmma on the raw cache bytes with the tokens as M, P·V by
mma.sync with each warp owning one 128-wide chunk of the output.

The same problem and outputs as decode_kernel.mla_decode_split_kernel for the case the api gate sends here (dense
block table, an FP8 cache whose pages are contiguous rows, bf16 q, rows <= 16, page size 16 / 32 / 64): program
(request · split) walks its split's tokens BLOCK_N = 64 at a time and writes the split's partials (o_part [split, b,
rows, 512] fp32, lse_part [split, b, rows] in log2 units, for combine_splits) or, with one split, the final out /
lse.

Why this shape: at 16 rows decode should be bound by reading the cache (656 bytes a token against bf16's 1152). The
first version of this kernel (session 21) converted every byte to fp16 twice (as Kᵀ and as V) and summed four warps'
partial scores each step: bound by the latency of that chain at 0.63-0.76x the bf16 cache. Here (TensorRT-LLM XQA's
and b12x's arrangement, written for Gluon's wgmma):
- a step's 64 rows come in by TMA: the latent as one [4, 64, 128] box (chunk outermost: four [64, 128] tiles in the
  wgmma's 128-byte swizzle; a [1, page, 128] box per chunk for pages under 64), the rope and the scales beside it,
  each kind of copy on an mbarrier allocation of its own;
- scores S [64 tokens, 16 rows]: per chunk c one e4m3 wgmma (M 64 tokens, N 16 rows · 2 terms, K 128) of the raw
  codes against q, which is carried as two e4m3 terms of q / a (a = the row's amax / 448; the second term the first's
  rounding error times 16, stacked along N), times the tokens' chunk-c scales (FP8's scale group is the chunk); the
  rope by a bf16 wgmma. No byte of K is converted. Accuracy: q's error ~2^-8 an element (1/16 of the cache's own
  rounding), 1 - cos ~1e-7 against the dequantised-cache reference, lse within ~1e-3 on one-token requests;
- the online softmax in the accumulator's layout: each warp's max over its 16 tokens by shuffles, the four warps' by
  one [4, 16] exchange in shared memory (one CTA barrier); the row sums kept per token slot and summed at the end;
- P times each chunk's scales in fp16, all four [64, 16] in one store, one barrier; warp w then reads its chunk's
  P (ldmatrix) and V (16 bytes of a token row a thread, LV: its e4m3 -> fp16 values are the mma.sync B fragments
  with no data movement, the output's columns relabelled through sigma_v, paged decode's design) in two 32-token
  halves into O[:, its 128 columns] (fp32, 64 registers a thread).
~206 registers, ~109 KB of shared memory at two ring slots: two programs an SM.

Where it stands (H200, b 128, h_q 16, benchmarks/NOTES.md session 22): 1.2x / 1.47x the bf16 cache's speed at L 4k /
16k (bar 1.6x).

Gluon's API changes between Triton releases: everything here is imported lazily (`available()`), and api.py only
dispatches here on sm_90 with a Triton in GLUON_TRITON_VERSIONS.
"""
from __future__ import annotations

import functools

import torch

LOG2E = 1.4426950408889634
D_V = 512
D_R = 64
ROWS = 16           # query rows per program: the score wgmma's N (per term of q)
WARPS = 4           # one warpgroup; for P·V warp w owns latent chunk w (128 columns)
BLOCK_N = 64        # cache tokens per step: the score wgmma's M
HALF_N = 32         # tokens per P·V sub-step (registers)
Q_TERMS = 2         # q as two e4m3 terms (one: 1 - cos ~3e-4; two: ~1e-7; scripts/emulate_rows16_numerics.py)
ROW_BYTES = 656     # FP8 row: 512 e4m3, 4 fp32 scales, 64 bf16 rope (kv_format.py)
SCALE_OFF = 512
ROPE_OFF = 528
GLUON_TRITON_VERSIONS = ("3.6",)  # Triton releases whose Gluon API this file was written and compiled against
MAX_REGS = None     # two programs an SM by shared memory; registers uncapped
MAX_INIT = -1.0e30  # finite running-max start: exp2(MAX_INIT - MAX_INIT) = 1 and exp2(-inf - MAX_INIT) = 0
E4M3_MAX = 448.0


def sigma_v(n: int) -> int:
    """The chunk (and output) column P·V's logical column n holds (LV's relabelling, as in paged decode)."""
    return ((n & 7) << 4) | (n >> 3)


def _layouts(gl):
    """(S, SQ, MMA, A, B, LV, SMEM_LAT, SMEM_LV, SMEM_ROPE, SMEM_S, SMEM_P).
    S / SQ: the score wgmmas' accumulators [64 tokens, 16 rows] / [64, 16 · Q_TERMS]; MMA / A / B: P·V's mma.sync
    [4 chunks, 16 rows, 128 columns] with its operands; LV: a sub-step's V as [4, 32, 128] bytes (chunk = warp, token,
    column), 16 consecutive columns of tokens t, t + 1 (+ 8, + 16) in one thread: converted to fp16 and reshaped so
    that logical column n is chunk column sigma_v(n), the mma.sync B fragments with no data movement.
    SMEM_LAT: a [64, 128] chunk tile as the wgmma reads it (128-byte swizzle; q's terms too); SMEM_LV the same bytes
    as TMA writes them and LV reads them, [4, 64, 128] (the swizzle's phase is the token row in both)."""
    s = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, ROWS, 16])
    sq = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, ROWS * Q_TERMS, 32])
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1], instr_shape=[1, 16, 8])
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    lv = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 8, 0], [0, 16, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]], warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[], shape=[WARPS, HALF_N, 128])
    smem_lat = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    smem_lv = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)
    smem_rope = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    smem_s = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    smem_p = gl.SwizzledSharedLayout(8, 1, 8, order=[2, 1, 0])
    return s, sq, mma, a, b, lv, smem_lat, smem_lv, smem_rope, smem_s, smem_p


@functools.lru_cache(maxsize=None)
def _build():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    MAX_INIT_C = gl.constexpr(MAX_INIT)
    BN, HN, NW, NR, DV = (gl.constexpr(BLOCK_N), gl.constexpr(HALF_N), gl.constexpr(WARPS), gl.constexpr(ROWS),
                          gl.constexpr(D_V))
    NT = gl.constexpr(Q_TERMS)
    D_R_C, QMAX = gl.constexpr(D_R), gl.constexpr(E4M3_MAX)
    # the tokens' four chunk scales: one 16-byte row a thread, at the score accumulator's rows
    SCL = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_N, 4]))
    ROPE_COL, SCALE_COL = gl.constexpr(ROPE_OFF // 2), gl.constexpr(SCALE_OFF // 4)   # in the bf16 / fp32 views

    @gluon.jit
    def _issue(kn_desc, kr_desc, ks_desc, ring, r_ring, s_ring, bars, slot, bt_row, n0, end, last_page,
               PAGE: gl.constexpr, BOX: gl.constexpr):
        """TMA of tokens n0 .. n0 + 63's rows into the rings' slot (BOX contiguous rows of one page at a time; the
        latent as one [4, 64, 128] box, or for smaller pages one [1, BOX, 128] box per chunk), on bars[.][slot];
        nothing when the step starts at or past end."""
        # each kind of copy on a barrier allocation of its own: the compiler orders every pair of shared-memory
        # writes to one allocation (a copy's arrival on its barrier is one) with a CTA barrier
        PARTS: gl.constexpr = BN // BOX
        if n0 < end:
            mbarrier.expect(bars[0].index(slot), BN * DV)
            mbarrier.expect(bars[1].index(slot), BN * 2 * D_R_C)
            mbarrier.expect(bars[2].index(slot), BN * 16)
            for part in gl.static_range(PARTS):
                tok = n0 + part * BOX
                page = gl.load(bt_row + gl.minimum(tok, end - 1) // PAGE)
                row = gl.minimum(gl.maximum(page, 0), last_page) * PAGE + tok % PAGE
                if PARTS == 1:   # the whole page: one [4, 64, 128] box (chunk, token, byte)
                    tma.async_copy_global_to_shared(kn_desc, [0, row, 0], bars[0].index(slot), ring.index(slot))
                else:            # a [1, BOX, 128] box per chunk
                    for c in gl.static_range(NW):
                        tma.async_copy_global_to_shared(kn_desc, [c, row, 0], bars[0].index(slot),
                                                        ring.index((slot * NW + c) * PARTS + part))
                tma.async_copy_global_to_shared(kr_desc, [row, ROPE_COL], bars[1].index(slot),
                                                r_ring.index(slot * PARTS + part))
                tma.async_copy_global_to_shared(ks_desc, [row, SCALE_COL], bars[2].index(slot),
                                                s_ring.index(slot * PARTS + part))

    @gluon.jit
    def _chunk_scores(ring8, cur, c: gl.constexpr, q_s, SQ: gl.constexpr):
        """The async e4m3 wgmma of step slot cur's chunk c [64 tokens, 128] against q's terms' chunk c."""
        return warpgroup_mma(ring8.index(cur * NW + c), q_s.slice(c * 128, 128, dim=1).permute((1, 0)),
                             gl.zeros([BN, NR * NT], gl.float32, SQ), use_acc=False, is_async=True)

    @gluon.jit
    def _scores(ring8, cur, r_tile, sc, q_s, qr_s, q_a, qk_scale, S: gl.constexpr, SQ: gl.constexpr):
        """[64 tokens, 16 rows] scores of a step (log2 units): per 128-column chunk one e4m3 wgmma of the raw codes
        against q's terms (N = 16 · Q_TERMS), times the tokens' chunk scales; the rope by a bf16 wgmma."""
        t0 = _chunk_scores(ring8, cur, 0, q_s, SQ)
        t1 = _chunk_scores(ring8, cur, 1, q_s, SQ)
        t2 = _chunk_scores(ring8, cur, 2, q_s, SQ)
        t3 = _chunk_scores(ring8, cur, 3, q_s, SQ)
        tr = warpgroup_mma(r_tile, qr_s.permute((1, 0)), gl.zeros([BN, NR], gl.float32, S), use_acc=False,
                           is_async=True)
        even, odd = gl.split(gl.reshape(sc, [BN, 2, 2]))   # chunks 0, 2 / 1, 3
        sc0, sc2 = gl.split(even)
        sc1, sc3 = gl.split(odd)
        a0, a1, a2, a3, ar = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3, tr))
        ROWL: gl.constexpr = gl.SliceLayout(1, SQ)
        lat_s = a0 * gl.convert_layout(sc0, ROWL, assert_trivial=True)[:, None]
        lat_s += a1 * gl.convert_layout(sc1, ROWL, assert_trivial=True)[:, None]
        lat_s += a2 * gl.convert_layout(sc2, ROWL, assert_trivial=True)[:, None]
        lat_s += a3 * gl.convert_layout(sc3, ROWL, assert_trivial=True)[:, None]
        hi, lo = gl.split(gl.permute(gl.reshape(lat_s, [BN, NT, NR]), [0, 2, 1]))   # q's two terms
        s = gl.convert_layout(hi + lo * 0.0625, S, assert_trivial=True)
        return (s * q_a[None, :] + ar) * qk_scale

    @gluon.jit
    def _step(ring8, ring_lv, r_ring, s_ring, cur, q_s, qr_s, q_a, p_buf, mx_buf, m_i, m_pv, l_acc, acc, n0, visible,
              ok_end, qk_scale, ref_inv, MASKED: gl.constexpr, S: gl.constexpr, SQ: gl.constexpr, A: gl.constexpr,
              B: gl.constexpr, LV: gl.constexpr):
        """One step of 64 tokens (n0 ..): the scores, the online softmax (the rows' max over the four warps' tokens
        through mx_buf), P per chunk through p_buf, each warp's P·V over its chunk in two 32-token halves. MASKED:
        tokens at or past a row's visible count are kept out, and rows at or past ok_end (whatever TMA brought from
        past the split) are zeroed in V and the scales. m_i / m_pv: the running max in the scores' and the
        accumulator's row layouts."""
        sc = s_ring.index(cur).load(SCL)
        if MASKED:
            tks = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, SCL))
            sc = gl.where((tks < ok_end)[:, None], sc, 0.0)   # rows past the split: 0, not NaN, in P · scale
        s = _scores(ring8, cur, r_ring.index(cur), sc, q_s, qr_s, q_a, qk_scale, S, SQ)
        if MASKED:
            tok = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, S))
            s = gl.where(tok[:, None] < visible[None, :], s, float("-inf"))
        # each warp's max over its 16 tokens (shuffles), the four through shared memory (one barrier), read in both
        # row layouts
        mx_buf.store(gl.max(gl.reshape(s, [NW, BN // NW, NR]), axis=1))
        gl.thread_barrier()
        MXS: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 8], [1, 0], [2, 0]], lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
            warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[NW, NR])
        MXP: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 8], [1, 0], [2, 0]], lane_bases=[[0, 0], [0, 0], [0, 1], [0, 2], [0, 4]],
            warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[NW, NR])
        ARL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, A.parent))
        m_new = gl.maximum(m_i, gl.convert_layout(gl.max(mx_buf.load(MXS), axis=0), gl.SliceLayout(0, S),
                                                  assert_trivial=True))
        m_pv_new = gl.maximum(m_pv, gl.convert_layout(gl.max(mx_buf.load(MXP), axis=0), ARL, assert_trivial=True))
        p = gl.exp2(s - m_new[None, :])
        l_acc = l_acc * gl.exp2(m_i - m_new)[None, :] + p
        # P times each chunk's scales relative to the program's (ref_inv: p times a scale of ~|latent| / 448 would
        # underflow fp16 at small latents), the four [64, 16] in one store
        even, odd = gl.split(gl.reshape(sc * ref_inv[None, :], [BN, 2, 2]))   # chunks 0, 2 / 1, 3
        sc0, sc2 = gl.split(even)
        sc1, sc3 = gl.split(odd)
        ROWS_S: gl.constexpr = gl.SliceLayout(1, S)
        p0 = p * gl.convert_layout(sc0, ROWS_S, assert_trivial=True)[:, None]
        p1 = p * gl.convert_layout(sc1, ROWS_S, assert_trivial=True)[:, None]
        p2 = p * gl.convert_layout(sc2, ROWS_S, assert_trivial=True)[:, None]
        p3 = p * gl.convert_layout(sc3, ROWS_S, assert_trivial=True)[:, None]
        p4 = gl.join(gl.join(p0, p2), gl.join(p1, p3))          # [64, 16, i, k]: chunk 2 i + k
        p_buf.store(gl.reshape(gl.permute(p4, [2, 3, 0, 1]), [NW, BN, NR]).to(gl.float16))
        acc = acc * gl.exp2(m_pv - m_pv_new)[None, :, None]
        gl.thread_barrier()
        lv = ring_lv.index(cur)
        for h in gl.static_range(BN // HN):
            pa = p_buf.slice(h * HN, HN, dim=1).permute((0, 2, 1)).load(A)      # [4, 16, 32]
            vx = lv.slice(h * HN, HN, dim=1).load(LV).to(gl.float8e4nv, bitcast=True).to(gl.float16)
            if MASKED:
                tv = n0 + h * HN + gl.arange(0, HN, layout=gl.SliceLayout(0, gl.SliceLayout(2, LV)))
                vx = gl.where((tv < ok_end)[None, :, None], vx, gl.zeros_like(vx))   # 0 · NaN would be NaN
            vx = gl.reshape(gl.permute(gl.reshape(vx, [NW, HN, 8, 16]), [0, 1, 3, 2]), [NW, HN, 128])
            acc = mma_v2(pa, gl.convert_layout(vx, B, assert_trivial=True), acc)
        return m_new, m_pv_new, l_acc, acc

    @gluon.jit
    def mla_decode_rows16_gluon_kernel(
        Q, kn_desc, kr_desc, ks_desc, BLOCK_TABLE, SEQLENS, O_PART, LSE_PART,
        stride_qb, stride_qs, stride_qh, stride_bt,
        stride_ps, stride_pb,  # partials: [split, b, rows, 512] and [split, b, rows]; FINAL: out as [1, b, rows, 512]
        stride_ls, stride_lb,
        qk_scale, capacity, last_page, n_splits,
        H_Q: gl.constexpr, S_Q: gl.constexpr, PAGE: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr,
        STAGES: gl.constexpr,
        S: gl.constexpr, SQ: gl.constexpr, MMA: gl.constexpr, A: gl.constexpr, B: gl.constexpr, LV: gl.constexpr,
        SMEM_LAT: gl.constexpr, SMEM_LV: gl.constexpr, SMEM_ROPE: gl.constexpr,
        SMEM_S: gl.constexpr, SMEM_P: gl.constexpr,
    ):
        """Program b · n_splits + split. Lengths are clamped to [0, capacity] and page ids to [0, last_page]
        (unchecked values under a CUDA-graph capture must not read outside the tensors). Query row r = j · H_Q + h."""
        BOX: gl.constexpr = BN if PAGE >= BN else PAGE   # rows a TMA box takes: contiguous within a page
        PARTS: gl.constexpr = BN // BOX
        gl.static_assert(kn_desc.block_type.shape[1] == BOX, "the descriptors' boxes must be the kernel's BOX rows")
        split = gl.program_id(0) % n_splits
        b64 = (gl.program_id(0) // n_splits).to(gl.int64)
        length = gl.minimum(gl.maximum(gl.load(SEQLENS + b64), 0), capacity)
        per_split = gl.cdiv(gl.cdiv(length, n_splits), BN) * BN
        start = split * per_split
        end = gl.minimum(start + per_split, length)
        n_steps = gl.maximum(gl.cdiv(end - start, BN), 0)
        bt_row = BLOCK_TABLE + b64 * stride_bt

        # rings: slot s's chunk c is the [64, 128] tile (s · 4 + c) (TMA writes it in [BOX, 128] boxes)
        CB: gl.constexpr = NW if PARTS == 1 else 1      # chunks a TMA box takes
        ring_tma = gl.allocate_shared_memory(gl.uint8, [STAGES * NW * PARTS // CB, CB, BOX, 128], SMEM_LV)
        ring8 = ring_tma._reinterpret(gl.float8e4nv, [STAGES * NW, BN, 128], SMEM_LAT)
        ring_lv = ring_tma._reinterpret(gl.uint8, [STAGES, NW, BN, 128], SMEM_LV)
        r_tma = gl.allocate_shared_memory(gl.bfloat16, [STAGES * PARTS, BOX, D_R_C], SMEM_ROPE)
        r_ring = r_tma._reinterpret(gl.bfloat16, [STAGES, BN, D_R_C], SMEM_ROPE)
        s_tma = gl.allocate_shared_memory(gl.float32, [STAGES * PARTS, BOX, 4], SMEM_S)
        s_ring = s_tma._reinterpret(gl.float32, [STAGES, BN, 4], SMEM_S)
        bars = (gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout()),
                gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout()),
                gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout()))
        for i in gl.static_range(STAGES):
            for j in gl.static_range(3):
                mbarrier.init(bars[j].index(i), count=1)
        for i in gl.static_range(STAGES - 1):
            _issue(kn_desc, kr_desc, ks_desc, ring_tma, r_tma, s_tma, bars, i, bt_row, start + i * BN, end,
                   last_page, PAGE, BOX)

        # q: the latent part as NT e4m3 terms of q / a (a = the row's amax / 448; term j in rows 16 j ..), the score
        # wgmmas' B operand per chunk; the rope part in bf16
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        r = gl.arange(0, NR, layout=gl.SliceLayout(1, QL))
        k = gl.arange(0, DV, layout=gl.SliceLayout(0, QL))
        q_row = b64 * stride_qb + (r // H_Q).to(gl.int64) * stride_qs + (r % H_Q).to(gl.int64) * stride_qh
        live = r < H_Q * S_Q
        qv = gl.load(Q + q_row[:, None] + k[None, :], mask=live[:, None], other=0.0).to(gl.float32)
        amax = gl.max(gl.abs(qv), axis=1)
        qa = gl.where(amax > 0, amax / QMAX, 1.0)
        x = qv / qa[:, None]
        q_s = gl.allocate_shared_memory(gl.float8e4nv, [NR * NT, DV], SMEM_LAT)   # chunk c: columns 128 c ..
        t = x.to(gl.float8e4nv)
        q_s.slice(0, NR, dim=0).store(t)
        if NT == 2:
            q_s.slice(NR, NR, dim=0).store(((x - t.to(gl.float32)) * 16.0).to(gl.float8e4nv))
        kr = gl.arange(0, D_R_C, layout=gl.SliceLayout(0, QL))
        qr = gl.load(Q + q_row[:, None] + DV + kr[None, :], mask=live[:, None], other=0.0).to(gl.bfloat16)
        qr_s = gl.allocate_shared_memory(gl.bfloat16, [NR, D_R_C], SMEM_ROPE)
        qr_s.store(qr)
        q_a = gl.convert_layout(qa, gl.SliceLayout(0, S))
        # P per chunk (times the tokens' chunk scales) for P·V, fp16
        p_buf = gl.allocate_shared_memory(gl.float16, [NW, BN, NR], SMEM_P)
        mx_buf = gl.allocate_shared_memory(gl.float32, [NW, NR], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        fence_async_shared()
        gl.thread_barrier()

        COL: gl.constexpr = gl.SliceLayout(0, S)       # [16]: per query row
        rs = gl.arange(0, NR, layout=COL)
        if CAUSAL:
            visible = length - S_Q + 1 + rs // H_Q      # row r sees tokens < visible (bottom-right aligned)
        else:
            visible = length + 0 * rs
        m_i = gl.full([NR], MAX_INIT_C, gl.float32, COL)
        m_pv = gl.full([NR], MAX_INIT_C, gl.float32, gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
        l_acc = gl.zeros([BN, NR], gl.float32, S)       # summed over tokens at the end
        acc = gl.zeros([NW, NR, 128], gl.float32, MMA)
        # the four chunks' reference scales: the largest of the first step's tokens (1 for an all-zero chunk; the
        # portable kernel takes the same), in P · V relative to them and put back on the output
        ref = gl.full([4], 1.0, gl.float32, gl.SliceLayout(0, SCL))
        if n_steps > 0:
            mbarrier.wait(bars[2].index(0), 0)
            first = gl.where((start + gl.arange(0, BN, layout=gl.SliceLayout(1, SCL)) < end)[:, None],
                             s_ring.index(0).load(SCL), 0.0)
            first_max = gl.max(first, axis=0)
            ref = gl.where(first_max > 0.0, first_max, 1.0)
        ref_inv = 1.0 / ref
        if CAUSAL:
            full_end = gl.minimum(end, length - S_Q + 1)
        else:
            full_end = end
        for i in range(n_steps):
            cur = i % STAGES
            for j in gl.static_range(3):
                mbarrier.wait(bars[j].index(cur), (i // STAGES) & 1)
            gl.thread_barrier()   # step i - 1's slot read by every warp before TMA overwrites it
            _issue(kn_desc, kr_desc, ks_desc, ring_tma, r_tma, s_tma, bars, (i + STAGES - 1) % STAGES, bt_row,
                   start + (i + STAGES - 1) * BN, end, last_page, PAGE, BOX)
            n0 = start + i * BN
            if n0 + BN <= full_end:
                m_i, m_pv, l_acc, acc = _step(ring8, ring_lv, r_ring, s_ring, cur, q_s, qr_s, q_a, p_buf, mx_buf, m_i,
                                              m_pv, l_acc, acc, n0, visible, end, qk_scale, ref_inv, False, S, SQ, A, B,
                                              LV)
            else:
                m_i, m_pv, l_acc, acc = _step(ring8, ring_lv, r_ring, s_ring, cur, q_s, qr_s, q_a, p_buf, mx_buf, m_i,
                                              m_pv, l_acc, acc, n0, gl.minimum(visible, end), end, qk_scale, ref_inv,
                                              True, S, SQ, A, B, LV)
        for i in gl.static_range(STAGES):
            for j in gl.static_range(3):
                mbarrier.invalidate(bars[j].index(i))

        l_i = gl.sum(l_acc, axis=0)
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        out = acc * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(0, gl.SliceLayout(2, MMA)))[None, :, None] * \
            gl.convert_layout(ref, gl.SliceLayout(1, gl.SliceLayout(2, MMA)))[:, None, None]   # chunk = warp
        wo = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
        ro = gl.arange(0, NR, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
        n = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
        o_col = (wo * 128)[:, None, None] + (((n & 7) << 4) | (n >> 3))[None, None, :]   # sigma_v
        o_ptrs = O_PART + split.to(gl.int64) * stride_ps + b64 * stride_pb + (ro.to(gl.int64) * DV)[None, :, None]
        o_mask = (wo >= 0)[:, None, None] & (ro < H_Q * S_Q)[None, :, None] & (n >= 0)[None, None, :]
        gl.store(o_ptrs + o_col, out.to(O_PART.dtype.element_ty), mask=o_mask)
        VEC: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        lse2 = gl.convert_layout(gl.where(empty, float("-inf"), m_i + gl.log2(l_safe)), VEC)  # [16]
        rv = gl.arange(0, NR, layout=VEC)
        if FINAL:
            gl.store(LSE_PART + b64 * stride_lb + (rv % H_Q) * S_Q + rv // H_Q, lse2 * 0.6931471805599453,
                     mask=rv < H_Q * S_Q)
        else:
            gl.store(LSE_PART + split.to(gl.int64) * stride_ls + b64 * stride_lb + rv, lse2, mask=rv < H_Q * S_Q)

    return mla_decode_rows16_gluon_kernel, gl


def available() -> bool:
    """This Triton's Gluon is one the kernel was written for (and imports)."""
    from .._gluon import builds
    return builds(_build, GLUON_TRITON_VERSIONS)


def cache_ok(kv_cache: torch.Tensor) -> bool:
    """An FP8 cache TMA reads as it is (else api runs the portable kernel): at least one page, one byte an element,
    16-byte aligned base, 656-byte rows one after another (the stride the H200 tests ran; TMA would take any
    multiple of 16), page size 16 / 32 / 64, fewer than 2^31 rows (TMA's int32 coordinates)."""
    pages, page, _, width = kv_cache.shape
    return (pages > 0 and kv_cache.element_size() == 1 and kv_cache.data_ptr() % 16 == 0 and page in (16, 32, 64)
            and width == ROW_BYTES and kv_cache.stride(3) == 1 and kv_cache.stride(1) == ROW_BYTES
            and kv_cache.stride(0) == page * ROW_BYTES and pages * page < 2 ** 31)


def _descriptors(kv_cache, layouts):
    """(latent, rope, scales) TMA descriptors over the cache's rows: the latent as bytes [4, rows, 128] (chunk, row,
    byte) in [4, 64, 128] boxes (pages of 64 or more) or [1, box, 128], the rope as bf16 [rows, 328] in [box, 64],
    the scales as fp32 [rows, 164] in [box, 4] (box: 64 rows, or the page). layouts: (SMEM_LV, SMEM_ROPE, SMEM_S)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    box = min(BLOCK_N, kv_cache.shape[1])
    smem_lv, smem_rope, smem_s = layouts

    def view(dtype, cols, layout):
        v = kv_cache.view(dtype)
        return TensorDescriptor(v, [rows, v.shape[3]], [v.stride(1), 1], [box, cols], layout)
    # [chunk, row, byte]: the chunk outermost, so that a box lands as four [box, 128] chunk tiles
    latent = TensorDescriptor(kv_cache, [4, rows, 128], [128, kv_cache.stride(1), 1],
                              [4 if box == BLOCK_N else 1, box, 128], smem_lv)
    return latent, view(torch.bfloat16, D_R, smem_rope), view(torch.float32, 4, smem_s)


def launch_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, o_part, lse_part, final, stages):
    """(kernel, grid, args, constexpr kwargs) of one launch; shared by mla_decode_rows16_gluon and the compile
    check. o_part / lse_part: out as [1, b, rows, 512] and lse [b, h_q, s_q] when final, else the partials."""
    assert stages >= 2, "the ring needs two slots (one is waited on while the next lands)"
    kernel, gl = _build()
    b, s_q, h_q, _ = q.shape
    num_splits = o_part.shape[0]
    s, sq, mma, a, bl, lv, smem_lat, smem_lv, smem_rope, smem_s, smem_p = _layouts(gl)
    kn_desc, kr_desc, ks_desc = _descriptors(kv_cache.view(torch.uint8), (smem_lv, smem_rope, smem_s))
    args = (q, kn_desc, kr_desc, ks_desc, block_table, cache_seqlens, o_part, lse_part,
            q.stride(0), q.stride(1), q.stride(2), block_table.stride(0),
            o_part.stride(0), o_part.stride(1), 0 if final else lse_part.stride(0), lse_part.stride(0 if final else 1),
            softmax_scale * LOG2E, block_table.shape[1] * kv_cache.shape[1] if kv_cache.shape[0] else 0,
            max(kv_cache.shape[0] - 1, 0), num_splits)
    meta = dict(H_Q=h_q, S_Q=s_q, PAGE=kv_cache.shape[1], CAUSAL=bool(causal), FINAL=bool(final), STAGES=stages,
                S=s, SQ=sq, MMA=mma, A=a, B=bl, LV=lv, SMEM_LAT=smem_lat, SMEM_LV=smem_lv,
                SMEM_ROPE=smem_rope, SMEM_S=smem_s, SMEM_P=smem_p, num_warps=WARPS, maxnreg=MAX_REGS)
    return kernel, (num_splits * b,), args, meta


def mla_decode_rows16_gluon(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, num_splits, stages):
    """The path of mla_decode_fwd that api's rows16 gate sends here: (out, lse) as the portable launcher returns
    them, through the same partials + combine_splits when num_splits > 1."""
    from .decode_kernel import split_decode

    def launch(o_part, lse_part, final):
        kernel, grid, args, meta = launch_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, o_part,
                                               lse_part, final, stages)
        kernel[grid](*args, **meta)
    return split_decode(q, num_splits, launch)


# ------------------------------------------------------------------------------------ compile-only check
def compile_sm90(h_q=16, s_q=1, causal=False, num_splits=1, page=64, stages=2, arch=90):
    """Compile for sm_<arch> without a GPU (ops/_gluon.py): PTX features, warps, shared memory, the kernel."""
    from .._gluon import compile_report
    b, pages, max_pages = 2, 8, 4
    q = torch.empty(b, s_q, h_q, D_V + D_R, dtype=torch.bfloat16)
    cache = torch.empty(pages, page, 1, 656, dtype=torch.uint8)
    table = torch.zeros(b, max_pages, dtype=torch.int32)
    lens = torch.zeros(b, dtype=torch.int32)
    from .decode_kernel import decode_outputs
    final = num_splits == 1
    _, _, o_part, lse_part = decode_outputs(q, num_splits)
    kernel, grid, args, meta = launch_args(q, cache, table, lens, (D_V + D_R) ** -0.5, causal, o_part, lse_part,
                                           final, stages)
    return compile_report(kernel, args, grid, meta, arch)
