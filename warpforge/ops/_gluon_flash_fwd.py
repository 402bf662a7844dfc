"""FlashAttention forward for Hopper (sm_90) in Gluon, on FlashAttention-3's schedule: the kernel, shared by the
attention family (ops/attention/flash_gluon_kernel.py: dense, causal or windowed) and the sparse family
(ops/sparse/sparse_gluon_kernel.py: top-k block-sparse), which differ only in the key tiles an item walks.

The same problem and the same outputs as attention's flash_kernel.flash_fwd for batched [b, s, h, d] inputs
(bf16/fp16, head dim 64 or 128, causal bottom-right aligned or no mask, GQA/MQA): out [b, s_q, h_q, d], lse fp32
[b, h_q, s_q] in natural log, -inf (and out 0) for a query that sees no key. The backwards reuse both.

The walk (`_tile`, `_key_row`, `_step_mask`): dense, an item's key tiles are a range (from the window's first tile
to the causal limit). SPARSE (sparse_kernel.py's lists): an item of 128 query rows lies in one query block i of BS
rows (BS a multiple of 128) and walks the kept blocks SEL[b, g, i, :NSEL[b, g, i]] in BLOCK_N sub-tiles, then its
own block up to the causal limit; only the producer reads SEL (one scalar load a tile, issued before it waits for
the slot). Causal kept blocks lie before the query block, so only the own block's tiles are masked. Items run
query tile by query tile with the heads innermost, so the heads of a GQA group, which keep the same blocks, read
them from L2.

Schedule (Triton 3.6's Gluon; the H200 runs 3.6), one program per (128 query rows, batch · head):
- shared memory: Q [2 × 64 rows, D] (one slice per consumer), a ring of STAGES slots each holding one K and one V
  tile [BLOCK_N, D] (NVMMA 128-byte swizzle), and mbarriers: q_bar; k_ready / v_ready / k_empty / v_empty per
  slot; two `turn` barriers for the ping-pong. d 128, BLOCK_N 128, 2 stages: 32 + 128 KB.
- producer (a worker partition of one warp, PRODUCER_REGS registers after setmaxnreg): TMA-loads the two Q
  slices once (q_bar), then for each key tile j of the program's band: waits `k_empty[j % STAGES]` (fresh
  barriers pass on the first lap) and TMA-loads K_j (k_ready), then the same for V_j (v_empty, v_ready). K's
  slot is freed as soon as S has read it, V's after P·V: K runs ahead of V, as in FA3's two pipelines. All loads
  go through 4-D descriptors over [b, s, h, d] with [1, rows, 1, D] boxes, so rows past a sequence's end arrive
  as zeros and any 16-byte-aligned strides work.
- consumers: two warpgroups, the default partition (warpgroup 0, query rows 0-63 of the tile) and a worker
  partition (warpgroup 1, rows 64-127), CONSUMER_REGS registers each. Each runs, for key tile j:
      wait k_ready[j]; [ping-pong: wait my turn]
      issue S_j = Q·K_jᵀ (async wgmma, 64 × BLOCK_N fp32) and O += P_{j-1}·V_{j-1} (async wgmma, P_{j-1} the
      bf16 register A operand converted from the previous step's fp32 probabilities: no shared-memory trip)
      [ping-pong: hand the turn to the other warpgroup]
      wait for S_j only (P·V still on the tensor cores), free K_j's slot, and do the online softmax of tile j
      (exp2, the softmax scale folded into one FMA per score; masks only on tiles that cross the causal diagonal
      or the end of the keys) while P·V_{j-1} runs: FA3's intra-warpgroup overlap;
      wait for P·V_{j-1}, free V_{j-1}'s slot, rescale O. (Each free is one arrive per warpgroup: count 2.)
  Ping-pong (PINGPONG): the two warpgroups issue their GEMMs in strict alternation through the two `turn`
  barriers, so one warpgroup's softmax runs under the other's GEMMs. Each warpgroup takes n_tiles + 1 turns
  (S_0; S_j with P·V_{j-1}; the last P·V) and hands over after each (one arrive on the other's `turn`, count 1).
  Warpgroup 0 takes turn 0 without waiting; at turn t it waits for the other's hand-over t-1 (parity (t-1) & 1),
  warpgroup 1 for hand-over t (parity t & 1). Strict alternation keeps each barrier at most one phase ahead of
  its waiter; both warpgroups take the same number of turns (the same key tiles), so no one waits at the end.
- epilogue: O normalised, written into the warpgroup's own Q slice (no S reads it any more) and stored with one
  TMA store (rows past s_q clipped); lse by pointer.
- causal: the program walks only the key tiles its 128 rows can see (fully masked tiles are skipped), both
  warpgroups the same count (the ping-pong needs it), masking only the tiles that cross a row's limit.
- 12 warps: 4 (consumer 0) + 4 (consumer 1) + 1 producer (rounded to a warpgroup); maxnreg 168 at launch,
  setmaxnreg gives the consumers 240 and the producer 24 (12 · 168 · 32 = 4 · 32 · (240 + 240 + 24)).

Gluon's API changes between Triton releases: everything here is imported lazily (`_build()`), and the api gate
(api.py) only dispatches here on sm_90 with a Triton in configs.GLUON_TRITON_VERSIONS.
"""
import functools

