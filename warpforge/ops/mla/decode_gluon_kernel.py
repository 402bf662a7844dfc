"""MLA decode for Hopper (sm_90) in Gluon with FlashMLA's "seesaw" schedule: two warpgroups, no producer warp.

The same problem and outputs as decode_kernel.mla_decode_split_kernel (bf16 cache, dense block table, page 64,
query rows h_q · s_q >= 64): program (64-row tile, split, request) walks its split's pages and writes either the
split's partials (o_part [split, b, rows, 512] fp32, lse_part [split, b, rows] in log2 units, for
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

Tails: a split with an odd number of pages runs its last pair with a phantom second page (the last page loaded
again, every score masked, its V rows zeroed); the request's last page has its rows past the length zeroed in
shared memory before its P·V (they may hold NaN, and 0 · NaN is NaN).

Gluon's API changes between Triton releases: everything here is imported lazily (`available()`), and the api
gate (api.py) only dispatches here on sm_90 with a Triton in GLUON_TRITON_VERSIONS.
"""
from __future__ import annotations

import functools
import os

import torch

LOG2E = 1.4426950408889634
BLOCK_M = 64     # query rows per program
PAGE = 64        # tokens per step = the cache's page size
D_V = 512
D_R = 64
GLUON_TRITON_VERSIONS = ("3.6",)  # Triton releases whose Gluon API this file was written and compiled against
# (configs.GLUON_TRITON_VERSIONS is the api gate's copy; tests check they agree)

HALF = D_V // 2
# Schedule variants behind constexpr knobs, for A/B runs on the H200 (benchmarks/NOTES.md, "MLA decode (session 11)"):
#   split_bars: one shared-memory allocation per mbarrier (Triton's membar pass then puts no warpgroup bar.sync
#               between operations on different barriers): 3 fewer bar.syncs per pair of pages, same schedule
#   quarters:   each 256-column half is loaded as two 64 x 128 boxes on two barriers, and the score GEMM runs its
#               first 128 columns while the second 128 stream in (FlashMLA waits per 64-column tile)
#   remat_desc: the loops address every wgmma operand (Q, the pages, the P slots) through a loop-variant index that
#               is always 0 (p >> 30), so LLVM cannot hoist the 72 shared-memory descriptors of the score GEMM out of
#               the loop and ptxas rebuilds them at their use (UIADD3.64) instead of spilling them (session 11's SASS:
#               21 LDL.64 of Q's descriptors per pair in WG0, 360 B of spills)
#   two_max:    WG0 publishes each pair's max in a slot of its own (WG1's stays in s_m): neither warpgroup then
#               overwrites the slot it has just read, and each loop loses its read-before-overwrite bar.sync; the
#               values and the math order are unchanged
#   p1_slot:    P1 gets a shared slot of its own (kr's fourth, 8 KB of the ~9.5 KB left) instead of page 1's rope slot,
#               so page 1's rope is reloaded with its right half by WG1 once P1·V1_R retires, and the reload WG0 issues
#               after P1·V1_L (the pair's last MMA: the load the next S1 waits for longest) shrinks from 40 to 32 KB;
#               S1 runs its right half and rope (20 wgmmas) before it waits for the late left half (16). Needs
#               remat_desc (the slot is indexed like the others)
#   early_pages: both warpgroups issue their first two pages' TMA loads before WG0 loads Q (through registers) instead
#               of after it, so the first pages' latency overlaps Q's instead of following it (the prologue: L 1k)
#   early_max:  each warpgroup publishes its new max and scale (and arrives on sync0 / sync1) right after the scale's
#               exp2, before the 32 exp2 of its P, so the other warpgroup's softmax (WG1's on sync0) or P0 handoff
#               (WG0's on sync1) need not wait for them; P's exp2 take m back through a shared load after the arrive
#               (ptxas otherwise hoists them above it). Same barriers, same values (_publish)
#   early_max1: WG1's publish only (sync1: WG0's P0 handoff waits on it). With early_max WG1's softmax runs beside WG0's
#               P exp2s and both share the MUFU (one warp of each warpgroup per sub-partition); WG1's early publish
#               costs no MUFU overlap (early_max wins if both are set)
# remat_desc is on: spill-free, it ran 1.22-1.33x the kernel without it on the H200 (NOTES, "MLA decode (session 13)")
DEFAULT_KNOBS = dict(split_bars=False, quarters=False, remat_desc=True, two_max=False, p1_slot=False,
                     early_pages=False, early_max=False, early_max1=False)
