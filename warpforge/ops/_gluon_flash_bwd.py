"""FlashAttention backward for Hopper (sm_90) in Gluon, on FlashAttention-3's schedule: the kernel, shared by the
attention family (ops/attention/flash_gluon_bwd_kernel.py: dense, causal or windowed) and the sparse family
(ops/sparse/sparse_gluon_kernel.py: top-k block-sparse), which differ only in the query tiles a program walks.

The walk (`_walk`, `_query_tile`): dense, a program's query tiles are a range (those that see any of its keys).
SPARSE: a program's 128 keys lie in key block j of BS rows (BS a multiple of 128); per head it walks the query
blocks that kept block j (sparse_kernel.py's CSR lists OFFSETS / QBLOCKS, ascending) in BLOCK_M tiles, then its own
query block's tiles from the first that sees its keys. Kept query blocks lie after block j when causal, so the dense
rule (a tile is masked iff its first row does not see the warpgroup's last key) masks only own-block tiles. The
statistics and dQ's accumulator are padded to whole blocks (rows past s_q: lse2 +inf, so P = 0 there). WORKLIST
(sparse, 128-row blocks): programs come from a work list instead, one (query block, key block) pair or one own block
each, in the order the host wrote them (a query block's pairs side by side: its Q, dO and dQ rows then serve all its
key blocks from L2); OFFSETS holds the list, and dK / dV are summed over the pairs as with GROUP_SPLIT.

The same problem as flash_kernel.flash_bwd for batched [b, s, h, d] inputs (bf16/fp16, head dim 64 or 128 for q, k
and v, causal bottom-right aligned or no mask, GQA/MQA): given do, q, k, v, out and the forward's lse [b, h_q, s_q]
(natural log, -inf for a query that sees nothing) it returns dq, dk, dv like q, k, v. Not deterministic: dq is
summed over key tiles by fp32 atomics (the api gate sends deterministic=True to the portable backward).

Three launches (four with GROUP_SPLIT or a work list):
1. `bwd_prep_kernel` (plain Triton): per (batch · head, 64 query rows): delta = rowsum(do ∘ out) and lse2 = lse · log2 e
   (+inf where lse is -inf, so that such a row's probabilities are exp2(-inf) = 0) into [b · h_q, s_pad] fp32 buffers
   padded to whole query tiles (padding: lse2 +inf, delta 0, so padded query rows contribute nothing and need no
   mask), and zeros into the fp32 dq accumulator [b · h_q, s_pad, d].
2. `flash_bwd_gluon_kernel`, one program per (128 keys, batch · kv head) (GROUP_SPLIT: per slice of the group;
   WORKLIST: per item), 12 warps:
   - shared memory: K and V of the program's keys as two 64-row slices each (one per consumer warpgroup), a ring of
     STAGES slots each holding Q_i and dO_i [BLOCK_M, d] and lse2_i, delta_i [1, BLOCK_M]; per consumer a P tile and
     a dS tile [BLOCK_M, 64] (16-bit; KEY_ROWS: two dSᵀ tiles [64, 64] instead, the same bytes); a [1, 64] int32
     table 0..63. d 128, BLOCK_M 64, 2 stages: 162 KB.
   - producer (a 1-warp worker partition, setmaxnreg 24): TMA-loads K, V and the index table once (kv_bar), then for
     each query head of the kv head's GQA group and each query tile i that sees any of the program's keys: waits
     `empty[slot]`, loads Q_i, dO_i, lse2_i, delta_i onto `ready[slot]` (one expect-tx for the four copies). 4-D
     descriptors over [b, s, h, d] with [1, rows, 1, d] boxes (rows past a sequence's end arrive as zeros); 2-D over
     the padded lse2 / delta.
   - consumers: warpgroup w (w = 0 the default partition, 1 a 4-warp worker; setmaxnreg 240) owns keys
     n0 + 64 w .. n0 + 64 w + 63 and accumulates dK_w, dV_w [64, d] fp32 in registers over every query tile and every
     head of the group (GQA's sum in-program; with GROUP_SPLIT or a work list the programs' partial sums meet in
     fp32 reduce-adds, in arrival order). Per query tile (queries as rows, so lse and
     delta are per-row values, two registers):
        S = Q_i · K_wᵀ (wgmma, [BLOCK_M, 64] fp32); P = exp2(S · scale · log2 e − lse2_i), the mask only on tiles whose
        first row does not see the warpgroup's last key (causal diagonal) or that hold keys past s_k; P stored 16-bit
        into the warpgroup's P tile
        dP = dO_i · V_wᵀ and dV_w += Pᵀ · dO_i issued together (Pᵀ: the P tile read transposed from shared memory)
        wait dP (dV may run); dS = P ∘ (dP − delta_i) (P read back from its tile), stored 16-bit into the dS tile
        dK_w += dSᵀ · Q_i and dQ_i,w[:, :DQ_N] = dS · K_w[:, :DQ_N] issued (both read dS from shared memory)
        wait all; release the ring slot (one arrive per warpgroup, count 2); relaxed fp32 atomic adds (red.v2.f32) of
        the dQ chunk into the accumulator; the next DQ_N columns of dQ the same way (D / DQ_N chunks).
     P and dS go through shared memory (not registers) and dQ in column chunks because registers are the limit: dK
     and dV hold 128 of the 240 at d 128, and with S, dP, P and dQ beside them ptxas spilled. The column indices the
     mask and the atomics need come from the shared table: an arange-built index vector is hoisted out of the loop
     and held 8-16 registers for its whole length. The two warpgroups are not synchronised with each other: while
     one computes exp2 or issues its atomics, the other's wgmmas keep the tensor cores busy.
   - DQ_SPLIT (a knob; the tables take it at d 128): instead, each warpgroup computes half of dQ's columns over all
     128 keys (two wgmmas: both warpgroups' dS tiles against both K slices), so a tile pair sends one [BLOCK_M, d]
     partial to the atomics instead of two (half the L2 reduction traffic, FA3's volume). It needs two barriers
     between the warpgroups (ds_full, ds_free, below).
   - DQ_TMA (a knob; the tables take it; with or without DQ_SPLIT): dQ's chunks are not added by per-thread fp32
     atomics (32 REDG.F32x2 a thread per tile at d 128, 64 KB of L2 reductions per tile pair without the split) but
     stored fp32 into a staging tile in shared memory (per warpgroup one [BLOCK_M, DQ_N] tile per chunk of a step)
     and sent by one TMA reduce-add each (cp.reduce.async.bulk.tensor ... .add, FA3's way): whole 128-byte lines into
     L2, no address registers, nothing for the warps to issue but one instruction. Before a step overwrites its
     staging tiles, the issuing thread waits until the previous step's reduce-adds have read them (tma.store_wait
     before the P tile's warpgroup barrier, KEY_ROWS the dSᵀ tile's, which holds the other threads). Shared memory:
     +32 KB with the split (d 128), +64 KB without (d 128, 2 stages: 226 KB of 227). With DQ_TMA, DQ_N may be D (one
     full-width dQ wgmma and one reduce per step).
   - KEY_ROWS (a knob: 0 off, 1 or 2; BLOCK_M 64 with DQ_SPLIT and DQ_TMA; the families' tables take 2 at d 128,
     3-4% off fwd+bwd, H100, session 28): the step transposed, FA3's order (its
     SdP_swapAB with dV / dK's A operand in registers). Sᵀ = K_w · Q_iᵀ and dPᵀ = V_w · dO_iᵀ ([64 keys, 64 queries],
     lse and delta per column) are issued together, so dPᵀ computes during the exp2s; Pᵀ and dSᵀ, converted to the
     wgmma's register A layout, feed dV_w += Pᵀ · dO_i and dK_w += dSᵀ · Q_i directly: no P tile in shared memory,
     no P reload, one barrier less a step. dSᵀ still goes to shared memory, for the dQ wgmmas (read transposed), in
     two tiles a warpgroup by the step's parity: a tile's last readers (both warpgroups' dQ of step it - 2) are done
     once the other warpgroup's ds_full arrival of step it - 1 was seen, so the ds_free wait before the step goes.
     1 issues dK before the ds_full wait (the tensor cores busy while the other warpgroup catches up), 2 after the dQ
     wgmmas, so that dQ's staging store runs beside dK (FA3's order) instead of after it.
   - epilogue: dK_w · scale and dV_w to 16-bit, written into the warpgroup's own K / V slices (nothing reads them
     any more) and stored by TMA (rows past s_k clipped).
   - causal: a program walks only query tiles from the first one that sees its first key (fully masked tiles are
     skipped); key tiles no query sees write zeros (with the fp32 dK / dV accumulator: keep its zeros).
3. `acc_convert_kernel` (plain Triton): dq = accumulator · scale, to q's dtype and layout; with GROUP_SPLIT a fourth
   launch of it converts dK and dV from their fp32 sums (a grid of depth 2).

Why atomics rather than a separate dq pass: the dq pass recomputes S and dP (7 GEMMs per tile pair instead of 5, 40%
more tensor work where the backward must run at ~450 TFLOP/s effective), and must re-read K and V for every query
tile; the atomics move dQ's fp32 partials through L2 (they stay there: a head's accumulator is 4 MB at s 8192,
d 128, and programs run head by head), and HBM sees the accumulator about once written, once read by the conversion.
The synchronisation is also simpler: no second kernel's schedule, and each warpgroup adds its own partial, so the
two consumers never wait on each other (no named barrier between them; the only shared state is the ring).

Barrier protocol (checked by tests/attention/test_attention_gluon_bwd.py's random-interleaving model):
  kv_bar (count 1, tx): one phase: the producer's expect + 5 copies (K, V slices, index table); consumers wait
  parity 0 before their first wgmma (and before the epilogue writes into the K / V slices).
  ready[s] (count 1, tx): the producer's expect + 4 copies for ring use u = it // STAGES; consumers wait parity u & 1.
  empty[s] (count 2): each consumer arrives once, after the wgmmas of step it that read the slot (S, dP, dV, dK, the
  first dQ chunk) have completed and a warpgroup barrier; the producer waits parity (u & 1) ^ 1 before refilling
  (fresh barriers pass the first lap). Both consumers walk the same (head, query tile) sequence, so ring positions
  agree; neither can be a lap ahead of the other, since a slot's refill needs both arrivals.
  DQ_SPLIT only: ds_full (count 2): each consumer arrives after storing its dS tile of step it (fence + warpgroup
  barrier first) and waits parity it & 1 before the dQ wgmmas that read both tiles. ds_free (count 2): each consumer
  arrives after those wgmmas completed; before step it (which overwrites its dS tile) it waits parity (it & 1) ^ 1
  (phase it - 1; fresh: passes), and before the epilogue overwrites its K slice with dK, parity (n - 1) & 1 (the
  other warpgroup's last dQ read that slice). A consumer cannot be two phases ahead on either: passing ds_free(it - 1)
  needs the other's dQ of it - 1, which came after its own ds_full(it - 1) wait.
  KEY_ROWS: no ds_free wait before a step; its dSᵀ tile alternates by parity, and the tile's last readers (both
  warpgroups' dQ of step it - 2) are done once this consumer passed ds_full(it - 1): the other arrived there after
  waiting for its dQ of it - 2. ds_full alone keeps the two within a step of each other, so ds_free still completes
  one phase a step and the epilogue's wait for parity (n - 1) & 1 holds as above.

Gluon's API changes between Triton releases: imported lazily (`_build()`); the api gate dispatches here only on sm_90
with a Triton in configs.GLUON_TRITON_VERSIONS.
"""
import functools

