"""The Evoformer forward in Gluon, for Hopper (sm_90).

At the models' head dims (16-32) a score's matmul share is small and its elementwise work is the cost: in the
portable forward ~13.5 instructions a score, ~4.5 of them the biases (the pair tile's 4-byte global loads in the
MMA layout, converts, scalings, the mask's add; benchmarks/NOTES.md "Session 31"). The pair bias is the same for
every MSA row, so here a program keeps its [64, N_res] strip in shared memory for a whole group of rows, already in
fp32 log2 units (gluon_shared_kernel.log2_biases): a score takes one shared load (two a 64-bit word), one FMA and
one add for its biases.

Program (batch · head, 64-query block i, group g of MSA rows), 12 warps (two consumer warpgroups and a producer
warp in a third):
- producer (1 warp): the pair strip once (NJ boxes [1, 64, 64] fp32, `pair_bar`); then per pair of MSA rows (one
  for each consumer): each row's Q_s,i and mask row into its warpgroup's Q slot (two a warpgroup, `q_ready` /
  `q_free`), then the rows' K_j, V_j key block by key block, alternating the warpgroups, into each warpgroup's ring
  of STAGES slots (`kv_ready` / `kv_free`), so both consumers advance together.
- consumer warpgroup w takes the group's rows w, w + 2, ...: per key block S = Q · K_jᵀ (wgmma), x = S · scale ·
  log2 e + pair_j + mask_j (shared memory), the online softmax, O += P · V_j (wgmma, P from registers); per row
  lse2 and the row scale (evoformer_kernel.row_stats) and O / l, times sigmoid(gate) with a gate.
"""
from __future__ import annotations

import functools

import torch

from ...runtime import cdiv
from ..shared_kernels import triton_launch
from .._gluon_flash_fwd import CONSUMER_REGS, GLUON_TRITON_VERSIONS, LOG2E, MAXNREG, PRODUCER_REGS
from .gluon_shared_kernel import (BLOCK, bias_descriptors, build_helpers, groups, log2_bias_buffers, log2_biases,
                                  row_descriptors, split_biases)

# consumer warpgroups -> (a warpgroup's ring of K / V slots: it holds two at a time, S_j and P·V_{j-1} in flight;
# registers a consumer thread, the launch's cap). Three consumers share the strip at 201 KB of shared memory (d 32,
# N_res 384) and 152 registers (3 x 128 x 152 + 128 x 24 <= 64K); the knob WARPFORGE_EVO_GLUON_FWD_CONSUMERS.
CONSUMER_PLANS = {2: (4, CONSUMER_REGS, MAXNREG), 3: (3, 152, 128)}
CONSUMERS_ENV = "WARPFORGE_EVO_GLUON_FWD_CONSUMERS"
CONSUMERS = 2


def consumers() -> int:
    import os
    return int(os.environ.get(CONSUMERS_ENV, CONSUMERS))


__all__ = ["GLUON_TRITON_VERSIONS", "available", "compile_sm90", "fwd_gluon"]


