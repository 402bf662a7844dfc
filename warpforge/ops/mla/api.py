"""MLA decode: `plan` -> `MLAPlan.run` (FlashInfer's plan/run), `mla_decode` (both in one call), `quantize_kv`.

plan() validates the shapes, dtypes and formats and fixes everything a decode step needs from them alone: the
tile config and the KV split count. plan.run(...) then checks the tensors it is given against the plan
(their values too, except while a CUDA graph is captured or torch.compile traces) and dispatches: the
reference, or the Triton split-KV kernel and combine as an op. Nothing in run() reads a value back to the
host when capturing, so one plan serves every replay of a captured decode step.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ...errors import (FP32_TINY, SCALE_MAX, check_choice, check_dtype, check_int, check_last_dim_contiguous,
                       check_no_grad, check_positive_float, check_rank, check_same_device, check_tensor, fail,
                       host_reads_allowed, read_once)
from ...runtime import arch_key, check_interpreted_matmul_dtype, resolve_backend, sm_count
from .._op import kernel_op
from .._plan import DecodePlan
from . import configs
from .kv_format import D_QK, D_V, KV_FORMATS
from .reference import mla_decode_reference, quantize_kv_reference

MAX_H_Q = 128
PAGE_SIZES = (16, 32, 64)
QUANTIZE_ROWS = 1 << 16


# ------------------------------------------------------------------------------------------- op
def _mla_decode_impl(q: torch.Tensor, kv_cache: torch.Tensor, block_table: Optional[torch.Tensor],
                     cache_seqlens: Optional[torch.Tensor], kv_scale: Optional[torch.Tensor], scale: float,
                     causal: bool, kv_format: str, num_splits: int, cfg: list[int],
                     indices: Optional[torch.Tensor] = None,
                     topk_length: Optional[torch.Tensor] = None,
                     gluon: bool = False, rows16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if rows16:  # the plan's rows16 gate passed (sm_90, a Gluon Triton, bf16 q, dense FP8, rows <= 16)
        from . import decode_rows16_gluon_kernel as d16
        if d16.available() and d16.cache_ok(kv_cache):
            return d16.mla_decode_rows16_gluon(q, kv_cache, block_table, cache_seqlens, scale, causal, num_splits,
                                               configs.GLUON_ROWS16_STAGES)
    if gluon:  # the plan's gate passed (sm_90, a Gluon Triton, bf16 q, dense, rows >= 64; see gluon_gate)
        from . import decode_gluon_kernel as dg
        fmt = KV_FORMATS[kv_format]
        if dg.available() and fmt.quantized:
            from .dequant_kernel import mla_decode_dequantized, slice_requests
            per_slice = slice_requests(q.shape[0], block_table.shape[1] * kv_cache.shape[1])
            if dg.tma_ok(kv_cache, fmt) and quantized_in_kernel(fmt, q.shape[0], per_slice):
                return dg.mla_decode_gluon(q, kv_cache, block_table, cache_seqlens, scale, causal, num_splits, fmt,
                                           kv_scale)

            def run_bf16(q_, cache_, table_, seqlens_):  # dequantised into bf16 pages for the bf16 kernel
                return dg.mla_decode_gluon(q_, cache_, table_, seqlens_, scale, causal, num_splits)
            return mla_decode_dequantized(q, kv_cache, block_table, cache_seqlens, kv_scale, fmt, run_bf16, per_slice,
                                          configs.DEQUANT.lookup(q.device, kv_format))
        if dg.available() and dg.tma_ok(kv_cache):
            return dg.mla_decode_gluon(q, kv_cache, block_table, cache_seqlens, scale, causal, num_splits)
    from .decode_kernel import mla_decode_fwd
    return mla_decode_fwd(q, kv_cache, block_table, cache_seqlens, scale, causal, KV_FORMATS[kv_format], kv_scale,
                          num_splits, configs.MLACfg(*cfg), indices, topk_length)


def quantized_in_kernel(fmt, batch: int, per_slice: int) -> bool:
    """Whether the Gluon kernel reads a quantized cache of page 64 itself (else its pages are dequantised into bf16
    scratch first, dequant_kernel.py). FP8: always (H200, h_q 128: 0.142 / 0.725 ms at L 1k / 8k against 0.198 /
    1.324). FP4: only where the dequantisation pass would run the batch in slices (per_slice < batch requests in its
    scratch): its e2m1 decode cost the kernel ~10 instructions a value, so the pass was 10-25% faster where one
    slice holds the batch (L 1k-4k at b 128) and the kernel 5-14% faster where slices start (L 8k+;
    benchmarks/NOTES.md, session 18). Session 43's word decode (~5.5 a value) may move that crossover: `mla-fp4-sweep`
    times both. WARPFORGE_MLA_GLUON_IN_KERNEL=0 always takes the pass."""
    if os.environ.get(configs.GLUON_IN_KERNEL_ENV, "1") == "0":
        return False
    return fmt.name == "fp8" or per_slice < batch


def _mla_decode_fake(q, kv_cache, block_table, cache_seqlens, kv_scale, scale, causal, kv_format, num_splits, cfg,
                     indices=None, topk_length=None, gluon=False, rows16=False):
    b, s_q, h_q, _ = q.shape
    return q.new_empty((b, s_q, h_q, D_V)), q.new_empty((b, h_q, s_q), dtype=torch.float32)


_mla_decode = kernel_op("mla_decode", _mla_decode_impl, _mla_decode_fake)


# ---------------------------------------------------------------------------------------- plan / run
@dataclass(frozen=True)
class MLAPlan(DecodePlan):
    """What an MLA decode step's shapes decide, fixed once: run() it on every step (CUDA-graph safe)."""
    max_tokens: int        # per request: block_table pages × page size, or topk when sparse
    sparse: bool
    causal: bool
    config: configs.MLACfg
    gluon: bool = False    # run() takes the Hopper Gluon kernel (decode_gluon_kernel.py): see gluon_gate
    rows16: bool = False   # run() takes the Gluon kernel for <= 16 rows (decode_rows16_gluon_kernel.py): rows16_gate

    @property
    def shapes(self) -> tuple:
        return (self.batch, self.s_q, self.h_q, self.page_size, self.max_tokens, self.kv_format, self.sparse)

    def run(self, q, kv_cache, block_table=None, cache_seqlens=None, *, kv_scale=None, indices=None,
            topk_length=None, backend=None):
        """(out [b, s_q, h_q, 512] in q's dtype, lse [b, h_q, s_q] fp32, natural log) for this step's tensors,
        which must have the shapes the plan was made for. Forward only (decode), on both backends: tensors that
        require grad are refused while grad mode is on."""
        backend = resolve_backend(backend, q.device) if isinstance(q, torch.Tensor) else backend
        _check_step(self, q, kv_cache, block_table, cache_seqlens, kv_scale, indices, topk_length)
        check_interpreted_matmul_dtype(backend, "q", q)
        if backend == "reference":
            return mla_decode_reference(q, kv_cache, block_table, cache_seqlens, softmax_scale=self.softmax_scale,
                                        causal=self.causal, kv_format=self.kv_format, kv_scale=kv_scale,
                                        indices=indices, topk_length=topk_length)
        return _mla_decode(q, kv_cache, block_table, cache_seqlens, kv_scale, self.softmax_scale, self.causal,
                           self.kv_format, self.num_splits, list(self.config), indices, topk_length, self.gluon,
                           self.rows16)


