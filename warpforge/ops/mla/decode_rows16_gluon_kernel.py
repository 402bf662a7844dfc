"""MLA decode of at most 16 query rows a request (h_q · s_q <= 16: 16-head shards at s_q 1) over an FP8 cache, for
Hopper (sm_90) in Gluon: each warp one 128-wide chunk of the latent, a TMA ring of the raw rows, mma.sync.

The same problem and outputs as decode_kernel.mla_decode_split_kernel for the case the api gate sends here (dense
block table, an FP8 cache whose pages are contiguous rows, bf16 q, rows <= 16, page size 16 / 32 / 64): program
(request · split) walks its split's tokens BLOCK_N = 32 at a time and writes the split's partials (o_part [split, b,
rows, 512] fp32, lse_part [split, b, rows] in log2 units, for combine_splits) or, with one split, the final out /
lse.

Why this kernel: at 16 rows decode is bound by reading the cache (656 bytes a token against bf16's 1152), but the
64-row kernel (decode_gluon_kernel.py) pads 16 rows to 64 for wgmma and converts in shared memory, and the
portable kernel waits for every copy at the top of each step. This is paged decode's Gluon design
(ops/paged/decode_gluon_kernel.py, measured there) with the warps cutting the latent instead of the tokens:
- a step's 32 rows come in by TMA (per 32 or 16 contiguous rows of a page: the latent as one [rows, 4, 128] box,
  the rope, the scales, each copy on an mbarrier of its own) into a ring slot; per-thread 16-byte cp.async of the
  same bytes ran at 2.3-2.7 TB/s with no math at all (benchmarks/NOTES.md, session 21);
- warp w owns latent columns [128 w, 128 w + 128) (FP8's scale group w) and rope columns [16 w, 16 w + 16): it
  reads its chunk once as Kᵀ and once as V in the two register layouts (LK, LV) whose e4m3 -> fp16 values are the
  mma.sync B fragments (checked at compile time: `convert_layout(..., assert_trivial=True)`; the head dim
  relabelled through sigma_k / sigma_v, composed into q's load and the output's store), and keeps O[:, its 128
  columns] (fp32, 64 registers a thread);
- scores: each warp's q_w · K_wᵀ times the rows' chunk-w scales, plus its rope slice (bf16 dot), summed over the
  four warps (one cross-warp reduction through shared memory a step); every warp then runs the same online softmax;
- P·V: p times the rows' chunk-w scales, in fp16, times the warp's V chunk into its accumulator.
Dots in fp16 as the portable FP8 path runs them (e4m3 -> fp16 is one cvt a pair and exact; q rounds to fp16 within
its range; the probabilities times a power-of-two scale round to fp16); the rope dot in bf16; fp32 accumulation.

Where it stands (H200, b 128, h_q 16): 0.63x / 0.76x the bf16 cache's speed at L 4k / 16k, 12-22% faster than the
portable kernel; bound by the latency of its per-step chain, not by memory (the copies alone reach 3-4 TB/s) nor by
the conversions (benchmarks/NOTES.md, session 21, with the variants to try next).

Gluon's API changes between Triton releases: everything here is imported lazily (`available()`), and api.py only
dispatches here on sm_90 with a Triton in GLUON_TRITON_VERSIONS.
"""
from __future__ import annotations

import functools

import torch

LOG2E = 1.4426950408889634
D_V = 512
D_R = 64
ROWS = 16           # query rows per program: one mma.sync M
WARPS = 4           # one per 128-column chunk of the latent
BLOCK_N = 32        # cache tokens per step
ROW_BYTES = 656     # FP8 row: 512 e4m3, 4 fp32 scales, 64 bf16 rope (kv_format.py)
SCALE_OFF = 512
ROPE_OFF = 528
GLUON_TRITON_VERSIONS = ("3.6",)  # Triton releases whose Gluon API this file was written and compiled against
MAX_REGS = 168    # three programs an SM (65536 registers / 384 threads, in units of 8)
MAX_INIT = -1.0e30  # finite running-max start: exp2(MAX_INIT - MAX_INIT) = 1 and exp2(-inf - MAX_INIT) = 0


def sigma_k(k: int) -> int:
    """The chunk column the score dot's logical column k reads (LK's relabelling, as in paged decode)."""
    return (k & 1) | (((k >> 3) & 15) << 1) | (((k >> 1) & 3) << 5)


def sigma_v(n: int) -> int:
    """The chunk (and output) column P·V's logical column n holds (LV's relabelling)."""
    return ((n & 7) << 4) | (n >> 3)


