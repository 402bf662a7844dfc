"""The Evoformer backward's dk and dv in Gluon, for Hopper (sm_90): the portable dk/dv pass's step (keys as rows,
evoformer_kernel._walk_queries) with the pair bias read as the forward's Gluon kernel reads it.

A step's pair-bias tile depends on (batch, head, key block, query block) and not on the MSA row, so a program owns
one key block of one (batch, head) for a group of MSA rows and keeps the transposed pair bias's [64 keys, N_res]
strip in shared memory, fp32 in log2 units (gluon_shared_kernel.log2_biases, transposed once per backward), for the
whole walk. dK and dV of a (row, key block) have one writer: no atomics.

Program (batch · head, 64-key block j, group g of MSA rows), 12 warps (two consumer warpgroups and a producer warp
in a third):
- producer (1 warp): the strip once (`pair_bar`); then per pair of MSA rows (one a consumer): each row's K_j, V_j
  into its warpgroup's K / V slot (two a warpgroup, `kv_ready` / `kv_free`), then the rows' Q_i, dO_i query block by
  query block, alternating the warpgroups, into each warpgroup's ring of STAGES slots (`q_ready` / `q_free`).
- consumer warpgroup w takes the group's rows w, w + 2, ...: per query block Sᵀ = K_j · Q_iᵀ and dPᵀ = V_j · dO_iᵀ
  (wgmma, issued together), pᵀ = exp2(Sᵀ · scale · log2 e + pairᵀ + mask − lse2), dsᵀ = pᵀ · (dPᵀ − delta),
  dV += pᵀ · dO_i and dK += dsᵀ · Q_i (wgmma, pᵀ and dsᵀ the A operands from registers); per row dK · scale and dV
  stored (key rows past N_res are not: their scores are never masked, their gradients never written).
"""
from __future__ import annotations

import functools

import torch

from ...runtime import cdiv
from ..shared_kernels import triton_launch
from .._gluon_flash_fwd import CONSUMER_REGS, GLUON_TRITON_VERSIONS, LOG2E, MAXNREG, PRODUCER_REGS
from .gluon_shared_kernel import (BLOCK, bias_descriptors, build_helpers, groups, log2_bias_buffers, log2_biases,
                                  row_descriptors, split_biases)

STAGES = 4  # a warpgroup's ring of Q / dO slots (it holds two at a time: block i's and i - 1's)

__all__ = ["GLUON_TRITON_VERSIONS", "available", "compile_sm90", "dkdv_gluon"]


