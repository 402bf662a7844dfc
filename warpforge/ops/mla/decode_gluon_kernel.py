"""MLA decode for Hopper (sm_90) in Gluon with FlashMLA's "seesaw" schedule: two warpgroups, no producer warp.

The same problem and outputs as decode_kernel.mla_decode_split_kernel (bf16 or quantized cache, dense block table,
page 64, query rows h_q · s_q >= 64): program (64-row tile, split, request) walks its split's pages and writes either
the split's partials (o_part [split, b, rows, 512] fp32, lse_part [split, b, rows] in log2 units, for
combine_splits) or, with one split, the final out / lse. Splits are cut as the portable kernel cuts them.

Why this schedule: session 9's Gluon kernel (a producer warp, a 2-slot ring, both warpgroups splitting every
S = Q·Kᵀ by columns as m64n32 wgmmas that re-read Q from shared memory) spent 0.777 of its 0.878 ms at h_q 128,
L 8k in S + softmax alone: the score GEMM was bound by shared-memory bandwidth (benchmarks/NOTES.md). Here the two
warpgroups take turns: warpgroup 0 computes the whole 64 × 64 S of the even pages, warpgroup 1 of the odd pages
(n64 wgmmas: half the shared-memory bytes per MAC), and each owns one half (256 columns) of the output, so a
pair of pages needs four half-width P·V products: its own P from registers, the other's P through shared memory.

Per pair of pages (2p in buffer 0, 2p+1 in buffer 1), with S0 / S1 already computed:
  WG0: softmax(S0) against the running max → P0; publishes max and scale0; O_L += P0·V0_L (P0 in registers)
  WG1: waits scale0; softmax(S1) against max(m0, ·) → P1; publishes scale1; O_R *= scale0·scale1;
       stores P1 (in buffer 1's rope slot, dead after S1); O_R += P1·V1_R
  WG0: waits scale1; reloads buffer 0's left half; stores P0·scale1 (in buffer 0's rope slot); O_L *= scale1
  WG1: waits P0; O_R += P0·V0_R; reloads its halves of both buffers once its products are done; S1' = Q·K(2p+3)ᵀ
  WG0: O_L += P1·V1_L; S0' = Q·K(2p+2)ᵀ; reloads buffer 1's left half and rope once P1·V1_L is done
Every buffer half is reloaded by the one warpgroup that read it last, as soon as its own MMA on it retires, so
no empty barriers are needed; the cross-warpgroup handshakes are four mbarriers used once per pair (phase = p & 1).
Shared memory: Q (64 KB + 8 KB rope) + two pages (2 × 72 KB) = 216 KB; P lives in the pages' rope slots.

Every wgmma operand in the page loops is addressed through an index that is always 0 but loop-variant to the
compilers (_mma_views): LLVM then cannot hoist the 72 shared-memory descriptors of the score GEMM out of the loop,
and ptxas rebuilds each at its use instead of spilling them across it (0 spills; hoisted, they spilled 360 B and the
kernel ran 1.22-1.31x slower on the H200). benchmarks/NOTES.md ("MLA decode", sessions 11-14) records the schedule
variants tried and their H200 times.

Quantized caches (page 64; `_build(code, ...)` per format, the same schedule): each half page comes in by TMA as its
raw bytes at the start of its bf16 buffer (FP8: 16 KB of e4m3; FP4: 8 KB of e2m1 pairs), with its rows' scales
beside it; the warpgroup that computes the page's scores (the first to read it) converts it in place to bf16 before
its score wgmma, and the other warpgroup reads the same bf16 as V. FP8 values are e4m3 · a power of two (exact);
FP4 values are decoded from 32-bit words of eight, each nibble's bits placed at fp16's exponent / mantissa boundary
(_nibble_pair), in the row's own order. The cache is read once (656 / 416 / 400 bytes a token). The in-place pass
adds shared-memory traffic (16 KB in, 32 KB out per FP8 half page) to a kernel whose score GEMM is bound by it: FP8
runs at 0.74x the bf16 cache at h_q 128 (benchmarks/NOTES.md, session 18); api.quantized_in_kernel chooses between
this and dequant_kernel.py.

Tails: a split with an odd number of pages runs its last pair with a phantom second page (the last page loaded
again, every score masked, its V rows zeroed); the request's last page has its rows past the length zeroed in
shared memory before its P·V (they may hold NaN, and 0 · NaN is NaN).

Gluon's API changes between Triton releases: everything here is imported lazily (`available()`), and the api
gate (api.py) only dispatches here on sm_90 with a Triton in GLUON_TRITON_VERSIONS.
"""
from __future__ import annotations

import functools

import torch

LOG2E = 1.4426950408889634
BLOCK_M = 64     # query rows per program
PAGE = 64        # tokens per step = the cache's page size
D_V = 512
D_R = 64
GLUON_TRITON_VERSIONS = ("3.6",)  # Triton releases whose Gluon API this file was written and compiled against
# (configs.GLUON_TRITON_VERSIONS is the api gate's copy; tests check they agree)

HALF = D_V // 2
WG1_REGS = 240   # the worker warpgroup; the default warpgroup gets the rest of the 64K registers
MAX_INIT = -1.0e30  # finite running-max start: exp2(MAX_INIT - MAX_INIT) = 1 and exp2(-inf - MAX_INIT) = 0