def _layouts(gl):
    """(MMA, ALL, A, B, LK, LV, SMEM, SMEM_TMA, SMEM_ROPE, SMEM_S). LK / LV hold the step's 32 rows as [32, 4, 128]
    bytes (token, chunk = warp, column) with 32 (LK) or 16 (LV) consecutive columns of a row in one thread's
    registers: permuted to [4, 32, 128], converted to fp16 and reshaped so that logical column k is chunk column
    sigma_k(k) (sigma_v for V), they are the mma.sync B fragments of K_wᵀ [128, 32] and V_w [32, 128] with no data
    movement. SMEM (= SMEM_TMA): the latent ring, the 128-byte swizzle over the flattened (token, chunk) lines, as
    TMA writes it and LK / LV read it; SMEM_ROPE / SMEM_S the rope's and scales' rings."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1], instr_shape=[1, 16, 8])
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # [4, 16, 32] with all four warps' partial scores in every warp, each [16, 32] at the accumulator's positions
    # (m16n8 fragments: lane = 4 · row + col / 2, registers col + 1, row + 8, then the n tiles)
    every = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 8, 0], [0, 0, 8], [0, 0, 16], [1, 0, 0], [2, 0, 0]],
        lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=[[0, 0, 0], [0, 0, 0]],
        block_bases=[], shape=[WARPS, ROWS, BLOCK_N])
    # over the tile as TMA lays it out, [32, 4, 128] (token, chunk, byte); permuted to [4, 32, 128] in registers
    warps = [[0, 1, 0], [0, 2, 0]]
    lk = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16], [8, 0, 0], [16, 0, 0]],
        lane_bases=[[0, 0, 32], [0, 0, 64], [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp_bases=warps, block_bases=[],
        shape=[BLOCK_N, WARPS, 128])
    lv = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [1, 0, 0], [8, 0, 0], [16, 0, 0]],
        lane_bases=[[2, 0, 0], [4, 0, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]], warp_bases=warps, block_bases=[],
        shape=[BLOCK_N, WARPS, 128])
    # a row's 512 latent bytes as 4 x 128 with the 128-byte swizzle over the flattened (token, chunk) line: LK / LV
    # read 8 lines of one chunk a wavefront (lines 4 t + w: phases w and w + 4 only), 4 wavefronts an LDS.128, the
    # fewest 512 bytes take
    smem = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)
    smem_tma = smem
    smem_rope = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    smem_s = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return mma, every, a, b, lk, lv, smem, smem_tma, smem_rope, smem_s


@functools.lru_cache(maxsize=None)
def _build():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    MAX_INIT_C = gl.constexpr(MAX_INIT)
    BN, NW, NR, DV = gl.constexpr(BLOCK_N), gl.constexpr(WARPS), gl.constexpr(ROWS), gl.constexpr(D_V)
    D_R_C = gl.constexpr(D_R)
    ROPE_COL, SCALE_COL = gl.constexpr(ROPE_OFF // 2), gl.constexpr(SCALE_OFF // 4)   # in the bf16 / fp32 views

    @gluon.jit
    def _issue(kn_desc, kr_desc, ks_desc, ring, r_ring, s_ring, bars, slot, bt_row, n0, end, last_page,
               PAGE: gl.constexpr, BOX: gl.constexpr):
        """TMA of tokens n0 .. n0 + 31's rows into the rings' slot (BOX contiguous rows of one page at a time), on
        bars[slot]; nothing when the step starts at or past end (it is never waited for)."""
        # each copy on a barrier of its own: the compiler orders every pair of shared-memory writes to one
        # allocation (a copy's arrival on its barrier is one) with a CTA barrier
        if n0 < end:
            mbarrier.expect(bars[0].index(slot), BN * DV)
            mbarrier.expect(bars[1].index(slot), BN * 2 * D_R_C)
            mbarrier.expect(bars[2].index(slot), BN * 16)
            for part in gl.static_range(BN // BOX):
                tok = n0 + part * BOX
                page = gl.load(bt_row + gl.minimum(tok, end - 1) // PAGE)
                row = gl.minimum(gl.maximum(page, 0), last_page) * PAGE + tok % PAGE
                tma.async_copy_global_to_shared(kn_desc, [row, 0, 0], bars[0].index(slot),
                                                ring.index(slot * (BN // BOX) + part))
                tma.async_copy_global_to_shared(kr_desc, [row, ROPE_COL], bars[1].index(slot),
                                                r_ring.index(slot * (BN // BOX) + part))
                tma.async_copy_global_to_shared(ks_desc, [row, SCALE_COL], bars[2].index(slot),
                                                s_ring.index(slot * (BN // BOX) + part))

    @gluon.jit
    def _step(tile, r_tile, s_tile, s_buf, qa, qra, m_i, l_i, acc, n0, visible, ok_end, qk_scale,
              MASKED: gl.constexpr, MMA: gl.constexpr, ALL: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
              LK: gl.constexpr, LV: gl.constexpr):
        """One step of 32 tokens (n0 ..): scores summed over the warps, the online softmax, each warp's P·V.
        MASKED: tokens at or past a row's visible count are kept out, and rows at or past ok_end (whatever TMA
        brought from past the split) are zeroed in V and the scales (else all are seen)."""
        # [4, 32]: row t's chunk-w scale, loaded as [32, 4] in the transpose of the scores' column layout and
        # transposed in registers (a transposed view of the unswizzled TMA tile read the wrong words on the H200,
        # test_gpu_shared_views_read_what_tma_wrote; a layout conversion would cost two CTA barriers a step)
        SCT: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[1, 0], [8, 0], [16, 0]], lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]],
            warp_bases=[[0, 1], [0, 2]], block_bases=[], shape=[BN, NW])
        sc = gl.convert_layout(gl.permute(s_tile.load(SCT), [1, 0]), gl.SliceLayout(1, MMA), assert_trivial=True)
        kx = gl.permute(tile.load(LK), [1, 0, 2]).to(gl.float8e4nv, bitcast=True).to(gl.float16)
        kx = gl.reshape(gl.permute(gl.reshape(kx, [NW, BN, 4, 16, 2]), [0, 1, 3, 2, 4]), [NW, BN, 128])
        kb = gl.convert_layout(gl.permute(kx, [0, 2, 1]), B, assert_trivial=True)
        s = mma_v2(qa, kb, gl.zeros([NW, NR, BN], gl.float32, MMA)) * sc[:, None, :]
        krb = r_tile.reshape([BN, NW, 16]).permute([1, 2, 0]).load(B)   # warp w: rope columns 16 w ..
        s = mma_v2(qra, krb, s)
        # the four warps' partials summed: each stores its own, every warp reads all four at its own positions (one
        # barrier; the loop's barrier orders the next step's stores after these loads)
        s_buf.store(s)
        gl.thread_barrier()
        s = gl.sum(s_buf.load(ALL), axis=0)
        s = gl.expand_dims(gl.convert_layout(s, gl.SliceLayout(0, MMA), assert_trivial=True), 0) * qk_scale
        # s: [1, 16, 32], the same in every warp
        vx = gl.permute(tile.load(LV), [1, 0, 2]).to(gl.float8e4nv, bitcast=True).to(gl.float16)
        if MASKED:
            tok = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
            seen = tok[None, None, :] < visible[None, :, None]
            s = gl.where(seen, s, float("-inf"))
            sc = gl.where((tok < ok_end)[None, :], sc, 0.0)
            tv = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, vx.type.layout)))
            vx = gl.where((tv < ok_end)[None, :, None], vx, gl.zeros_like(vx))   # 0 · NaN would be NaN
        m_new = gl.maximum(m_i, gl.max(s, axis=2))
        p = gl.exp2(s - m_new[:, :, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=2)
        pa = gl.convert_layout((p * sc[:, None, :]).to(gl.float16), A, assert_trivial=True)
        vx = gl.reshape(gl.permute(gl.reshape(vx, [NW, BN, 8, 16]), [0, 1, 3, 2]), [NW, BN, 128])
        vb = gl.convert_layout(vx, B, assert_trivial=True)
        return m_new, l_i, mma_v2(pa, vb, acc * alpha[:, :, None])

    @gluon.jit
    def mla_decode_rows16_gluon_kernel(
        Q, kn_desc, kr_desc, ks_desc, BLOCK_TABLE, SEQLENS, O_PART, LSE_PART,
        stride_qb, stride_qs, stride_qh, stride_bt,
        stride_ps, stride_pb,  # partials: [split, b, rows, 512] and [split, b, rows]; FINAL: out as [1, b, rows, 512]
        stride_ls, stride_lb,
        qk_scale, capacity, last_page, n_splits,
        H_Q: gl.constexpr, S_Q: gl.constexpr, PAGE: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr,
        STAGES: gl.constexpr,
        MMA: gl.constexpr, ALL: gl.constexpr, A: gl.constexpr, B: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr,
        SMEM: gl.constexpr, SMEM_TMA: gl.constexpr, SMEM_ROPE: gl.constexpr, SMEM_S: gl.constexpr,
    ):
        """Program b · n_splits + split. Lengths are clamped to [0, capacity] and page ids to [0, last_page]
        (unchecked values under a CUDA-graph capture must not read outside the tensors). Query row r = j · H_Q + h."""
        BOX: gl.constexpr = BN if PAGE >= BN else PAGE   # rows a TMA box takes: contiguous within a page
        gl.static_assert(kn_desc.block_type.shape[0] == BOX, "the descriptors' boxes must be the kernel's BOX rows")
        split = gl.program_id(0) % n_splits
        b64 = (gl.program_id(0) // n_splits).to(gl.int64)
        length = gl.minimum(gl.maximum(gl.load(SEQLENS + b64), 0), capacity)
        per_split = gl.cdiv(gl.cdiv(length, n_splits), BN) * BN
        start = split * per_split
        end = gl.minimum(start + per_split, length)
        n_steps = gl.maximum(gl.cdiv(end - start, BN), 0)
        bt_row = BLOCK_TABLE + b64 * stride_bt

        # TMA writes [BOX, 128]-byte boxes (one per chunk) and the [BOX, 64] rope and [BOX, 4] scales; the step reads
        # the same bytes as a [4, 32, 128] latent tile (LK / LV), [32, 64] rope, [32, 4] scales
        ring_tma = gl.allocate_shared_memory(gl.uint8, [STAGES * (BN // BOX), BOX, NW, 128], SMEM_TMA)
        ring = ring_tma._reinterpret(gl.uint8, [STAGES, BN, NW, 128], SMEM)
        r_tma = gl.allocate_shared_memory(gl.bfloat16, [STAGES * (BN // BOX), BOX, D_R_C], SMEM_ROPE)
        r_ring = r_tma._reinterpret(gl.bfloat16, [STAGES, BN, 64], SMEM_ROPE)
        s_tma = gl.allocate_shared_memory(gl.float32, [STAGES * (BN // BOX), BOX, 4], SMEM_S)
        s_ring = s_tma._reinterpret(gl.float32, [STAGES, BN, 4], SMEM_S)
        bars = (gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout()),
                gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout()),
                gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout()))
        for i in gl.static_range(STAGES):
            for j in gl.static_range(3):
                mbarrier.init(bars[j].index(i), count=1)
        # the warps' score partials: 2-float vectors XOR-swizzled by the row, so the accumulator fragments' stores
        # and loads are conflict-free
        s_buf = gl.allocate_shared_memory(gl.float32, [NW, NR, BN], gl.SwizzledSharedLayout(2, 1, 8, order=[2, 1, 0]))
        for i in gl.static_range(STAGES - 1):
            _issue(kn_desc, kr_desc, ks_desc, ring_tma, r_tma, s_tma, bars, i, bt_row, start + i * BN, end,
                   last_page, PAGE, BOX)

        # q: warp w's latent chunk in fp16 through sigma_k (exact from bf16 within fp16's range), its rope slice in
        # bf16, loaded straight into the dot operand layout (a layout conversion would take 8 KB of shared memory);
        # the softmax scale (log2 units) multiplies the fp32 scores
        w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, A)))
        r = gl.arange(0, NR, layout=gl.SliceLayout(0, gl.SliceLayout(2, A)))
        k = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, A)))
        col = (k & 1) | (((k >> 3) & 15) << 1) | (((k >> 1) & 3) << 5)   # sigma_k
        q_row = b64 * stride_qb + (r // H_Q).to(gl.int64) * stride_qs + (r % H_Q).to(gl.int64) * stride_qh
        q_mask = (w >= 0)[:, None, None] & (r < H_Q * S_Q)[None, :, None] & (k >= 0)[None, None, :]
        qa = gl.load(Q + q_row[None, :, None] + (w * 128)[:, None, None] + col[None, None, :], mask=q_mask,
                     other=0.0).to(gl.float16)
        k = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, A)))
        q_mask = (w >= 0)[:, None, None] & (r < H_Q * S_Q)[None, :, None] & (k >= 0)[None, None, :]
        qra = gl.load(Q + q_row[None, :, None] + (DV + w * 16)[:, None, None] + k[None, None, :], mask=q_mask,
                      other=0.0).to(gl.bfloat16)

        ROW: gl.constexpr = gl.SliceLayout(2, MMA)      # [1, 16]: per query row, the same in every warp
        rs = gl.arange(0, NR, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
        if CAUSAL:
            visible = length - S_Q + 1 + rs // H_Q      # row r sees tokens < visible (bottom-right aligned)
        else:
            visible = length + 0 * rs
        m_i = gl.full([1, NR], MAX_INIT_C, gl.float32, ROW)
        l_i = gl.zeros([1, NR], gl.float32, ROW)
        acc = gl.zeros([NW, NR, 128], gl.float32, MMA)
        # steps wholly before full_end need no mask: every token in the split, seen by every row
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
                m_i, l_i, acc = _step(ring.index(cur), r_ring.index(cur), s_ring.index(cur), s_buf, qa, qra, m_i, l_i,
                                      acc, n0, visible, end, qk_scale, False, MMA, ALL, A, B, LK, LV)
            else:
                m_i, l_i, acc = _step(ring.index(cur), r_ring.index(cur), s_ring.index(cur), s_buf, qa, qra, m_i, l_i,
                                      acc, n0, gl.minimum(visible, end), end, qk_scale, True, MMA, ALL, A, B, LK, LV)
        for i in gl.static_range(STAGES):
            for j in gl.static_range(3):
                mbarrier.invalidate(bars[j].index(i))

        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        out = acc * (1.0 / l_safe)[:, :, None]
        wo = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
        ro = gl.arange(0, NR, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
        n = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
        o_col = (wo * 128)[:, None, None] + (((n & 7) << 4) | (n >> 3))[None, None, :]   # sigma_v
        o_ptrs = O_PART + split.to(gl.int64) * stride_ps + b64 * stride_pb + (ro.to(gl.int64) * DV)[None, :, None]
        o_mask = (wo >= 0)[:, None, None] & (ro < H_Q * S_Q)[None, :, None] & (n >= 0)[None, None, :]
        gl.store(o_ptrs + o_col, out.to(O_PART.dtype.element_ty), mask=o_mask)
        VEC: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        lse2 = gl.convert_layout(gl.sum(gl.where(empty, float("-inf"), m_i + gl.log2(l_safe)), axis=0), VEC)  # [16]
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
    """(latent, rope, scales) TMA descriptors over the cache's rows: the latent as [rows, 4, 128] bytes in boxes of
    [box, 4, 128], the rope as bf16 [rows, 328] in [box, 64], the scales as fp32 [rows, 164] in [box, 4] (box: 32
    rows, or the page)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    box = min(BLOCK_N, kv_cache.shape[1])
    _, smem_tma, smem_rope, smem_s = layouts

    def view(dtype, cols, layout):
        v = kv_cache.view(dtype)
        return TensorDescriptor(v, [rows, v.shape[3]], [v.stride(1), 1], [box, cols], layout)
    latent = TensorDescriptor(kv_cache, [rows, 4, 128], [kv_cache.stride(1), 128, 1], [box, 4, 128], smem_tma)
    return latent, view(torch.bfloat16, D_R, smem_rope), view(torch.float32, 4, smem_s)