def plan(q, kv_cache, block_table=None, *, indices=None, kv_format="bf16", softmax_scale=None, causal=False,
         num_splits=None, head_dim_v=D_V) -> MLAPlan:
    """An MLAPlan for decode steps shaped like these tensors (only their shapes, dtypes and device are read):
    q [b, s_q, h_q, 576]; kv_cache [num_pages, page_size, 1, width] in `kv_format` (see mla_decode); block_table
    int32 [b, max_pages], or, sparse, indices int32 [b, s_q, topk]. num_splits: None plans it, an int forces it."""
    from .decode_kernel import plan_block_h, plan_num_splits
    _check_shapes(q, kv_cache, block_table, indices, kv_format, causal, head_dim_v)
    check_positive_float("softmax_scale", softmax_scale)
    b, s_q, h_q, _ = q.shape
    sparse = indices is not None
    rows = h_q if sparse else s_q * h_q  # the query rows one program's tiles are cut from
    cfg = configs.DECODE.lookup(q.device, "fp32" if q.dtype == torch.float32 else kv_format, rows)
    cfg = cfg._replace(block_h=plan_block_h(cfg.block_h, rows))
    max_tokens = indices.shape[2] if sparse else block_table.shape[1] * kv_cache.shape[1]
    if num_splits is not None:  # more splits than tokens would only be empty partials
        check_int("num_splits", num_splits, lo=1, hi=max(max_tokens, 1),
                  what=f"None (planned) or an int from 1 to {max(max_tokens, 1)} (the tokens a request may see)")
    gluon = gluon_gate(q, kv_cache, kv_format, sparse)
    rows16 = rows16_gate(q, kv_format, sparse)
    if num_splits is None:
        if rows16:
            num_splits = plan_num_splits(b, rows, max_tokens, configs.GLUON_ROWS16_MAX_ROWS, sm_count(q.device),
                                         waves=configs.GLUON_ROWS16_WAVES)
        elif gluon:  # one 64-row program fills an SM (224 KB of shared memory); quantized caches run in slices
            from .dequant_kernel import slice_requests
            per_launch = b if kv_format == "bf16" else slice_requests(b, max_tokens)
            num_splits = plan_num_splits(per_launch, rows, max_tokens, configs.GLUON_BLOCK_H, sm_count(q.device),
                                         waves=configs.GLUON_WAVES)
        else:
            num_splits = plan_num_splits(b * s_q if sparse else b, rows, max_tokens, cfg.block_h, sm_count(q.device),
                                         waves=cfg.waves)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(D_QK)
    return MLAPlan(batch=b, s_q=s_q, h_q=h_q, page_size=kv_cache.shape[1], kv_format=kv_format, softmax_scale=scale,
                   dtype=q.dtype, num_splits=num_splits, max_tokens=max_tokens, sparse=sparse, causal=causal,
                   config=cfg, gluon=gluon, rows16=rows16)