import torch
import triton
import triton.language as tl

from ._gluon import SMEM_MAX, check_smem, tma_addressable, tma_descriptor  # noqa: F401 - SMEM_MAX: the tests' bound
from ._gluon_flash_fwd import CONSUMER_REGS, GLUON_TRITON_VERSIONS, HEAD_DIMS, LOG2E, MAXNREG, PRODUCER_REGS
from .shared_kernels import triton_launch

BLOCK_N = 128           # keys per program: two consumer warpgroups of 64 keys each
WG_KEYS = 64
PREP_ROWS = 64          # query rows per program of the prep kernel (BLOCK_M is a multiple of it)

__all__ = ["BLOCK_N", "GLUON_TRITON_VERSIONS", "HEAD_DIMS", "available", "compile_sm90", "fits", "flash_bwd_gluon",
           "group_split", "key_rows_fits", "key_rows_knob", "launch_args", "smem_bytes"]


def smem_bytes(d: int, block_m: int, stages: int, dq_n: int = 64, dq_split: bool = False, dq_tma: bool = False) -> int:
    """Shared memory of the schedule (2-byte elements): K, V, the ring (Q, dO, lse2, delta), two P and two dS tiles
    (KEY_ROWS: four dSᵀ tiles, the same bytes at BLOCK_M 64), barriers; with DQ_TMA the fp32 dQ staging tiles (per
    warpgroup one [block_m, dq_n] tile per dQ chunk)."""
    dq_stage = 2 * (1 if dq_split else d // dq_n) * block_m * dq_n * 4 if dq_tma else 0
    return (2 * (2 * BLOCK_N * d + stages * 2 * block_m * d + 4 * WG_KEYS * block_m) + stages * 2 * block_m * 4 + 256
            + 1024 + dq_stage)


# ------------------------------------------------------------------------------------ plain Triton helpers
@triton.jit
def bwd_prep_kernel(OUT, DO, LSE, LSE2, DELTA, DQ_ACC, KV_ACC, s_q, s_pad, kv_rows, stride_ob, stride_os, stride_oh,
                    stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, H_Q: tl.constexpr, D: tl.constexpr,
                    BLOCK: tl.constexpr, ZERO_KV: tl.constexpr):
    """delta = rowsum(out ∘ do), lse2 = lse · log2 e (+inf for -inf), padded to s_pad; zeros into dq's accumulator,
    and with ZERO_KV into the [kv_rows, D] fp32 dK / dV accumulator too (GROUP_SPLIT's; its rows spread evenly over
    the programs: one launch, where torch.zeros would be another)."""
    bh = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    b = (bh // H_Q).to(tl.int64)
    h = (bh % H_Q).to(tl.int64)
    live = rows < s_q
    o = tl.load(OUT + b * stride_ob + h * stride_oh + rows[:, None].to(tl.int64) * stride_os + cols[None, :],
                mask=live[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None].to(tl.int64) * stride_dos + cols[None, :],
                 mask=live[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + rows, mask=live, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    stat = bh.to(tl.int64) * s_pad + rows
    tl.store(LSE2 + stat, lse2)
    tl.store(DELTA + stat, delta)
    tl.store(DQ_ACC + stat[:, None] * D + cols[None, :], tl.zeros([BLOCK, D], tl.float32))
    if ZERO_KV:
        programs = tl.num_programs(0) * tl.num_programs(1)
        per = tl.cdiv(kv_rows, programs * BLOCK)  # row tiles a program
        first = (bh * tl.num_programs(1) + tl.program_id(1)) * per
        for t in range(per):
            r = (first + t).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            tl.store(KV_ACC + r[:, None] * D + cols[None, :], tl.zeros([BLOCK, D], tl.float32),
                     mask=(r < kv_rows)[:, None])


@triton.jit
def acc_convert_kernel(ACC, OUT, OUT2, s, s_pad, scale, stride_ob, stride_os, stride_oh, H: tl.constexpr,
                       D: tl.constexpr, BLOCK: tl.constexpr):
    """out [b, s, h, d] = accumulator [b · h, s_pad, d] · scale, in out's dtype (dq). A grid of depth 2 converts two
    such pairs in one launch (dK and dV: accumulator [2, b · h, s_pad, d], the second into OUT2, strided like OUT)."""
    bh = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    second = tl.program_id(2)
    cols = tl.arange(0, D)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    acc_rows = (second * tl.num_programs(0) + bh).to(tl.int64) * s_pad + rows
    acc = tl.load(ACC + acc_rows[:, None] * D + cols[None, :])
    at = b * stride_ob + h * stride_oh + rows[:, None].to(tl.int64) * stride_os + cols[None, :]
    live = (rows < s)[:, None]
    if second == 0:
        tl.store(OUT + at, (acc * scale).to(OUT.dtype.element_ty), mask=live)
    else:
        tl.store(OUT2 + at, (acc * scale).to(OUT2.dtype.element_ty), mask=live)


# ------------------------------------------------------------------------------------------------- Gluon
@functools.lru_cache(maxsize=None)
def _build():
    """The Gluon kernel, built on first use (importing warpforge never touches Gluon)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton._C.libtriton import ir
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    @builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """TMA reduce-add (cp.reduce.async.bulk.tensor ... .add) of a shared-memory tile into global memory at coord:
        Triton 3.9's tma.async_atomic_add, which 3.6's Gluon lacks (its IR builder has the op). Completion is tracked
        like a TMA store (tma.store_wait)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    @gluon.jit
    def _span(n0, s_q, s_k, left, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, BLOCK_M: gl.constexpr):
        """(first, end) query tiles that see any of the keys n0 .. n0 + 127 (bottom-right causal: query c sees key
        r iff r <= c + s_k - s_q; WINDOW, a left window: only if r >= c + s_k - s_q - left)."""
        n_m = gl.cdiv(s_q, BLOCK_M)
        if CAUSAL:
            first = gl.maximum(n0 - (s_k - s_q), 0) // BLOCK_M
            first = gl.minimum(first, n_m)
        else:
            first = n_m * 0
        if WINDOW:
            # the last query that sees key n0 + 127 is c = n0 + 127 - (s_k - s_q) + left (none if that is < 0)
            last = n0 + 127 - (s_k - s_q) + left
            end = gl.minimum(gl.maximum(last + BLOCK_M, 0) // BLOCK_M, n_m)
            end = gl.maximum(end, first)
        else:
            end = n_m
        return first, end

    @gluon.jit
    def _walk(n0, b, kv_head, H_KV, GSPLIT: gl.constexpr, s_q, s_k, left, OFFSETS, QBLOCKS, n_kb,
              CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SPARSE: gl.constexpr, BS: gl.constexpr,
              BLOCK_M: gl.constexpr, WORKLIST: gl.constexpr = False):
        """The query tiles the program walks for each head: (first, n_i, n_kept, kept). Dense: tiles first ..
        first + n_i - 1 (n_kept 0). SPARSE: the n_kept tiles of the query blocks in kept[:n_kept / TPB] (TPB =
        BS / BLOCK_M tiles a block), then own-block tiles first .. first + n_i - n_kept - 1. WORKLIST (sparse,
        OFFSETS the work list, see _program): one query block's tiles, the kept pair's or the own block's."""
        if SPARSE:
            TPB: gl.constexpr = BS // BLOCK_M
            j = n0 // BS
            if WORKLIST:
                item = OFFSETS + gl.program_id(0) * 4
                kind = gl.load(item + 3)                    # 0 nothing, 1 the kept pair, 2 the own block
                n_kept = (kind == 1).to(gl.int32) * TPB
                kept = item + 2                             # the query block
            else:
                key = (b * (H_KV // GSPLIT) + kv_head) * n_kb + j
                lo = gl.load(OFFSETS + key)
                n_kept = (gl.load(OFFSETS + key + 1) - lo) * TPB
                kept = QBLOCKS + lo
            own = j - (s_k - s_q) // BS                     # the key block as a query block (< 0: keys before q)
            if CAUSAL:  # from the tile of the first query that sees key n0
                first = gl.maximum(own * BS, n0 - (s_k - s_q)) // BLOCK_M
            else:
                first = own * TPB
            n_own = gl.maximum((own + 1) * TPB - first, 0) * (own >= 0).to(gl.int32)
            if WORKLIST:
                n_own = n_own * (kind == 2).to(gl.int32)
            n_i = n_kept + n_own
        else:
            first, end = _span(n0, s_q, s_k, left, CAUSAL, WINDOW, BLOCK_M)
            n_i = end - first
            n_kept = first * 0
            kept = QBLOCKS
        return first, n_i, n_kept, kept

    @gluon.jit
    def _query_tile(t, first, n_kept, kept, SPARSE: gl.constexpr, BS: gl.constexpr, BLOCK_M: gl.constexpr):
        """The query tile of a head's walk step t (see _walk)."""
        if SPARSE:
            TPB: gl.constexpr = BS // BLOCK_M
            if t < n_kept:
                i = gl.load(kept + t // TPB) * TPB + t % TPB
            else:
                i = first + (t - n_kept)
        else:
            i = first + t
        return i

    @gluon.jit
    def _program(s_k, head_group, WORK, WORKLIST: gl.constexpr = False):
        """(key tile of BLOCK_N = 128 keys, batch · kv-head slice) of this program of the 1-D grid: slices in groups
        of head_group, each group's programs key tile by key tile, slice-fastest within a tile. A causal walk is
        longest at the first keys: in key-tile order, slice after slice (head_group 1), the last slice's long
        programs start last and run alone at the end (~6% of the sparse fwd+bwd at 16k tokens, measured); groups of
        4 start them while 3 other slices' work remains, and keep only 4 slices' Q / dO in L2 at a time.
        WORKLIST: program p's item of WORK int32 [programs, 4] = (key tile, slice, query block, kind), in the order
        the host chose (sparse_gluon_kernel.query_block_items: a query block's pairs side by side)."""
        if WORKLIST:
            item = WORK + gl.program_id(0) * 4
            return gl.load(item), gl.load(item + 1)
        n_kt = (s_k + 127) // 128
        per = n_kt * head_group
        pid = gl.program_id(0)
        r = pid % per
        return r // head_group, (pid // per) * head_group + r % head_group

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, do_desc, lse_desc, dl_desc, idx_desc, k_bufs, v_bufs, q_bufs, do_bufs,
                  lse_bufs, dl_bufs, idx_smem, kv_bar, ready, empty, s_q, s_k, left, H_Q, H_KV, GROUP, OFFSETS,
                  QBLOCKS, n_kb, head_group, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SPARSE: gl.constexpr,
                  BS: gl.constexpr, GSPLIT: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                  WORKLIST: gl.constexpr):
        kt, bkv = _program(s_k, head_group, OFFSETS, WORKLIST)
        n0 = kt * 128
        b = bkv // H_KV
        kvh = bkv % H_KV          # with GSPLIT: a slice of GROUP query heads of kv head kvh // GSPLIT
        kv_head = kvh // GSPLIT
        kv_bytes: gl.constexpr = (2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes
                                  + idx_desc.block_type.nbytes)
        mbarrier.expect(kv_bar, kv_bytes)
        tma.async_copy_global_to_shared(idx_desc, [0, 0], kv_bar, idx_smem)
        for w in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [b, n0 + 64 * w, kv_head, 0], kv_bar, k_bufs.index(w))
            tma.async_copy_global_to_shared(v_desc, [b, n0 + 64 * w, kv_head, 0], kv_bar, v_bufs.index(w))
        tile_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse_desc.block_type.nbytes
                                    + dl_desc.block_type.nbytes)
        first, n_i, n_kept, kept = _walk(n0, b, kv_head, H_KV, GSPLIT, s_q, s_k, left, OFFSETS, QBLOCKS, n_kb,
                                         CAUSAL, WINDOW, SPARSE, BS, BLOCK_M, WORKLIST)
        for it in range(GROUP * n_i):  # (head of the group, query tile), as the consumers walk them
            g = it // n_i
            i = _query_tile(it - g * n_i, first, n_kept, kept, SPARSE, BS, BLOCK_M)
            h = kvh * GROUP + g
            bh = b * H_Q + h
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass the first lap
            mbarrier.expect(ready.index(slot), tile_bytes)
            tma.async_copy_global_to_shared(q_desc, [b, i * BLOCK_M, h, 0], ready.index(slot), q_bufs.index(slot))
            tma.async_copy_global_to_shared(do_desc, [b, i * BLOCK_M, h, 0], ready.index(slot),
                                            do_bufs.index(slot))
            tma.async_copy_global_to_shared(lse_desc, [bh, i * BLOCK_M], ready.index(slot), lse_bufs.index(slot))
            tma.async_copy_global_to_shared(dl_desc, [bh, i * BLOCK_M], ready.index(slot), dl_bufs.index(slot))

    @gluon.jit
    def _probs(s, lse2, p_smem, idx_smem, m0, limit0, shift, left, qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr,
               WINDOW: gl.constexpr, s_layout: gl.constexpr, BLOCK_M: gl.constexpr):
        """P [BLOCK_M queries m0 .., 64 keys] = exp2(S · scale2 − lse2) (lse2 [BLOCK_M, 1] broadcast over the keys),
        stored 16-bit into p_smem. The mask keeps key column c of row r iff c <= limit0 (the keys' end) and, causal,
        c <= r + shift: one comparison with a per-row limit, so that no [64] key vector stays in registers; WINDOW,
        also c >= r + shift - left (a second per-row limit)."""
        p = gl.exp2(s * qk_scale - lse2)
        if MASK:
            limit = gl.full([BLOCK_M], limit0, gl.int32, gl.SliceLayout(1, s_layout))
            rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            if CAUSAL:
                limit = gl.minimum(limit, rows + shift)
            cols = idx_smem.load(s_layout)                 # [1, 64]: 0 .. 63 (see _consumer)
            ok = cols <= limit[:, None]
            if WINDOW:
                ok = ok & (cols >= (rows + (shift - left))[:, None])
            p = gl.where(ok, p, 0.0)
        # stored here, inside the caller's masked / unmasked branch: no [BLOCK_M, 64] tensor crosses the branches' join
        p_smem.store(p.to(p_smem.dtype))

    @gluon.jit
    def _probs_t(st, lse2, idx_smem, m0, limit0, shift, left, qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                 WINDOW: gl.constexpr, st_layout: gl.constexpr):
        """KEY_ROWS: Pᵀ [64 keys, 64 queries m0 ..] = exp2(Sᵀ · scale2 − lse2) (lse2 [1, 64] broadcast over the keys),
        returned fp32 (it stays in registers). Key row r (from the warpgroup's first key) is seen by query column c
        iff r <= limit0 and, causal, r <= m0 + c + shift; WINDOW, also r >= m0 + c + shift − left. The rows come from
        an arange (two registers a thread), the columns from the shared table."""
        p = gl.exp2(st * qk_scale - lse2)
        if MASK:
            rows = gl.arange(0, 64, layout=gl.SliceLayout(1, st_layout))
            cols = idx_smem.load(st_layout)                 # [1, 64]: 0 .. 63
            ok = (cols >= 0) & (rows <= limit0)[:, None]   # (cols >= 0: only the broadcast to [64, 64])
            if CAUSAL:
                ok = ok & (cols >= (rows - m0 - shift)[:, None])
            if WINDOW:
                ok = ok & (cols <= (rows - m0 - shift + left)[:, None])
            p = gl.where(ok, p, 0.0)
        return p

    @gluon.jit
    def _dq_add(dq_head, idx_smem, m0, c0, dq, q_layout: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                DQ_N: gl.constexpr):
        """Relaxed fp32 atomic adds of one [BLOCK_M, DQ_N] chunk of dQ into the accumulator at (m0, c0). The offsets
        are built here from the chunk's own position, so that no offset or pointer tensor lives across a wgmma."""
        rows = (m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))) * D + c0
        cols = idx_smem.slice(0, DQ_N, dim=1).load(q_layout)     # [1, DQ_N]: 0 .. DQ_N - 1
        # (what the table holds: DQ_N consecutive values from 0, so that the adds go out two floats at a time)
        cols = gl.max_contiguous(gl.multiple_of(cols, [1, DQ_N]), [1, DQ_N])
        gl.atomic_add(dq_head + rows[:, None] + cols, dq, sem="relaxed")

    @gluon.jit
    def _consumer(k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, dl_bufs, p_bufs, ds_bufs, dq_bufs, idx_smem, kv_bar, ready,
                  empty, ds_full, ds_free, fin, dk_desc, dv_desc, dq_desc, dkv_desc, DQ_ACC, s_q, s_k, s_pad, s_kpad,
                  dv_row0, left, H_Q, H_KV, GROUP, qk_scale, sm_scale, OFFSETS, QBLOCKS, n_kb, head_group,
                  WG: gl.constexpr,
                  D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  WINDOW: gl.constexpr, SPARSE: gl.constexpr, BS: gl.constexpr, GSPLIT: gl.constexpr,
                  DQ_N: gl.constexpr, DQ_SPLIT: gl.constexpr, DQ_TMA: gl.constexpr, KEY_ROWS: gl.constexpr,
                  WORKLIST: gl.constexpr):
        # S, dP, P, dS: [BLOCK_M queries, 64 keys] (queries as rows: lse and delta are per-row, two registers);
        # KEY_ROWS: their transposes [64 keys, 64 queries] (st_layout), Pᵀ and dSᵀ the A operands of dV and dK
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 64, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DQ_N, 16])
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = q_bufs.dtype
        kt, bkv = _program(s_k, head_group, OFFSETS, WORKLIST)
        key_lo = kt * 128 + WG * 64
        s_zero = gl.zeros([BLOCK_M, 64], gl.float32, s_layout)
        st_zero = gl.zeros([64, BLOCK_M], gl.float32, st_layout)
        dq_zero = gl.zeros([BLOCK_M, DQ_N], gl.float32, q_layout)
        dk = gl.zeros([64, D], gl.float32, o_layout)
        dv = gl.zeros([64, D], gl.float32, o_layout)
        # key columns (relative to key_lo) a row may see: <= limit0 (the keys' end); causal, row r: <= r + shift.
        # A tile needs the mask iff its first row does not see the warpgroup's last key (column 63)
        limit0 = s_k - 1 - key_lo
        shift = (s_k - s_q) - key_lo
        keys_cut = limit0 < 63
        first, n_i, n_kept, kept = _walk(kt * 128, bkv // H_KV, (bkv % H_KV) // GSPLIT, H_KV, GSPLIT, s_q, s_k, left,
                                         OFFSETS, QBLOCKS, n_kb, CAUSAL, WINDOW, SPARSE, BS, BLOCK_M, WORKLIST)
        end = first + n_i
        bh0 = (bkv // H_KV) * H_Q + (bkv % H_KV) * GROUP   # the group's first query head
        # idx_smem: the column indices 0 .. 63 as a table in shared memory (loaded by TMA with K and V), read where a
        # tile needs them (the mask, dQ's adds): an index vector built from arange would be hoisted out of the loop
        # and hold 8-16 registers for its whole length
        mbarrier.wait(kv_bar, 0)
        # one flat loop over (head of the group, query tile): nothing of an outer loop stays live around the inner one
        g = first * 0                                       # (head of the group, query tile) of step it, carried:
        i = first                                           # a division here would land amid the exp2 registers
        t = first * 0                                       # SPARSE: the step within the head's walk
        for it in range(GROUP * n_i):
            if SPARSE:
                i = _query_tile(t, first, n_kept, kept, SPARSE, BS, BLOCK_M)
            # this warpgroup's fixed tiles, indexed by z = it >> 30: 0 for every real step count but loop-variant to
            # LLVM and ptxas, so their wgmma descriptors are rebuilt at each use instead of hoisted out of the loop
            # and held (spilled) across it (the MLA decode's remat_desc, benchmarks/NOTES.md)
            z = it >> 30
            k = k_bufs.index(WG + z).reshape([64, D])
            v = v_bufs.index(WG + z).reshape([64, D])
            if KEY_ROWS:  # dSᵀ [64 keys, 64 queries], two tiles a warpgroup by the step's parity; no P tile
                ds_smem = ds_bufs.index(2 * (it & 1) + WG + z)
            else:
                p_smem = p_bufs.index(WG + z)               # [BLOCK_M, 64 keys]
                ds_smem = ds_bufs.index(WG + z)
            m0 = i * BLOCK_M
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            if DQ_SPLIT:
                if not KEY_ROWS:
                    # both warpgroups' dQ of the previous tile have read this warpgroup's dS tile (and the P tile is
                    # free anyway); waited here, where few registers are live (fresh barrier: the first pass is free).
                    # KEY_ROWS alternates two dS tiles: their last readers, both dQs of step it - 2, completed before
                    # the other warpgroup's ds_full arrival of step it - 1, which this one waited for
                    mbarrier.wait(ds_free, (it & 1) ^ 1)
            q = q_bufs.index(slot).reshape([BLOCK_M, D])
            do = do_bufs.index(slot).reshape([BLOCK_M, D])
            masked = keys_cut
            if CAUSAL:
                masked = masked | (m0 + shift < 63)
            if WINDOW:  # the tile's last row does not see the warpgroup's first key (column 0)
                masked = masked | (m0 + BLOCK_M - 1 + shift - left > 0)
            if KEY_ROWS:
                # FA3's order (its SdP_swapAB): Sᵀ = K_w · Q_iᵀ and dPᵀ = V_w · dO_iᵀ issued together, so that dPᵀ
                # computes during the exp2s; Pᵀ and dSᵀ stay in registers as the A operands of dV += Pᵀ · dO_i and
                # dK += dSᵀ · Q_i (no P tile in shared memory, no reloads); dSᵀ goes to shared memory for dQ only
                st_tok = warpgroup_mma(k, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
                dpt_tok = warpgroup_mma(v, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
                lse2 = lse_bufs.index(slot).load(st_layout)                  # [1, BLOCK_M]
                st = warpgroup_mma_wait(1, deps=(st_tok, ))
                if masked:
                    pt = _probs_t(st, lse2, idx_smem, m0, limit0, shift, left, qk_scale, True, CAUSAL, WINDOW,
                                  st_layout)
                else:
                    pt = _probs_t(st, lse2, idx_smem, m0, limit0, shift, left, qk_scale, False, CAUSAL, WINDOW,
                                  st_layout)
                dpt = warpgroup_mma_wait(0, deps=(dpt_tok, ))
                delta = dl_bufs.index(slot).load(st_layout)
                ds_t = (pt * (dpt - delta)).to(dtype)
                dv_tok = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do, dv, is_async=True)
                ds_smem.store(ds_t)
                if DQ_TMA:  # the previous step's dQ reduce-add has read its staging tile (see below)
                    tma.store_wait(0)
                fence_async_shared()
                gl.thread_barrier()                        # the whole dSᵀ tile is in shared memory
                if KEY_ROWS == 1:  # dK now, beside dV, before the wait for the other warpgroup's dS
                    dk_tok = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q, dk, is_async=True)
            else:
                s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                lse2 = lse_bufs.index(slot).permute((1, 0)).load(s_layout)     # [BLOCK_M, 1]
                s = warpgroup_mma_wait(0, deps=(s_tok, ))
                if masked:
                    _probs(s, lse2, p_smem, idx_smem, m0, limit0, shift, left, qk_scale, True, CAUSAL, WINDOW,
                           s_layout, BLOCK_M)
                else:
                    _probs(s, lse2, p_smem, idx_smem, m0, limit0, shift, left, qk_scale, False, CAUSAL, WINDOW,
                           s_layout, BLOCK_M)
                # P goes to shared memory (dV's A operand) and is read back for dS after dP: no fp32 or 16-bit copy
                # of P stays in registers while dP is in flight beside dK and dV
                if DQ_TMA:
                    # the previous step's dQ reduce-adds have read their staging tiles (the issuing thread waits; the
                    # barrier below holds the warpgroup until it has) before this step's dQ overwrites them
                    tma.store_wait(0)
                fence_async_shared()
                gl.thread_barrier()                        # the whole P tile is in shared memory
                dp_tok = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dv_tok = warpgroup_mma(p_smem.permute((1, 0)), do, dv, is_async=True)     # dV += Pᵀ · dO
                dp = warpgroup_mma_wait(1, deps=(dp_tok, ))  # dP done; dV may still run
                delta = dl_bufs.index(slot).permute((1, 0)).load(s_layout)
                p = p_smem.load(s_layout)
                ds = (p.to(gl.float32) * (dp - delta)).to(dtype)
                ds_smem.store(ds)
                fence_async_shared()
                gl.thread_barrier()                        # the whole dS tile is in shared memory
                dk_tok = warpgroup_mma(ds_smem.permute((1, 0)), q, dk, is_async=True)     # dK += dSᵀ · Q
            if DQ_SPLIT:
                # dQ = dS · K over all 128 keys (both warpgroups' dS tiles), this warpgroup's half of the columns:
                # one [BLOCK_M, D / 2] partial per tile pair instead of two [BLOCK_M, D] ones (half the atomics)
                mbarrier.arrive(ds_full)
                mbarrier.wait(ds_full, it & 1)
                k0 = k_bufs.index(z).reshape([64, D]).slice(WG * DQ_N, DQ_N, dim=1)
                k1 = k_bufs.index(1 + z).reshape([64, D]).slice(WG * DQ_N, DQ_N, dim=1)
                if KEY_ROWS:  # the step's dSᵀ tiles, read transposed
                    ds0 = ds_bufs.index(2 * (it & 1) + z).permute((1, 0))
                    ds1 = ds_bufs.index(2 * (it & 1) + 1 + z).permute((1, 0))
                else:
                    ds0 = ds_bufs.index(z)
                    ds1 = ds_bufs.index(1 + z)
                dq_tok = warpgroup_mma(ds0, k0, dq_zero, use_acc=False, is_async=True)
                dq_tok = warpgroup_mma(ds1, k1, dq_tok, is_async=True)
                if KEY_ROWS == 2:
                    # dK after dQ: dQ's staging store (and its fence) overlaps dK's wgmma instead of following it
                    dk_tok = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q, dk, is_async=True)
                    dv, dq = warpgroup_mma_wait(1, deps=(dv_tok, dq_tok))
                    dq_bufs.index(WG).store(dq)
                    fence_async_shared()
                    dk = warpgroup_mma_wait(0, deps=(dk_tok, ))
                else:
                    dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
                    if DQ_TMA:
                        dq_bufs.index(WG).store(dq)
                        fence_async_shared()
                gl.thread_barrier()                        # every warp is past the slot's and the dS tiles' last reads
                mbarrier.arrive(empty.index(slot))
                mbarrier.arrive(ds_free)
                if DQ_TMA:  # one TMA reduce-add of the [BLOCK_M, D / 2] fp32 tile into the accumulator
                    _tma_reduce_add(dq_desc, [(bh0 + g) * s_pad + m0, WG * DQ_N], dq_bufs.index(WG))
                else:
                    dq_head = DQ_ACC + (bh0 + g).to(gl.int64) * s_pad * D
                    _dq_add(dq_head, idx_smem, m0, WG * DQ_N, dq, q_layout, D, BLOCK_M, DQ_N)
            else:
                # dQ = dS · K in column chunks of DQ_N (this warpgroup's 64 keys; dS from shared memory, K-major)
                dq_tok = warpgroup_mma(ds_smem, k.slice(0, DQ_N, dim=1), dq_zero, use_acc=False, is_async=True)
                dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
                NC: gl.constexpr = D // DQ_N
                if DQ_TMA:
                    dq_bufs.index(WG * NC).store(dq)
                    fence_async_shared()
                gl.thread_barrier()                        # every warp is past the slot's last reads
                mbarrier.arrive(empty.index(slot))
                dq_row = (bh0 + g) * s_pad + m0
                dq_head = DQ_ACC + (bh0 + g).to(gl.int64) * s_pad * D
                if DQ_TMA:
                    _tma_reduce_add(dq_desc, [dq_row, 0], dq_bufs.index(WG * NC))
                else:
                    _dq_add(dq_head, idx_smem, m0, 0, dq, q_layout, D, BLOCK_M, DQ_N)
                for c in gl.static_range(1, NC):
                    # the previous chunk's adds are issued (its registers free) before this chunk's accumulator
                    gl.thread_barrier()
                    dq_tok = warpgroup_mma(ds_smem, k.slice(c * DQ_N, DQ_N, dim=1), dq_zero, use_acc=False,
                                           is_async=True)
                    dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
                    if DQ_TMA:  # each chunk its own staging tile: no wait for the previous chunk's reduce
                        dq_bufs.index(WG * NC + c).store(dq)
                        fence_async_shared()
                        gl.thread_barrier()
                        _tma_reduce_add(dq_desc, [dq_row, c * DQ_N], dq_bufs.index(WG * NC + c))
                    else:
                        _dq_add(dq_head, idx_smem, m0, c * DQ_N, dq, q_layout, D, BLOCK_M, DQ_N)
            if SPARSE:
                t += 1
                if t == n_i:
                    t = 0
                    g += 1
            else:
                i += 1
                if i == end:
                    i = first
                    g += 1

        if DQ_SPLIT:
            # the other warpgroup's last dQ has read this warpgroup's K slice before dK is written over it
            mbarrier.wait(ds_free, ((GROUP * n_i - 1) & 1), pred=GROUP * n_i > 0)
        b = bkv // H_KV
        kvh = bkv % H_KV
        if GSPLIT > 1 or WORKLIST:
            # GSPLIT programs (WORKLIST: every pair's) share this kv head's keys: dK, dV are fp32 partials,
            # reduce-added by TMA into the [2, b · h_kv · s_kpad, D] fp32 accumulator (converted afterwards), staged
            # [64, D] fp32 in the ring's memory (warpgroup 0 in the Q slots, 1 in the dO slots: STAGES · BLOCK_M · D ·
            # 2 B >= 64 · D · 4 B), once both warpgroups are past their last reads of the ring (fin; every load
            # landed: each was waited for)
            mbarrier.arrive(fin)
            mbarrier.wait(fin, 0)
            if WG == 0:
                stage = q_bufs._reinterpret(gl.float32, [64, D], dkv_desc.layout)
            else:
                stage = do_bufs._reinterpret(gl.float32, [64, D], dkv_desc.layout)
            row = (b * (H_KV // GSPLIT) + kvh // GSPLIT) * s_kpad + key_lo   # H_KV: kv heads · GSPLIT
            stage.store(dk * sm_scale)
            fence_async_shared()
            gl.thread_barrier()
            _tma_reduce_add(dkv_desc, [row, 0], stage)
            tma.store_wait(0)
            gl.thread_barrier()                            # the issuing thread has seen the reduce read the tile
            stage.store(dv)
            fence_async_shared()
            gl.thread_barrier()
            _tma_reduce_add(dkv_desc, [dv_row0 + row, 0], stage)
            tma.store_wait(0)
        else:
            # epilogue: dK (scaled) and dV through this warpgroup's own K / V slices, one TMA store each
            k = k_bufs.index(WG).reshape([64, D])
            v = v_bufs.index(WG).reshape([64, D])
            k.store((dk * sm_scale).to(dtype))
            v.store(dv.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(dk_desc, [b, key_lo, kvh, 0], k_bufs.index(WG))
            tma.async_copy_shared_to_global(dv_desc, [b, key_lo, kvh, 0], v_bufs.index(WG))
            tma.store_wait(0)

    @gluon.jit
    def flash_bwd_gluon_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, dl_desc, idx_desc, dk_desc, dv_desc, dq_desc,
                               dkv_desc, DQ_ACC, s_q, s_k, s_pad, s_kpad, dv_row0, left, H_Q, H_KV, GROUP, qk_scale,
                               sm_scale, OFFSETS, QBLOCKS, n_kb, head_group, D: gl.constexpr, BLOCK_M: gl.constexpr,
                               STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SPARSE: gl.constexpr,
                               BS: gl.constexpr, GSPLIT: gl.constexpr, DQ_N: gl.constexpr,
                               DQ_SPLIT: gl.constexpr, DQ_TMA: gl.constexpr, KEY_ROWS: gl.constexpr,
                               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                               WORKLIST: gl.constexpr = False):
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        lse_bufs = gl.allocate_shared_memory(lse_desc.dtype, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
        dl_bufs = gl.allocate_shared_memory(dl_desc.dtype, [STAGES] + dl_desc.block_type.shape, dl_desc.layout)
        if KEY_ROWS:  # no P tiles; dSᵀ [64, 64] tiles, two a warpgroup (the same bytes)
            dst_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_M], q_desc.dtype)
            ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [4, 64, BLOCK_M], dst_layout)
            p_bufs = ds_bufs  # not read
        else:
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 64], q_desc.dtype)
            p_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, 64], ds_layout)
            ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, 64], ds_layout)
        idx_smem = gl.allocate_shared_memory(idx_desc.dtype, idx_desc.block_type.shape, idx_desc.layout)
        if DQ_TMA:  # fp32 dQ staging tiles for the TMA reduce-adds: per warpgroup one per dQ chunk of a step
            N_DQ: gl.constexpr = 2 if DQ_SPLIT else 2 * (D // DQ_N)
            dq_bufs = gl.allocate_shared_memory(dq_desc.dtype, [N_DQ] + dq_desc.block_type.shape, dq_desc.layout)
        else:
            dq_bufs = ds_bufs  # unused
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        mbarrier.init(fin, count=2)  # GSPLIT / WORKLIST: both warpgroups are past their last reads of the ring
        mbarrier.init(ds_full, count=2)  # DQ_SPLIT: both warpgroups' dS tiles of this step are in shared memory
        mbarrier.init(ds_free, count=2)  # DQ_SPLIT: both warpgroups' dQ of this step have read them
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrive per consumer warpgroup

        gl.warp_specialize([
            (_consumer, (k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, dl_bufs, p_bufs, ds_bufs, dq_bufs, idx_smem, kv_bar,
                         ready, empty, ds_full, ds_free, fin, dk_desc, dv_desc, dq_desc, dkv_desc, DQ_ACC, s_q, s_k,
                         s_pad, s_kpad, dv_row0, left, H_Q, H_KV, GROUP, qk_scale, sm_scale, OFFSETS, QBLOCKS, n_kb,
                         head_group, 0, D, BLOCK_M, STAGES, CAUSAL, WINDOW, SPARSE, BS, GSPLIT, DQ_N, DQ_SPLIT, DQ_TMA,
                         KEY_ROWS, WORKLIST)),
            (_consumer, (k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, dl_bufs, p_bufs, ds_bufs, dq_bufs, idx_smem, kv_bar,
                         ready, empty, ds_full, ds_free, fin, dk_desc, dv_desc, dq_desc, dkv_desc, DQ_ACC, s_q, s_k,
                         s_pad, s_kpad, dv_row0, left, H_Q, H_KV, GROUP, qk_scale, sm_scale, OFFSETS, QBLOCKS, n_kb,
                         head_group, 1, D, BLOCK_M, STAGES, CAUSAL, WINDOW, SPARSE, BS, GSPLIT, DQ_N, DQ_SPLIT, DQ_TMA,
                         KEY_ROWS, WORKLIST)),
            (_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, dl_desc, idx_desc, k_bufs, v_bufs, q_bufs, do_bufs,
                         lse_bufs, dl_bufs, idx_smem, kv_bar, ready, empty, s_q, s_k, left, H_Q, H_KV, GROUP, OFFSETS,
                         QBLOCKS, n_kb, head_group, CAUSAL, WINDOW, SPARSE, BS, GSPLIT, BLOCK_M, STAGES, WORKLIST)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    return flash_bwd_gluon_kernel, gl


def available() -> bool:
    """This Triton's Gluon is one the kernel was written for (and imports)."""
    from ._gluon import builds
    return builds(_build, GLUON_TRITON_VERSIONS)


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, do: torch.Tensor) -> bool:
    """Batched 16-bit inputs of head dim 64/128 (q, k and v alike) that TMA descriptors can address (a
    non-contiguous do is copied contiguous first)."""
    return (q.dim() == 4 and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in HEAD_DIMS
            and k.shape[-1] == q.shape[-1] and v.shape[-1] == q.shape[-1] and do.dtype == q.dtype
            and out.shape == q.shape and do.shape == q.shape and all(tma_addressable(t) for t in (q, k, v))
            and (not do.is_contiguous() or tma_addressable(do)))


def _index_table(device) -> torch.Tensor:
    """int32 [1, 64] = 0 .. 63: the kernel's column-index table (loaded once per program by TMA). Made on every
    call, like the other buffers, never cached: a device tensor cached on the first call would, under
    torch.compile(mode="reduce-overhead"), be made inside the CUDA graphs' private pool during their warmup and
    stay there as no graph's output ("tensor(s) in the cudagraph pool not tracked as outputs")."""
    return torch.arange(64, dtype=torch.int32, device=device).reshape(1, 64)


def _descriptors(q, k, v, do, lse2, delta, dk, dv, dq_acc, dkv_acc, block_m, dq_n, gl):
    d = q.shape[-1]
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    descs = [tma_descriptor(t, (1, rows, 1, d), gdt) for t, rows in ((q, block_m), (k, WG_KEYS), (v, WG_KEYS),
                                                                       (do, block_m))]
    descs += [tma_descriptor(t, block, dt) for t, block, dt in ((lse2, (1, block_m), gl.float32),
                                                                (delta, (1, block_m), gl.float32),
                                                                (_index_table(q.device), (1, 64), gl.int32))]
    descs += [tma_descriptor(t, (1, WG_KEYS, 1, d), gdt) for t in (dk, dv)]
    acc = dq_acc.view(-1, d)  # [b · h_q · s_pad, d] fp32: the target of DQ_TMA's reduce-adds
    descs.append(tma_descriptor(acc, (block_m, dq_n), gl.float32))
    # GROUP_SPLIT's fp32 dK / dV accumulator [2 · b · h_kv · s_kpad, d] ([64, d] boxes); unused (dq's) otherwise
    kv_acc = (dkv_acc if dkv_acc is not None else dq_acc).view(-1, d)
    descs.append(tma_descriptor(kv_acc, (WG_KEYS, d), gl.float32))
    return descs


def launch_args(q, k, v, do, lse2, delta, dk, dv, dq_acc, s_pad, sm_scale, causal, block_m, stages, dq_n=None,
                dq_split=False, dq_tma=False, group_split=1, dkv_acc=None, left=None, blocks=None, head_group=1,
                key_rows=0, work=None):
    """(kernel, grid, args, constexpr kwargs) of the Gluon launch; shared by flash_bwd_gluon and the compile test.
    group_split > 1: that many programs per (kv head, key block), each over GROUP / group_split query heads, dK / dV
    reduce-added into dkv_acc (fp32 [2, b · h_kv · s_kpad, d], zeroed; s_kpad = s_k rounded up to 128). left: a left
    window (query c sees key r only if r >= c + s_k - s_q - left); None: no window. blocks: the sparse walk,
    (offsets, qblocks, block_size) as sparse_kernel.py's dk/dv pass takes them (sparse_kernel.kept_by; block_size a
    multiple of 128 and of block_m, s_pad a multiple of it); None: dense. head_group: the programs' order (_program:
    kv-head slices in groups of that many, each group key tile by key tile); it must divide b · h_kv · group_split.
    key_rows: 0, or S, dP, P and dS computed transposed (keys as the wgmma's rows; Pᵀ and dSᵀ the register A operands of
    dV and dK: FA3's order; 1: dK issued before dQ, 2: after), with BLOCK_M 64, dq_split and dq_tma. work: sparse
    only, int32 [programs, 4] (key tile, slice, query block, kind: 0 none, 1 the kept pair, 2 the own block), one
    program an item in that order (sparse_gluon_kernel.query_block_items); dK / dV then reduce-added into dkv_acc as
    with group_split > 1; None: programs key tile by key tile (_program)."""
    if stages < 2:
        raise ValueError(f"flash_bwd_gluon: stages must be >= 2 (got {stages})")
    d = q.shape[-1]
    if block_m not in (64, 128) or s_pad % block_m:
        raise ValueError(f"flash_bwd_gluon: BLOCK_M must be 64 or 128 and divide the padded length (got {block_m})")
    if dq_split:  # each warpgroup computes half of dQ's columns over all 128 keys
        dq_n = d // 2
    dq_n = dq_n or 64
    if dq_n not in (16, 32, 64, 128) or d % dq_n or (dq_n > 64 and not dq_tma):
        raise ValueError(f"flash_bwd_gluon: dq's column chunk must be 16, 32 or 64 (128: with dq_tma) and divide d {d} "
                         f"(got {dq_n})")
    if key_rows not in (0, 1, 2) or (key_rows and not key_rows_fits(block_m, dq_split, dq_tma)):
        raise ValueError(f"flash_bwd_gluon: key_rows is 0, 1 or 2, and needs BLOCK_M 64, dq_split and dq_tma "
                         f"(got {key_rows})")
    check_smem("flash_bwd_gluon", smem_bytes(d, block_m, stages, dq_n, dq_split, dq_tma),
               f"BLOCK_M {block_m} x {stages} stages at d {d} (dq_n {dq_n}, split {dq_split}, tma {dq_tma})")
    b, s_q, h_q, _ = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    group = h_q // h_kv
    if group_split < 1 or group % group_split:
        raise ValueError(f"flash_bwd_gluon: group_split must divide the GQA group {group} (got {group_split})")
    slices = b * h_kv * group_split
    if head_group < 1 or slices % head_group:
        raise ValueError(f"flash_bwd_gluon: head_group must divide the {slices} kv-head slices (got {head_group})")
    s_kpad = -(-s_k // BLOCK_N) * BLOCK_N
    if work is not None and (blocks is None or blocks[2] != BLOCK_N):
        raise ValueError(f"flash_bwd_gluon: a work list needs the sparse walk over {BLOCK_N}-row blocks")
    if group_split > 1 or work is not None:
        # the [64, d] fp32 dK / dV staging tile lives in the ring's Q (dO) slots: STAGES · BLOCK_M rows of 16-bit d
        if not dq_tma or stages * block_m < 128:
            raise ValueError("flash_bwd_gluon: group_split > 1 or a work list needs dq_tma and stages · BLOCK_M "
                             ">= 128")
        if dkv_acc is None or tuple(dkv_acc.shape) != (2, b * h_kv * s_kpad, d) or dkv_acc.dtype != torch.float32:
            raise ValueError("flash_bwd_gluon: group_split > 1 or a work list needs the fp32 dK / dV accumulator")
    window = left is not None and left < s_k
    if blocks is None:
        offsets = qblocks = dq_acc  # never read
        bs, n_kb = BLOCK_N, 0
    else:
        offsets, qblocks, bs = blocks
        if bs % BLOCK_N or bs % block_m or s_pad % bs:
            raise ValueError(f"flash_bwd_gluon: a sparse block of {bs} rows must be a multiple of {BLOCK_N} and of "
                             f"BLOCK_M {block_m}, and divide the padded length {s_pad}")
        n_kb = -(-s_k // bs)
    kernel, gl = _build()
    reduce_kv = group_split > 1 or work is not None
    descs = _descriptors(q, k, v, do, lse2, delta, dk, dv, dq_acc, dkv_acc if reduce_kv else None, block_m, dq_n, gl)
    grid = (-(-s_k // BLOCK_N) * slices,) if work is None else (work.shape[0],)
    if work is not None:
        offsets = qblocks = work   # the kernel reads its item there (WORKLIST), not the CSR lists (None then)
    # the program's "kv head" is a (kv head, slice of the group) pair: h_kv · group_split of them, group / group_split
    # query heads each (query head kvh' · GROUP' + g, kv head kvh' // group_split)
    args = (*descs, dq_acc, s_q, s_k, s_pad, s_kpad, b * h_kv * s_kpad, int(left) if window else 0, h_q,
            h_kv * group_split, group // group_split, sm_scale * LOG2E, sm_scale, offsets, qblocks, n_kb, head_group)
    meta = dict(D=d, BLOCK_M=block_m, STAGES=stages, CAUSAL=bool(causal), WINDOW=window, SPARSE=blocks is not None,
                BS=bs, GSPLIT=group_split, DQ_N=dq_n,
                DQ_SPLIT=bool(dq_split), DQ_TMA=bool(dq_tma), KEY_ROWS=int(key_rows), CONSUMER_REGS=CONSUMER_REGS,
                PRODUCER_REGS=PRODUCER_REGS, WORKLIST=work is not None, num_warps=4, maxnreg=MAXNREG)
    return kernel, grid, args, meta


def key_rows_fits(block_m: int, dq_split: bool, dq_tma: bool) -> bool:
    """Whether the knobs can take KEY_ROWS (the transposed step): BLOCK_M 64 (the dSᵀ tiles are [64, 64]), dQ split
    between the warpgroups (the step's only dS exchange) and reduced by TMA."""
    return block_m == 64 and bool(dq_split) and bool(dq_tma)


def key_rows_knob(want: int, block_m: int, dq_split: bool, dq_tma: bool) -> int:
    """The KEY_ROWS a family's table or environment asks for (want: 0, 1, 2), 0 where the knobs cannot take it."""
    return want if key_rows_fits(block_m, dq_split, dq_tma) else 0


def group_split(group: int, want: int, block_m: int, stages: int, dq_tma: bool) -> int:
    """Programs per (kv head, key block) for a GQA group of `group` query heads: the largest divisor of the group
    not above `want` (<= 0: the whole group, one query head per program). 1 where the knobs cannot take a split (it
    sums dK / dV by TMA in the ring's memory: dq_tma and stages · BLOCK_M >= 128)."""
    if group <= 1 or not dq_tma or stages * block_m < 128:
        return 1
    return _divisor_at_most(group, group if want <= 0 else want)


def head_group(slices: int, want: int) -> int:
    """The programs' order knob for `slices` kv-head slices (b · h_kv · group_split): the largest divisor of slices
    not above want (>= 1)."""
    return _divisor_at_most(slices, want)


def _divisor_at_most(n: int, want: int) -> int:
    """The largest divisor of n (>= 1) not above want (at least 1)."""
    d = max(1, min(want, n))
    while n % d:
        d -= 1
    return d


def _buffers(q, block_m, pad=None):
    """(s_pad, lse2, delta, dq's fp32 accumulator): the statistics padded to whole tiles of pad (block_m) rows."""
    b, s_q, h_q, d = q.shape
    pad = pad or block_m
    s_pad = -(-s_q // pad) * pad
    lse2 = torch.empty((b * h_q, s_pad), device=q.device, dtype=torch.float32)
    delta = torch.empty_like(lse2)
    dq_acc = torch.empty((b * h_q, s_pad, d), device=q.device, dtype=torch.float32)
    return s_pad, lse2, delta, dq_acc


def flash_bwd_gluon(do, q, k, v, out, lse, sm_scale, causal, block_m, stages, dq_n=None, dq_split=False,
                    dq_tma=False, group_split=1, left=None, blocks=None, launch=triton_launch, head_group=1,
                    key_rows=0, work=None):
    """(dq, dk, dv) like q, k, v (contiguous); the caller checked fits(...) and available(). lse: the forward's
    [b, h_q, s_q] fp32 (natural log). Knobs: query rows per ring slot (64 / 128), ring slots (>= 2), dq columns per
    wgmma chunk (16 / 32 / 64, or d with dq_tma; per-warpgroup dQ), dq_split (each warpgroup computes half of dQ's
    columns over both warpgroups' keys: half the atomics, one cross-warpgroup barrier pair per tile; dq_n is then
    d / 2), dq_tma (dQ staged in shared memory and added by TMA reduce-adds instead of per-thread atomics),
    group_split (GQA: programs per (kv head, key block), each over GROUP / group_split query heads; dK / dV then
    summed in fp32 by TMA reduce-adds and converted), left (a left window; None or >= s_k: none), blocks (the sparse
    walk, launch_args); launch: shared_kernels.triton_launch's form (the ops pass their cached launch); head_group:
    the programs' order; key_rows: the transposed step; work: the sparse programs' work list (launch_args)."""
    b, s_q, h_q, d = q.shape
    s_k = k.shape[1]
    dq = torch.empty((b, s_q, h_q, d), device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    if q.numel() == 0 or k.numel() == 0 or s_q == 0 or s_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if not do.is_contiguous():  # e.g. an expanded gradient (zero strides): TMA wants real, 16-byte strides
        do = do.contiguous()
    s_pad, lse2, delta, dq_acc = _buffers(q, block_m, None if blocks is None else blocks[2])
    h_kv = k.shape[2]
    dkv_acc = None
    grid = (b * h_q, s_pad // PREP_ROWS)
    kv_rows = 0
    reduce_kv = group_split > 1 or work is not None
    if reduce_kv:
        s_kpad = -(-s_k // BLOCK_N) * BLOCK_N
        kv_rows = 2 * b * h_kv * s_kpad
        # zeroed by the prep kernel while that spreads it over its programs (a few row tiles each); keys much longer
        # than the queries (a context-parallel chunk) would leave it to a few programs: torch.zeros then
        zero_kv = kv_rows <= 4 * grid[0] * grid[1] * PREP_ROWS
        dkv_acc = (torch.empty if zero_kv else torch.zeros)((2, b * h_kv * s_kpad, d), device=q.device,
                                                             dtype=torch.float32)
        kv_rows = kv_rows if zero_kv else 0
    launch(bwd_prep_kernel, grid, out, do, lse, lse2, delta, dq_acc, dkv_acc if dkv_acc is not None else dq_acc, s_q,
           s_pad, kv_rows, out.stride(0), out.stride(1), out.stride(2), do.stride(0), do.stride(1), do.stride(2),
           lse.stride(0), lse.stride(1), H_Q=h_q, D=d, BLOCK=PREP_ROWS, ZERO_KV=kv_rows > 0, num_warps=4)
    kernel, kgrid, args, meta = launch_args(q, k, v, do, lse2, delta, dk, dv, dq_acc, s_pad, sm_scale, causal,
                                            block_m, stages, dq_n, dq_split, dq_tma, group_split, dkv_acc, left, blocks,
                                            head_group, key_rows, work)
    launch(kernel, kgrid, *args, **meta)
    launch(acc_convert_kernel, grid, dq_acc, dq, dq, s_q, s_pad, sm_scale, dq.stride(0), dq.stride(1), dq.stride(2),
           H=h_q, D=d, BLOCK=PREP_ROWS, num_warps=4)
    if reduce_kv:  # dK (already scaled) and dV from their fp32 sums, like dq, in one launch
        launch(acc_convert_kernel, (b * h_kv, s_kpad // PREP_ROWS, 2), dkv_acc, dk, dv, s_k, s_kpad, 1.0, dk.stride(0),
               dk.stride(1), dk.stride(2), H=h_kv, D=d, BLOCK=PREP_ROWS, num_warps=4)
    return dq, dk, dv


# ------------------------------------------------------------------------------------ compile-only check
def compile_sm90(d=128, causal=True, block_m=64, stages=2, dq_n=None, dq_split=False, dq_tma=False, h_q=4, h_kv=2,
                 dtype="bfloat16", arch=90, group_split=1, left=None, block_size=None, key_rows=0, worklist=False):
    """Compile the Gluon kernel for sm_<arch> without a GPU (ops/_gluon.py's stub target; nothing is launched).
    Returns compile_report's dict (PTX features, warps, shared memory, the compiled kernel) plus whether the PTX
    holds fp32 reductions to global memory (dq's atomics). worklist: the sparse programs from a work list (launch_args'
    work; block_size 128)."""
    from ._gluon import compile_report
    dt = getattr(torch, dtype)
    b, s = 2, 300
    q = torch.empty(b, s, h_q, d, dtype=dt)
    k = torch.empty(b, s, h_kv, d, dtype=dt)
    v = torch.empty(b, s, h_kv, d, dtype=dt)
    do = torch.empty(b, s, h_q, d, dtype=dt)
    s_pad, lse2, delta, dq_acc = _buffers(q, block_m, block_size)
    s_kpad = -(-s // BLOCK_N) * BLOCK_N
    blocks = None
    if block_size:  # the sparse walk (block_size rows a block)
        blocks = (torch.empty(b * h_kv * -(-s // block_size) + 1, dtype=torch.int32),
                  torch.empty(64, dtype=torch.int32), block_size)
    reduce_kv = group_split > 1 or worklist
    dkv_acc = torch.empty((2, b * h_kv * s_kpad, d), dtype=torch.float32) if reduce_kv else None
    work = torch.zeros((8, 4), dtype=torch.int32) if worklist else None
    kernel, grid, args, meta = launch_args(q, k, v, do, lse2, delta, torch.empty_like(k), torch.empty_like(v),
                                           dq_acc, s_pad, d ** -0.5, causal, block_m, stages, dq_n, dq_split, dq_tma,
                                           group_split, dkv_acc, left, blocks, key_rows=key_rows, work=work)
    report = compile_report(kernel, args, grid, meta, arch)
    ptx = report["kernel"].asm.get("ptx", "")
    report["red"] = "red.global" in ptx or "atom.global" in ptx
    report["tma_reduce"] = "cp.reduce.async.bulk" in ptx
    return report