def launch_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, o_part, lse_part, final, stages):
    """(kernel, grid, args, constexpr kwargs) of one launch; shared by mla_decode_rows16_gluon and the compile
    check. o_part / lse_part: out as [1, b, rows, 512] and lse [b, h_q, s_q] when final, else the partials."""
    assert stages >= 2, "the ring needs two slots (one is waited on while the next lands)"
    kernel, gl = _build()
    b, s_q, h_q, _ = q.shape
    num_splits = o_part.shape[0]
    mma, every, a, bl, lk, lv, smem, smem_tma, smem_rope, smem_s = _layouts(gl)
    kn_desc, kr_desc, ks_desc = _descriptors(kv_cache.view(torch.uint8), (smem, smem_tma, smem_rope, smem_s))
    args = (q, kn_desc, kr_desc, ks_desc, block_table, cache_seqlens, o_part, lse_part,
            q.stride(0), q.stride(1), q.stride(2), block_table.stride(0),
            o_part.stride(0), o_part.stride(1), 0 if final else lse_part.stride(0), lse_part.stride(0 if final else 1),
            softmax_scale * LOG2E, block_table.shape[1] * kv_cache.shape[1] if kv_cache.shape[0] else 0,
            max(kv_cache.shape[0] - 1, 0), num_splits)
    meta = dict(H_Q=h_q, S_Q=s_q, PAGE=kv_cache.shape[1], CAUSAL=bool(causal), FINAL=bool(final), STAGES=stages,
                MMA=mma, ALL=every, A=a, B=bl, LK=lk, LV=lv, SMEM=smem, SMEM_TMA=smem_tma,
                SMEM_ROPE=smem_rope, SMEM_S=smem_s, num_warps=WARPS, maxnreg=MAX_REGS)
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
def compile_sm90(h_q=16, s_q=1, causal=False, num_splits=1, page=64, stages=3, arch=90):
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