@torch.compiler.assume_constant_result
def _gluon_switch() -> bool:
    """WARPFORGE_MLA_GLUON (unset or anything but "0": on) and a Triton whose Gluon API the kernel was written
    for: read on the host, a constant to torch.compile."""
    if os.environ.get(configs.GLUON_ENV, "1") == "0":
        return False
    import triton
    return triton.__version__.startswith(configs.GLUON_TRITON_VERSIONS)


def _gluon_eligible(q, sparse) -> bool:
    """What both Gluon kernels need: an sm_90 device, bf16 q, a dense decode, a Triton in
    configs.GLUON_TRITON_VERSIONS, WARPFORGE_MLA_GLUON not "0"."""
    return (q.device.type == "cuda" and arch_key(q.device) == "sm90" and not sparse and q.dtype == torch.bfloat16
            and _gluon_switch())


def gluon_gate(q, kv_cache, kv_format, sparse) -> bool:
    """Whether a plan for these shapes takes the Hopper Gluon kernel: an sm_90 device, a Triton in
    configs.GLUON_TRITON_VERSIONS, bf16 q, dense (block table, no indices), h_q · s_q >= 64 query rows,
    WARPFORGE_MLA_GLUON not "0", and either a bf16 cache of page size 64 or a quantized cache (any page size:
    its pages are dequantised into bf16 scratch pages first, dequant_kernel.py, unless WARPFORGE_MLA_GLUON_DEQUANT
    is "0"; one of page size 64 may be read by the kernel itself instead: quantized_in_kernel). Everything else
    runs the portable kernel (so does a bf16 run whose cache is not 16-byte aligned for TMA, checked at run
    time)."""
    b, s_q, h_q, _ = q.shape
    if s_q * h_q < configs.GLUON_MIN_ROWS or not _gluon_eligible(q, sparse):
        return False
    if kv_format != "bf16":
        return os.environ.get(configs.GLUON_DEQUANT_ENV, "1") != "0"
    return kv_cache.dtype == torch.bfloat16 and kv_cache.shape[1] == configs.GLUON_PAGE


