"""The Evoformer backward's dq and pair-bias gradient in one Gluon pass, for Hopper (sm_90).

The portable backward recomputes every score three times (dk/dv pass, dq pass, pair-bias pass). Two of those
walks share their whole step: the dq pass and the pair-bias pass both compute p and ds = p · (dp − delta) for
every (MSA row, query, key), and differ only in which sum they keep (ds · K over the keys; ds over the MSA rows).
This pass computes each ds once and keeps both sums. What plain Triton could not give is the second sum's home: a
program that owns 64 queries of one (batch, head) and walks the MSA rows must keep the pair-bias gradient of its
whole [64, N_res] strip across the walk. Here two consumer warpgroups split the strip's key blocks (warpgroup w
takes blocks j = w, w + 2, w + 4) and keep their [64, 64] tiles of it in registers (three fp32 tiles a thread: N_res
<= 384), so the sum costs one add a score.

Program (batch · head, 64-query block i, group g of MSA rows), 12 warps (two consumer warpgroups and a producer
warp in a third):
- producer (1 warp, setmaxnreg PRODUCER_REGS): first the pair bias's [64, N_res] strip (fp32, log2 units:
  gluon_shared_kernel.log2_biases) into shared memory (`pair_bar`), the same for every MSA row of the walk; then
  per MSA row s of the group, in order, waits `row_free[s % 2]` and TMA-loads Q_s,i, dO_s,i [64, D], the row's K_s,
  V_s as NJ tiles [64, D] each and its mask row into row buffer s % 2, onto `row_ready[s % 2]` (one expect-tx for
  them all). 4-D descriptors over q's [B · N_seq, N_res, H, D] with [1, 64, 1, D] boxes: rows past N_res arrive as
  zeros.
- consumer warpgroup w (w = 0 the default partition, setmaxnreg CONSUMER_REGS): per row, lse and delta of its 64
  queries (plain loads, issued before the row's wait), then for each of its key blocks j:
      S = Q · K_jᵀ and dP = dO · V_jᵀ issued together (wgmma, [64, 64] fp32)
      x = S · scale · log2 e + pair_j + mask_j (shared memory; −inf for keys past N_res), p = exp2(x − lse2)
      ds = p · (dP − delta); acc_j += ds; dq_w += ds · K_j (wgmma, ds the A operand from registers)
  then both arrive on `row_free[s % 2]`. Warpgroup 1 hands dq_1 to warpgroup 0 through a shared [64, D] fp32 tile
  (`dq_full` / `dq_free`), and warpgroup 0 stores (dq_0 + dq_1) · scale: a fixed order, deterministic.
- epilogue: each warpgroup stores its accumulator tiles into the group's fp32 partial [G, B · H, N_res, N_res]; the
  host sums the G partials in a fixed order (torch.sum over a dim: no atomics) into the [B, H, N_res, N_res]
  gradient. G spreads B · H · NI programs over enough waves to fill the GPU.

What it takes (gluon_shared_kernel.fits): fp16 / bf16 q, k, v of head dim 16 or 32 (two row buffers of K and V,
96 KB at d 32, beside the 96 KB strip), N_res <= 384, the biases a pair tile shared by the MSA rows (required: its
gradient is the point) and at most one key-row mask; every other case keeps the portable passes. Gluon's API
changes between Triton releases: built lazily (`_build()`) and only for GLUON_TRITON_VERSIONS.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...runtime import cdiv
from ..shared_kernels import triton_launch
from .._gluon_flash_fwd import CONSUMER_REGS, GLUON_TRITON_VERSIONS, LOG2E, MAXNREG, PRODUCER_REGS
from .gluon_shared_kernel import (BLOCK, bias_descriptors, build_helpers, groups, log2_bias_buffers, log2_biases,
                                  row_descriptors, split_biases)

__all__ = ["GLUON_TRITON_VERSIONS", "available", "compile_sm90", "dq_dbias_gluon"]


@functools.lru_cache(maxsize=None)
def _build():
    """The Gluon kernel, built on first use (importing warpforge never touches Gluon)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    _program, _load_strip = build_helpers()

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, do_desc, pair_desc, mask_desc, q_bufs, do_bufs, k_bufs, v_bufs, pair_bufs,
                  mask_bufs, pair_bar, row_ready, row_free, BH, S, rows_per, mask_heads, H: gl.constexpr,
                  NI: gl.constexpr, NJ: gl.constexpr, HAS_MASK: gl.constexpr):
        bh, i, g, b, h, s0, n_rows = _program(BH, NI, H, S, rows_per)
        # the pair bias's strip (log2 units, fp32) once: the same for every MSA row of the walk
        _load_strip(pair_desc, pair_bufs, pair_bar, bh, i, NJ)
        row_bytes: gl.constexpr = (2 * q_desc.block_type.nbytes + 2 * NJ * k_desc.block_type.nbytes
                                   + HAS_MASK * NJ * mask_desc.block_type.nbytes)
        for t in range(n_rows):
            p = t % 2
            mbarrier.wait(row_free.index(p), ((t // 2) & 1) ^ 1)  # fresh barriers pass the first lap
            bar = row_ready.index(p)
            mbarrier.expect(bar, row_bytes)
            bs = b * S + s0 + t
            tma.async_copy_global_to_shared(q_desc, [bs, i * 64, h, 0], bar, q_bufs.index(p))
            tma.async_copy_global_to_shared(do_desc, [bs, i * 64, h, 0], bar, do_bufs.index(p))
            for j in gl.static_range(NJ):
                tma.async_copy_global_to_shared(k_desc, [bs, j * 64, h, 0], bar, k_bufs.index(p * NJ + j))
                tma.async_copy_global_to_shared(v_desc, [bs, j * 64, h, 0], bar, v_bufs.index(p * NJ + j))
                if HAS_MASK:
                    tma.async_copy_global_to_shared(mask_desc, [bs * mask_heads + h % mask_heads, j * 64], bar,
                                                    mask_bufs.index(p * NJ + j))

    @gluon.jit
    def _consumer(q_bufs, do_bufs, k_bufs, v_bufs, pair_bufs, mask_bufs, dq_x, pair_bar, row_ready, row_free, dq_full,
                  dq_free, DQ, LSE, DELTA, PART, BH, S, R, rows_per, qk_scale, sm_scale, WG: gl.constexpr,
                  H: gl.constexpr, D: gl.constexpr, NI: gl.constexpr, NJ: gl.constexpr, HAS_MASK: gl.constexpr,
                  EVEN: gl.constexpr):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 64, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        dtype: gl.constexpr = q_bufs.dtype
        bh, i, g, b, h, s0, n_rows = _program(BH, NI, H, S, rows_per)
        rows = i * 64 + gl.arange(0, 64, layout=row_l)
        live = rows < R
        s_zero = gl.zeros([64, 64], gl.float32, s_layout)
        # the strip's tiles this warpgroup owns, key blocks WG, WG + 2, WG + 4 (all three made and stored even where
        # N_res has fewer blocks: Triton 3.6 fails to lower a warp-specialized loop whose carried values differ)
        acc0 = gl.zeros([64, 64], gl.float32, s_layout)
        acc1 = gl.zeros([64, 64], gl.float32, s_layout)
        acc2 = gl.zeros([64, 64], gl.float32, s_layout)
        mbarrier.wait(pair_bar, 0)
        for t in range(n_rows):
            p = t % 2
            s = s0 + t
            stat = ((b * S + s) * H + h).to(gl.int64) * R
            lse = gl.load(LSE + stat + rows, mask=live, other=float("-inf"))
            lse2 = gl.where(lse == float("-inf"), float("inf"), lse)
            delta = gl.load(DELTA + stat + rows, mask=live, other=0.0)
            mbarrier.wait(row_ready.index(p), (t // 2) & 1)
            # z = t >> 30: 0 for every real row count but loop-variant to LLVM and ptxas, so the fixed strip tiles'
            # shared addresses are rebuilt at each use instead of hoisted out of the loop and held (spilled) across it
            z = t >> 30
            q = q_bufs.index(p).reshape([64, D])
            do = do_bufs.index(p).reshape([64, D])
            dq = gl.zeros([64, D], gl.float32, o_layout)
            for jj in gl.static_range(3):
                j = 2 * jj + WG
                if j < NJ:
                    k = k_bufs.index(p * NJ + j).reshape([64, D])
                    v = v_bufs.index(p * NJ + j).reshape([64, D])
                    s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    dp_tok = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    # the biases from shared memory, already in log2 units (fp32)
                    bias = pair_bufs.index(j + z).reshape([64, 64]).load(s_layout)
                    if HAS_MASK:
                        bias = bias + mask_bufs.index(p * NJ + j).load(s_layout)
                    sc = warpgroup_mma_wait(1, deps=(s_tok, ))
                    x = sc * qk_scale + bias
                    if not EVEN:
                        if j == NJ - 1:
                            cols = j * 64 + gl.arange(0, 64, layout=col_l)
                            x = gl.where((cols < R)[None, :], x, float("-inf"))
                    # the exponent clamped at 0 (why: evoformer_kernel._dscores)
                    pr = gl.exp2(gl.minimum(x - lse2[:, None], 0.0))
                    dpv = warpgroup_mma_wait(0, deps=(dp_tok, ))
                    ds = pr * (dpv - delta[:, None])
                    if jj == 0:
                        acc0 += ds
                    elif jj == 1:
                        acc1 += ds
                    else:
                        acc2 += ds
                    dq_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k, dq, is_async=True)
                    dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
            gl.thread_barrier()                    # every warp of the warpgroup is past the row buffer's reads
            mbarrier.arrive(row_free.index(p))
            # dq of the row: warpgroup 1's partial through shared memory into warpgroup 0's, which stores the sum
            if WG == 1:
                mbarrier.wait(dq_free, (t & 1) ^ 1)
                dq_x.store(dq)
                gl.thread_barrier()
                mbarrier.arrive(dq_full)
            else:
                mbarrier.wait(dq_full, t & 1)
                dq = dq + dq_x.load(o_layout)
                gl.thread_barrier()
                mbarrier.arrive(dq_free)
                qrows = i * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
                dcols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
                at = ((b * S + s).to(gl.int64) * R + qrows[:, None]) * (H * D) + h * D + dcols[None, :]
                gl.store(DQ + at, (dq * sm_scale).to(dtype), mask=(qrows < R)[:, None])
        # the strip's tiles into this group's partial
        cols0 = gl.arange(0, 64, layout=col_l)
        base = PART + (g * BH + bh).to(gl.int64) * R * R
        for jj in gl.static_range(3):
            j = 2 * jj + WG
            cols = j * 64 + cols0  # (a tile past the last key block stores nothing: its columns are >= R)
            at = base + rows[:, None] * R + cols[None, :]
            if jj == 0:
                tile = acc0
            elif jj == 1:
                tile = acc1
            else:
                tile = acc2
            gl.store(at, tile, mask=live[:, None] & (cols < R)[None, :])

    @gluon.jit
    def evo_dq_dbias_kernel(q_desc, k_desc, v_desc, do_desc, pair_desc, mask_desc, DQ, LSE, DELTA, PART, BH, S, R,
                            rows_per, mask_heads, qk_scale, sm_scale,
                            H: gl.constexpr, D: gl.constexpr, NI: gl.constexpr, NJ: gl.constexpr,
                            HAS_MASK: gl.constexpr, EVEN: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            PRODUCER_REGS: gl.constexpr):
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2 * NJ] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [2 * NJ] + v_desc.block_type.shape, v_desc.layout)
        pair_bufs = gl.allocate_shared_memory(gl.float32, [NJ] + pair_desc.block_type.shape, pair_desc.layout)
        if HAS_MASK:
            mask_bufs = gl.allocate_shared_memory(gl.float32, [2 * NJ] + mask_desc.block_type.shape, mask_desc.layout)
        else:
            mask_bufs = pair_bufs  # not read
        dq_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        dq_x = gl.allocate_shared_memory(gl.float32, [64, D], dq_layout)
        pair_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        row_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        row_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        dq_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for p in gl.static_range(2):
            mbarrier.init(row_ready.index(p), count=1)
            mbarrier.init(row_free.index(p), count=2)  # one arrive per consumer warpgroup
        mbarrier.init(pair_bar, count=1)
        mbarrier.init(dq_full, count=1)
        mbarrier.init(dq_free, count=1)
        gl.warp_specialize([
            (_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, pair_bufs, mask_bufs, dq_x, pair_bar, row_ready, row_free,
                         dq_full, dq_free, DQ, LSE, DELTA, PART, BH, S, R, rows_per, qk_scale, sm_scale, 0, H, D, NI,
                         NJ, HAS_MASK, EVEN)),
            (_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, pair_bufs, mask_bufs, dq_x, pair_bar, row_ready, row_free,
                         dq_full, dq_free, DQ, LSE, DELTA, PART, BH, S, R, rows_per, qk_scale, sm_scale, 1, H, D, NI,
                         NJ, HAS_MASK, EVEN)),
            (_producer, (q_desc, k_desc, v_desc, do_desc, pair_desc, mask_desc, q_bufs, do_bufs, k_bufs, v_bufs,
                         pair_bufs, mask_bufs, pair_bar, row_ready, row_free, BH, S, rows_per, mask_heads, H, NI, NJ,
                         HAS_MASK)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    return evo_dq_dbias_kernel, gl


def available() -> bool:
    """This Triton's Gluon is one the kernel was written for (and imports)."""
    from .._gluon import builds
    return builds(_build, GLUON_TRITON_VERSIONS)


def launch_args(q, k, v, do, lse, delta, dq, part, pair2, mask2, mask_heads, scale, G):
    """(kernel, grid, args, constexpr kwargs) of the launch; shared by dq_dbias_gluon and the compile test. part:
    fp32 [G, B · H, R, R]; pair2, mask2, mask_heads: log2_biases'."""
    B, S, R, H, D = q.shape
    NJ = cdiv(R, BLOCK)
    kernel, _ = _build()
    rows_per = cdiv(S, G)
    args = [*row_descriptors(q, k, v, do), *bias_descriptors(pair2, mask2), dq, lse, delta, part, B * H, S, R,
            rows_per, mask_heads, scale * LOG2E, scale]
    meta = dict(H=H, D=D, NI=NJ, NJ=NJ, HAS_MASK=mask2 is not None, EVEN=R % BLOCK == 0,
                CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG)
    return kernel, (B * H * NJ * cdiv(S, rows_per),), args, meta


def dq_dbias_gluon(q, k, v, do, lse, delta, dq, biases, scale, n_sm, launch=triton_launch, out_dtype=torch.float32):
    """Writes dq (like q) and returns the scores' gradient summed over N_seq, [B, H, R, R] in out_dtype (fits() holds;
    the groups' fp32 partials are summed in fp32, then cast once). do: the gated output gradient, delta its rowsum
    with the output (both times the row scale), lse the forward's row statistics
    [2, B, S, H, R] (plane 0, lse2 in log2 units, is read; evoformer_kernel.row_stats)."""
    B, S, R, H, D = q.shape
    pair, mask = split_biases(biases, S)
    NJ = cdiv(R, BLOCK)
    G = groups(B * H, NJ, S, n_sm)
    G = cdiv(S, cdiv(S, G))  # no empty group
    dbias = torch.empty((B, H, R, R), device=q.device, dtype=out_dtype)
    direct = G == 1 and out_dtype == torch.float32  # the one partial is the result
    part = dbias.view(1, B * H, R, R) if direct else torch.empty((G, B * H, R, R), device=q.device,
                                                                 dtype=torch.float32)
    biases2 = log2_biases(pair, mask, B, S, H, R, launch)
    kernel, grid, args, meta = launch_args(q, k, v, do, lse, delta, dq, part, *biases2, scale, G)
    launch(kernel, grid, *args, **meta)
    if not direct:
        n = B * H * R * R
        launch(evo_sum_partials_kernel, (cdiv(n, SUM_BLOCK),), part, dbias, n, G, BLOCK=SUM_BLOCK)
    return dbias


SUM_BLOCK = 1024


@triton.jit
def evo_sum_partials_kernel(PART, OUT, n, G, BLOCK: tl.constexpr):
    """OUT = the sum of the G fp32 partials [G, n] in group order (bitwise reproducible), cast to OUT's dtype: one
    launch where torch.sum and a cast were two."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    ptrs = PART + offs
    acc = tl.load(ptrs, mask=inside, other=0.0)
    for _ in range(1, G):
        ptrs += n
        acc += tl.load(ptrs, mask=inside, other=0.0)
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=inside)


def compile_sm90(R=384, D=32, S=4, H=2, B=1, mask=True, dtype="bfloat16", arch=90, G=2):
    """Compile the kernel for sm_<arch> without a GPU (ops/_gluon.py's stub target; nothing is launched)."""
    from .._gluon import compile_report
    dt = getattr(torch, dtype)
    q = torch.empty(B, S, R, H, D, dtype=dt)
    lse = torch.empty(B, S, H, R, dtype=torch.float32)
    full = (B, S, H, R, R)
    pair = torch.empty(B, 1, H, R, R, dtype=dt).expand(full)
    m = torch.empty(B, S, 1, 1, R, dtype=dt).expand(full) if mask else None
    part = torch.empty((G, B * H, R, R), dtype=torch.float32)
    kernel, grid, args, meta = launch_args(q, q, q, q, lse, lse, q, part, *log2_bias_buffers(pair, m, B, S, H, R),
                                           D ** -0.5, G)
    return compile_report(kernel, args, grid, meta, arch)