@functools.lru_cache(maxsize=None)
def _build(code: int = 0, group: int = 0, scale_col: int = 0, rope_col: int = D_V):
    """The kernel for one cache format (kv_format.py's code; group, and the scales' and the rope's columns in the
    views the descriptors read them through: see _format_key)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 64, 16]))
    O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 256, 16]))
    P_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT.value, k_width=2))
    ROW_S = gl.constexpr(gl.SliceLayout(1, S_LAYOUT.value))
    ROW_O = gl.constexpr(gl.SliceLayout(1, O_LAYOUT.value))
    HALF_C = gl.constexpr(HALF)
    MAX_INIT_C = gl.constexpr(MAX_INIT)
    # the cache format is fixed per build: flags passed through warp_specialize's arguments arrive in the partitions
    # as runtime values (Triton 3.6), and the format must choose code at compile time
    FP8 = gl.constexpr(code == 1)
    FP4 = gl.constexpr(code >= 2)
    NVFP4 = gl.constexpr(code == 2)
    GROUP_C = gl.constexpr(group)
    SCALE_COL_C = gl.constexpr(scale_col)   # FP8: in the fp32 view of the rows; FP4: in their bytes
    ROPE_COL = gl.constexpr(rope_col)       # in the bf16 view of the rows
    # a half page's raw bytes in the first half (FP8) or quarter (FP4) of its bf16 buffer: [64, 256] e4m3 or [64, 128]
    # bytes of e2m1 pairs
    if code >= 2:
        RAW_LAYOUT = gl.constexpr(gl.NVMMASharedLayout.get_default_for([PAGE, HALF // 2], gl.uint8))
        # the same bytes as 32-bit words: one 128-byte swizzle row a token either way
        RAW_WORDS = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    else:
        RAW_LAYOUT = gl.constexpr(gl.NVMMASharedLayout.get_default_for([PAGE, HALF], gl.float8e4nv))
        RAW_WORDS = gl.constexpr(None)   # FP4's only (every build's closures must bind it)

    @gluon.jit
    def _page_row(bt_row, first_page, blk, n_steps, last_page):
        """Cache row of block blk of this split (a phantom block past the split reloads its last page)."""
        page = gl.load(bt_row + first_page + gl.minimum(blk, n_steps - 1))
        return gl.minimum(gl.maximum(page, 0), last_page) * 64

    # (H and USE_ACC below arrive as literals, which Triton passes on as constexprs; a `gl.constexpr` annotation
    # would not resolve: `from __future__ import annotations` leaves it a string, and these bodies never name gl)
    @gluon.jit
    def _load_latent(kn_desc, ks_desc, kn_dst, ks, kbar, H, row, col, extra_bytes):
        """256 latent columns of a page → kn_dst on kbar[H] (FP8: the e4m3 bytes into the buffer's first half, and
        the row's four scales into ks[H], for _dequant_half; FP4: the e2m1 bytes into its first quarter and the
        half's 16 scale bytes, all 16 of the row for MXFP4), expecting extra_bytes more from the caller's copies."""
        if FP4:
            mbarrier.expect(kbar[H], kn_desc.block_type.nbytes + ks_desc.block_type.nbytes + extra_bytes)
            tma.async_copy_global_to_shared(kn_desc, [row, col // 2], kbar[H],
                                            kn_dst._reinterpret(gl.uint8, [64, HALF_C // 2], RAW_LAYOUT))
            if NVFP4:
                tma.async_copy_global_to_shared(ks_desc, [row, SCALE_COL_C + 16 * (H % 2)], kbar[H], ks.index(H))
            else:
                tma.async_copy_global_to_shared(ks_desc, [row, SCALE_COL_C], kbar[H], ks.index(H))
        elif FP8:
            mbarrier.expect(kbar[H], kn_desc.block_type.nbytes + ks_desc.block_type.nbytes + extra_bytes)
            tma.async_copy_global_to_shared(kn_desc, [row, col], kbar[H],
                                            kn_dst._reinterpret(gl.float8e4nv, [64, HALF_C], RAW_LAYOUT))
            tma.async_copy_global_to_shared(ks_desc, [row, SCALE_COL_C], kbar[H], ks.index(H))
        else:
            mbarrier.expect(kbar[H], kn_desc.block_type.nbytes + extra_bytes)
            tma.async_copy_global_to_shared(kn_desc, [row, col], kbar[H], kn_dst)

    @gluon.jit
    def _load_half(kn_desc, ks_desc, kn_dst, ks, kbar, H, row, col):
        """256 latent columns of a page → shared memory, on kbar[H]."""
        _load_latent(kn_desc, ks_desc, kn_dst, ks, kbar, H, row, col, 0)

    @gluon.jit
    def _load_half_rope(kn_desc, kr_desc, ks_desc, kn_dst, kr_dst, ks, kbar, H, row, col):
        """256 latent columns and the 64 rope columns of a page → shared memory, on kbar[H]."""
        _load_latent(kn_desc, ks_desc, kn_dst, ks, kbar, H, row, col, kr_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kr_desc, [row, ROPE_COL], kbar[H], kr_dst)

    @gluon.jit
    def _nibble_pair(w, n: gl.constexpr, WHOLE: gl.constexpr):
        """Nibbles n and n + 4 (values 8j + n and 8j + n + 4) of words w of packed e2m1 → their values · 2^-14 in
        fp32 (WHOLE: the values). Each nibble's three magnitude bits land at fp16's exponent / mantissa boundary
        (bits 9-11: e2m1's subnormal 0.5 becomes fp16's subnormal 2^-15, the rest normals) and its sign at bit 15,
        nibble n in the low half of a 32-bit word and nibble n + 4 in the high half: two shift-and-mask pairs for
        two values, where the per-element form took ~10 instructions a value (benchmarks/NOTES.md, session 43)."""
        if n == 3:
            mag = w >> 3
        else:
            mag = w << (9 - 4 * n)
        h = (mag & 0x0E000E00) | ((w << (12 - 4 * n)) & 0x80008000)
        lo = (h & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
        hi = (h >> 16).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
        if WHOLE:   # the values themselves (times 2^14)
            lo = lo * 16384.0
            hi = hi * 16384.0
        return lo, hi

    @gluon.jit
    def _dequant_fp4_rows(w, sb, kv_scale):
        """Words w [16, NB, WPB] of packed e2m1 (byte i of a word: values 2i, low nibble, and 2i + 1), NB blocks of
        WPB words a row, and their scale bytes sb [16, NB] → [16, NB · WPB · 8] fp32 values · their block's scale
        (· kv_scale for NVFP4), in the row's own order."""
        if NVFP4:
            sc = sb.to(gl.float8e4nv, bitcast=True).to(gl.float32) * (kv_scale * 16384.0)
        else:   # e8m0: 2^(byte - 127); the values take the 2^14 (2^(byte - 113) would overflow from byte 241)
            sc = (sb.to(gl.int32) << 23).to(gl.float32, bitcast=True)
        sc3 = gl.expand_dims(sc, 2)
        v0, v4 = _nibble_pair(w, 0, not NVFP4)
        v1, v5 = _nibble_pair(w, 1, not NVFP4)
        v2, v6 = _nibble_pair(w, 2, not NVFP4)
        v3, v7 = _nibble_pair(w, 3, not NVFP4)
        # join appends its pair as the last dim: [.., b0, b1, b2] for value 4 b2 + 2 b1 + b0; permuted to the order
        x = gl.join(gl.join(gl.join(v0 * sc3, v1 * sc3), gl.join(v2 * sc3, v3 * sc3)),
                    gl.join(gl.join(v4 * sc3, v5 * sc3), gl.join(v6 * sc3, v7 * sc3)))
        x = gl.permute(x, [0, 1, 2, 5, 4, 3])
        return gl.reshape(x, [16, w.shape[1] * w.shape[2] * 8])

    @gluon.jit
    def _dequant_half(k, ks, H, kv_scale):
        """The quantized half page in k → bf16 values in place, read by TMA into the buffer's first bytes with its
        rows' scales in ks[H]. Every row's bytes are read before it is written (the bf16 rows overlay them).
        FP8: e4m3 · its 128-column chunk's scale. FP4: e2m1 · its block's scale (· kv_scale for NVFP4), as 32-bit
        words, 16 rows at a time (the output accumulator holds most of the registers)."""
        if FP4:
            WPB: gl.constexpr = GROUP_C // 8      # words per scale block: NVFP4 2, MXFP4 4
            NB: gl.constexpr = 32 // WPB          # blocks per half row: NVFP4 16, MXFP4 8
            # 4 words a thread (16 rows a pass); LW2 the same as [16, 32] words
            LW: gl.constexpr = gl.BlockedLayout([1, 4 // WPB, WPB], [4, 8, 1], [4, 1, 1], [2, 1, 0])
            raw = k._reinterpret(gl.uint32, [64, HALF_C // 8], RAW_WORDS)
            # MXFP4: the row's 16 scale bytes, 8 for each half; NVFP4: the half's 16
            first: gl.constexpr = 0 if NVFP4 else 8 * (H % 2)
            sks = ks.index(H).slice(first, NB, dim=1)
            LW2: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
            for g in gl.static_range(4):   # rows 16 g ..: their words read (by the warps that write them) first
                w = gl.reshape(raw.slice(16 * g, 16, dim=0).load(LW2), [16, NB, WPB])
                sb = sks.slice(16 * g, 16, dim=0).load(gl.SliceLayout(2, LW))
                gl.thread_barrier()
                vals = _dequant_fp4_rows(gl.convert_layout(w, LW, assert_trivial=True), sb, kv_scale)
                k.slice(16 * g, 16, dim=0).store(vals.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
        else:
            _dequant_fp8_half(k, ks, H)

    @gluon.jit
    def _dequant_fp8_half(k, ks, H):
        """The FP8 half page in k (e4m3 bytes in its first 16 KB, its rows' scales in ks[H]) → bf16 values · scale,
        in place."""
        blk: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
        raw = k._reinterpret(gl.float8e4nv, [64, HALF_C], RAW_LAYOUT)
        r0 = raw.slice(0, 64, dim=1).load(blk)
        r1 = raw.slice(64, 64, dim=1).load(blk)
        r2 = raw.slice(128, 64, dim=1).load(blk)
        r3 = raw.slice(192, 64, dim=1).load(blk)
        sc_layout: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])
        sc = ks.index(H).load(sc_layout)
        c4 = gl.arange(0, 4, layout=gl.SliceLayout(0, sc_layout))[None, :]
        first = (H % 2) * 2   # the left half's chunks are 0, 1; the right half's 2, 3
        s_lo = gl.convert_layout(gl.sum(gl.where(c4 == first, sc, 0.0), axis=1), gl.SliceLayout(1, blk))[:, None]
        s_hi = gl.convert_layout(gl.sum(gl.where(c4 == first + 1, sc, 0.0), axis=1), gl.SliceLayout(1, blk))[:, None]
        gl.thread_barrier()
        k.slice(0, 64, dim=1).store((r0.to(gl.float32) * s_lo).to(gl.bfloat16))
        k.slice(64, 64, dim=1).store((r1.to(gl.float32) * s_lo).to(gl.bfloat16))
        k.slice(128, 64, dim=1).store((r2.to(gl.float32) * s_hi).to(gl.bfloat16))
        k.slice(192, 64, dim=1).store((r3.to(gl.float32) * s_hi).to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _s_half(q, k, kbar, H, phase, acc, USE_ACC, ks, kv_scale):
        """acc (+)= q · kᵀ over one 256-column half, issued once kbar[H] has landed (a quantized cache: and k is
        dequantised, by the warpgroup that computes this page's scores: the one that reads it first)."""
        mbarrier.wait(kbar[H], phase)
        if FP8 or FP4:
            _dequant_half(k, ks, H, kv_scale)
        return warpgroup_mma(q, k.permute((1, 0)), acc, use_acc=USE_ACC, is_async=True)

    @gluon.jit
    def _kv_scale(KV_SCALE):
        """NVFP4's cache-wide fp32 scale (its values are e2m1 · block scale · it); 1 for the other formats."""
        if NVFP4:
            return gl.load(KV_SCALE)
        else:
            return 1.0

    @gluon.jit
    def _zero_rows(v, n_valid):
        """Rows n_valid.. of a [64, 256] V half set to 0 (past the request's end: may hold NaN)."""
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
        for c in gl.static_range(4):
            sub = v.slice(c * 64, 64, dim=1)
            t = sub.load(blk)
            sub.store(gl.where((rows < n_valid)[:, None], t, gl.zeros_like(t)))

    @gluon.jit
    def _masked(s, n0, limit, qk_scale):
        cols = n0 + gl.arange(0, 64, layout=gl.SliceLayout(0, S_LAYOUT))
        return gl.where(cols[None, :] < limit[:, None], s * qk_scale, float("-inf"))

    @gluon.jit
    def _limit(tile, length, end, H_Q: gl.constexpr, S_Q: gl.constexpr, CAUSAL: gl.constexpr):
        """Per query row: the first token it must not see (the split's end, and bottom-right causal)."""
        r = tile * 64 + gl.arange(0, 64, layout=ROW_S)
        if CAUSAL:
            return gl.minimum(length - S_Q + 1 + r // H_Q, end)
        else:
            return gl.full([64], 0, gl.int32, ROW_S) + end

    @gluon.jit
    def _mma_views(q_half, kn, kr, p):
        """The loop's wgmma operands: Q's halves, Q's rope (kr's slot 2), the four page halves, the two pages' rope
        slots (each then holds that page's P), each indexed by z = p >> 30: 0 for every real pair count, but
        loop-variant to LLVM and ptxas, so the wgmma descriptors are rebuilt from a base address at their use instead
        of hoisted out of the loop (and spilled across it)."""
        z = p >> 30
        return (q_half.index(z), q_half.index(z + 1), kr.index(z + 2), kn.index(z), kn.index(z + 1),
                kn.index(z + 2), kn.index(z + 3), kr.index(z), kr.index(z + 1))

    @gluon.jit
    def _wg0_first_loads(kn_desc, kr_desc, ks_desc, kn, kr, ks, kbar, bt_row, first_page, n_steps, last_page):
        """WG0's halves of the first two pages: page 0's left half, page 1's left half and rope."""
        _load_half(kn_desc, ks_desc, kn.index(0), ks, kbar, 0, _page_row(bt_row, first_page, 0, n_steps, last_page), 0)
        _load_half_rope(kn_desc, kr_desc, ks_desc, kn.index(2), kr.index(1), ks, kbar, 2,
                        _page_row(bt_row, first_page, 1, n_steps, last_page), 0)

    @gluon.jit
    def _wg1_first_loads(kn_desc, kr_desc, ks_desc, kn, kr, ks, kbar, bt_row, first_page, n_steps, last_page):
        """WG1's halves of the first two pages: page 0's right half and rope, page 1's right half."""
        _load_half_rope(kn_desc, kr_desc, ks_desc, kn.index(1), kr.index(0), ks, kbar, 1,
                        _page_row(bt_row, first_page, 0, n_steps, last_page), HALF_C)
        _load_half(kn_desc, ks_desc, kn.index(3), ks, kbar, 3, _page_row(bt_row, first_page, 1, n_steps, last_page),
                   HALF_C)

    @gluon.jit
    def _wg0(q_half, q_rope, kn, kr, ks, kbar, sync, s_m, s_sc0, s_sc1, s_l0, s_l1, kn_desc, kr_desc, ks_desc, Q,
             KV_SCALE,
             O_PART, LSE_PART, bt_row, first_page, b, split, tile, start, end, length, n_steps, last_page, rows_total,
             qk_scale, stride_qb, stride_qs, stride_qh, stride_ps, stride_pb, stride_ls, stride_lb,
             H_Q: gl.constexpr, S_Q: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr):
        # Q rows of this tile → shared memory (rows past the request's are zeros and never stored); WG1 waits on it
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rq = tile * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
        rq_ok = rq < rows_total
        q_rows = Q + b.to(gl.int64) * stride_qb + (rq // H_Q).to(gl.int64) * stride_qs + \
            (rq % H_Q).to(gl.int64) * stride_qh
        c64 = gl.arange(0, 64, layout=gl.SliceLayout(0, blk))
        q_mask = rq_ok[:, None] & (c64 >= 0)[None, :]   # Gluon does not broadcast masks
        for c in gl.static_range(8):
            half = q_half.index(c // 4).slice((c % 4) * 64, 64, dim=1)
            half.store(gl.load(q_rows[:, None] + c * 64 + c64[None, :], mask=q_mask, other=0.0))
        q_rope.store(gl.load(q_rows[:, None] + 512 + c64[None, :], mask=q_mask, other=0.0))
        s_m.store(gl.full([64], MAX_INIT_C, gl.float32, ROW_S))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(sync[4], count=1)   # Q and the running max are in place

        limit = _limit(tile, length, end, H_Q, S_Q, CAUSAL)
        kv_scale = _kv_scale(KV_SCALE)
        n_pairs = (n_steps + 1) // 2
        l_i = gl.zeros([64], gl.float32, ROW_S)
        acc = gl.zeros([64, HALF_C], gl.float32, O_LAYOUT)
        s0 = gl.zeros([64, 64], gl.float32, S_LAYOUT)
        if n_pairs > 0:
            _wg0_first_loads(kn_desc, kr_desc, ks_desc, kn, kr, ks, kbar, bt_row, first_page, n_steps, last_page)
            tok = _s_half(q_half.index(0), kn.index(0), kbar, 0, 0, s0, False, ks, kv_scale)
            tok = _s_half(q_half.index(1), kn.index(1), kbar, 1, 0, tok, True, ks, kv_scale)
            tok = warpgroup_mma(q_rope, kr.index(0).permute((1, 0)), tok, is_async=True)
            s0 = warpgroup_mma_wait(0, deps=(tok, ))
        for p in range(n_pairs):
            ph = p & 1
            n0 = start + 2 * p * 64
            more = p + 1 < n_pairs
            vq0, vq1, vqr, vk0, vk1, vk2, vk3, vr0, vr1 = _mma_views(q_half, kn, kr, p)
            next0 = _page_row(bt_row, first_page, 2 * p + 2, n_steps, last_page)  # early: off the reload's path
            next1 = _page_row(bt_row, first_page, 2 * p + 3, n_steps, last_page)
            # softmax of the even page against the running max; publish the new max and the rescale
            s = _masked(s0, n0, limit, qk_scale)
            m_old = s_m.load(ROW_S)
            m0 = gl.maximum(m_old, gl.max(s, axis=1))
            scale0 = gl.exp2(m_old - m0)
            p0 = gl.exp2(s - m0[:, None])
            l_i = l_i * scale0 + gl.sum(p0, axis=1)
            gl.thread_barrier()   # every thread has read the old max before any writes the new one
            s_sc0.store(scale0)
            s_m.store(m0)
            gl.thread_barrier()
            mbarrier.arrive(sync[0], count=1)
            acc = acc * gl.convert_layout(scale0, ROW_O)[:, None]
            n_valid0 = end - n0
            if n_valid0 < 64:
                _zero_rows(kn.index(0), n_valid0)
                fence_async_shared()
                gl.thread_barrier()
            tok = warpgroup_mma(gl.convert_layout(p0.to(gl.bfloat16), P_OPERAND), vk0, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(tok, ))
            # WG1 has the odd page's max: rescale P0 to it and hand it over through page 0's rope slot
            mbarrier.wait(sync[1], ph)
            if more:
                _load_half(kn_desc, ks_desc, kn.index(0), ks, kbar, 0, next0, 0)
            scale1 = s_sc1.load(ROW_S)
            kr.index(0).store((p0 * scale1[:, None]).to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(sync[2], count=1)
            acc = acc * gl.convert_layout(scale1, ROW_O)[:, None]
            l_i = l_i * scale1
            # P1 is in page 1's rope slot once WG1 has issued its P0·V0_R
            mbarrier.wait(sync[3], ph)
            n_valid1 = n_valid0 - 64
            if n_valid1 < 64:
                _zero_rows(kn.index(2), n_valid1)
                fence_async_shared()
                gl.thread_barrier()
            tok = warpgroup_mma(vr1, vk2, acc, is_async=True)   # P1·V1_L
            if more:
                s_tok = _s_half(vq0, vk0, kbar, 0, (p + 1) & 1, s0, False, ks, kv_scale)
                acc = warpgroup_mma_wait(1, deps=(tok, ))   # P1·V1_L retired (S0's first half may run on)
                _load_half_rope(kn_desc, kr_desc, ks_desc, kn.index(2), kr.index(1), ks, kbar, 2, next1, 0)
                s_tok = _s_half(vq1, vk1, kbar, 1, (p + 1) & 1, s_tok, True, ks, kv_scale)
                s_tok = warpgroup_mma(vqr, vr0.permute((1, 0)), s_tok, is_async=True)
                s0 = warpgroup_mma_wait(0, deps=(s_tok, ))
            else:
                acc = warpgroup_mma_wait(0, deps=(tok, ))

        # the row sums of both warpgroups (same running max) → the normaliser; WG1 writes the lse
        s_l0.store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(sync[5], count=1)
        mbarrier.wait(sync[5], 0)
        l_all = l_i + s_l1.load(ROW_S)
        _epilogue(acc, l_all, s_m.load(ROW_S), O_PART, LSE_PART, b, split, tile, rows_total, 0,
                  stride_ps, stride_pb, stride_ls, stride_lb, H_Q, S_Q, FINAL, False)

    @gluon.jit
    def _wg1(q_half, q_rope, kn, kr, ks, kbar, sync, s_m, s_sc0, s_sc1, s_l0, s_l1, kn_desc, kr_desc, ks_desc, Q,
             KV_SCALE,
             O_PART, LSE_PART, bt_row, first_page, b, split, tile, start, end, length, n_steps, last_page, rows_total,
             qk_scale, stride_qb, stride_qs, stride_qh, stride_ps, stride_pb, stride_ls, stride_lb,
             H_Q: gl.constexpr, S_Q: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr):
        limit = _limit(tile, length, end, H_Q, S_Q, CAUSAL)
        kv_scale = _kv_scale(KV_SCALE)
        n_pairs = (n_steps + 1) // 2
        l_i = gl.zeros([64], gl.float32, ROW_S)
        acc = gl.zeros([64, HALF_C], gl.float32, O_LAYOUT)
        s1 = gl.zeros([64, 64], gl.float32, S_LAYOUT)
        mbarrier.wait(sync[4], 0)
        if n_pairs > 0:
            _wg1_first_loads(kn_desc, kr_desc, ks_desc, kn, kr, ks, kbar, bt_row, first_page, n_steps, last_page)
            tok = _s_half(q_half.index(1), kn.index(3), kbar, 3, 0, s1, False, ks, kv_scale)
            tok = _s_half(q_half.index(0), kn.index(2), kbar, 2, 0, tok, True, ks, kv_scale)
            tok = warpgroup_mma(q_rope, kr.index(1).permute((1, 0)), tok, is_async=True)
            s1 = warpgroup_mma_wait(0, deps=(tok, ))
        for p in range(n_pairs):
            ph = p & 1
            n1 = start + (2 * p + 1) * 64
            more = p + 1 < n_pairs
            vq0, vq1, vqr, vk0, vk1, vk2, vk3, vr0, vr1 = _mma_views(q_half, kn, kr, p)
            next0 = _page_row(bt_row, first_page, 2 * p + 2, n_steps, last_page)  # early: off the reload's path
            next1 = _page_row(bt_row, first_page, 2 * p + 3, n_steps, last_page)
            # softmax of the odd page against WG0's new max
            mbarrier.wait(sync[0], ph)
            m0 = s_m.load(ROW_S)
            scale0 = s_sc0.load(ROW_S)
            s = _masked(s1, n1, limit, qk_scale)
            m1 = gl.maximum(m0, gl.max(s, axis=1))
            scale1 = gl.exp2(m0 - m1)
            p1 = gl.exp2(s - m1[:, None])
            both = scale0 * scale1
            l_i = l_i * both + gl.sum(p1, axis=1)
            gl.thread_barrier()   # every thread has read WG0's max before any writes the new one
            s_sc1.store(scale1)
            s_m.store(m1)
            gl.thread_barrier()
            mbarrier.arrive(sync[1], count=1)
            acc = acc * gl.convert_layout(both, ROW_O)[:, None]
            p1b = p1.to(gl.bfloat16)
            kr.index(1).store(p1b)   # for WG0's P1·V1_L (page 1's rope slot is dead after S1)
            n_valid1 = end - n1
            if n_valid1 < 64:
                _zero_rows(kn.index(3), n_valid1)
            fence_async_shared()
            gl.thread_barrier()
            tok = warpgroup_mma(gl.convert_layout(p1b, P_OPERAND), vk3, acc, is_async=True)
            # P0 (rescaled to m1) from WG0
            mbarrier.wait(sync[2], ph)
            n_valid0 = n_valid1 + 64
            if n_valid0 < 64:
                _zero_rows(kn.index(1), n_valid0)
                fence_async_shared()
                gl.thread_barrier()
            tok = warpgroup_mma(vr0, vk1, tok, is_async=True)
            mbarrier.arrive(sync[3], count=1)
            if more:
                warpgroup_mma_wait(1, deps=(tok, ))   # P1·V1_R retired: page 1's right half is free
                _load_half(kn_desc, ks_desc, kn.index(3), ks, kbar, 3, next1, HALF_C)
                acc = warpgroup_mma_wait(0, deps=(tok, ))   # P0·V0_R retired: page 0's right half and rope
                _load_half_rope(kn_desc, kr_desc, ks_desc, kn.index(1), kr.index(0), ks, kbar, 1, next0, HALF_C)
                s_tok = _s_half(vq1, vk3, kbar, 3, (p + 1) & 1, s1, False, ks, kv_scale)
                s_tok = _s_half(vq0, vk2, kbar, 2, (p + 1) & 1, s_tok, True, ks, kv_scale)
                s_tok = warpgroup_mma(vqr, vr1.permute((1, 0)), s_tok, is_async=True)
                s1 = warpgroup_mma_wait(0, deps=(s_tok, ))
            else:
                acc = warpgroup_mma_wait(0, deps=(tok, ))

        s_l1.store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(sync[5], count=1)
        mbarrier.wait(sync[5], 0)
        l_all = l_i + s_l0.load(ROW_S)
        _epilogue(acc, l_all, s_m.load(ROW_S), O_PART, LSE_PART, b, split, tile, rows_total, HALF_C,
                  stride_ps, stride_pb, stride_ls, stride_lb, H_Q, S_Q, FINAL, True)

    @gluon.jit
    def _epilogue(acc, l_all, m_final, O_PART, LSE_PART, b, split, tile, rows_total, col0,
                  stride_ps, stride_pb, stride_ls, stride_lb,
                  H_Q: gl.constexpr, S_Q: gl.constexpr, FINAL: gl.constexpr, WRITES_LSE: gl.constexpr):
        empty_row = l_all == 0.0
        l_safe = gl.where(empty_row, 1.0, l_all)
        norm = gl.convert_layout(1.0 / l_safe, ROW_O)
        ro = tile * 64 + gl.arange(0, 64, layout=ROW_O)
        cols = col0 + gl.arange(0, HALF_C, layout=gl.SliceLayout(0, O_LAYOUT))
        o_ptrs = O_PART + split.to(gl.int64) * stride_ps + b.to(gl.int64) * stride_pb + \
            ro.to(gl.int64)[:, None] * 512 + cols[None, :]
        o_mask = (ro < rows_total)[:, None] & (cols >= 0)[None, :]   # Gluon does not broadcast masks
        gl.store(o_ptrs, (acc * norm[:, None]).to(O_PART.dtype.element_ty), mask=o_mask)
        if WRITES_LSE:
            # WG1 writes it: Triton 3.6 fails to lower this store in the default partition (ConvertTritonGPUToLLVM)
            vec: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            lse2 = gl.convert_layout(gl.where(empty_row, float("-inf"), m_final + gl.log2(l_safe)), vec)
            r = tile * 64 + gl.arange(0, 64, layout=vec)
            if FINAL:
                gl.store(LSE_PART + b.to(gl.int64) * stride_lb + (r % H_Q) * S_Q + r // H_Q,
                         lse2 * 0.6931471805599453, mask=r < rows_total)
            else:
                gl.store(LSE_PART + split.to(gl.int64) * stride_ls + b.to(gl.int64) * stride_lb + r, lse2,
                         mask=r < rows_total)

    @gluon.jit
    def mla_decode_gluon_kernel(
        Q, kn_desc, kr_desc, ks_desc, KV_SCALE, BLOCK_TABLE, SEQLENS, O_PART, LSE_PART,
        stride_qb, stride_qs, stride_qh, stride_bt,
        stride_ps, stride_pb, stride_ls, stride_lb,
        rows_total, qk_scale, capacity, last_page,
        H_Q: gl.constexpr, S_Q: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr,
        HALF_LAYOUT: gl.constexpr, WG1_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        # the row tiles of one (request, split) are neighbours in launch order: the second reads the pages from L2
        tile = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2)
        n_splits = gl.num_programs(1)
        length = gl.minimum(gl.maximum(gl.load(SEQLENS + b), 0), capacity)
        per_split = gl.cdiv(gl.cdiv(length, n_splits), 64) * 64
        start = split * per_split
        end = gl.minimum(start + per_split, length)
        n_steps = gl.maximum(gl.cdiv(end - start, 64), 0)

        rope_layout: gl.constexpr = kr_desc.layout
        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_half = gl.allocate_shared_memory(gl.bfloat16, [2, 64, HALF_C], HALF_LAYOUT)
        kn = gl.allocate_shared_memory(gl.bfloat16, [4, 64, HALF_C], HALF_LAYOUT)   # page (0|1) x half (L|R)
        # page 0's rope, page 1's rope (each then holds that page's P), Q's rope: one buffer, so the loops index
        # Q's rope like the other wgmma operands (_mma_views)
        kr = gl.allocate_shared_memory(gl.bfloat16, [3, 64, 64], rope_layout)
        q_rope = kr.index(2)
        if FP8:   # each half's rows' four scales (fp32), beside its bytes
            ks = gl.allocate_shared_memory(gl.float32, [4, 64, 4], ks_desc.layout)
        elif FP4:   # each half's 16 scale bytes (MXFP4: the row's 16)
            ks = gl.allocate_shared_memory(gl.uint8, [4, 64, 16], ks_desc.layout)
        else:
            ks = kr
        s_m = gl.allocate_shared_memory(gl.float32, [64], vec_layout)   # the running max (WG1's after each pair)
        s_sc0 = gl.allocate_shared_memory(gl.float32, [64], vec_layout)
        s_sc1 = gl.allocate_shared_memory(gl.float32, [64], vec_layout)
        s_l0 = gl.allocate_shared_memory(gl.float32, [64], vec_layout)   # the row sums of WG0 and WG1, at the end
        s_l1 = gl.allocate_shared_memory(gl.float32, [64], vec_layout)
        # kbar: page 0 left (WG0 loads), page 0 right + rope (WG1), page 1 left + rope (WG0), page 1 right (WG1)
        # sync: 0 scale0 ready, 1 scale1 ready, 2 P0 ready, 3 P0·V0_R issued (P1 stored), 4 Q ready, 5 row sums
        sall = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
        kall = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        kbar = (kall.index(0), kall.index(1), kall.index(2), kall.index(3))
        sync = (sall.index(0), sall.index(1), sall.index(2), sall.index(3), sall.index(4), sall.index(5))
        for i in gl.static_range(4):
            mbarrier.init(kbar[i], count=1)
        for i in gl.static_range(5):
            mbarrier.init(sync[i], count=1)
        mbarrier.init(sync[5], count=2)

        bt_row = BLOCK_TABLE + b.to(gl.int64) * stride_bt
        args = (q_half, q_rope, kn, kr, ks, kbar, sync, s_m, s_sc0, s_sc1, s_l0, s_l1, kn_desc, kr_desc, ks_desc, Q,
                KV_SCALE,
                O_PART, LSE_PART, bt_row, start // 64, b, split, tile, start, end, length, n_steps, last_page,
                rows_total, qk_scale, stride_qb, stride_qs, stride_qh, stride_ps, stride_pb, stride_ls, stride_lb,
                H_Q, S_Q, CAUSAL, FINAL)
        gl.warp_specialize([(_wg0, args), (_wg1, args)], [4], [WG1_REGS])

    return mla_decode_gluon_kernel, gl


def available() -> bool:
    """This Triton's Gluon is one the kernel was written for (and imports)."""
    from .._gluon import builds
    return builds(_build, GLUON_TRITON_VERSIONS)


def _format_key(fmt) -> tuple:
    """_build's arguments for a cache format (a kv_format.KVFormat, or None for bf16): its code, group, and the
    scales' column in the view they are read through (FP8: fp32, FP4: bytes) and the rope's in the bf16 view."""
    if fmt is None or fmt.code == 0:
        return (0, 0, 0, D_V)
    return (fmt.code, fmt.group, fmt.scale_offset // 4 if fmt.code == 1 else fmt.scale_offset, fmt.rope_offset // 2)


def tma_ok(kv_cache: torch.Tensor, fmt=None) -> bool:
    """The cache can be read through TMA descriptors over its rows: 16-byte aligned base and row stride, pages of
    64 contiguous rows; a quantized cache (fmt a kv_format.KVFormat) in bytes, fmt.width of them a row."""
    if fmt is not None and fmt.code != 0 and (kv_cache.element_size() != 1 or kv_cache.shape[3] != fmt.width):
        return False
    rows_contiguous = kv_cache.stride(3) == 1 and kv_cache.stride(0) == PAGE * kv_cache.stride(1)  # one [rows, w] view
    return (kv_cache.data_ptr() % 16 == 0 and (kv_cache.stride(1) * kv_cache.element_size()) % 16 == 0
            and kv_cache.shape[1] == PAGE and rows_contiguous)


def _descriptors(kv_cache, gl, code):
    """(latent halves, rope, scales) descriptors over the cache's rows; bf16: the scales' is the rope's (unused).
    Quantized rows are read through views of their bytes: the latent as e4m3 (FP8) or bytes (FP4), the scales as
    fp32 (FP8) or bytes, the rope as bf16."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    rope_layout = gl.NVMMASharedLayout.get_default_for([PAGE, D_R], gl.bfloat16)
    if code == 0:
        shape, strides = [rows, kv_cache.shape[3]], [kv_cache.stride(1), 1]
        half_layout = gl.NVMMASharedLayout.get_default_for([PAGE, HALF], gl.bfloat16)
        rope = TensorDescriptor(kv_cache, shape, strides, [PAGE, D_R], rope_layout)
        return TensorDescriptor(kv_cache, shape, strides, [PAGE, HALF], half_layout), rope, rope

    def view(dtype, box, layout):
        v = kv_cache.view(dtype)
        return TensorDescriptor(v, [rows, v.shape[3]], [v.stride(1), 1], box, layout)
    rope = view(torch.bfloat16, [PAGE, D_R], rope_layout)
    if code == 1:
        return (view(torch.float8_e4m3fn, [PAGE, HALF], gl.NVMMASharedLayout.get_default_for([PAGE, HALF],
                                                                                            gl.float8e4nv)),
                rope, view(torch.float32, [PAGE, 4], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                                          rank=2)))
    return (view(torch.uint8, [PAGE, HALF // 2], gl.NVMMASharedLayout.get_default_for([PAGE, HALF // 2], gl.uint8)),
            rope, view(torch.uint8, [PAGE, 16], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)))


def launch_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, o_part, lse_part, final, fmt=None,
                kv_scale=None):
    """(kernel, grid, args, constexpr kwargs) of one launch; shared by mla_decode_gluon and the compile check."""
    key = _format_key(fmt)
    kernel, gl = _build(*key)
    b, s_q, h_q, _ = q.shape
    rows = s_q * h_q
    num_splits = o_part.shape[0]
    kn_desc, kr_desc, ks_desc = _descriptors(kv_cache, gl, key[0])
    grid = (-(-rows // BLOCK_M), num_splits, b)
    kv_scale = kv_scale if kv_scale is not None else cache_seqlens   # a pointer NVFP4's build alone reads
    args = (q, kn_desc, kr_desc, ks_desc, kv_scale, block_table, cache_seqlens, o_part, lse_part,
            q.stride(0), q.stride(1), q.stride(2), block_table.stride(0),
            o_part.stride(0), o_part.stride(1), 0 if final else lse_part.stride(0), lse_part.stride(0 if final else 1),
            rows, softmax_scale * LOG2E, block_table.shape[1] * kv_cache.shape[1] if kv_cache.shape[0] else 0,
            max(kv_cache.shape[0] - 1, 0))
    meta = dict(H_Q=h_q, S_Q=s_q, CAUSAL=bool(causal), FINAL=bool(final),
                HALF_LAYOUT=gl.NVMMASharedLayout.get_default_for([PAGE, HALF], gl.bfloat16), WG1_REGS=WG1_REGS,
                num_warps=4)
    return kernel, grid, args, meta


def mla_decode_gluon(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, num_splits, fmt=None,
                     kv_scale=None):
    """The Gluon path of mla_decode_fwd (dense, page 64, rows >= 64; a bf16 cache, or a quantized one, fmt its
    kv_format.KVFormat, with NVFP4's kv_scale): (out, lse) as the portable launcher returns them, through the same
    partials + combine_splits when num_splits > 1."""
    from .decode_kernel import split_decode

    def launch(o_part, lse_part, final):
        kernel, grid, args, meta = launch_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, o_part,
                                               lse_part, final, fmt, kv_scale)
        kernel[grid](*args, **meta)
    return split_decode(q, num_splits, launch)


# ------------------------------------------------------------------------------------ compile-only check
def compile_sm90(h_q=128, s_q=1, causal=False, num_splits=1, arch=90, fmt=None):
    """Compile for sm_<arch> without a GPU (ops/_gluon.py): PTX features, warps, shared memory, the kernel. fmt: a
    quantized format's kv_format.KVFormat fields as a dict (the tests pass KV_FORMATS[name]._asdict())."""
    from types import SimpleNamespace
    from .._gluon import compile_report
    b, pages, max_pages = 2, 8, 4
    q = torch.empty(b, s_q, h_q, 576, dtype=torch.bfloat16)
    fmt = SimpleNamespace(**fmt) if fmt else None
    kv_scale = torch.ones(1)
    if fmt is not None:
        cache = torch.empty(pages, PAGE, 1, fmt.width, dtype=torch.uint8)
    else:
        cache = torch.empty(pages, PAGE, 1, 576, dtype=torch.bfloat16)
    table = torch.zeros(b, max_pages, dtype=torch.int32)
    lens = torch.zeros(b, dtype=torch.int32)
    from .decode_kernel import decode_outputs
    final = num_splits == 1
    _, _, o_part, lse_part = decode_outputs(q, num_splits)
    kernel, grid, args, meta = launch_args(q, cache, table, lens, 576 ** -0.5, causal, o_part, lse_part, final, fmt,
                                           kv_scale)
    return compile_report(kernel, args, grid, meta, arch)