KNOBS_ENV = "WARPFORGE_MLA_GLUON_KNOBS"
WG1_REGS = 240   # the worker warpgroup; the default warpgroup gets the rest of the 64K registers
MAX_INIT = -1.0e30  # finite running-max start: exp2(MAX_INIT - MAX_INIT) = 1 and exp2(-inf - MAX_INIT) = 0


@functools.lru_cache(maxsize=None)
def _build():
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

    @gluon.jit
    def _bar():
        return gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())

    @gluon.jit
    def _page_row(bt_row, first_page, blk, n_steps, last_page):
        """Cache row of block blk of this split (a phantom block past the split reloads its last page)."""
        page = gl.load(bt_row + first_page + gl.minimum(blk, n_steps - 1))
        return gl.minimum(gl.maximum(page, 0), last_page) * 64

    @gluon.jit
    def _load_half(kn_desc, kn_dst, kbar, H: gl.constexpr, row, col, QUARTERS: gl.constexpr):
        """256 latent columns of a page → shared memory, on kbar[H] (QUARTERS: columns 0-127 on kbar[H], 128-255 on
        kbar[4 + H], two 64 x 128 boxes)."""
        QC: gl.constexpr = gl.constexpr(128)   # columns per quarter box
        if QUARTERS:
            mbarrier.expect(kbar[H], kn_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kn_desc, [row, col], kbar[H], kn_dst.slice(0, QC, dim=1))
            mbarrier.expect(kbar[4 + H], kn_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kn_desc, [row, col + QC], kbar[4 + H], kn_dst.slice(QC, QC, dim=1))
        else:
            mbarrier.expect(kbar[H], kn_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kn_desc, [row, col], kbar[H], kn_dst)

    @gluon.jit
    def _load_half_rope(kn_desc, kr_desc, kn_dst, kr_dst, kbar, H: gl.constexpr, row, col, QUARTERS: gl.constexpr):
        """256 latent columns and the 64 rope columns of a page → shared memory, on kbar[H] (QUARTERS: the rope
        travels with the second quarter, on kbar[4 + H])."""
        QC: gl.constexpr = gl.constexpr(128)
        if QUARTERS:
            mbarrier.expect(kbar[H], kn_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kn_desc, [row, col], kbar[H], kn_dst.slice(0, QC, dim=1))
            mbarrier.expect(kbar[4 + H], kn_desc.block_type.nbytes + kr_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kn_desc, [row, col + QC], kbar[4 + H], kn_dst.slice(QC, QC, dim=1))
            tma.async_copy_global_to_shared(kr_desc, [row, 512], kbar[4 + H], kr_dst)
        else:
            mbarrier.expect(kbar[H], kn_desc.block_type.nbytes + kr_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kn_desc, [row, col], kbar[H], kn_dst)
            tma.async_copy_global_to_shared(kr_desc, [row, 512], kbar[H], kr_dst)

    @gluon.jit
    def _s_half(q, k, kbar, H: gl.constexpr, phase, acc, USE_ACC: gl.constexpr, QUARTERS: gl.constexpr):
        """acc (+)= q · kᵀ over one 256-column half, issued once kbar[H] has landed (QUARTERS: as two 128-column
        wgmma groups, the second once kbar[4 + H] has landed: the first runs while the second quarter streams in)."""
        QC: gl.constexpr = gl.constexpr(128)
        if QUARTERS:
            mbarrier.wait(kbar[H], phase)
            tok = warpgroup_mma(q.slice(0, QC, dim=1), k.slice(0, QC, dim=1).permute((1, 0)), acc,
                                use_acc=USE_ACC, is_async=True)
            mbarrier.wait(kbar[4 + H], phase)
            tok = warpgroup_mma(q.slice(QC, QC, dim=1), k.slice(QC, QC, dim=1).permute((1, 0)), tok,
                                is_async=True)
        else:
            mbarrier.wait(kbar[H], phase)
            tok = warpgroup_mma(q, k.permute((1, 0)), acc, use_acc=USE_ACC, is_async=True)
        return tok

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
    def _publish(s_max, SLOT: gl.constexpr, m, s_sc, scale, bar):
        """A warpgroup's softmax hands over its new max and rescale: m to the running max (s_max[0]; with two_max and
        SLOT 1, WG0's own slot s_max[1]), scale to s_sc, then one arrive on bar. The values are whole in registers
        before any store; the bar.sync after the stores orders every thread's STS before thread 0's arrive (its
        release), so a reader that has waited on bar never sees half of them. The bar.sync before them keeps the
        read of the old max (this warpgroup's own, and the other's) ahead of the overwrite."""
        if len(s_max) == 1:
            gl.thread_barrier()   # every thread has read the old max before any writes the new one
        s_sc.store(scale)
        if len(s_max) == 2:
            s_max[SLOT].store(m)
        else:
            s_max[0].store(m)
        gl.thread_barrier()
        mbarrier.arrive(bar, count=1)
        # m again, through a shared load after the arrive: ptxas moves MUFU freely across BAR.SYNC, the arrive and
        # branches, and left alone it hoists the 32 EX2 of P that use m above the stores and the arrive; the load
        # stays behind the bar.sync the membar pass puts before it. s_sc is written by this warpgroup only (its next
        # write is a pair later), so the load returns what was stored; scale = exp2(m_old - m) <= 1 (m >= m_old), so
        # the select always picks m: the same bits, the same math
        back = s_sc.load(ROW_S)
        return gl.where(back > 2.0, back, m)

    @gluon.jit
    def _mma_views(q_half, q_rope, kn, kr, p):
        """The loop's wgmma operands (Q halves, Q rope, the four page halves, the two rope / P slots). With the
        remat_desc knob (kr then has a third slot, Q's rope: the shape is the static switch, because the knobs reach
        a partition as i1 values, not constexprs) each is indexed by z = p >> 30, 0 for every real pair count but
        loop-variant to LLVM and ptxas, so the wgmma descriptors are rebuilt from a base address at their use
        instead of hoisted out of the loop (and spilled across it). The last view is P1's slot: page 1's rope slot,
        or with p1_slot (kr has a fourth slot) a slot of its own."""
        if kr.shape[0] == 4:
            z = p >> 30
            return (q_half.index(z), q_half.index(z + 1), kr.index(z + 2), kn.index(z), kn.index(z + 1),
                    kn.index(z + 2), kn.index(z + 3), kr.index(z), kr.index(z + 1), kr.index(z + 3))
        elif kr.shape[0] == 3:
            z = p >> 30
            return (q_half.index(z), q_half.index(z + 1), kr.index(z + 2), kn.index(z), kn.index(z + 1),
                    kn.index(z + 2), kn.index(z + 3), kr.index(z), kr.index(z + 1), kr.index(z + 1))
        else:
            return (q_half.index(0), q_half.index(1), q_rope, kn.index(0), kn.index(1), kn.index(2), kn.index(3),
                    kr.index(0), kr.index(1), kr.index(1))

    @gluon.jit
    def _wg0_first_loads(kn_desc, kr_desc, kn, kr, kbar, bt_row, first_page, n_steps, last_page, QUARTERS):
        """WG0's halves of the first two pages: page 0's left half, page 1's left half (and rope)."""
        _load_half(kn_desc, kn.index(0), kbar, 0, _page_row(bt_row, first_page, 0, n_steps, last_page), 0,
                   QUARTERS)
        if kr.shape[0] == 4:   # (p1_slot: page 1's rope comes with its right half, WG1's load)
            _load_half(kn_desc, kn.index(2), kbar, 2, _page_row(bt_row, first_page, 1, n_steps, last_page), 0,
                       QUARTERS)
        else:
            _load_half_rope(kn_desc, kr_desc, kn.index(2), kr.index(1), kbar, 2,
                            _page_row(bt_row, first_page, 1, n_steps, last_page), 0, QUARTERS)

    @gluon.jit
    def _wg1_first_loads(kn_desc, kr_desc, kn, kr, kbar, bt_row, first_page, n_steps, last_page, QUARTERS):
        """WG1's halves of the first two pages: page 0's right half and rope, page 1's right half (p1_slot: and
        rope)."""
        _load_half_rope(kn_desc, kr_desc, kn.index(1), kr.index(0), kbar, 1,
                        _page_row(bt_row, first_page, 0, n_steps, last_page), HALF_C, QUARTERS)
        if kr.shape[0] == 4:
            _load_half_rope(kn_desc, kr_desc, kn.index(3), kr.index(1), kbar, 3,
                            _page_row(bt_row, first_page, 1, n_steps, last_page), HALF_C, QUARTERS)
        else:
            _load_half(kn_desc, kn.index(3), kbar, 3, _page_row(bt_row, first_page, 1, n_steps, last_page), HALF_C,
                       QUARTERS)

    @gluon.jit
    def _wg0(q_half, q_rope, kn, kr, kbar, sync, s_max, s_sc0, s_sc1, s_l0, s_l1, kn_desc, kr_desc, Q,
             O_PART, LSE_PART, bt_row, first_page, b, split, tile, start, end, length, n_steps, last_page, rows_total,
             qk_scale, stride_qb, stride_qs, stride_qh, stride_ps, stride_pb, stride_ls, stride_lb,
             H_Q: gl.constexpr, S_Q: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr,
             QUARTERS: gl.constexpr):
        s_m = s_max[0]   # the running max (WG1's after each pair); with two_max, s_max[1] holds WG0's
        if len(sync) == 7:   # (early_pages: the first pages' loads go out before Q's; sync's length is the switch)
            if n_steps > 0:
                _wg0_first_loads(kn_desc, kr_desc, kn, kr, kbar, bt_row, first_page, n_steps, last_page, QUARTERS)
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
        n_pairs = (n_steps + 1) // 2
        l_i = gl.zeros([64], gl.float32, ROW_S)
        acc = gl.zeros([64, HALF_C], gl.float32, O_LAYOUT)
        s0 = gl.zeros([64, 64], gl.float32, S_LAYOUT)
        if n_pairs > 0:
            if len(sync) == 6:
                _wg0_first_loads(kn_desc, kr_desc, kn, kr, kbar, bt_row, first_page, n_steps, last_page, QUARTERS)
            tok = _s_half(q_half.index(0), kn.index(0), kbar, 0, 0, s0, False, QUARTERS)
            tok = _s_half(q_half.index(1), kn.index(1), kbar, 1, 0, tok, True, QUARTERS)
            tok = warpgroup_mma(q_rope, kr.index(0).permute((1, 0)), tok, is_async=True)
            s0 = warpgroup_mma_wait(0, deps=(tok, ))
        for p in range(n_pairs):
            ph = p & 1
            n0 = start + 2 * p * 64
            more = p + 1 < n_pairs
            vq0, vq1, vqr, vk0, vk1, vk2, vk3, vr0, vr1, vp1 = _mma_views(q_half, q_rope, kn, kr, p)
            next0 = _page_row(bt_row, first_page, 2 * p + 2, n_steps, last_page)  # early: off the reload's path
            next1 = _page_row(bt_row, first_page, 2 * p + 3, n_steps, last_page)
            # softmax of the even page against the running max; publish the new max and the rescale
            s = _masked(s0, n0, limit, qk_scale)
            m_old = s_m.load(ROW_S)
            m0 = gl.maximum(m_old, gl.max(s, axis=1))
            scale0 = gl.exp2(m_old - m0)
            if len(kbar) == 9:   # (early_max: publish before P0's exp2s; kbar's length is the switch, 10: early_max1)
                m0 = _publish(s_max, 1, m0, s_sc0, scale0, sync[0])
            p0 = gl.exp2(s - m0[:, None])
            l_i = l_i * scale0 + gl.sum(p0, axis=1)
            if len(kbar) != 9:   # (no early_max, or early_max1: WG1 only)
                # (the flags reach a partition as i1 values, not constexprs: the tuple's length is the static switch)
                if len(s_max) == 1:   # (two_max: the new max goes to a slot of its own, s_max[1])
                    gl.thread_barrier()   # every thread has read the old max before any writes the new one
                s_sc0.store(scale0)
                if len(s_max) == 2:
                    s_max[1].store(m0)
                else:
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
                _load_half(kn_desc, kn.index(0), kbar, 0, next0, 0, QUARTERS)
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
            tok = warpgroup_mma(vp1, vk2, acc, is_async=True)
            if more:
                s_tok = _s_half(vq0, vk0, kbar, 0, (p + 1) & 1, s0, False, QUARTERS)
                if QUARTERS:   # P1·V1_L retired (the score groups issued after it may run on)
                    acc = warpgroup_mma_wait(2, deps=(tok, ))
                else:
                    acc = warpgroup_mma_wait(1, deps=(tok, ))
                if kr.shape[0] == 4:   # (p1_slot: page 1's rope went with WG1's reload of its right half)
                    _load_half(kn_desc, kn.index(2), kbar, 2, next1, 0, QUARTERS)
                else:
                    _load_half_rope(kn_desc, kr_desc, kn.index(2), kr.index(1), kbar, 2, next1, 0, QUARTERS)
                s_tok = _s_half(vq1, vk1, kbar, 1, (p + 1) & 1, s_tok, True, QUARTERS)
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
    def _wg1(q_half, q_rope, kn, kr, kbar, sync, s_max, s_sc0, s_sc1, s_l0, s_l1, kn_desc, kr_desc, Q,
             O_PART, LSE_PART, bt_row, first_page, b, split, tile, start, end, length, n_steps, last_page, rows_total,
             qk_scale, stride_qb, stride_qs, stride_qh, stride_ps, stride_pb, stride_ls, stride_lb,
             H_Q: gl.constexpr, S_Q: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr,
             QUARTERS: gl.constexpr):
        s_m = s_max[0]   # the running max (WG1's after each pair); with two_max, s_max[1] holds WG0's
        limit = _limit(tile, length, end, H_Q, S_Q, CAUSAL)
        n_pairs = (n_steps + 1) // 2
        l_i = gl.zeros([64], gl.float32, ROW_S)
        acc = gl.zeros([64, HALF_C], gl.float32, O_LAYOUT)
        s1 = gl.zeros([64, 64], gl.float32, S_LAYOUT)
        if len(sync) == 7:   # (early_pages: before Q is in place; WG1 touches Q only in its S GEMM)
            if n_pairs > 0:
                _wg1_first_loads(kn_desc, kr_desc, kn, kr, kbar, bt_row, first_page, n_steps, last_page, QUARTERS)
        mbarrier.wait(sync[4], 0)
        if n_pairs > 0:
            if len(sync) == 6:
                _wg1_first_loads(kn_desc, kr_desc, kn, kr, kbar, bt_row, first_page, n_steps, last_page, QUARTERS)
            if kr.shape[0] == 4:   # (p1_slot: page 1's rope came with its right half; S1's rope before the left half)
                tok = _s_half(q_half.index(1), kn.index(3), kbar, 3, 0, s1, False, QUARTERS)
                tok = warpgroup_mma(q_rope, kr.index(1).permute((1, 0)), tok, is_async=True)
                tok = _s_half(q_half.index(0), kn.index(2), kbar, 2, 0, tok, True, QUARTERS)
            else:
                tok = _s_half(q_half.index(1), kn.index(3), kbar, 3, 0, s1, False, QUARTERS)
                tok = _s_half(q_half.index(0), kn.index(2), kbar, 2, 0, tok, True, QUARTERS)
                tok = warpgroup_mma(q_rope, kr.index(1).permute((1, 0)), tok, is_async=True)
            s1 = warpgroup_mma_wait(0, deps=(tok, ))
        for p in range(n_pairs):
            ph = p & 1
            n1 = start + (2 * p + 1) * 64
            more = p + 1 < n_pairs
            vq0, vq1, vqr, vk0, vk1, vk2, vk3, vr0, vr1, vp1 = _mma_views(q_half, q_rope, kn, kr, p)
            next0 = _page_row(bt_row, first_page, 2 * p + 2, n_steps, last_page)  # early: off the reload's path
            next1 = _page_row(bt_row, first_page, 2 * p + 3, n_steps, last_page)
            # softmax of the odd page against WG0's new max
            mbarrier.wait(sync[0], ph)
            if len(s_max) == 2:
                m0 = s_max[1].load(ROW_S)
            else:
                m0 = s_m.load(ROW_S)
            scale0 = s_sc0.load(ROW_S)
            s = _masked(s1, n1, limit, qk_scale)
            m1 = gl.maximum(m0, gl.max(s, axis=1))
            scale1 = gl.exp2(m0 - m1)
            if len(kbar) >= 9:   # (early_max, early_max1: publish before P1's exp2s)
                m1 = _publish(s_max, 0, m1, s_sc1, scale1, sync[1])
            p1 = gl.exp2(s - m1[:, None])
            both = scale0 * scale1
            l_i = l_i * both + gl.sum(p1, axis=1)
            if len(kbar) == 8:
                if len(s_max) == 1:   # (two_max: WG0's max is in a slot of its own, s_max[1])
                    gl.thread_barrier()   # every thread has read WG0's max before any writes the new one
                s_sc1.store(scale1)
                s_m.store(m1)
                gl.thread_barrier()
                mbarrier.arrive(sync[1], count=1)
            acc = acc * gl.convert_layout(both, ROW_O)[:, None]
            p1b = p1.to(gl.bfloat16)
            if kr.shape[0] == 4:
                kr.index(3).store(p1b)   # for WG0's P1·V1_L (p1_slot: a slot of its own)
            else:
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
                if kr.shape[0] == 4:   # (p1_slot: and page 1's rope, dead since S1)
                    _load_half_rope(kn_desc, kr_desc, kn.index(3), kr.index(1), kbar, 3, next1, HALF_C, QUARTERS)
                else:
                    _load_half(kn_desc, kn.index(3), kbar, 3, next1, HALF_C, QUARTERS)
                acc = warpgroup_mma_wait(0, deps=(tok, ))   # P0·V0_R retired: page 0's right half and rope
                _load_half_rope(kn_desc, kr_desc, kn.index(1), kr.index(0), kbar, 1, next0, HALF_C, QUARTERS)
                s_tok = _s_half(vq1, vk3, kbar, 3, (p + 1) & 1, s1, False, QUARTERS)
                if kr.shape[0] == 4:   # the rope has landed with the right half: only the left half is left to wait for
                    s_tok = warpgroup_mma(vqr, vr1.permute((1, 0)), s_tok, is_async=True)
                    s_tok = _s_half(vq0, vk2, kbar, 2, (p + 1) & 1, s_tok, True, QUARTERS)
                else:
                    s_tok = _s_half(vq0, vk2, kbar, 2, (p + 1) & 1, s_tok, True, QUARTERS)
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
        Q, kn_desc, kr_desc, BLOCK_TABLE, SEQLENS, O_PART, LSE_PART,
        stride_qb, stride_qs, stride_qh, stride_bt,
        stride_ps, stride_pb, stride_ls, stride_lb,
        rows_total, qk_scale, capacity, last_page,
        H_Q: gl.constexpr, S_Q: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr,
        WG1_REGS: gl.constexpr, SPLIT_BARS: gl.constexpr, QUARTERS: gl.constexpr, REMAT: gl.constexpr,
        TWO_MAX: gl.constexpr, P1_SLOT: gl.constexpr, EARLY_PAGES: gl.constexpr, EARLY_MAX: gl.constexpr,
        EARLY_MAX1: gl.constexpr, num_warps: gl.constexpr,
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

        half_layout: gl.constexpr = kn_desc.layout
        rope_layout: gl.constexpr = kr_desc.layout
        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_half = gl.allocate_shared_memory(gl.bfloat16, [2, 64, HALF_C], half_layout)
        if REMAT:   # Q's rope tile is kr's slot 2, so the loops can index it like the others (_mma_views)
            kn = gl.allocate_shared_memory(gl.bfloat16, [4, 64, HALF_C], half_layout)
            # (P1_SLOT: slot 3 holds P1; the partitions see it as kr's shape, the static switch)
            kr = gl.allocate_shared_memory(gl.bfloat16, [4 if P1_SLOT else 3, 64, 64], rope_layout)
            q_rope = kr.index(2)
        else:
            q_rope = gl.allocate_shared_memory(gl.bfloat16, [64, 64], rope_layout)
            kn = gl.allocate_shared_memory(gl.bfloat16, [4, 64, HALF_C], half_layout)   # page (0|1) x half (L|R)
            kr = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], rope_layout)     # page rope; then that page's P
        s_m = gl.allocate_shared_memory(gl.float32, [64], vec_layout)   # the running max (WG1's after each pair)
        s_sc0 = gl.allocate_shared_memory(gl.float32, [64], vec_layout)
        s_sc1 = gl.allocate_shared_memory(gl.float32, [64], vec_layout)
        s_l0 = gl.allocate_shared_memory(gl.float32, [64], vec_layout)   # the row sums of WG0 and WG1, at the end
        s_l1 = gl.allocate_shared_memory(gl.float32, [64], vec_layout)
        if TWO_MAX:   # WG0's max of each pair in a slot of its own: no read-before-overwrite barrier in either loop
            s_max = (s_m, gl.allocate_shared_memory(gl.float32, [64], vec_layout))
        else:   # (passing s_m twice, or any buffer, as the second slot changes the membar pass's barriers)
            s_max = (s_m, )
        # kbar: page 0 left (WG0 loads), page 0 right + rope (WG1), page 1 left + rope (WG0), page 1 right (WG1)
        # sync: 0 scale0 ready, 1 scale1 ready, 2 P0 ready, 3 P0·V0_R issued (P1 stored), 4 Q ready, 5 row sums
        if SPLIT_BARS:   # one allocation per barrier: the membar pass sees no hazard between different barriers
            kbar = (_bar(), _bar(), _bar(), _bar(), _bar(), _bar(), _bar(), _bar())
            sync = (_bar(), _bar(), _bar(), _bar(), _bar(), _bar())
        else:
            sall = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
            if QUARTERS:
                kall = gl.allocate_shared_memory(gl.int64, [8, 1], mbarrier.MBarrierLayout())
                kbar = (kall.index(0), kall.index(1), kall.index(2), kall.index(3), kall.index(4), kall.index(5),
                        kall.index(6), kall.index(7))
            else:   # session 10's kernel exactly: four barriers (4-7 are never used)
                kall = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
                kbar = (kall.index(0), kall.index(1), kall.index(2), kall.index(3), kall.index(0), kall.index(1),
                        kall.index(2), kall.index(3))
            sync = (sall.index(0), sall.index(1), sall.index(2), sall.index(3), sall.index(4), sall.index(5))
        for i in gl.static_range(8 if QUARTERS else 4):   # 4-7: the second quarters
            mbarrier.init(kbar[i], count=1)
        for i in gl.static_range(5):
            mbarrier.init(sync[i], count=1)
        mbarrier.init(sync[5], count=2)
        if EARLY_PAGES:
            # the first TMA loads may now go out before any other fence: make the inits visible to the async proxy
            fence_async_shared()
            sync = sync + (sync[5], )   # (a seventh entry, never used: the partitions' static switch)
        if EARLY_MAX:
            kbar = kbar + (kbar[0], )   # (a ninth entry, never used: the partitions' static switch)
        elif EARLY_MAX1:
            kbar = kbar + (kbar[0], kbar[0])   # (and a tenth: WG1's publish only)

        bt_row = BLOCK_TABLE + b.to(gl.int64) * stride_bt
        args = (q_half, q_rope, kn, kr, kbar, sync, s_max, s_sc0, s_sc1, s_l0, s_l1, kn_desc, kr_desc, Q,
                O_PART, LSE_PART, bt_row, start // 64, b, split, tile, start, end, length, n_steps, last_page,
                rows_total, qk_scale, stride_qb, stride_qs, stride_qh, stride_ps, stride_pb, stride_ls, stride_lb,
                H_Q, S_Q, CAUSAL, FINAL, QUARTERS)
        gl.warp_specialize([(_wg0, args), (_wg1, args)], [4], [WG1_REGS])

    return mla_decode_gluon_kernel, gl


