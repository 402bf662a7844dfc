"""MLA decode for Hopper (sm_90) in Gluon: a TMA ring of latent pages, one producer warp, two consumer warpgroups.

The same problem and the same outputs as decode_kernel.mla_decode_split_kernel (bf16 cache, dense block-table
walk, page size 64, query rows h_q · s_q >= 64): program (64-row tile, split, b) walks its split's pages one
page (64 tokens × 576) per step, and writes either the split's partials (o_part [split, b, rows, 512] fp32,
lse_part [split, b, rows] in log2 units, for the existing combine_splits) or, with one split, the final out /
lse itself. Splits are cut exactly as the portable kernel cuts them (BLOCK_N 64), so the plan's split count and
the combine work unchanged.

Schedule (Triton 3.6's Gluon; the H200 runs 3.6):
- shared memory: Q resident ([64, 512] latent + [64, 64] rope, 72 KB, NVMMA 128-byte swizzle), a ring of
  STAGES latent pages (each [64, 512] + [64, 64], 72 KB), and one [64, 64] bf16 P tile: 224 KB at 2 stages.
- producer (a worker partition of one warp, 24 registers): reads the page id for each step from block_table
  (clamped to [0, last_page] like the portable kernel), waits for the ring slot to be empty, and issues the
  slot's TMA copies over a 2-D view [pages · 64, 576] of the cache (row = page · 64), signalling `ready[slot]`.
- consumers (the default partition: 8 warps = two warpgroups). Every MMA is laid out with warps_per_cta
  [4, 2], so warpgroup 0 owns output columns 0-255 and warpgroup 1 columns 256-511 (a 64 × 256 fp32
  accumulator each, 128 registers a thread); S = Q·Kᵀ (64 × 64, K 576) is split the same way (32 score
  columns each), its row max / row sum cross the two warpgroups through shared memory, and P goes through
  shared memory to both warpgroups' P·V wgmma. Software pipelining: step i issues S(i+1) and then P(i)·V(i)
  as async wgmmas, waits for S(i+1) only (P·V still running on the tensor cores), does the softmax of step
  i+1, then waits for P·V(i), frees ring slot i (mbarrier arrive), rescales the accumulator and writes
  P(i+1).
- tails: tokens past the split's end (and, causal, past each row's bottom-right-aligned limit) are masked
  to -inf in S; the last page's rows past the request's length are zeroed in shared memory before the last
  P·V (they may hold anything, NaN included, and 0 · NaN would poison the accumulator).

MODE (diagnosis): 0 full; 1 S = QKᵀ + softmax only (P·V skipped: out 0, lse right).

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
DEFAULT_STAGES = 2                # ring slots: 2 fill the SM's 227 KB with Q and P (3 do not fit). At least 2:
# step i issues S(i+1) before it frees slot i, so one slot would deadlock (it did, on the H200)
PRODUCER_REGS = 24
MAXNREG = 168    # 12 warps (8 consumer + 1 producer, rounded to warpgroups) x 168 <= 64K registers


@functools.lru_cache(maxsize=None)
def _build():
    """The Gluon kernel, built on first use (importing warpforge never touches Gluon)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    @gluon.jit
    def _producer(kn_desc, kr_desc, kn_bufs, kr_bufs, ready, empty, bt_row, first_page, n_steps, last_page,
                  STAGES: gl.constexpr):
        nbytes: gl.constexpr = kn_desc.block_type.nbytes + kr_desc.block_type.nbytes
        page = gl.load(bt_row + first_page, mask=n_steps > 0, other=0)
        for i in range(n_steps):
            slot = i % STAGES
            # the page id of the next step is loaded while this step's slot may still be busy
            page_next = gl.load(bt_row + first_page + i + 1, mask=i + 1 < n_steps, other=0)
            row = gl.minimum(gl.maximum(page, 0), last_page) * 64
            # empty barriers start as if phase 1 had completed: the first lap does not wait
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), nbytes)
            tma.async_copy_global_to_shared(kn_desc, [row, 0], ready.index(slot), kn_bufs.index(slot))
            tma.async_copy_global_to_shared(kr_desc, [row, 512], ready.index(slot), kr_bufs.index(slot))
            page = page_next

    @gluon.jit
    def _scores(q_nope, q_rope, kn, kr, s_layout: gl.constexpr):
        """S = Q·Kᵀ of one ring slot, issued async (two wgmma groups)."""
        s0 = gl.zeros([64, 64], gl.float32, s_layout)
        tok = warpgroup_mma(q_nope, kn.permute((1, 0)), s0, use_acc=False, is_async=True)
        return warpgroup_mma(q_rope, kr.permute((1, 0)), tok, is_async=True)

    @gluon.jit
    def _softmax(s, n0, limit, m_i, l_i, qk_scale, s_layout: gl.constexpr):
        """One online-softmax step on the raw scores of the tokens n0 .. n0+63 (log2 units after qk_scale):
        (p, alpha, new row sums, new row maxima). limit [64]: per row, the first token it must not see."""
        cols = n0 + gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        ok = cols[None, :] < limit[:, None]
        s = gl.where(ok, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        return p, alpha, l_i * alpha + gl.sum(p, axis=1), m_new

    @gluon.jit
    def _zero_tail(kn, n_valid, num_warps: gl.constexpr):
        """Rows n_valid.. of a ring slot's [64, 512] latent tile set to 0 (they lie past the request's end)."""
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
        for c in gl.static_range(8):
            sub = kn.slice(c * 64, 64, dim=1)
            v = sub.load(blk)
            v = gl.where((rows < n_valid)[:, None], v, gl.zeros_like(v))
            sub.store(v)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _consumer(q_nope, q_rope, kn_bufs, kr_bufs, p_smem, ready, empty, O_PART, LSE_PART,
                  b, split, tile, start, end, length, n_steps, rows_total, qk_scale,
                  stride_ps, stride_pb, stride_ls, stride_lb,
                  H_Q: gl.constexpr, S_Q: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr,
                  STAGES: gl.constexpr, MODE: gl.constexpr, num_warps: gl.constexpr):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, 32, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, 256, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        r = tile * 64 + gl.arange(0, 64, layout=row_s)  # query row = j · H_Q + h
        if CAUSAL:
            limit = gl.minimum(length - S_Q + 1 + r // H_Q, end)  # bottom-right aligned, per row
        else:
            limit = gl.full([64], 0, gl.int32, row_s) + end
        m_i = gl.full([64], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([64], gl.float32, row_s)
        acc = gl.zeros([64, 512], gl.float32, o_layout)
        if n_steps > 0:
            mbarrier.wait(ready.index(0), 0)
            s = warpgroup_mma_wait(0, deps=(_scores(q_nope, q_rope, kn_bufs.index(0), kr_bufs.index(0),
                                                    s_layout), ))
            p, alpha, l_i, m_i = _softmax(s, start, limit, m_i, l_i, qk_scale, s_layout)
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            for i in range(n_steps - 1):
                cur = i % STAGES
                nxt = (i + 1) % STAGES
                mbarrier.wait(ready.index(nxt), ((i + 1) // STAGES) & 1)
                s_tok = _scores(q_nope, q_rope, kn_bufs.index(nxt), kr_bufs.index(nxt), s_layout)
                if MODE == 0:
                    acc_tok = warpgroup_mma(p_smem, kn_bufs.index(cur), acc, is_async=True)
                    s = warpgroup_mma_wait(1, deps=(s_tok, ))  # S(i+1) done; P·V(i) may still run
                    p, alpha, l_i, m_i = _softmax(s, start + (i + 1) * 64, limit, m_i, l_i, qk_scale, s_layout)
                    acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
                else:
                    s = warpgroup_mma_wait(0, deps=(s_tok, ))
                    p, alpha, l_i, m_i = _softmax(s, start + (i + 1) * 64, limit, m_i, l_i, qk_scale, s_layout)
                # both warpgroups are past their P·V(i): slot i and the P tile may be reused
                gl.thread_barrier()
                mbarrier.arrive(empty.index(cur), count=1)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                p_smem.store(p.to(gl.bfloat16))
                fence_async_shared()
                gl.thread_barrier()
            last = (n_steps - 1) % STAGES
            if MODE == 0:
                n_valid = end - (start + (n_steps - 1) * 64)
                if n_valid < 64:
                    _zero_tail(kn_bufs.index(last), n_valid, num_warps)
                acc = warpgroup_mma(p_smem, kn_bufs.index(last), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc, ))

        # epilogue: normalise, store the partial (or final) output and lse
        empty_row = l_i == 0.0
        l_safe = gl.where(empty_row, 1.0, l_i)
        lse2 = gl.where(empty_row, float("-inf"), m_i + gl.log2(l_safe))
        norm = gl.convert_layout(1.0 / l_safe, row_o)
        ro = tile * 64 + gl.arange(0, 64, layout=row_o)
        cols = gl.arange(0, 512, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = O_PART + split.to(gl.int64) * stride_ps + b.to(gl.int64) * stride_pb + \
            ro.to(gl.int64)[:, None] * 512 + cols[None, :]
        o_mask = (ro < rows_total)[:, None] & (cols < 512)[None, :]
        gl.store(o_ptrs, (acc * norm[:, None]).to(O_PART.dtype.element_ty), mask=o_mask)
        r_ok = r < rows_total
        if FINAL:
            gl.store(LSE_PART + b.to(gl.int64) * stride_lb + (r % H_Q) * S_Q + r // H_Q, lse2 * 0.6931471805599453,
                     mask=r_ok)
        else:
            gl.store(LSE_PART + split.to(gl.int64) * stride_ls + b.to(gl.int64) * stride_lb + r, lse2, mask=r_ok)

    @gluon.jit
    def mla_decode_gluon_kernel(
        Q, kn_desc, kr_desc, BLOCK_TABLE, SEQLENS, O_PART, LSE_PART,
        stride_qb, stride_qs, stride_qh, stride_bt,
        stride_ps, stride_pb, stride_ls, stride_lb,
        rows_total, qk_scale, capacity, last_page,
        H_Q: gl.constexpr, S_Q: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr, STAGES: gl.constexpr,
        MODE: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        # the row tiles of one (request, split) are neighbours in launch order: they walk the same pages at about
        # the same time, so the second reads them from L2 (tile on axis 2 doubled the HBM traffic at h_q 128)
        tile = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2)
        n_splits = gl.num_programs(1)
        length = gl.minimum(gl.maximum(gl.load(SEQLENS + b), 0), capacity)
        per_split = gl.cdiv(gl.cdiv(length, n_splits), 64) * 64
        start = split * per_split
        end = gl.minimum(start + per_split, length)
        n_steps = gl.maximum(gl.cdiv(end - start, 64), 0)

        q_layout: gl.constexpr = kn_desc.layout
        qr_layout: gl.constexpr = kr_desc.layout
        q_nope = gl.allocate_shared_memory(gl.bfloat16, [64, 512], q_layout)
        q_rope = gl.allocate_shared_memory(gl.bfloat16, [64, 64], qr_layout)
        kn_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 64, 512], q_layout)
        kr_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 64, 64], qr_layout)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], qr_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)

        # Q rows of this tile (rows past the request's are zeros and never stored) -> shared memory
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        r = tile * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
        r_ok = r < rows_total
        q_rows = Q + b.to(gl.int64) * stride_qb + (r // H_Q).to(gl.int64) * stride_qs + \
            (r % H_Q).to(gl.int64) * stride_qh
        c512 = gl.arange(0, 512, layout=gl.SliceLayout(0, blk))
        c64 = gl.arange(0, 64, layout=gl.SliceLayout(0, blk))
        q_nope.store(gl.load(q_rows[:, None] + c512[None, :], mask=r_ok[:, None] & (c512 < 512)[None, :], other=0.0))
        q_rope.store(gl.load(q_rows[:, None] + 512 + c64[None, :], mask=r_ok[:, None] & (c64 < 64)[None, :],
                             other=0.0))
        fence_async_shared()
        gl.thread_barrier()

        bt_row = BLOCK_TABLE + b.to(gl.int64) * stride_bt
        gl.warp_specialize([
            (_consumer, (q_nope, q_rope, kn_bufs, kr_bufs, p_smem, ready, empty, O_PART, LSE_PART,
                         b, split, tile, start, end, length, n_steps, rows_total, qk_scale,
                         stride_ps, stride_pb, stride_ls, stride_lb,
                         H_Q, S_Q, CAUSAL, FINAL, STAGES, MODE, num_warps)),
            (_producer, (kn_desc, kr_desc, kn_bufs, kr_bufs, ready, empty, bt_row, start // 64, n_steps, last_page,
                         STAGES)),
        ], [1], [PRODUCER_REGS])

    return mla_decode_gluon_kernel, gl


def available() -> bool:
    """This Triton's Gluon is one the kernel was written for (and imports)."""
    import triton
    if not triton.__version__.startswith(GLUON_TRITON_VERSIONS):
        return False
    try:
        _build()
    except Exception:  # noqa: BLE001 - any import / definition failure means: use the portable kernel
        return False
    return True


def knobs() -> tuple[int, int]:
    """(ring stages, mode) for diagnosis and sweeps: WARPFORGE_MLA_GLUON_STAGES (>= 2, default 2; more do not
    fit in shared memory on sm_90) and WARPFORGE_MLA_GLUON_MODE (0 full, 1 S + softmax only)."""
    import os
    return (int(os.environ.get("WARPFORGE_MLA_GLUON_STAGES", DEFAULT_STAGES)),
            int(os.environ.get("WARPFORGE_MLA_GLUON_MODE", 0)))


def tma_ok(kv_cache: torch.Tensor) -> bool:
    """The cache can be read through a TMA descriptor over its rows: 16-byte aligned base and row stride."""
    return kv_cache.data_ptr() % 16 == 0 and (kv_cache.stride(1) * kv_cache.element_size()) % 16 == 0


def _descriptors(kv_cache, gl):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    nope_layout = gl.NVMMASharedLayout.get_default_for([PAGE, D_V], gl.bfloat16)
    rope_layout = gl.NVMMASharedLayout.get_default_for([PAGE, D_R], gl.bfloat16)
    shape, strides = [rows, kv_cache.shape[3]], [kv_cache.stride(1), 1]
    return (TensorDescriptor(kv_cache, shape, strides, [PAGE, D_V], nope_layout),
            TensorDescriptor(kv_cache, shape, strides, [PAGE, D_R], rope_layout))


def launch_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, o_part, lse_part, final, stages,
                mode):
    """(kernel, grid, args, constexpr kwargs) of one launch; shared by mla_decode_gluon and the compile test."""
    if stages < 2:
        raise ValueError(f"mla_decode_gluon: stages must be >= 2 (got {stages}): the schedule loads step i+1 into "
                         "the ring before it frees step i's slot")
    kernel, gl = _build()
    b, s_q, h_q, _ = q.shape
    rows = s_q * h_q
    num_splits = o_part.shape[0]
    kn_desc, kr_desc = _descriptors(kv_cache, gl)
    grid = (-(-rows // BLOCK_M), num_splits, b)
    args = (q, kn_desc, kr_desc, block_table, cache_seqlens, o_part, lse_part,
            q.stride(0), q.stride(1), q.stride(2), block_table.stride(0),
            o_part.stride(0), o_part.stride(1), 0 if final else lse_part.stride(0), lse_part.stride(0 if final else 1),
            rows, softmax_scale * LOG2E, block_table.shape[1] * kv_cache.shape[1] if kv_cache.shape[0] else 0,
            max(kv_cache.shape[0] - 1, 0))
    meta = dict(H_Q=h_q, S_Q=s_q, CAUSAL=bool(causal), FINAL=bool(final), STAGES=stages, MODE=mode,
                PRODUCER_REGS=PRODUCER_REGS, num_warps=8, maxnreg=MAXNREG)
    return kernel, grid, args, meta


def mla_decode_gluon(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, num_splits,
                     stages=DEFAULT_STAGES, mode=0):
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
                                           lse_part, final, stages, mode)
    kernel[grid](*args, **meta)
    if not final:
        combine_splits(o_part, lse_part, out, lse, h_q, s_q)
    return out, lse


# ------------------------------------------------------------------------------------ compile-only check
PTX_FEATURES = {"wgmma": "wgmma.mma_async", "tma": "cp.async.bulk.tensor", "setmaxnreg": "setmaxnreg",
                "mbarrier": "mbarrier"}


class _StubTarget:
    """A stand-in driver for compiling without a GPU: it names the target and launches nothing."""

    def __init__(self, arch):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def compile_sm90(h_q=128, s_q=1, causal=False, num_splits=1, stages=DEFAULT_STAGES, mode=0, arch=90):
    """Compile the kernel for sm_<arch> without a GPU (Triton's wheel carries ptxas): a stub driver stands in
    for the device while nothing is launched. Returns a report dict: PTX features, warps, shared memory,
    registers / spills from ptxas (when the compiled kernel carries them), and the compiled kernel."""
    import re

    from triton.runtime.driver import driver

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
    previous = driver._active
    driver.set_active(_StubTarget(arch))
    try:
        kernel, grid, args, meta = launch_args(q, cache, table, lens, 576 ** -0.5, causal, o_part, lse_part, final,
                                               stages, mode)
        k = kernel.warmup(*args, grid=grid, **meta)
    finally:
        driver._active = previous
    ptx = k.asm.get("ptx", "")
    report = {name: tag in ptx for name, tag in PTX_FEATURES.items()}
    report["setmaxnreg_values"] = sorted(set(int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                                          ptx)))
    report["warp_specialize"] = "ttg.warp_specialize" in k.asm.get("ttgir", "")
    report["num_warps"] = k.metadata.num_warps
    report["shared_bytes"] = k.metadata.shared
    for key in ("n_regs", "n_spills"):
        report[key] = getattr(k, key, None)
    report["kernel"] = k
    return report


def ptxas_usage(ptx: str, arch: str = "sm_90a") -> dict:
    """Registers, spill stores / loads and stack of each kernel in the PTX, from `ptxas -v` (Triton's ptxas)."""
    import os
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([get_ptxas(90).path, "-v", f"-arch={arch}", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    out = {"ptxas_rc": res.returncode}
    m = re.search(r"Used (\d+) registers", text)
    out["registers"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    out["spill_stores"], out["spill_loads"] = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    m = re.search(r"(\d+) bytes stack frame", text)
    out["stack_bytes"] = int(m.group(1)) if m else None
    out["ptxas_log"] = text.strip()
    return out