def rows16_gate(q, kv_format, sparse) -> bool:
    """Whether a plan for these shapes takes the Gluon kernel for few rows (decode_rows16_gluon_kernel.py): an sm_90
    device, a Triton in configs.GLUON_TRITON_VERSIONS, bf16 q, dense, an FP8 cache, h_q · s_q <= 16 query rows,
    WARPFORGE_MLA_GLUON_ROWS16 not "0" (a cache TMA cannot read as it is, decode_rows16_gluon_kernel.cache_ok, takes
    the portable kernel, checked at run time)."""
    b, s_q, h_q, _ = q.shape
    if kv_format != "fp8" or s_q * h_q > configs.GLUON_ROWS16_MAX_ROWS:
        return False
    return os.environ.get(configs.GLUON_ROWS16_ENV, "1") != "0" and _gluon_eligible(q, sparse)


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: Optional[torch.Tensor],
               cache_seqlens: Optional[torch.Tensor], *, head_dim_v: int = D_V, softmax_scale: Optional[float] = None,
               causal: bool = False, kv_format: str = "bf16", kv_scale: Optional[torch.Tensor] = None,
               indices: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None,
               num_splits: Optional[int] = None, backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA decode over a paged latent cache. Returns (out [b, s_q, h_q, 512] like q, lse [b, h_q, s_q]
    fp32, natural log). `plan(...).run(...)` in one call; a serving loop makes the plan once instead.

    q [b, s_q, h_q, 576] (h_q 1-128, s_q 1-4); kv_cache [num_pages, page_size, 1, width]: bf16 in q's dtype
    (width 576), or uint8 rows of "fp8" (656), "nvfp4" (416; kv_scale: its one-element fp32 tensor scale) or
    "mxfp4" (400), made by `quantize_kv`; block_table int32 [b, max_pages]; cache_seqlens int32 [b]. causal (MTP,
    s_q > 1): query i sees the first cache_seqlens - s_q + 1 + i tokens. A request that sees no token gets out 0
    and lse -inf. num_splits: None (planned from shapes) or an int number of KV splits.

    Sparse (top-k) variant: indices int32 [b, s_q, topk] of absolute cache slots (page * page_size + offset,
    -1 skipped) replace the block table walk (block_table / cache_seqlens may then be None); topk_length
    int32 [b] optionally limits each request's list.

    Forward only: q, kv_cache and kv_scale must not require grad while grad mode is on (the Triton op has no
    backward; call it under torch.no_grad() or detach).
    """
    p = plan(q, kv_cache, block_table, indices=indices, kv_format=kv_format, softmax_scale=softmax_scale,
             causal=causal, num_splits=num_splits, head_dim_v=head_dim_v)
    return p.run(q, kv_cache, block_table, cache_seqlens, kv_scale=kv_scale, indices=indices,
                 topk_length=topk_length, backend=backend)


def quantize_kv(latent: torch.Tensor, kv_format: str, kv_scale=None) -> torch.Tensor:
    """latent [..., 576] -> cache rows in `kv_format`: "bf16" unchanged; "fp8" / "nvfp4" / "mxfp4" uint8
    [..., 656 / 416 / 400] (layouts in kv_format.py). "nvfp4" takes the cache-wide fp32 kv_scale, fixed for
    the cache's life (e.g. nvfp4_tensor_scale of calibration data); pass the same to mla_decode. Latents larger
    than that scale covers (6 · 448 · kv_scale) saturate, as in any fixed-scale format."""
    check_tensor("latent", latent)
    check_choice("kv_format", kv_format, KV_FORMATS)
    fmt = KV_FORMATS[kv_format]
    check_dtype("latent", latent, (torch.bfloat16, torch.float16, torch.float32))
    if latent.dim() == 0 or latent.shape[-1] != D_QK:
        fail("latent", f"a tensor [..., {D_QK}]", f"shape {tuple(latent.shape)}")
    _check_kv_scale(kv_format, kv_scale, "latent", latent)
    if fmt.quantized and host_reads_allowed(latent) and not bool(torch.isfinite(latent).all()):
        fail("latent", "finite values (a NaN or inf has no place in a quantized cache)", "NaN or inf")
    if not fmt.quantized:
        return latent
    # in slices of rows: the reference quantiser's fp32 temporaries are ~10x the slice (a whole large cache at
    # once runs a GPU out of memory)
    rows = latent.reshape(-1, D_QK)
    out = torch.empty(rows.shape[0], fmt.width, dtype=torch.uint8, device=latent.device)
    for i in range(0, rows.shape[0], QUANTIZE_ROWS):
        out[i:i + QUANTIZE_ROWS] = quantize_kv_reference(rows[i:i + QUANTIZE_ROWS], kv_format, kv_scale)
    return out.reshape(*latent.shape[:-1], fmt.width)


# ------------------------------------------------------------------------------------------ checks
def _check_shapes(q, kv_cache, block_table, indices, kv_format, causal, head_dim_v):
    """What plan() reads: shapes, dtypes, formats, flags."""
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        check_tensor(name, t)
        check_same_device(name, t, "q", q)
    check_rank("q", q, 4)
    check_dtype("q", q, (torch.bfloat16, torch.float16, torch.float32))
    b, s_q, h_q, d = q.shape
    if d != D_QK:
        fail("q", f"head dim {D_QK} (512 latent + 64 rope)", d)
    check_int("head_dim_v", head_dim_v, lo=D_V, hi=D_V, what=f"the int {D_V} (the latent's width, out's head dim)")
    if not 1 <= h_q <= MAX_H_Q:
        fail("q", f"h_q from 1 to {MAX_H_Q}", h_q)
    if not 1 <= s_q <= 4:
        fail("q", "s_q from 1 to 4", s_q)
    check_last_dim_contiguous("q", q)
    check_choice("kv_format", kv_format, KV_FORMATS)
    fmt = KV_FORMATS[kv_format]
    check_rank("kv_cache", kv_cache, 4)
    if kv_cache.shape[2] != 1:
        fail("kv_cache", "one latent head: [num_pages, page_size, 1, width]", tuple(kv_cache.shape))
    if kv_cache.shape[1] not in PAGE_SIZES:
        fail("kv_cache", f"page size in {PAGE_SIZES}", kv_cache.shape[1])
    check_dtype("kv_cache", kv_cache, (torch.uint8,) if fmt.quantized else (q.dtype,))
    if kv_cache.shape[3] != fmt.width:
        fail("kv_cache", f"{fmt.width} {'bytes' if fmt.quantized else 'values'} per token for {kv_format}",
             kv_cache.shape[3])
    if not _rows_evenly_spaced(kv_cache):
        fail("kv_cache", "token rows evenly spaced (stride(0) = page_size · stride(1), last dim contiguous), e.g. "
             "contiguous, or one head of a [pages, page_size, h_kv, width] cache", f"strides {kv_cache.stride()}")
    if not isinstance(causal, bool):
        fail("causal", "a bool", type(causal).__name__)
    if indices is not None:
        _check_int32("indices", indices, q, 3, (b, s_q))
        if indices.shape[2] < 1:
            fail("indices", f"[{b}, {s_q}, topk >= 1]", tuple(indices.shape))
        if causal:
            fail("causal", "False with indices (the index list already says what each query sees)", causal)
    else:
        _check_int32("block_table", block_table, q, 2, (b,))


def _check_step(p: MLAPlan, q, kv_cache, block_table, cache_seqlens, kv_scale, indices, topk_length):
    """What run() is given: the plan's shapes, and (unless capturing) values in range."""
    check_tensor("q", q)
    check_no_grad("q", q, "mla_decode")
    if tuple(q.shape) != (p.batch, p.s_q, p.h_q, D_QK) or q.dtype != p.dtype:
        fail("q", f"[{p.batch}, {p.s_q}, {p.h_q}, {D_QK}] {p.dtype} (the plan's)", f"{tuple(q.shape)} {q.dtype}")
    check_last_dim_contiguous("q", q)
    fmt = KV_FORMATS[p.kv_format]
    check_tensor("kv_cache", kv_cache)
    check_same_device("kv_cache", kv_cache, "q", q)
    check_no_grad("kv_cache", kv_cache, "mla_decode")
    if kv_cache.dim() != 4 or tuple(kv_cache.shape[1:]) != (p.page_size, 1, fmt.width) or \
            kv_cache.dtype != (torch.uint8 if fmt.quantized else q.dtype) or not _rows_evenly_spaced(kv_cache):
        fail("kv_cache", f"a [num_pages, {p.page_size}, 1, {fmt.width}] {p.kv_format} cache (the plan's)",
             f"{tuple(kv_cache.shape)} {kv_cache.dtype}")
    _check_kv_scale(p.kv_format, kv_scale, "q", q)
    if kv_scale is not None:
        check_no_grad("kv_scale", kv_scale, "mla_decode")
    if not p.sparse:
        for name, t in (("indices", indices), ("topk_length", topk_length)):
            if t is not None:
                fail(name, "None for a dense plan (plan with indices for the sparse decode)", "a tensor")
    if p.sparse:
        # the block table walk is replaced, but what is passed is still checked as what it claims to be (no values)
        if block_table is not None:
            _check_int32("block_table", block_table, q, 2, (p.batch,))
        if cache_seqlens is not None:
            _check_int32("cache_seqlens", cache_seqlens, q, 1, (p.batch,))
        _check_int32("indices", indices, q, 3, (p.batch, p.s_q))
        if indices.shape[2] != p.max_tokens:
            fail("indices", f"topk {p.max_tokens} (the plan's)", indices.shape[2])
        if topk_length is not None:
            _check_int32("topk_length", topk_length, q, 1, (p.batch,))
        if host_reads_allowed(q):
            _check_index_values(kv_cache, indices, topk_length)
    else:
        _check_int32("block_table", block_table, q, 2, (p.batch,))
        if block_table.shape[1] * p.page_size != p.max_tokens:
            fail("block_table", f"{p.max_tokens // p.page_size} pages per request (the plan's)",
                 block_table.shape[1])
        _check_int32("cache_seqlens", cache_seqlens, q, 1, (p.batch,))
        if host_reads_allowed(q):
            _check_table_values(kv_cache, block_table, cache_seqlens)