def available() -> bool:
    """This Triton's Gluon is one the kernel was written for (and imports)."""
    from .._gluon import builds
    return builds(_build, GLUON_TRITON_VERSIONS)


def tma_ok(kv_cache: torch.Tensor) -> bool:
    """The cache can be read through a TMA descriptor over its rows: 16-byte aligned base and row stride."""
    return kv_cache.data_ptr() % 16 == 0 and (kv_cache.stride(1) * kv_cache.element_size()) % 16 == 0


def _descriptors(kv_cache, gl, quarters=False):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    box = HALF // 2 if quarters else HALF
    half_layout = gl.NVMMASharedLayout.get_default_for([PAGE, box], gl.bfloat16)
    rope_layout = gl.NVMMASharedLayout.get_default_for([PAGE, D_R], gl.bfloat16)
    shape, strides = [rows, kv_cache.shape[3]], [kv_cache.stride(1), 1]
    return (TensorDescriptor(kv_cache, shape, strides, [PAGE, box], half_layout),
            TensorDescriptor(kv_cache, shape, strides, [PAGE, D_R], rope_layout))


def knobs(overrides=None) -> dict:
    """The kernel's schedule knobs: DEFAULT_KNOBS, then KNOBS_ENV ("split_bars=1,quarters=0"), then overrides."""
    out = dict(DEFAULT_KNOBS)
    env = os.environ.get(KNOBS_ENV, "").strip()
    for item in filter(None, (x.strip() for x in env.split(","))):
        name, _, value = item.partition("=")
        if name not in out:
            raise ValueError(f"{KNOBS_ENV}: unknown knob {name!r} (known: {sorted(out)})")
        out[name] = value.strip().lower() in ("1", "true", "yes", "on")
    for name, value in (overrides or {}).items():
        if name not in out:
            raise ValueError(f"unknown knob {name!r} (known: {sorted(out)})")
        out[name] = bool(value)
    if out["p1_slot"] and not out["remat_desc"]:
        raise ValueError("knob p1_slot needs remat_desc (P1's slot is indexed like the other wgmma operands)")
    return out