@functools.lru_cache(maxsize=None)
def _build():
    """The Gluon kernel, built on first use (importing warpforge never touches Gluon)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    _program, _load_strip = build_helpers()

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, do_desc, pair_desc, q_bufs, k_bufs, v_bufs, do_bufs, pair_bufs, pair_bar,
                  kv_ready, kv_free, q_ready, q_free, BH, S, rows_per, H: gl.constexpr, NJ: gl.constexpr,
                  STAGES: gl.constexpr):
        bh, j, g, b, h, s0, n_rows = _program(BH, NJ, H, S, rows_per)
        _load_strip(pair_desc, pair_bufs, pair_bar, bh, j, NJ)
        box: gl.constexpr = 2 * q_desc.block_type.nbytes
        for u in range((n_rows + 1) // 2):
            for w in gl.static_range(2):
                if 2 * u + w < n_rows:
                    ks = 2 * w + u % 2
                    mbarrier.wait(kv_free.index(ks), ((u // 2) & 1) ^ 1)  # fresh barriers pass the first lap
                    bar = kv_ready.index(ks)
                    mbarrier.expect(bar, box)
                    bs = b * S + s0 + 2 * u + w
                    tma.async_copy_global_to_shared(k_desc, [bs, j * 64, h, 0], bar, k_bufs.index(ks))
                    tma.async_copy_global_to_shared(v_desc, [bs, j * 64, h, 0], bar, v_bufs.index(ks))
            for i in range(NJ):
                for w in gl.static_range(2):
                    if 2 * u + w < n_rows:
                        c = u * NJ + i
                        slot = w * STAGES + c % STAGES
                        mbarrier.wait(q_free.index(slot), ((c // STAGES) & 1) ^ 1)
                        bar = q_ready.index(slot)
                        mbarrier.expect(bar, box)
                        bs = b * S + s0 + 2 * u + w
                        tma.async_copy_global_to_shared(q_desc, [bs, i * 64, h, 0], bar, q_bufs.index(slot))
                        tma.async_copy_global_to_shared(do_desc, [bs, i * 64, h, 0], bar, do_bufs.index(slot))

    @gluon.jit
    def _stats(LSE, DELTA, stat, qrows, R):
        """lse2 (log2 units; +inf for a query that saw nothing or past R, whose p is 0) and delta of a query block."""
        lse = gl.load(LSE + stat + qrows, mask=qrows < R, other=float("-inf"))
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse)
        return lse2, gl.load(DELTA + stat + qrows, mask=qrows < R, other=0.0)

    @gluon.jit
    def _bias_t(pair_bufs, i, mcol, HAS_MASK: gl.constexpr, st_layout: gl.constexpr):
        """Query block i's biases, transposed (keys as rows), log2 units: the strip's tile plus the mask column."""
        bias = pair_bufs.index(i).reshape([64, 64]).load(st_layout).to(gl.float32)
        if HAS_MASK:
            bias = bias + mcol[:, None]
        return bias

    @gluon.jit
    def _consumer(q_bufs, k_bufs, v_bufs, do_bufs, pair_bufs, pair_bar, kv_ready, kv_free, q_ready, q_free, DK, DV,
                  LSE, DELTA, MASK, mask_rows, mask_heads, BH, S, R, rows_per, qk_scale, sm_scale, WG: gl.constexpr,
                  H: gl.constexpr, D: gl.constexpr, NJ: gl.constexpr, STAGES: gl.constexpr, HAS_MASK: gl.constexpr):
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, 64, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        key_l: gl.constexpr = gl.SliceLayout(1, st_layout)
        qry_l: gl.constexpr = gl.SliceLayout(0, st_layout)
        okey_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = q_bufs.dtype
        bh, j, g, b, h, s0, n_rows = _program(BH, NJ, H, S, rows_per)
        keys = j * 64 + gl.arange(0, 64, layout=key_l)
        okeys = j * 64 + gl.arange(0, 64, layout=okey_l)
        dcols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        qcols0 = gl.arange(0, 64, layout=qry_l)
        st_zero = gl.zeros([64, 64], gl.float32, st_layout)
        mbarrier.wait(pair_bar, 0)
        for u in range((n_rows - WG + 1) // 2):
            s = s0 + 2 * u + WG
            ks = 2 * WG + u % 2
            stat = ((b * S + s) * H + h).to(gl.int64) * R
            mcol = keys * 0.0
            if HAS_MASK:  # the mask's key row, a column here (keys as rows), already in log2 units
                mrow = (b * S + s).to(gl.int64) * mask_heads + h % mask_heads
                mcol = gl.load(MASK + mrow * mask_rows + keys, mask=keys < R, other=0.0)
            mbarrier.wait(kv_ready.index(ks), (u // 2) & 1)
            k = k_bufs.index(ks).reshape([64, D])
            v = v_bufs.index(ks).reshape([64, D])
            dk = gl.zeros([64, D], gl.float32, o_layout)
            dv = gl.zeros([64, D], gl.float32, o_layout)
            # query block 0's Sᵀ and dPᵀ alone; then block i's beside block i - 1's dV and dK wgmmas, so the tensor
            # cores work while the exp2s of i run (the portable pass waits for each in turn)
            c = u * NJ
            slot = WG * STAGES + c % STAGES
            lse2, delta = _stats(LSE, DELTA, stat, qcols0, R)
            mbarrier.wait(q_ready.index(slot), (c // STAGES) & 1)
            q = q_bufs.index(slot).reshape([64, D])
            do = do_bufs.index(slot).reshape([64, D])
            st_tok = warpgroup_mma(k, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            dpt_tok = warpgroup_mma(v, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            bias = _bias_t(pair_bufs, 0, mcol, HAS_MASK, st_layout)
            st = warpgroup_mma_wait(1, deps=(st_tok, ))
            # the exponent clamped at 0 (why: evoformer_kernel._dscores)
            pt = gl.exp2(gl.minimum(st * qk_scale + bias - lse2[None, :], 0.0))
            dpt = warpgroup_mma_wait(0, deps=(dpt_tok, ))
            pt_op = gl.convert_layout(pt.to(dtype), a_layout)
            ds_op = gl.convert_layout((pt * (dpt - delta[None, :])).to(dtype), a_layout)
            for i in range(1, NJ):
                c = u * NJ + i
                slot = WG * STAGES + c % STAGES
                prev = WG * STAGES + (c - 1) % STAGES
                lse2, delta = _stats(LSE, DELTA, stat, i * 64 + qcols0, R)
                mbarrier.wait(q_ready.index(slot), (c // STAGES) & 1)
                q = q_bufs.index(slot).reshape([64, D])
                do = do_bufs.index(slot).reshape([64, D])
                st_tok = warpgroup_mma(k, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
                dpt_tok = warpgroup_mma(v, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
                dv_tok = warpgroup_mma(pt_op, do_bufs.index(prev).reshape([64, D]), dv, is_async=True)
                dk_tok = warpgroup_mma(ds_op, q_bufs.index(prev).reshape([64, D]), dk, is_async=True)
                bias = _bias_t(pair_bufs, i, mcol, HAS_MASK, st_layout)
                st = warpgroup_mma_wait(3, deps=(st_tok, ))   # Sᵀ_i done; dPᵀ_i, dV and dK of i - 1 may run
                pt = gl.exp2(gl.minimum(st * qk_scale + bias - lse2[None, :], 0.0))
                dpt = warpgroup_mma_wait(2, deps=(dpt_tok, ))
                dst = pt * (dpt - delta[None, :])
                # block i - 1's A operands stay alive (deps) until its wgmmas are done
                dv, dk, _, _ = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, pt_op, ds_op))
                gl.thread_barrier()                 # every warp is past slot i - 1's reads
                mbarrier.arrive(q_free.index(prev))
                pt_op = gl.convert_layout(pt.to(dtype), a_layout)
                ds_op = gl.convert_layout(dst.to(dtype), a_layout)
            c = u * NJ + NJ - 1
            last = WG * STAGES + c % STAGES
            dv_tok = warpgroup_mma(pt_op, do_bufs.index(last).reshape([64, D]), dv, is_async=True)
            dk_tok = warpgroup_mma(ds_op, q_bufs.index(last).reshape([64, D]), dk, is_async=True)
            dv, dk, _, _ = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, pt_op, ds_op))
            gl.thread_barrier()
            mbarrier.arrive(q_free.index(last))
            gl.thread_barrier()                     # and past the row's K and V
            mbarrier.arrive(kv_free.index(ks))
            at = ((b * S + s).to(gl.int64) * R + okeys[:, None]) * (H * D) + h * D + dcols[None, :]
            live = (okeys < R)[:, None]
            gl.store(DK + at, (dk * sm_scale).to(dtype), mask=live)
            gl.store(DV + at, dv.to(dtype), mask=live)

    @gluon.jit
    def evo_dkdv_gluon_kernel(q_desc, k_desc, v_desc, do_desc, pair_desc, DK, DV, LSE, DELTA, MASK, mask_rows,
                              mask_heads, BH, S, R, rows_per, qk_scale, sm_scale, H: gl.constexpr, D: gl.constexpr,
                              NJ: gl.constexpr, STAGES: gl.constexpr, HAS_MASK: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2 * STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(do_desc.dtype, [2 * STAGES] + do_desc.block_type.shape, do_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [4] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [4] + v_desc.block_type.shape, v_desc.layout)
        pair_bufs = gl.allocate_shared_memory(gl.float32, [NJ] + pair_desc.block_type.shape, pair_desc.layout)
        pair_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(pair_bar, count=1)
        for x in gl.static_range(4):
            mbarrier.init(kv_ready.index(x), count=1)
            mbarrier.init(kv_free.index(x), count=1)
        for x in gl.static_range(2 * STAGES):
            mbarrier.init(q_ready.index(x), count=1)
            mbarrier.init(q_free.index(x), count=1)
        gl.warp_specialize([
            (_consumer, (q_bufs, k_bufs, v_bufs, do_bufs, pair_bufs, pair_bar, kv_ready, kv_free, q_ready, q_free, DK,
                         DV, LSE, DELTA, MASK, mask_rows, mask_heads, BH, S, R, rows_per, qk_scale, sm_scale, 0, H, D,
                         NJ, STAGES, HAS_MASK)),
            (_consumer, (q_bufs, k_bufs, v_bufs, do_bufs, pair_bufs, pair_bar, kv_ready, kv_free, q_ready, q_free, DK,
                         DV, LSE, DELTA, MASK, mask_rows, mask_heads, BH, S, R, rows_per, qk_scale, sm_scale, 1, H, D,
                         NJ, STAGES, HAS_MASK)),
            (_producer, (q_desc, k_desc, v_desc, do_desc, pair_desc, q_bufs, k_bufs, v_bufs, do_bufs, pair_bufs,
                         pair_bar, kv_ready, kv_free, q_ready, q_free, BH, S, rows_per, H, NJ, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    return evo_dkdv_gluon_kernel, gl


def available() -> bool:
    """This Triton's Gluon is one the kernel was written for (and imports)."""
    from .._gluon import builds
    return builds(_build, GLUON_TRITON_VERSIONS)