@functools.lru_cache(maxsize=None)
def _build():
    """The Gluon kernel, built on first use (importing warpforge never touches Gluon)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    _program, _load_strip = build_helpers()

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, pair_desc, mask_desc, q_bufs, k_bufs, v_bufs, pair_bufs, mask_bufs, pair_bar,
                  q_ready, q_free, kv_ready, kv_free, BH, S, rows_per, mask_heads, H: gl.constexpr, NI: gl.constexpr,
                  NJ: gl.constexpr, STAGES: gl.constexpr, HAS_MASK: gl.constexpr, NC: gl.constexpr):
        bh, i, g, b, h, s0, n_rows = _program(BH, NI, H, S, rows_per)
        _load_strip(pair_desc, pair_bufs, pair_bar, bh, i, NJ)
        q_bytes: gl.constexpr = q_desc.block_type.nbytes + HAS_MASK * NJ * mask_desc.block_type.nbytes
        kv_bytes: gl.constexpr = 2 * k_desc.block_type.nbytes
        for u in range((n_rows + NC - 1) // NC):  # rows NC·u + w, one for each consumer w
            for w in gl.static_range(NC):
                if NC * u + w < n_rows:
                    qs = 2 * w + u % 2
                    mbarrier.wait(q_free.index(qs), ((u // 2) & 1) ^ 1)  # fresh barriers pass the first lap
                    bar = q_ready.index(qs)
                    mbarrier.expect(bar, q_bytes)
                    bs = b * S + s0 + NC * u + w
                    tma.async_copy_global_to_shared(q_desc, [bs, i * 64, h, 0], bar, q_bufs.index(qs))
                    if HAS_MASK:
                        for jm in gl.static_range(NJ):
                            tma.async_copy_global_to_shared(mask_desc, [bs * mask_heads + h % mask_heads, jm * 64],
                                                            bar, mask_bufs.index(qs * NJ + jm))
            for j in range(NJ):
                for w in gl.static_range(NC):
                    if NC * u + w < n_rows:
                        c = u * NJ + j
                        slot = w * STAGES + c % STAGES
                        mbarrier.wait(kv_free.index(slot), ((c // STAGES) & 1) ^ 1)
                        bar = kv_ready.index(slot)
                        mbarrier.expect(bar, kv_bytes)
                        bs = b * S + s0 + NC * u + w
                        tma.async_copy_global_to_shared(k_desc, [bs, j * 64, h, 0], bar, k_bufs.index(slot))
                        tma.async_copy_global_to_shared(v_desc, [bs, j * 64, h, 0], bar, v_bufs.index(slot))

    @gluon.jit
    def _bias(pair_bufs, mask_bufs, j, mslot, HAS_MASK: gl.constexpr, s_layout: gl.constexpr):
        """Key block j's biases from shared memory, log2 units: the pair strip's [64, 64] tile plus the mask row."""
        bias = pair_bufs.index(j).reshape([64, 64]).load(s_layout).to(gl.float32)
        if HAS_MASK:
            bias = bias + mask_bufs.index(mslot).load(s_layout)
        return bias

    @gluon.jit
    def _softmax(sc, bias, j, m, l, qk_scale, R, cols0, EVEN: gl.constexpr):
        """One online-softmax step over key block j: (p, the rescale of what came before, row sums, row maxima); keys
        past R -inf; a row that has seen nothing keeps max -inf and gets p 0."""
        x = sc * qk_scale + bias
        if not EVEN:
            x = gl.where((j * 64 + cols0 < R)[None, :], x, float("-inf"))
        m_new = gl.maximum(m, gl.max(x, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(x - m_use[:, None])
        alpha = gl.exp2(m - m_use)
        return p, alpha, l * alpha + gl.sum(p, 1), m_new

    @gluon.jit
    def _s_block(q, k_bufs, kv_ready, slot, c, s_zero, D, STAGES):
        """Waits for ring slot `slot` (the row's block c) and issues S = Q · Kᵀ on it (async). (D and STAGES come in
        as the callers' constexprs; an annotation would need `gl` in this closure.)"""
        mbarrier.wait(kv_ready.index(slot), (c // STAGES) & 1)
        return warpgroup_mma(q, k_bufs.index(slot).reshape([64, D]).permute((1, 0)), s_zero, use_acc=False,
                             is_async=True)

    @gluon.jit
    def _keys(q, k_bufs, v_bufs, pair_bufs, mask_bufs, kv_ready, kv_free, u, qs, m, l, acc, qk_scale, R, cols0,
              s_zero, WG: gl.constexpr, D: gl.constexpr, NJ: gl.constexpr, STAGES: gl.constexpr,
              HAS_MASK: gl.constexpr, EVEN: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
              orow_l: gl.constexpr):
        """One MSA row's walk over the key blocks, one a step: (acc, m, l). Block 0: S only; then block j's S and
        block j - 1's P·V in flight together (the attention family's Gluon forward's order), so S_j computes while
        the softmax of j - 1 finishes its P·V wait."""
        dtype: gl.constexpr = k_bufs.dtype
        c = u * NJ
        s_tok = _s_block(q, k_bufs, kv_ready, WG * STAGES + c % STAGES, c, s_zero, D, STAGES)
        bias = _bias(pair_bufs, mask_bufs, 0, qs * NJ, HAS_MASK, s_layout)
        sc = warpgroup_mma_wait(0, deps=(s_tok, ))
        p, alpha, l, m = _softmax(sc, bias, 0, m, l, qk_scale, R, cols0, EVEN)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, NJ):
            c = u * NJ + j
            slot = WG * STAGES + c % STAGES
            prev = WG * STAGES + (c - 1) % STAGES
            s_tok = _s_block(q, k_bufs, kv_ready, slot, c, s_zero, D, STAGES)
            acc_tok = warpgroup_mma(p_op, v_bufs.index(prev).reshape([64, D]), acc, is_async=True)
            bias = _bias(pair_bufs, mask_bufs, j, qs * NJ + j, HAS_MASK, s_layout)
            sc = warpgroup_mma_wait(1, deps=(s_tok, ))  # S_j done; P·V_{j-1} may still run
            p, alpha, l, m = _softmax(sc, bias, j, m, l, qk_scale, R, cols0, EVEN)
            # P_{j-1}'s registers are the in-flight wgmma's A operand: kept alive (deps) until it is done
            acc, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
            gl.thread_barrier()                 # every warp is past slot j - 1's reads
            mbarrier.arrive(kv_free.index(prev))
            acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        c = u * NJ + NJ - 1
        last = WG * STAGES + c % STAGES
        acc_tok = warpgroup_mma(p_op, v_bufs.index(last).reshape([64, D]), acc, is_async=True)
        acc, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
        gl.thread_barrier()
        mbarrier.arrive(kv_free.index(last))
        return acc, m, l

    @gluon.jit
    def _consumer(q_bufs, k_bufs, v_bufs, pair_bufs, mask_bufs, pair_bar, q_ready, q_free, kv_ready, kv_free, OUT, LSE,
                  ROW_SCALE, GATE, BH, S, R, rows_per, qk_scale, WG: gl.constexpr, H: gl.constexpr, D: gl.constexpr,
                  NI: gl.constexpr, NJ: gl.constexpr, STAGES: gl.constexpr, HAS_MASK: gl.constexpr,
                  HAS_GATE: gl.constexpr, EVEN: gl.constexpr, NC: gl.constexpr):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 64, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = q_bufs.dtype
        bh, i, g, b, h, s0, n_rows = _program(BH, NI, H, S, rows_per)
        rows = i * 64 + gl.arange(0, 64, layout=row_l)
        orows = i * 64 + gl.arange(0, 64, layout=orow_l)
        dcols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        cols0 = gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([64, 64], gl.float32, s_layout)
        mbarrier.wait(pair_bar, 0)
        for u in range((n_rows - WG + NC - 1) // NC):
            s = s0 + NC * u + WG
            qs = 2 * WG + u % 2
            mbarrier.wait(q_ready.index(qs), (u // 2) & 1)
            q = q_bufs.index(qs).reshape([64, D])
            m = gl.full([64], float("-inf"), gl.float32, row_l)  # (log2 units)
            l = gl.zeros([64], gl.float32, row_l)
            acc = gl.zeros([64, D], gl.float32, o_layout)
            acc, m, l = _keys(q, k_bufs, v_bufs, pair_bufs, mask_bufs, kv_ready, kv_free, u, qs, m, l, acc, qk_scale,
                              R, cols0, s_zero, WG, D, NJ, STAGES, HAS_MASK, EVEN, s_layout, p_layout, orow_l)
            gl.thread_barrier()                     # and past the row's Q and mask
            mbarrier.arrive(q_free.index(qs))
            empty = l == 0.0
            l_safe = gl.where(empty, 1.0, l)
            big = gl.abs(m) >= 16384.0  # evoformer_kernel.BIG_MAX2
            lse2 = gl.where(empty, float("-inf"), gl.where(big, m, m + gl.log2(l_safe)))
            stat = ((b * S + s) * H + h).to(gl.int64) * R
            gl.store(LSE + stat + rows, lse2, mask=rows < R)
            gl.store(ROW_SCALE + stat + rows, gl.where(big & ~empty, 1.0 / l_safe, 1.0), mask=rows < R)
            out = acc / gl.convert_layout(l_safe, orow_l)[:, None]
            at = ((b * S + s).to(gl.int64) * R + orows[:, None]) * (H * D) + h * D + dcols[None, :]
            live = (orows < R)[:, None]
            if HAS_GATE:
                gate = gl.load(GATE + at, mask=live, other=0.0).to(gl.float32)
                out = out / (1.0 + gl.exp2(-gate * 1.4426950408889634))
            gl.store(OUT + at, out.to(dtype), mask=live)

    @gluon.jit
    def evo_fwd_gluon_kernel(q_desc, k_desc, v_desc, pair_desc, mask_desc, OUT, LSE, ROW_SCALE, GATE, BH, S, R,
                             rows_per, mask_heads, qk_scale, H: gl.constexpr, D: gl.constexpr, NI: gl.constexpr,
                             NJ: gl.constexpr, STAGES: gl.constexpr, HAS_MASK: gl.constexpr, HAS_GATE: gl.constexpr,
                             EVEN: gl.constexpr, NC: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2 * NC] + q_desc.block_type.shape, q_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NC * STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NC * STAGES] + v_desc.block_type.shape, v_desc.layout)
        pair_bufs = gl.allocate_shared_memory(gl.float32, [NJ] + pair_desc.block_type.shape, pair_desc.layout)
        if HAS_MASK:
            mask_bufs = gl.allocate_shared_memory(gl.float32, [2 * NC * NJ] + mask_desc.block_type.shape,
                                                  mask_desc.layout)
        else:
            mask_bufs = pair_bufs  # not read
        pair_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [2 * NC, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [2 * NC, 1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [NC * STAGES, 1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [NC * STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(pair_bar, count=1)
        for x in gl.static_range(2 * NC):
            mbarrier.init(q_ready.index(x), count=1)
            mbarrier.init(q_free.index(x), count=1)
        for x in gl.static_range(NC * STAGES):
            mbarrier.init(kv_ready.index(x), count=1)
            mbarrier.init(kv_free.index(x), count=1)
        if NC == 3:  # (the partitions are a literal list: Gluon takes no tuple of a function in a variable)
            gl.warp_specialize([
                (_consumer, (q_bufs, k_bufs, v_bufs, pair_bufs, mask_bufs, pair_bar, q_ready, q_free, kv_ready,
                             kv_free, OUT, LSE, ROW_SCALE, GATE, BH, S, R, rows_per, qk_scale, 0, H, D, NI, NJ,
                             STAGES, HAS_MASK, HAS_GATE, EVEN, NC)),
                (_consumer, (q_bufs, k_bufs, v_bufs, pair_bufs, mask_bufs, pair_bar, q_ready, q_free, kv_ready,
                             kv_free, OUT, LSE, ROW_SCALE, GATE, BH, S, R, rows_per, qk_scale, 1, H, D, NI, NJ,
                             STAGES, HAS_MASK, HAS_GATE, EVEN, NC)),
                (_consumer, (q_bufs, k_bufs, v_bufs, pair_bufs, mask_bufs, pair_bar, q_ready, q_free, kv_ready,
                             kv_free, OUT, LSE, ROW_SCALE, GATE, BH, S, R, rows_per, qk_scale, 2, H, D, NI, NJ,
                             STAGES, HAS_MASK, HAS_GATE, EVEN, NC)),
                (_producer, (q_desc, k_desc, v_desc, pair_desc, mask_desc, q_bufs, k_bufs, v_bufs, pair_bufs,
                             mask_bufs, pair_bar, q_ready, q_free, kv_ready, kv_free, BH, S, rows_per, mask_heads, H,
                             NI, NJ, STAGES, HAS_MASK, NC)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (q_bufs, k_bufs, v_bufs, pair_bufs, mask_bufs, pair_bar, q_ready, q_free, kv_ready,
                             kv_free, OUT, LSE, ROW_SCALE, GATE, BH, S, R, rows_per, qk_scale, 0, H, D, NI, NJ,
                             STAGES, HAS_MASK, HAS_GATE, EVEN, NC)),
                (_consumer, (q_bufs, k_bufs, v_bufs, pair_bufs, mask_bufs, pair_bar, q_ready, q_free, kv_ready,
                             kv_free, OUT, LSE, ROW_SCALE, GATE, BH, S, R, rows_per, qk_scale, 1, H, D, NI, NJ,
                             STAGES, HAS_MASK, HAS_GATE, EVEN, NC)),
                (_producer, (q_desc, k_desc, v_desc, pair_desc, mask_desc, q_bufs, k_bufs, v_bufs, pair_bufs,
                             mask_bufs, pair_bar, q_ready, q_free, kv_ready, kv_free, BH, S, rows_per, mask_heads, H,
                             NI, NJ, STAGES, HAS_MASK, NC)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    return evo_fwd_gluon_kernel, gl


def available() -> bool:
    """This Triton's Gluon is one the kernel was written for (and imports)."""
    from .._gluon import builds
    return builds(_build, GLUON_TRITON_VERSIONS)


def launch_args(q, k, v, out, lse, gate, pair2, mask2, mask_heads, scale, G, nc=2):
    """(kernel, grid, args, constexpr kwargs) of the launch; shared by fwd_gluon and the compile test. nc: consumer
    warpgroups (CONSUMER_PLANS)."""
    B, S, R, H, D = q.shape
    stages, consumer_regs, maxnreg = CONSUMER_PLANS[nc]
    NJ = cdiv(R, BLOCK)
    kernel, _ = _build()
    rows_per = cdiv(S, G)
    # lse's two planes as two pointers (an int argument of 1, B · H here, is specialised to a constant by Triton)
    args = [*row_descriptors(q, k, v), *bias_descriptors(pair2, mask2), out, lse[0], lse[1],
            q if gate is None else gate, B * H, S, R, rows_per, mask_heads, scale * LOG2E]
    meta = dict(H=H, D=D, NI=NJ, NJ=NJ, STAGES=stages, HAS_MASK=mask2 is not None, HAS_GATE=gate is not None,
                EVEN=R % BLOCK == 0, NC=nc, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=PRODUCER_REGS,
                num_warps=4, maxnreg=maxnreg)
    return kernel, (B * H * NJ * cdiv(S, rows_per),), args, meta


def fwd_gluon(q, k, v, biases, gate, scale, n_sm, launch=triton_launch):
    """(out like q, lse [2, B, S, H, R] fp32), as evoformer_kernel.evoformer_fwd returns them (gluon_shared_kernel.fits
    holds). The rows of a group are split between the consumer warpgroups, so a group holds at least one for each."""
    B, S, R, H, D = q.shape
    pair, mask = split_biases(biases, S)
    NJ = cdiv(R, BLOCK)
    nc = consumers()
    G = groups(B * H, NJ, cdiv(S, nc), n_sm)
    out = torch.empty_like(q)
    lse = torch.empty((2, B, S, H, R), device=q.device, dtype=torch.float32)
    biases2 = log2_biases(pair, mask, B, S, H, R, launch)
    kernel, grid, args, meta = launch_args(q, k, v, out, lse, gate, *biases2, scale, G, nc)
    launch(kernel, grid, *args, **meta)
    return out, lse


def compile_sm90(R=384, D=32, S=4, H=2, B=1, mask=True, gate=True, dtype="bfloat16", arch=90, G=2, nc=2):
    """Compile the kernel for sm_<arch> without a GPU (ops/_gluon.py's stub target; nothing is launched)."""
    from .._gluon import compile_report
    dt = getattr(torch, dtype)
    q = torch.empty(B, S, R, H, D, dtype=dt)
    lse = torch.empty(2, B, S, H, R, dtype=torch.float32)
    full = (B, S, H, R, R)
    pair = torch.empty(B, 1, H, R, R, dtype=dt).expand(full)
    m = torch.empty(B, S, 1, 1, R, dtype=dt).expand(full) if mask else None
    kernel, grid, args, meta = launch_args(q, q, q, q, lse, q if gate else None,
                                           *log2_bias_buffers(pair, m, B, S, H, R), D ** -0.5, G, nc)
    return compile_report(kernel, args, grid, meta, arch)