def _check_kv_scale(kv_format, kv_scale, ref_name, ref):
    """The one-element fp32 cache-wide scale a tensor-scaled format (nvfp4) needs, finite and > 0 (read on the
    host once per tensor value, not while capturing); None for every other format."""
    if not KV_FORMATS[kv_format].tensor_scale:
        if kv_scale is not None:
            fail("kv_scale", f"None for kv_format {kv_format!r} (only a tensor-scaled format takes one)",
                 type(kv_scale).__name__)
        return
    if not isinstance(kv_scale, torch.Tensor) or kv_scale.numel() != 1 or kv_scale.dtype != torch.float32:
        fail("kv_scale", f"the cache-wide one-element fp32 scale for {kv_format} (see nvfp4_tensor_scale)",
             kv_scale)
    check_same_device("kv_scale", kv_scale, ref_name, ref)
    if host_reads_allowed(kv_scale):
        value = read_once((kv_scale,), ("kv_scale",), lambda: float(kv_scale.detach()))
        if not (math.isfinite(value) and FP32_TINY <= value <= SCALE_MAX):  # the kernels' fp32 range, as scalars
            fail("kv_scale", f"a finite scale > 0 from {FP32_TINY:.2g} to {SCALE_MAX:g}", value)


def _rows_evenly_spaced(kv_cache) -> bool:
    """The kernel addresses token row page · page_size + offset as one stride: pages must follow each other."""
    return kv_cache.stride(-1) == 1 and kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.stride(1)