def launch_args(q, k, v, do, lse, delta, dk, dv, pair2t, mask2, mask_heads, scale, G):
    """(kernel, grid, args, constexpr kwargs) of the launch; shared by dkdv_gluon and the compile test. pair2t: the
    log2 pair bias transposed, [B · H, keys, queries]."""
    B, S, R, H, D = q.shape
    NJ = cdiv(R, BLOCK)
    kernel, _ = _build()
    rows_per = cdiv(S, G)
    pair_desc = bias_descriptors(pair2t, None)[0]
    mask_args = [pair2t, 0, 1] if mask2 is None else [mask2, mask2.stride(0), mask_heads]
    args = [*row_descriptors(q, k, v, do), pair_desc, dk, dv, lse, delta, *mask_args, B * H, S, R, rows_per,
            scale * LOG2E, scale]
    meta = dict(H=H, D=D, NJ=NJ, STAGES=STAGES, HAS_MASK=mask2 is not None, CONSUMER_REGS=CONSUMER_REGS,
                PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG)
    return kernel, (B * H * NJ * cdiv(S, rows_per),), args, meta


def dkdv_gluon(q, k, v, do, lse, delta, dk, dv, biases, scale, n_sm, launch=triton_launch):
    """Writes dk and dv (like k, v; gluon_shared_kernel.fits holds). do: the gated output gradient, delta its rowsum
    with the output (both times the row scale), lse the forward's row statistics
    [2, B, S, H, R] (plane 0, lse2 in log2 units, is read; evoformer_kernel.row_stats)."""
    B, S, R, H, D = q.shape
    pair, mask = split_biases(biases, S)
    NJ = cdiv(R, BLOCK)
    G = groups(B * H, NJ, cdiv(S, 2), n_sm)
    pair2t, mask2, mask_heads = log2_biases(pair.transpose(3, 4), mask, B, S, H, R, launch)
    kernel, grid, args, meta = launch_args(q, k, v, do, lse, delta, dk, dv, pair2t, mask2, mask_heads, scale, G)
    launch(kernel, grid, *args, **meta)


def compile_sm90(R=384, D=32, S=4, H=2, B=1, mask=True, dtype="bfloat16", arch=90, G=2):
    """Compile the kernel for sm_<arch> without a GPU (ops/_gluon.py's stub target; nothing is launched)."""
    from .._gluon import compile_report
    dt = getattr(torch, dtype)
    q = torch.empty(B, S, R, H, D, dtype=dt)
    lse = torch.empty(B, S, H, R, dtype=torch.float32)
    full = (B, S, H, R, R)
    pair = torch.empty(B, 1, H, R, R, dtype=dt).expand(full)
    m = torch.empty(B, S, 1, 1, R, dtype=dt).expand(full) if mask else None
    pair2t, mask2, mask_heads = log2_bias_buffers(pair.transpose(3, 4), m, B, S, H, R)
    kernel, grid, args, meta = launch_args(q, q, q, q, lse, lse, q, q, pair2t, mask2, mask_heads, D ** -0.5, G)
    return compile_report(kernel, args, grid, meta, arch)