import torch

from ._gluon import SMEM_MAX, check_smem, tma_addressable, tma_descriptor  # noqa: F401 - SMEM_MAX: the tests' bound
from .shared_kernels import triton_launch

LOG2E = 1.4426950408889634
BLOCK_M = 128           # query rows per program: two consumer warpgroups of 64 rows each
WG_ROWS = 64
GLUON_TRITON_VERSIONS = ("3.6",)  # Triton releases whose Gluon API this file was written and compiled against
HEAD_DIMS = (64, 128)
PRODUCER_REGS = 24
CONSUMER_REGS = 240
MAXNREG = 168           # 12 warps x 168 registers = 64K: what setmaxnreg redistributes


def smem_bytes(d: int, block_n: int, stages: int, persistent: bool = False) -> int:
    """Shared memory of the schedule (2-byte elements): Q (two slots when persistent), the ring, barriers."""
    return 2 * ((2 if persistent else 1) * BLOCK_M * d + stages * 2 * block_n * d) + 1024


@functools.lru_cache(maxsize=None)
def _build():
    """The Gluon kernel, built on first use (importing warpforge never touches Gluon)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    @gluon.jit
    def _item(k):
        """This program's work item in round k: programs take items k · P + pid, in reverse order on odd rounds
        (a snake: with P a multiple of the row tiles per head, every program's causal work evens out over two
        rounds)."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        t = k * nprog + pid
        if k % 2 == 1:
            t = k * nprog + (nprog - 1 - pid)
        return t

    @gluon.jit
    def _tile(t, n_m, H_Q, GROUP, s_q, s_k, left, NSEL, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
              SPARSE: gl.constexpr, BS: gl.constexpr, BLOCK_N: gl.constexpr):
        """Work item t: (b, h, kv head, first query row, first key tile j0, key tiles to walk, kept tiles). Dense:
        items run head by head, each head's row tiles from the last (the heaviest when causal) to the first; the
        walk is tiles j0 .. j0 + n - 1, and WINDOW (a left window: query c sees key r only if r >= c + s_k - s_q -
        left) starts it at the tile of the first row's first key. SPARSE: items run row tile by row tile (the last
        first), heads innermost; the walk is the kept blocks' tiles (the last value: NSEL · BS / BLOCK_N), then the
        own block's from its tile j0."""
        if SPARSE:
            h = t % H_Q
            rest = t // H_Q
            pid_m = n_m - 1 - rest % n_m
            b = rest // n_m
        else:
            bh = t // n_m
            pid_m = n_m - 1 - t % n_m
            b = bh // H_Q
            h = bh % H_Q
        m_lo = pid_m * 128
        if SPARSE:
            i = m_lo // BS
            n_sel = gl.load(NSEL + (b * (H_Q // GROUP) + h // GROUP) * gl.cdiv(s_q, BS) + i)
            own_lo = i * BS + (s_k - s_q)  # the query block as a key block (keys may be longer by whole blocks)
            if CAUSAL:
                own_hi = gl.minimum(m_lo + 128, s_q) + (s_k - s_q)
            else:
                own_hi = gl.minimum(own_lo + BS, s_k)
            n_kept = n_sel * (BS // BLOCK_N)
            j0 = own_lo // BLOCK_N
            n_tiles = n_kept + gl.cdiv(own_hi - own_lo, BLOCK_N)
        else:
            if CAUSAL:
                # the last key the tile's last row sees (bottom-right aligned); tiles past it are fully masked
                hi = gl.minimum(gl.minimum(m_lo + 128, s_q) + (s_k - s_q), s_k)
            else:
                hi = s_k
            n_hi = gl.maximum(gl.cdiv(hi, BLOCK_N), 0)
            if WINDOW:
                j0 = gl.minimum(gl.maximum(m_lo + (s_k - s_q) - left, 0) // BLOCK_N, n_hi)
            else:
                j0 = n_hi * 0
            n_tiles = n_hi - j0
            n_kept = j0 * 0
        return b, h, h // GROUP, m_lo, j0, n_tiles, n_kept

    @gluon.jit
    def _sel_row(SEL, b, kvh, m_lo, stride_sb, stride_sh, stride_si, SPARSE: gl.constexpr, BS: gl.constexpr):
        """SPARSE: the item's kept-block list SEL[b, kv head, query block] (dense: SEL itself, never read)."""
        if SPARSE:
            return (SEL + b.to(gl.int64) * stride_sb + kvh.to(gl.int64) * stride_sh
                    + (m_lo // BS).to(gl.int64) * stride_si)
        else:
            return SEL

    @gluon.jit
    def _key_row(j, j0, n_kept, sel_row, SPARSE: gl.constexpr, BS: gl.constexpr, BLOCK_N: gl.constexpr):
        """The first key of walk step j."""
        if SPARSE:
            if j < n_kept:
                n0 = gl.load(sel_row + j // (BS // BLOCK_N)) * BS + (j % (BS // BLOCK_N)) * BLOCK_N
            else:
                n0 = (j0 + j - n_kept) * BLOCK_N
        else:
            n0 = (j0 + j) * BLOCK_N
        return n0

    @gluon.jit
    def _step_mask(j, j0, n_kept, sel_row, s_k, first_masked, lo_full, CAUSAL: gl.constexpr, SPARSE: gl.constexpr,
                   BS: gl.constexpr, BLOCK_N: gl.constexpr):
        """(first key, masked) of walk step j in a consumer; the first key matters only where masked. SPARSE and
        causal: kept blocks are earlier than the query block, whole and wholly visible, so only the own block's
        tiles are masked and SEL is not read; not causal, a kept block may be the keys' last, partial one."""
        gl.static_assert(BS % BLOCK_N == 0)  # (also makes gl a name this function's annotations can resolve)
        if SPARSE:
            if CAUSAL:
                n0 = (j0 + j - n_kept) * BLOCK_N
                masked = j >= n_kept
            else:
                n0 = _key_row(j, j0, n_kept, sel_row, SPARSE, BS, BLOCK_N)
                masked = (j >= n_kept) | (n0 + BLOCK_N > s_k)
        else:
            jj = j0 + j
            n0 = jj * BLOCK_N
            masked = (jj >= first_masked) | (jj < lo_full)
        return n0, masked

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
                  v_empty, n_m, total, n_rounds, H_Q, GROUP, s_q, s_k, left, SEL, NSEL, stride_sb, stride_sh,
                  stride_si, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SPARSE: gl.constexpr, BS: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, QBUF: gl.constexpr):
        gl.static_assert(STAGES >= 2)  # S_j is issued before tile j-1's slot is freed: one slot would deadlock
        it = 0  # K/V tiles loaded so far: the ring position, continued across work items
        tc = 0  # work items so far
        for k in range(n_rounds):
            t = _item(k)
            if t < total:
                it, tc = _produce_item(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
                                       v_ready, k_empty, v_empty, t, it, tc, n_m, H_Q, GROUP, s_q, s_k, left, SEL,
                                       NSEL, stride_sb, stride_sh, stride_si, CAUSAL, WINDOW, SPARSE, BS, BLOCK_N,
                                       STAGES, QBUF)

    @gluon.jit
    def _produce_item(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
                      v_empty, t, it, tc, n_m, H_Q, GROUP, s_q, s_k, left, SEL, NSEL, stride_sb, stride_sh, stride_si,
                      CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SPARSE: gl.constexpr, BS: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, QBUF: gl.constexpr):
        q_bytes: gl.constexpr = 2 * q_desc.block_type.nbytes
        b, h, kvh, m_lo, j0, n_tiles, n_kept = _tile(t, n_m, H_Q, GROUP, s_q, s_k, left, NSEL, CAUSAL, WINDOW,
                                                     SPARSE, BS, BLOCK_N)
        sel_row = _sel_row(SEL, b, kvh, m_lo, stride_sb, stride_sh, stride_si, SPARSE, BS)
        qs = tc % QBUF
        # empty barriers start as if their phase 1 had completed: the first lap does not wait. Q's slot is free
        # once both consumers have stored the output they staged in it. Q is loaded even for an item without
        # key tiles: the consumers wait for every copy, so none is still landing when the program exits
        mbarrier.wait(q_empty.index(qs), ((tc // QBUF) & 1) ^ 1)
        mbarrier.expect(q_ready.index(qs), q_bytes)
        tma.async_copy_global_to_shared(q_desc, [b, m_lo, h, 0], q_ready.index(qs), q_bufs.index(2 * qs))
        tma.async_copy_global_to_shared(q_desc, [b, m_lo + 64, h, 0], q_ready.index(qs), q_bufs.index(2 * qs + 1))
        for j in range(n_tiles):
            slot = it % STAGES
            phase = ((it // STAGES) & 1) ^ 1
            n0 = _key_row(j, j0, n_kept, sel_row, SPARSE, BS, BLOCK_N)  # SPARSE: its load runs during the wait
            # K's slot is freed once S has read it, V's once P·V has: K runs further ahead
            mbarrier.wait(k_empty.index(slot), phase)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, n0, kvh, 0], k_ready.index(slot), k_bufs.index(slot))
            mbarrier.wait(v_empty.index(slot), phase)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [b, n0, kvh, 0], v_ready.index(slot), v_bufs.index(slot))
            it += 1
        tc += 1
        return it, tc

    @gluon.jit
    def _softmax(s, n0, limit_row, low_row, s_k, m_i, l_i, qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                 WINDOW: gl.constexpr, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
        """One online-softmax step on the raw scores of keys n0 .. n0+BLOCK_N-1: (p fp32, alpha, l, m), m in
        log2 units. limit_row [64]: causal, the last key each row may see; low_row [64]: WINDOW, the first."""
        if MASK:
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            ok = (cols < s_k)[None, :]
            if CAUSAL:
                ok = ok & (cols[None, :] <= limit_row[:, None])
            if WINDOW:
                ok = ok & (cols[None, :] >= low_row[:, None])
            s = gl.where(ok, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
            p = gl.exp2(s - m_use[:, None])
        else:
            # scale and shift in one FMA per score
            # (every row sees every key of the tile: its maximum is finite)
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            m_use = m_new
            p = gl.exp2(s * qk_scale - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        return p, alpha, l_i * alpha + gl.sum(p, axis=1), m_new

    @gluon.jit
    def _consumer(q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, o_desc, LSE,
                  n_m, total, n_rounds, H_Q, GROUP, s_q, s_k, left, qk_scale, stride_lb, stride_lh, SEL, NSEL,
                  stride_sb, stride_sh, stride_si, WG: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SPARSE: gl.constexpr,
                  BS: gl.constexpr, PINGPONG: gl.constexpr, QBUF: gl.constexpr):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = q_bufs.dtype
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
        it = 0  # K/V tiles consumed so far (the ring position)
        tn = 0  # GEMM turns taken so far (the ping-pong position): n_tiles + 1 per item with key tiles
        tc = 0  # work items so far
        for k in range(n_rounds):
            t = _item(k)
            if t < total:
                b, h, kvh, m_lo, j0, n_tiles, n_kept = _tile(t, n_m, H_Q, GROUP, s_q, s_k, left, NSEL, CAUSAL,
                                                             WINDOW, SPARSE, BS, BLOCK_N)
                sel_row = _sel_row(SEL, b, kvh, m_lo, stride_sb, stride_sh, stride_si, SPARSE, BS)
                qs = tc % QBUF
                q_smem = q_bufs.index(2 * qs + WG)
                q = q_smem.reshape([64, D])
                r0 = m_lo + WG * 64
                rows = r0 + gl.arange(0, 64, layout=row_s)
                limit_row = rows + (s_k - s_q)          # causal: the last key each row sees (bottom-right aligned)
                # key tiles from here on need a mask: past the keys' end, or (causal) past the first row's limit
                if CAUSAL:
                    first_masked = gl.minimum(s_k, r0 + (s_k - s_q) + 1) // BLOCK_N
                else:
                    first_masked = s_k // BLOCK_N
                # WINDOW: key tiles before lo_full hold keys below some row's window (the last row's first key)
                if WINDOW:
                    low_row = limit_row - left
                    lo_full = (gl.maximum(r0 + 63 + (s_k - s_q) - left, 0) + BLOCK_N - 1) // BLOCK_N
                else:
                    low_row = limit_row
                    lo_full = first_masked * 0
                m_i = gl.full([64], float("-inf"), gl.float32, row_s)
                l_i = gl.zeros([64], gl.float32, row_s)
                acc = gl.zeros([64, D], gl.float32, o_layout)
                mbarrier.wait(q_ready.index(qs), (tc // QBUF) & 1)
                if n_tiles > 0:
                    # ---- key tile 0: S only
                    slot = it % STAGES
                    mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
                    if PINGPONG:
                        # global turn tn: warpgroup 0 waits for warpgroup 1's hand-over tn-1 (none before turn 0),
                        # warpgroup 1 for warpgroup 0's hand-over tn
                        if WG == 0:
                            mbarrier.wait(turn.index(0), (tn + 1) & 1, pred=tn > 0)
                        else:
                            mbarrier.wait(turn.index(1), tn & 1)
                    s_tok = warpgroup_mma(q, k_bufs.index(slot).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                                          use_acc=False, is_async=True)
                    if PINGPONG:
                        mbarrier.arrive(turn.index(1 - WG))
                    s = warpgroup_mma_wait(0, deps=(s_tok, ))
                    mbarrier.arrive(k_empty.index(slot))  # K read (Triton syncs the warpgroup before an arrive)
                    n0, masked = _step_mask(0, j0, n_kept, sel_row, s_k, first_masked, lo_full, CAUSAL, SPARSE, BS,
                                            BLOCK_N)
                    if masked:
                        p, alpha, l_i, m_i = _softmax(s, n0, limit_row, low_row, s_k, m_i, l_i, qk_scale,
                                                      True, CAUSAL, WINDOW, s_layout, BLOCK_N)
                    else:
                        p, alpha, l_i, m_i = _softmax(s, n0, limit_row, low_row, s_k, m_i, l_i, qk_scale,
                                                      False, CAUSAL, WINDOW, s_layout, BLOCK_N)
                    p_op = gl.convert_layout(p.to(dtype), p_layout)
                    # ---- key tiles 1 .. n-1: S_j and P_{j-1}·V_{j-1} in flight together
                    for j in range(1, n_tiles):
                        g = it + j
                        slot = g % STAGES
                        prev = (g - 1) % STAGES
                        mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
                        mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
                        if PINGPONG:  # global turn tn + j
                            mbarrier.wait(turn.index(WG), (tn + j + 1 + WG) & 1)
                        s_tok = warpgroup_mma(q, k_bufs.index(slot).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                                              use_acc=False, is_async=True)
                        acc_tok = warpgroup_mma(p_op, v_bufs.index(prev).reshape([BLOCK_N, D]), acc, is_async=True)
                        if PINGPONG:
                            mbarrier.arrive(turn.index(1 - WG))
                        s = warpgroup_mma_wait(1, deps=(s_tok, ))  # S_j done; P·V_{j-1} may still run
                        mbarrier.arrive(k_empty.index(slot))
                        n0, masked = _step_mask(j, j0, n_kept, sel_row, s_k, first_masked, lo_full, CAUSAL, SPARSE,
                                                BS, BLOCK_N)
                        if masked:
                            p, alpha, l_i, m_i = _softmax(s, n0, limit_row, low_row, s_k, m_i, l_i,
                                                          qk_scale, True, CAUSAL, WINDOW, s_layout, BLOCK_N)
                        else:
                            p, alpha, l_i, m_i = _softmax(s, n0, limit_row, low_row, s_k, m_i, l_i,
                                                          qk_scale, False, CAUSAL, WINDOW, s_layout, BLOCK_N)
                        # P_{j-1}'s registers are the in-flight wgmma's A operand: kept alive (deps) until it is done
                        acc, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
                        gl.thread_barrier()  # the whole warpgroup is past P·V_{j-1} before its slot is handed back
                        mbarrier.arrive(v_empty.index(prev))
                        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                        p_op = gl.convert_layout(p.to(dtype), p_layout)
                    # ---- the last P·V
                    g = it + n_tiles - 1
                    last = g % STAGES
                    mbarrier.wait(v_ready.index(last), (g // STAGES) & 1)
                    if PINGPONG:  # global turn tn + n_tiles
                        mbarrier.wait(turn.index(WG), (tn + n_tiles + 1 + WG) & 1)
                    acc_tok = warpgroup_mma(p_op, v_bufs.index(last).reshape([BLOCK_N, D]), acc, is_async=True)
                    if PINGPONG:
                        mbarrier.arrive(turn.index(1 - WG))
                    acc, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
                    gl.thread_barrier()
                    mbarrier.arrive(v_empty.index(last))
                    it += n_tiles
                    tn += n_tiles + 1

                # epilogue: normalise; out goes through this warpgroup's Q slice (every S GEMM that read it is done)
                # and one TMA store, which clips rows past s_q; lse by pointer
                empty_row = l_i == 0.0
                l_safe = gl.where(empty_row, 1.0, l_i)
                lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
                out = acc * gl.convert_layout(1.0 / l_safe, row_o)[:, None]
                q.store(out.to(dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [b, r0, h, 0], q_smem)
                gl.store(LSE + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + rows, lse, mask=rows < s_q)
                tma.store_wait(0)
                gl.thread_barrier()  # every issuing thread has seen its store leave the slot
                mbarrier.arrive(q_empty.index(qs))  # the producer may load a later item's Q here
                tc += 1

    @gluon.jit
    def flash_fwd_gluon_kernel(q_desc, k_desc, v_desc, o_desc, LSE, s_q, s_k, qk_scale, stride_lb, stride_lh, H_Q,
                               GROUP, n_m, total, n_rounds, left, SEL, NSEL, stride_sb, stride_sh, stride_si,
                               D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                               WINDOW: gl.constexpr, SPARSE: gl.constexpr, BS: gl.constexpr, PINGPONG: gl.constexpr,
                               QBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        # Q: QBUF slots of two 64-row slices (slice 2 · slot + warpgroup); QBUF 2 (persistent) lets the producer
        # load the next item's Q while the consumers finish this one
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2 * QBUF] + q_desc.block_type.shape, q_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(QBUF):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # one arrive per consumer warpgroup
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)

        gl.warp_specialize([
            (_consumer, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, o_desc,
                         LSE, n_m, total, n_rounds, H_Q, GROUP, s_q, s_k, left, qk_scale, stride_lb, stride_lh, SEL,
                         NSEL, stride_sb, stride_sh, stride_si, 0, D, BLOCK_N, STAGES, CAUSAL, WINDOW, SPARSE, BS,
                         PINGPONG, QBUF)),
            (_consumer, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, o_desc,
                         LSE, n_m, total, n_rounds, H_Q, GROUP, s_q, s_k, left, qk_scale, stride_lb, stride_lh, SEL,
                         NSEL, stride_sb, stride_sh, stride_si, 1, D, BLOCK_N, STAGES, CAUSAL, WINDOW, SPARSE, BS,
                         PINGPONG, QBUF)),
            (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
                         v_empty, n_m, total, n_rounds, H_Q, GROUP, s_q, s_k, left, SEL, NSEL, stride_sb, stride_sh,
                         stride_si, CAUSAL, WINDOW, SPARSE, BS, BLOCK_N, STAGES, QBUF)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    return flash_fwd_gluon_kernel, gl


def available() -> bool:
    """This Triton's Gluon is one the kernel was written for (and imports)."""
    from ._gluon import builds
    return builds(_build, GLUON_TRITON_VERSIONS)




def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Batched 16-bit inputs of head dim 64/128 (q, k and v alike) that TMA descriptors can address: 16-byte
    aligned bases and strides."""
    return (q.dim() == 4 and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in HEAD_DIMS
            and k.shape[-1] == q.shape[-1] and v.shape[-1] == q.shape[-1]
            and all(tma_addressable(t) for t in (q, k, v)))


def _descriptors(q, k, v, out, block_n, gl):
    d = q.shape[-1]
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    return [tma_descriptor(t, (1, rows, 1, d), gdt) for t, rows in ((q, WG_ROWS), (k, block_n), (v, block_n),
                                                                       (out, WG_ROWS))]


def launch_args(q, k, v, out, lse, sm_scale, causal, block_n, stages, pingpong, persistent=False, sms=132, left=None,
                blocks=None):
    """(kernel, grid, args, constexpr kwargs) of one launch; shared by the families' launchers and the compile tests.
    left: a left window (query c sees key r only if r >= c + s_k - s_q - left); None or >= s_k: none. blocks: the
    sparse walk, (sel, n_sel, block_size) as sparse_kernel.py takes them (block_size a multiple of 128 and of
    block_n); None: dense."""
    if stages < 2:
        raise ValueError(f"flash_fwd_gluon: stages must be >= 2 (got {stages}): S_j is issued before the slot of "
                         "tile j-1 is freed")
    d = q.shape[-1]
    check_smem("flash_fwd_gluon", smem_bytes(d, block_n, stages, persistent),
               f"BLOCK_N {block_n} x {stages} stages at d {d} (persistent {persistent})")
    if blocks is None:
        sel = n_sel = lse  # never read
        sel_strides, bs = (0, 0, 0), BLOCK_M
    else:
        sel, n_sel, bs = blocks
        if bs % BLOCK_M or bs % block_n:
            raise ValueError(f"flash_fwd_gluon: a sparse block of {bs} rows is not a multiple of {BLOCK_M} and of "
                             f"BLOCK_N {block_n}")
        sel_strides = sel.stride()[:3]
    kernel, gl = _build()
    b, s_q, h_q, _ = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    q_desc, k_desc, v_desc, o_desc = _descriptors(q, k, v, out, block_n, gl)
    window = left is not None and left < s_k
    n_m = -(-s_q // BLOCK_M)
    total = n_m * b * h_q  # work items: (row tile, batch · head)
    if persistent:
        # causal dense: a multiple of the row tiles per head, so that the snake order evens out the programs' work
        progs = sms // n_m * n_m if causal and blocks is None and n_m <= sms else sms
        progs = max(1, min(progs, total))
    else:
        progs = total
    grid = (progs, )
    args = (q_desc, k_desc, v_desc, o_desc, lse, s_q, s_k, sm_scale * LOG2E, lse.stride(0), lse.stride(1), h_q,
            h_q // h_kv, n_m, total, -(-total // progs), int(left) if window else 0, sel, n_sel, *sel_strides)
    meta = dict(D=d, BLOCK_N=block_n, STAGES=stages, CAUSAL=bool(causal), WINDOW=window, SPARSE=blocks is not None,
                BS=bs, PINGPONG=bool(pingpong), QBUF=2 if persistent else 1, CONSUMER_REGS=CONSUMER_REGS,
                PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG)
    return kernel, grid, args, meta


def flash_fwd_gluon(q, k, v, sm_scale, causal, block_n, stages, pingpong, persistent=False, left=None, blocks=None,
                    launch=triton_launch):
    """(out [b, s_q, h_q, d] contiguous in q's dtype, lse fp32 [b, h_q, s_q]); the caller checked fits(q, k, v) and
    available(). Knobs: key rows per ring slot (64 or 128), ring slots (>= 2), ping-pong on/off, persistent (one
    program per SM walking work items; else one program per item). left: a left window (None: none); blocks: the
    sparse walk (launch_args). launch: shared_kernels.triton_launch's form (the ops pass their cached launch)."""
    b, s_q, h_q, d = q.shape
    out = torch.empty((b, s_q, h_q, d), device=q.device, dtype=q.dtype)  # contiguous: TMA-aligned
    lse = torch.empty((b, h_q, s_q), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    if k.shape[1] == 0:  # no keys: every query sees nothing (a descriptor cannot have an empty dimension)
        lse.fill_(float("-inf"))
        return out.zero_(), lse
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if persistent else 0
    kernel, grid, args, meta = launch_args(q, k, v, out, lse, sm_scale, causal, block_n, stages, pingpong,
                                           persistent, sms, left, blocks)
    launch(kernel, grid, *args, **meta)
    return out, lse


def compile_sm90(d=128, causal=True, block_n=128, stages=2, pingpong=True, persistent=False, h_q=4, h_kv=2,
                 dtype="bfloat16", arch=90, left=None, block_size=None):
    """Compile the kernel for sm_<arch> without a GPU (Triton's wheel carries ptxas): a stub driver stands in
    for the device while nothing is launched. block_size: the sparse walk over blocks of that many rows. Returns
    a report dict (PTX features, warps, shared memory, the compiled kernel)."""
    from ._gluon import compile_report
    dt = getattr(torch, dtype)
    b, s = 2, 300
    q = torch.empty(b, s, h_q, d, dtype=dt)
    k = torch.empty(b, s, h_kv, d, dtype=dt)
    v = torch.empty(b, s, h_kv, d, dtype=dt)
    out = torch.empty(b, s, h_q, d, dtype=dt)
    lse = torch.empty(b, h_q, s)
    blocks = None
    if block_size:
        nb = -(-s // block_size)
        blocks = (torch.empty(b, h_kv, nb, 4, dtype=torch.int32), torch.empty(b, h_kv, nb, dtype=torch.int32),
                  block_size)
    kernel, grid, args, meta = launch_args(q, k, v, out, lse, d ** -0.5, causal, block_n, stages, pingpong,
                                           persistent, left=left, blocks=blocks)
    return compile_report(kernel, args, grid, meta, arch)