def _check_int32(name, t, q, rank, lead):
    """An int32 tensor on q's device of the given rank whose leading dims are `lead` (batch first)."""
    check_tensor(name, t)
    check_same_device(name, t, "q", q)
    check_rank(name, t, rank)
    check_dtype(name, t, (torch.int32,))
    if tuple(t.shape[:len(lead)]) != tuple(lead):
        fail(name, f"leading dims {tuple(lead)} (batch{', s_q' if len(lead) > 1 else ''} of q)", tuple(t.shape))
    check_last_dim_contiguous(name, t)


def _check_table_values(kv_cache, block_table, cache_seqlens):
    page = kv_cache.shape[1]
    capacity = block_table.shape[1] * page
    # every check as one reduction on the device and a single read-back; the details only on failure
    lens = cache_seqlens.long()
    used = torch.arange(block_table.shape[1], device=lens.device)[None, :] < ((lens + page - 1) // page)[:, None]
    bad_pages = used & ((block_table < 0) | (block_table >= kv_cache.shape[0]))
    if not bool(((lens < 0) | (lens > capacity)).any() | bad_pages.any()):
        return
    lens = lens.cpu()
    if bool((lens < 0).any()):
        fail("cache_seqlens", "values >= 0", lens.tolist()[:8])
    if bool((lens > capacity).any()):
        fail("cache_seqlens", f"values <= {capacity} (block_table pages x page_size)", int(lens.max()))
    i, p = (int(x) for x in bad_pages.nonzero()[0])
    fail("block_table", f"page indices in [0, {kv_cache.shape[0]})", f"{int(block_table[i, p])} at [{i}, {p}]")


def _check_index_values(kv_cache, indices, topk_length):
    slots = kv_cache.shape[0] * kv_cache.shape[1]
    bad_idx = ((indices < -1) | (indices >= slots)).any()  # one read-back for both checks, as above
    bad_len = ((topk_length < 0) | (topk_length > indices.shape[2])).any() if topk_length is not None else bad_idx
    if not bool(bad_idx | bad_len):
        return
    if bool(bad_idx):
        fail("indices", f"slots in [-1, {slots})", f"min {int(indices.min())}, max {int(indices.max())}")
    fail("topk_length", f"values in [0, {indices.shape[2]}]", topk_length.tolist()[:8])