def launch_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, o_part, lse_part, final,
                knob_overrides=None):
    """(kernel, grid, args, constexpr kwargs) of one launch; shared by mla_decode_gluon and the compile check."""
    kernel, gl = _build()
    kn = knobs(knob_overrides)
    b, s_q, h_q, _ = q.shape
    rows = s_q * h_q
    num_splits = o_part.shape[0]
    kn_desc, kr_desc = _descriptors(kv_cache, gl, kn["quarters"])
    grid = (-(-rows // BLOCK_M), num_splits, b)
    args = (q, kn_desc, kr_desc, block_table, cache_seqlens, o_part, lse_part,
            q.stride(0), q.stride(1), q.stride(2), block_table.stride(0),
            o_part.stride(0), o_part.stride(1), 0 if final else lse_part.stride(0), lse_part.stride(0 if final else 1),
            rows, softmax_scale * LOG2E, block_table.shape[1] * kv_cache.shape[1] if kv_cache.shape[0] else 0,
            max(kv_cache.shape[0] - 1, 0))
    meta = dict(H_Q=h_q, S_Q=s_q, CAUSAL=bool(causal), FINAL=bool(final), WG1_REGS=WG1_REGS,
                SPLIT_BARS=kn["split_bars"], QUARTERS=kn["quarters"], REMAT=kn["remat_desc"],
                TWO_MAX=kn["two_max"], P1_SLOT=kn["p1_slot"],
                EARLY_PAGES=kn["early_pages"], EARLY_MAX=kn["early_max"],
                EARLY_MAX1=kn["early_max1"], num_warps=4)
    return kernel, grid, args, meta


def mla_decode_gluon(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, num_splits,
                     knob_overrides=None):
    """The Gluon path of mla_decode_fwd (bf16 cache, dense, page 64, rows >= 64): (out, lse) as the portable
    launcher returns them, through the same partials + combine_splits when num_splits > 1."""
    from ..shared_kernels import combine_splits
    b, s_q, h_q, _ = q.shape
    rows = s_q * h_q
    out = torch.empty((b, s_q, h_q, D_V), device=q.device, dtype=q.dtype)
    lse = torch.empty((b, h_q, s_q), device=q.device, dtype=torch.float32)
    if b == 0:
        return out, lse
    final = num_splits == 1
    if final:
        o_part, lse_part = out.unsqueeze(0), lse
    else:
        o_part = torch.empty((num_splits, b, rows, D_V), device=q.device, dtype=torch.float32)
        lse_part = torch.empty((num_splits, b, rows), device=q.device, dtype=torch.float32)
    kernel, grid, args, meta = launch_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, o_part,
                                           lse_part, final, knob_overrides)
    kernel[grid](*args, **meta)
    if not final:
        combine_splits(o_part, lse_part, out, lse, h_q, s_q)
    return out, lse


# ------------------------------------------------------------------------------------ compile-only check
def compile_sm90(h_q=128, s_q=1, causal=False, num_splits=1, arch=90, knob_overrides=None):
    """Compile for sm_<arch> without a GPU (ops/_gluon.py): PTX features, warps, shared memory, the kernel."""
    from .._gluon import compile_report
    b, pages, max_pages = 2, 8, 4
    q = torch.empty(b, s_q, h_q, 576, dtype=torch.bfloat16)
    cache = torch.empty(pages, PAGE, 1, 576, dtype=torch.bfloat16)
    table = torch.zeros(b, max_pages, dtype=torch.int32)
    lens = torch.zeros(b, dtype=torch.int32)
    final = num_splits == 1
    if final:
        o_part, lse_part = torch.empty(1, b, s_q * h_q, D_V, dtype=torch.bfloat16), torch.empty(b, h_q, s_q)
    else:
        o_part, lse_part = torch.empty(num_splits, b, s_q * h_q, D_V), torch.empty(num_splits, b, s_q * h_q)
    kernel, grid, args, meta = launch_args(q, cache, table, lens, 576 ** -0.5, causal, o_part, lse_part, final,
                                           knob_overrides)
    return compile_report(kernel, args, grid, meta, arch)
