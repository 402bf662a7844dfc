"""Paged GQA decode: `plan` -> `PagedPlan.run` (FlashInfer's plan/run), `paged_decode` (both in one call), and the
cache helpers `quantize_kv` / `append_kv`.

plan() validates shapes, dtypes and the format and fixes what a decode step needs from them alone: the tiles and
the KV split count. run() checks the step's tensors against the plan (their values too, except while a CUDA graph
is captured or torch.compile traces) and dispatches: the reference, or the Triton split-KV kernel and combine as an
op. run() reads nothing back to the host when capturing, so one plan serves every replay of a captured step.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ...errors import (FP32_TINY, SCALE_MAX, check_choice, check_dtype, check_int, check_last_dim_contiguous,
                       check_no_grad, check_positive_float, check_rank, check_same_device, check_same_dtype,
                       check_tensor, fail, host_reads_allowed, read_once)
from ...runtime import check_interpreted_matmul_dtype, resolve_backend, sm_count
from .._op import kernel_op
from .._plan import DecodePlan
from . import configs
from .kv_format import BY_DTYPE, KV_FORMATS, split_fp4
from .reference import (append_kv_slots_reference, fp8_scales, paged_decode_reference, quantize_kv_reference,
                        write_entries)

PAGE_SIZES = (1, 8, 16, 32, 64, 128)
MAX_S_Q = 16
# every multiple of 8 up to 256 (the kernels pad to the next power of two, at least 16, masked); the FP4 formats take
# the multiples of their block (head_dims)
HEAD_DIMS = tuple(range(8, 257, 8))
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def head_dims(kv_format: Optional[str] = None) -> tuple:
    """The head dims paged_decode and the cache helpers take for kv_format (None: any values format): HEAD_DIMS,
    and for the FP4 formats only the multiples of their block (nvfp4 16, mxfp4 32)."""
    fmt = KV_FORMATS.get(kv_format) if kv_format is not None else None
    if fmt is not None and fmt.fp4:
        return tuple(d for d in HEAD_DIMS if d % fmt.group == 0)
    return HEAD_DIMS


# ------------------------------------------------------------------------------------------- op
def _decode_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_bs: Optional[torch.Tensor],
                 v_bs: Optional[torch.Tensor], block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                 k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], kv_format: str, softmax_scale: float,
                 softcap: float, window: int, num_splits: int, cfg: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = configs.PagedCfg(*cfg)
    fmt = KV_FORMATS[kv_format]
    if fmt.fp4:  # the kernels read an FP4 cache as its values and block scales (a row-layout cache: views)
        d = q.shape[3]
        (k_cache, k_bs), (v_cache, v_bs) = (split_fp4(c if bs is None else (c, bs), d)
                                            for c, bs in ((k_cache, k_bs), (v_cache, v_bs)))
    if cfg.gluon:  # plan()'s gluon_gate held (decode_gluon_kernel.py)
        from . import decode_gluon_kernel as dg
        if dg.cache_ok(k_cache, v_cache, fmt.code, k_bs, v_bs) and not nvfp4_pair_held_back(fmt, k_cache, k_bs):
            return dg.paged_decode_gluon(q, k_cache, v_cache, block_table, cache_seqlens, k_scale, v_scale,
                                         softmax_scale, num_splits, cfg, fmt.code, k_bs, v_bs)
        cfg = _portable_cfg(q, fmt, k_cache.shape[2])  # a cache laid out otherwise: the portable kernel
    from .decode_kernel import paged_decode_fwd
    return paged_decode_fwd(q, k_cache, v_cache, block_table, cache_seqlens, k_scale, v_scale, fmt,
                            softmax_scale, softcap, window if window >= 0 else None, num_splits, cfg, k_bs, v_bs)


def nvfp4_pair_held_back(fmt, values, block_scales) -> bool:
    """An NVFP4 cache given as a pair (values and block scales in tensors of their own, not a row cache's views) stays
    off the Gluon kernel unless configs.GLUON_NVFP4_PAIR_ENV is "1" (see there)."""
    return (fmt.code == 2 and block_scales is not None and os.environ.get(configs.GLUON_NVFP4_PAIR_ENV, "0") != "1"
            and values.untyped_storage().data_ptr() != block_scales.untyped_storage().data_ptr())


def _portable_cfg(q, fmt, h_kv) -> configs.PagedCfg:
    """The portable kernel's tiles for q and a cache format, as plan() picks them."""
    from .decode_kernel import block_d, plan_block_h
    cfg = configs.DECODE.lookup(q.device, "fp32" if q.dtype == torch.float32 else fmt.name, block_d(q.shape[3], fmt))
    return cfg._replace(block_h=plan_block_h(cfg.block_h, (q.shape[2] // h_kv) * q.shape[1]))


def _decode_fake(q, k_cache, v_cache, k_bs, v_bs, block_table, cache_seqlens, k_scale, v_scale, kv_format,
                 softmax_scale, softcap, window, num_splits, cfg):
    b, s_q, h_q, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h_q, s_q), dtype=torch.float32)


_paged_decode = kernel_op("paged_decode", _decode_impl, _decode_fake)


# ---------------------------------------------------------------------------------------- plan / run
@dataclass(frozen=True)
class PagedPlan(DecodePlan):
    """What a paged GQA decode step's shapes decide, fixed once: run() it on every step (CUDA-graph safe)."""
    softcap: Optional[float]
    window: Optional[int]
    h_kv: int
    head_dim: int
    max_pages: int       # block_table's width
    config: configs.PagedCfg

    def run(self, q, k_cache, v_cache, block_table, cache_seqlens, *, k_scale=None, v_scale=None, return_lse=False,
            backend=None):
        """out [b, s_q, h_q, d] in q's dtype (and lse [b, h_q, s_q] fp32, natural log, if return_lse) for this step's
        tensors, which must have the shapes the plan was made for. Forward only (decode), on both backends: tensors
        that require grad are refused while grad mode is on."""
        backend = resolve_backend(backend, q.device) if isinstance(q, torch.Tensor) else backend
        k_scale, v_scale = _check_step(self, q, k_cache, v_cache, block_table, cache_seqlens, k_scale, v_scale)
        check_interpreted_matmul_dtype(backend, "q", q)
        if not isinstance(return_lse, bool):
            fail("return_lse", "a bool", repr(return_lse))
        if backend == "reference":
            out, lse = paged_decode_reference(q, k_cache, v_cache, block_table, cache_seqlens,
                                              softmax_scale=self.softmax_scale, kv_format=self.kv_format,
                                              k_scale=k_scale, v_scale=v_scale, softcap=self.softcap,
                                              window=self.window)
        else:
            (k_cache, k_bs), (v_cache, v_bs) = (_op_parts(c) for c in (k_cache, v_cache))
            out, lse = _paged_decode(q, k_cache, v_cache, k_bs, v_bs, block_table, cache_seqlens, k_scale, v_scale,
                                     self.kv_format, self.softmax_scale, float(self.softcap or 0.0),
                                     -1 if self.window is None else self.window, self.num_splits, list(self.config))
        return (out, lse) if return_lse else out


def plan(q, k_cache, block_table, *, kv_format=None, softmax_scale=None, softcap=None, window=None,
         num_splits=None) -> PagedPlan:
    """A PagedPlan for decode steps shaped like these tensors (only shapes, dtypes and device are read): q [b, s_q,
    h_q, d]; k_cache [num_pages, page_size, h_kv, width] in kv_format, or an FP4 pair (see paged_decode);
    block_table int32 [b, max_pages]. num_splits: None plans it from the shapes, an int forces it."""
    from .decode_kernel import plan_num_splits
    kv_format = _check_shapes(q, k_cache, block_table, kv_format)
    check_positive_float("softmax_scale", softmax_scale)
    check_positive_float("softcap", softcap)
    if window is not None:
        check_int("window", window, lo=0, what="None or an int >= 0 (tokens before the query's own that it sees)")
    b, s_q, h_q, d = q.shape
    k_cache = _values(k_cache)
    h_kv = k_cache.shape[2]
    max_tokens = block_table.shape[1] * k_cache.shape[1]
    if window is not None:
        window = min(window, max_tokens)  # a wider window hides nothing; 2**70 would not fit the kernel's ints
        max_tokens = min(max_tokens, window + s_q)
    if num_splits is not None:
        check_int("num_splits", num_splits, lo=1, hi=max(max_tokens, 1),
                  what=f"None (planned) or an int from 1 to {max(max_tokens, 1)} (the tokens a request may see)")
    rows = (h_q // h_kv) * s_q
    cfg = _portable_cfg(q, KV_FORMATS[kv_format], h_kv)
    if gluon_gate(q, kv_format, d, rows, softcap, window):
        cfg = configs.GLUON[kv_format]._replace(block_h=cfg.block_h)
    if num_splits is None:
        num_splits = plan_num_splits(b, h_kv, -(-rows // cfg.block_h), max_tokens, sm_count(q.device), waves=cfg.waves)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    return PagedPlan(batch=b, s_q=s_q, h_q=h_q, page_size=k_cache.shape[1], kv_format=kv_format, softmax_scale=scale,
                     dtype=q.dtype, num_splits=num_splits, softcap=float(softcap) if softcap is not None else None,
                     window=window, h_kv=h_kv, head_dim=d, max_pages=block_table.shape[1], config=cfg)


def gluon_gate(q, kv_format, d, rows, softcap, window) -> bool:
    """Whether plan() takes the Hopper Gluon kernel (decode_gluon_kernel.py): an sm_90 GPU, a Triton in
    configs.GLUON_TRITON_VERSIONS, WARPFORGE_PAGED_GLUON not "0", a format it reads (configs.GLUON), d 128, at most 16
    query rows per kv head (GQA group · s_q), fp16 / bf16 q (bf16 for MXFP4: its dots run in bf16), no softcap or
    window. (The caches' layout is checked per call, decode_gluon_kernel.cache_ok.)"""
    if (kv_format not in configs.GLUON or d != 128 or rows > 16 or softcap is not None or window is not None
            or q.dtype not in (torch.float16, torch.bfloat16) or q.device.type != "cuda"
            or (kv_format == "mxfp4" and q.dtype != torch.bfloat16)
            or os.environ.get(configs.GLUON_ENV, "1") == "0"):
        return False
    import triton
    return (triton.__version__.startswith(configs.GLUON_TRITON_VERSIONS)
            and torch.cuda.get_device_capability(q.device) == (9, 0))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 cache_seqlens: torch.Tensor, *, softmax_scale: Optional[float] = None, kv_format: Optional[str] = None,
                 k_scale: Union[None, float, torch.Tensor] = None, v_scale: Union[None, float, torch.Tensor] = None,
                 softcap: Optional[float] = None, window: Optional[int] = None, return_lse: bool = False,
                 num_splits: Optional[int] = None,
                 backend: Optional[str] = None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Decode attention over paged K/V caches, GQA: `plan(...).run(...)` in one call (a serving loop makes the plan
    once instead). Returns out [b, s_q, h_q, d] like q (and lse [b, h_q, s_q] fp32 if return_lse).

    q [b, s_q, h_q, d] (s_q 1-16: the newest tokens, causal among themselves; d a multiple of 8 up to 256, for nvfp4
    / mxfp4 caches a multiple of 16 / 32; h_q a multiple of h_kv); k_cache / v_cache [num_pages, page_size, h_kv,
    width] (page size 1, 8, 16, 32, 64 or 128); block_table int32 [b, max_pages]; cache_seqlens int32 [b], the
    tokens in the cache including the s_q new ones (see reference.py for the exact rule). kv_format (None: from the
    cache's dtype): "bf16" / "fp16" / "fp32" (q's dtype), "fp8" (float8_e4m3fn; k_scale / v_scale a float, a
    one-element fp32 tensor, or fp32 [num_pages, h_kv]), "nvfp4" (uint8 rows, width d/2 + d/16; k_scale / v_scale
    the one-element fp32 tensor scales) or "mxfp4" (uint8, d/2 + d/32; under fp16 q its values saturate at fp16's
    ±65504); an FP4 cache may also be the pair (values [.., d/2], block scales [.., d/16 or d/32]), FlashInfer's
    layout (kv_format.py); `quantize_kv` and `append_kv` write them. softcap: c · tanh(s / c); window: a query at
    position p sees tokens p - window .. p. Forward only: tensors that require grad are refused while grad mode is
    on (the Triton op has no backward; call it under torch.no_grad() or detach).
    """
    p = plan(q, k_cache, block_table, kv_format=kv_format, softmax_scale=softmax_scale, softcap=softcap,
             window=window, num_splits=num_splits)
    return p.run(q, k_cache, v_cache, block_table, cache_seqlens, k_scale=k_scale, v_scale=v_scale,
                 return_lse=return_lse, backend=backend)


# ------------------------------------------------------------------------------------ cache helpers
def quantize_kv(x, kv_format, *, scale=None, per_page=False, split_scales=False):
    """Values x [..., h_kv, d] (e.g. whole pages [num_pages, page_size, h_kv, d]) -> (cache entries, scale) in
    kv_format. fp8: scale None computes one (per tensor, or with per_page=True per page and head from x's pages);
    nvfp4: scale None computes the tensor scale (amax over x); mxfp4 and the values formats take no scale (None
    comes back). Pass the returned scale to paged_decode as k_scale / v_scale. The values formats ("bf16", "fp16",
    "fp32") are a plain cast, as Tensor.to: a value past fp16's range becomes ±inf there (checking would need a host
    read). split_scales (nvfp4 / mxfp4 only): the entries as the pair (values [..., d/2], block scales [...,
    d/block]), FlashInfer's layout, which paged_decode and the append helpers take wherever a cache goes."""
    check_tensor("x", x)
    check_dtype("x", x, FLOATS)
    check_choice("kv_format", kv_format, KV_FORMATS)
    fmt = KV_FORMATS[kv_format]
    if x.dim() < 2 or x.shape[-1] not in HEAD_DIMS:
        fail("x", f"a tensor [..., h_kv, d] with d {_HEAD_DIMS_SAY}", f"shape {tuple(x.shape)}")
    _check_fp4_head_dim(kv_format, x.shape[-1])
    if not isinstance(per_page, bool) or (per_page and (kv_format != "fp8" or x.dim() != 4)):
        fail("per_page", "a bool, True only for fp8 pages [num_pages, page_size, h_kv, d]", repr(per_page))
    if not isinstance(split_scales, bool) or (split_scales and not fmt.fp4):
        fail("split_scales", "a bool, True only for nvfp4 / mxfp4", repr(split_scales))
    # before a scale is computed from x: a NaN would make it NaN and the error would name `scale`
    if fmt.quantized and host_reads_allowed(x) and not bool(torch.isfinite(x).all()):
        fail("x", "finite values (a NaN or inf has no place in a quantised cache)", "NaN or inf")
    if kv_format in ("fp8", "nvfp4"):
        if scale is None and kv_format == "fp8":
            scale = fp8_scales(x, per_page)
        elif scale is None:  # nvfp4's tensor scale, from amax (0 for no pages: amax() refuses an empty x)
            amax = x.float().abs().amax() if x.numel() else x.new_zeros((), dtype=torch.float32)
            scale = (amax / (6.0 * 448.0)).clamp(min=1e-12).reshape(1)
        elif kv_format == "fp8" and isinstance(scale, torch.Tensor) and scale.numel() != 1 and x.dim() != 4:
            fail("x", "pages [num_pages, page_size, h_kv, d] (4-d) for a per-page scale", f"shape {tuple(x.shape)}")
        scale = _scale_tensor("scale", scale, "x", x, x.shape[0] if x.dim() == 4 else None, x.shape[-2],
                              per_page_ok=kv_format == "fp8")
    elif scale is not None:
        fail("scale", f"None for kv_format {kv_format!r}", type(scale).__name__)
    return quantize_kv_reference(x, kv_format, scale, split_scales), scale


def append_kv(k_cache, v_cache, k_new, v_new, block_table, cache_seqlens, *, kv_format=None, k_scale=None,
              v_scale=None):
    """Writes k_new / v_new [b, s_new, h_kv, d] into the pages in place, token i of request b at position
    cache_seqlens[b] + i (cache_seqlens: the tokens already there; add s_new after). Quantised formats quantise
    the new tokens with the cache's scales: fp8 needs per-tensor scales (a per-page scale cannot follow tokens
    into a page), nvfp4 its tensor scales.

    k_cache and v_cache must not share memory, nor require grad while grad mode is on (they are written in place).
    Every new token must go to a slot of its own: requests may share pages they read (a common prefix), but
    block_table entries that send two new tokens to one page slot are refused when the values are checked; while a
    CUDA graph is captured or torch.compile traces nothing is read back, and that stays the caller's contract (one
    of the writes would win)."""
    _check_tokens("k_new", k_new, 1 << 30)
    kv_format = _check_cache("k_cache", k_cache, kv_format, k_new.dtype, k_new.shape[3], "k_new", k_new)
    kc = _values(k_cache)
    if kc.shape[2] != k_new.shape[2]:
        fail("k_new", f"{kc.shape[2]} kv heads (the cache's)", k_new.shape[2])
    _check_int32("block_table", block_table, "k_new", k_new, 2)
    _check_like_k_cache(v_cache, k_cache)
    check_tensor("v_new", v_new)
    check_same_device("v_new", v_new, "k_cache", kc)
    _check_writable(k_cache, v_cache, "append_kv")
    if v_new.shape != k_new.shape:
        fail("v_new", f"k_new's shape {tuple(k_new.shape)}", tuple(v_new.shape))
    check_same_dtype("v_new", v_new, "k_new", k_new)
    b, s_new = k_new.shape[:2]
    _check_int32("cache_seqlens", cache_seqlens, "k_new", k_new, 1)
    scales = _append_scales(kv_format, kc, k_scale, v_scale)
    num_pages, page = kc.shape[:2]
    capacity = block_table.shape[1] * page
    if b and num_pages == 0:
        fail("k_cache", "at least one page to append to", "0 pages")
    if b and capacity < s_new:
        fail("block_table", f"room for {s_new} new tokens per request ({page}-token pages)",
             f"{block_table.shape[1]} pages per request")
    pos = cache_seqlens.long()[:, None] + torch.arange(s_new, device=kc.device)[None, :]  # [b, s_new]
    # The values go unchecked under capture: positions are clamped into the table and page numbers into the cache,
    # so no write lands outside them (the tokens of a bad entry overwrite some page instead).
    pos = pos.clamp(0, capacity - 1)
    entries = torch.gather(block_table, 1, pos // page)
    slots = pos % page
    if host_reads_allowed(kc):
        _check_append_values(cache_seqlens, entries, entries.long() * page + slots, num_pages, capacity, s_new,
                             (k_new, v_new) if KV_FORMATS[kv_format].quantized else ())
    pages = entries.long().clamp(0, num_pages - 1)
    for cache, new, scale in ((k_cache, k_new, scales[0]), (v_cache, v_new, scales[1])):
        write_entries(cache, (pages, slots), quantize_kv_reference(new, kv_format, scale, _is_pair(cache)))


def _append_slots_impl(k_cache: torch.Tensor, v_cache: torch.Tensor, k_bs: Optional[torch.Tensor],
                       v_bs: Optional[torch.Tensor], k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], kv_format: str) -> None:
    from .append_kernel import append_slots_fwd
    fmt = KV_FORMATS[kv_format]
    if fmt.fp4:  # the kernel writes an FP4 cache as its values and block scales (a row-layout cache: views)
        d = k.shape[2]
        (k_cache, k_bs), (v_cache, v_bs) = (split_fp4(c if bs is None else (c, bs), d)
                                            for c, bs in ((k_cache, k_bs), (v_cache, v_bs)))
    append_slots_fwd(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale, fmt, configs.APPEND.lookup(k.device),
                     k_bs, v_bs)


# registered with the caches (and an FP4 pair's block scales) as mutated arguments: torch.compile and
# functionalisation see the write
_append_slots_op = kernel_op("paged_append_kv_slots", _append_slots_impl, lambda *args: None,
                             mutates_args=("k_cache", "v_cache", "k_bs", "v_bs"))


def append_kv_slots(k_cache, v_cache, k, v, slot_mapping, *, kv_format=None, k_scale=None, v_scale=None,
                    backend=None) -> None:
    """Writes new tokens k / v [num_tokens, h_kv, d] into the caches in place, token t at flat slot
    slot_mapping[t] = page · page_size + offset (vLLM's reshape_and_cache); a slot of -1 is skipped (padding). One
    launch writes K and V of a whole step, whatever mix of requests and lengths its tokens come from. Quantised
    formats quantise as append_kv does: fp8 with per-tensor scales (a float or one-element fp32 tensor; None: 1.0),
    nvfp4 with its tensor scales (required), mxfp4 with none.

    slot_mapping: int32 or int64 [num_tokens]. When values may be read on the host, every slot must be -1 or in
    [0, num_pages · page_size), no two tokens may share a slot, and a quantised cache's tokens must be finite;
    under a CUDA-graph capture or torch.compile nothing is read back and the kernel skips slots out of range (no
    write lands outside the caches; two tokens for one slot stay the caller's contract: one of them wins). k_cache
    and v_cache: as for append_kv (apart in memory, not requiring grad while grad mode is on)."""
    check_tensor("k", k)
    check_rank("k", k, 3)
    check_dtype("k", k, FLOATS)
    if k.shape[2] not in HEAD_DIMS:
        fail("k", f"head dim {_HEAD_DIMS_SAY}", k.shape[2])
    check_last_dim_contiguous("k", k)
    kv_format = _check_cache("k_cache", k_cache, kv_format, k.dtype, k.shape[2], "k", k)
    kc = _values(k_cache)
    if kc.shape[2] != k.shape[1]:
        fail("k", f"{kc.shape[2]} kv heads (the cache's)", k.shape[1])
    _check_like_k_cache(v_cache, k_cache)
    for name, t in (("v", v), ("slot_mapping", slot_mapping)):
        check_tensor(name, t)
        check_same_device(name, t, "k", k)
    _check_writable(k_cache, v_cache, "append_kv_slots")
    if v.shape != k.shape:
        fail("v", f"k's shape {tuple(k.shape)}", tuple(v.shape))
    check_same_dtype("v", v, "k", k)
    check_last_dim_contiguous("v", v)
    check_rank("slot_mapping", slot_mapping, 1)
    check_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.shape[0] != k.shape[0]:
        fail("slot_mapping", f"{k.shape[0]} slots (one per token of k)", slot_mapping.shape[0])
    if slot_mapping.numel() and slot_mapping.stride(0) != 1:
        fail("slot_mapping", "a contiguous tensor", f"stride {slot_mapping.stride(0)}")
    k_scale, v_scale = _append_scales(kv_format, kc, k_scale, v_scale)
    backend = resolve_backend(backend, k.device)
    capacity = kc.shape[0] * kc.shape[1]
    if host_reads_allowed(k) and k.shape[0]:
        _check_slot_values(slot_mapping, capacity, (k, v) if KV_FORMATS[kv_format].quantized else ())
    if backend == "reference":
        append_kv_slots_reference(k_cache, v_cache, k, v, slot_mapping, kv_format, k_scale, v_scale)
    else:
        (kc, k_bs), (vc, v_bs) = (_op_parts(c) for c in (k_cache, v_cache))
        _append_slots_op(kc, vc, k_bs, v_bs, k, v, slot_mapping, k_scale, v_scale, kv_format)


def _slot_flags(flat, capacity):
    """(slots out of range, two tokens for one slot) as device bools; skips (-1) are never equal."""
    bad_range = (flat < -1) | (flat >= capacity)
    kept = torch.where(flat >= 0, flat, -2 - torch.arange(flat.numel(), device=flat.device))
    ordered = kept.sort().values
    return bad_range, kept, [bad_range.any(), (ordered[1:] == ordered[:-1]).any()]


def _check_slot_values(slots, capacity, tokens):
    """append_kv_slots' values: every slot -1 or in [0, capacity), none twice, the tokens finite (a quantised
    cache's). The slots are read back once for as long as the same tensor comes back unchanged (every layer of a
    step passes the same one: read_once), the tokens once per call; the details only on failure."""
    flat = slots.long()
    slots_ok = read_once((slots,), ("append_kv_slots", capacity),
                         lambda: not bool(torch.stack(_slot_flags(flat, capacity)[2]).any()))
    bad = [False, False]
    if not slots_ok:
        bad_range, kept, flags = _slot_flags(flat, capacity)
        bad = torch.stack(flags).tolist()
    bad += torch.stack([~torch.isfinite(t).all() for t in tokens]).tolist() if tokens else []
    if bad[0]:
        i = int(bad_range.nonzero()[0])
        fail("slot_mapping", f"slots in [0, {capacity}) (num_pages · page_size), or -1 to skip a token",
             f"{int(flat[i])} for token {i}")
    if bad[1]:
        ordered, order = kept.sort(stable=True)
        first = int((ordered[1:] == ordered[:-1]).nonzero()[0])
        a, b = int(order[first]), int(order[first + 1])
        fail("slot_mapping", "a slot of its own for every token (or -1)", f"tokens {a} and {b} both to slot "
             f"{int(flat[a])}")
    for name, is_bad in zip(("k", "v"), bad[2:]):
        if is_bad:
            fail(name, "finite values (a NaN or inf has no place in a quantised cache)", "NaN or inf")


# ------------------------------------------------------------------------------------------ checks
def _append_scales(kv_format, k_cache, k_scale, v_scale):
    """The scales the cache writers take: one-element fp32 tensors for fp8 (None: 1.0) and nvfp4 (required), None
    for the other formats (a given scale is refused)."""
    scales = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if kv_format in ("fp8", "nvfp4"):
            scales.append(_scale_tensor(name, scale if scale is not None else (1.0 if kv_format == "fp8" else None),
                                        "k_cache", k_cache, None, k_cache.shape[2], per_page_ok=False))
        elif scale is not None:
            fail(name, f"None for kv_format {kv_format!r}", type(scale).__name__)
        else:
            scales.append(None)
    return scales


def _check_writable(k_cache, v_cache, op):
    """Caches a writer may fill in place: each element its own memory, K apart from V (an FP4 pair: each of its
    four tensors apart from the others), no grad required."""
    if _is_pair(k_cache):
        named = _named_parts("k_cache", k_cache) + _named_parts("v_cache", v_cache)
        for (kn, kp), (vn, vp) in zip(named[:2], named[2:]):
            _check_writable_pair(kn, kp, vn, vp, op)
        for i, (an, a) in enumerate(named):
            for bn, b in named[i + 1:]:
                if a.shape != b.shape and _overlaps(a, b):
                    fail(bn, f"a tensor apart from {an} ({op} writes both)", f"memory shared with {an}")
        return
    _check_writable_pair("k_cache", k_cache, "v_cache", v_cache, op)


def _check_writable_pair(k_name, k_cache, v_name, v_cache, op):
    for name, cache in ((k_name, k_cache), (v_name, v_cache)):
        # an expanded cache (stride 0) has one slot under many indices: a write to one page would show in all
        # (metadata only, but not traceable: unchecked while torch.compile traces, like _overlaps)
        if not torch.compiler.is_compiling() and torch._debug_has_internal_overlap(cache) == 1:
            fail(name, f"a cache whose elements are each their own memory ({op} writes it in place)",
                 f"an expanded or self-overlapping view, strides {cache.stride()}")
    if _overlaps(k_cache, v_cache):
        fail(v_name, f"a tensor apart from {k_name} (the V write would overwrite the K tokens)",
             f"memory shared with {k_name}")
    for name, cache in ((k_name, k_cache), (v_name, v_cache)):
        # autograd refuses the in-place write on a leaf (a raw RuntimeError), and a cache in a graph is of no use
        # to the forward-only decode
        if torch.is_grad_enabled() and cache.requires_grad:
            fail(name, f"a cache that does not require grad ({op} writes it in place; call it under "
                 "torch.no_grad() or pass cache.detach(), which shares its memory)", "requires_grad=True")


def _is_pair(cache) -> bool:
    """An FP4 cache given as (values, block scales) (kv_format.py)."""
    return isinstance(cache, (tuple, list))


def _values(cache):
    """The tensor that carries a cache's [num_pages, page_size, h_kv, ·] shape: the cache, or a pair's values."""
    return cache[0] if _is_pair(cache) and len(cache) else cache


def _op_parts(cache):
    """(cache tensor, block scales or None): what the ops take."""
    return (cache[0], cache[1]) if _is_pair(cache) else (cache, None)


def _named_parts(name, cache):
    """[(name, tensor)] of a cache argument: itself, or a pair's values and block scales."""
    if not _is_pair(cache):
        return [(name, cache)]
    if len(cache) != 2:
        fail(name, "a tensor, or for nvfp4 / mxfp4 the pair (values, block scales)",
             f"a {type(cache).__name__} of {len(cache)}")
    return [(f"{name}[0]", cache[0]), (f"{name}[1]", cache[1])]


def _part_widths(name, cache, fmt, d):
    """[(name, tensor, last dim)] a cache argument must have in format fmt at head dim d: one tensor of
    fmt.width(d), or for an FP4 pair the values (d / 2) and the block scales (d / block)."""
    parts = _named_parts(name, cache)
    if len(parts) == 1:
        return [(name, cache, fmt.width(d))]
    if not fmt.fp4:
        fail(name, f"a tensor for kv_format {fmt.name!r} (a pair (values, block scales) only for nvfp4 / mxfp4)",
             f"a {type(cache).__name__}")
    return [parts[0] + (d // 2,), parts[1] + (fmt.scale_width(d),)]


def _check_cache(name, cache, kv_format, dtype, d, ref_name, ref):
    """A [num_pages, page_size, h_kv, width] cache (FP4: or the pair (values [.., d/2], block scales [.., d/block]))
    for values of `dtype` (ref's) and head dim d; returns its format's name (kv_format, or the one the cache's dtype
    implies)."""
    lead_name, lead = _named_parts(name, cache)[0]
    check_tensor(lead_name, lead)
    if kv_format is None:
        kv_format = BY_DTYPE.get(lead.dtype)
        if kv_format is None and lead.dtype == torch.uint8:
            fail("kv_format", "given for a uint8 cache (\"nvfp4\" or \"mxfp4\")", None)
        if kv_format is None:
            fail(lead_name, "dtype in (bfloat16, float16, float32, float8_e4m3fn), or uint8 with kv_format "
                 "\"nvfp4\" or \"mxfp4\"", str(lead.dtype).replace("torch.", ""))
    check_choice("kv_format", kv_format, KV_FORMATS)
    fmt = KV_FORMATS[kv_format]
    _check_fp4_head_dim(kv_format, d)
    for part_name, part, width in _part_widths(name, cache, fmt, d):
        check_tensor(part_name, part)
        check_same_device(part_name, part, ref_name, ref)
        check_rank(part_name, part, 4)
        # the cache against its format first, then an unquantised format against the values' dtype: either
        # mismatch names what is wrong (an fp32 cache under kv_format 'fp16' is not "q's dtype")
        if part.dtype != fmt.storage:
            fail(part_name, f"dtype {_short(fmt.storage)} for kv_format {kv_format!r}", _short(part.dtype))
        if not fmt.quantized and fmt.storage != dtype:
            fail(part_name, f"dtype {_short(dtype)} ({ref_name}'s: an unquantised cache holds {ref_name}'s dtype; "
                 f"kv_format {kv_format!r} is {_short(fmt.storage)})", _short(part.dtype))
        if part.shape[1] not in PAGE_SIZES:
            fail(part_name, f"page size in {PAGE_SIZES}", part.shape[1])
        if part.shape[:3] != lead.shape[:3]:
            fail(part_name, f"{lead_name}'s [num_pages, page_size, h_kv] {tuple(lead.shape[:3])}",
                 tuple(part.shape[:3]))
        if part.shape[3] != width:
            fail(part_name, f"{width} entries per token and head for {kv_format} at head dim {d}", part.shape[3])
        check_last_dim_contiguous(part_name, part)
    return kv_format


def _check_like_k_cache(v_cache, k_cache):
    """v_cache: k_cache's form (tensor or pair), shapes, dtypes and device (k_cache checked by _check_cache)."""
    if _is_pair(v_cache) != _is_pair(k_cache):
        fail("v_cache", "a pair (values, block scales) like k_cache" if _is_pair(k_cache) else "a tensor like "
             "k_cache", type(v_cache).__name__)
    for (kn, kp), (vn, vp) in zip(_named_parts("k_cache", k_cache), _named_parts("v_cache", v_cache)):
        check_tensor(vn, vp)
        check_same_device(vn, vp, kn, kp)
        if vp.shape != kp.shape or vp.dtype != kp.dtype:
            fail(vn, f"{kn}'s shape and dtype {tuple(kp.shape)} {kp.dtype}", f"{tuple(vp.shape)} {vp.dtype}")
        check_last_dim_contiguous(vn, vp)


_HEAD_DIMS_SAY = "a multiple of 8 from 8 to 256"


def _check_fp4_head_dim(kv_format, d):
    """FP4 rows hold whole blocks of 16 (nvfp4) or 32 (mxfp4) elements, each under one scale byte."""
    fmt = KV_FORMATS[kv_format]
    if fmt.fp4 and d % fmt.group:
        fail("kv_format", f"a format that holds head dim {d} ({kv_format} stores blocks of {fmt.group} elements: "
             f"head dims {fmt.group}, {2 * fmt.group}, ... 256; bf16 / fp16 / fp8 take any multiple of 8)",
             repr(kv_format))


def _short(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_tokens(name, x, max_tokens):
    """q or new K/V tokens: [b, s, heads, d], float, d in HEAD_DIMS, s from 1 to max_tokens."""
    check_tensor(name, x)
    check_rank(name, x, 4)
    check_dtype(name, x, FLOATS)
    if x.shape[3] not in HEAD_DIMS:
        fail(name, f"head dim {_HEAD_DIMS_SAY}", x.shape[3])
    if not 1 <= x.shape[1] <= max_tokens:
        fail(name, f"from 1 to {max_tokens} tokens per request", x.shape[1])
    check_last_dim_contiguous(name, x)


def _check_shapes(q, k_cache, block_table, kv_format):
    """What plan() reads: shapes, dtypes, the format. Returns the format's name."""
    _check_tokens("q", q, MAX_S_Q)
    kv_format = _check_cache("k_cache", k_cache, kv_format, q.dtype, q.shape[3], "q", q)
    h_q, h_kv = q.shape[2], _values(k_cache).shape[2]
    if h_kv < 1 or h_q % h_kv:
        fail("k_cache", f"a number of kv heads dividing q's {h_q}", h_kv)
    _check_int32("block_table", block_table, "q", q, 2)
    return kv_format


def _check_step(p: PagedPlan, q, k_cache, v_cache, block_table, cache_seqlens, k_scale, v_scale):
    """What run() is given: the plan's shapes, and (unless capturing) values in range. Returns the scales as the
    kernel takes them (fp32 tensors, or None)."""
    check_tensor("q", q)
    check_no_grad("q", q, "paged_decode")
    if tuple(q.shape) != (p.batch, p.s_q, p.h_q, p.head_dim) or q.dtype != p.dtype:
        fail("q", f"[{p.batch}, {p.s_q}, {p.h_q}, {p.head_dim}] {p.dtype} (the plan's)", f"{tuple(q.shape)} {q.dtype}")
    check_last_dim_contiguous("q", q)
    fmt = KV_FORMATS[p.kv_format]
    num_pages = None
    for side, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        for name, part, width in _part_widths(side, cache, fmt, p.head_dim):
            check_tensor(name, part)
            check_same_device(name, part, "q", q)
            check_no_grad(name, part, "paged_decode")
            if part.dim() != 4 or tuple(part.shape[1:]) != (p.page_size, p.h_kv, width) or \
                    part.dtype != (fmt.storage if fmt.quantized else q.dtype):
                fail(name, f"a [num_pages, {p.page_size}, {p.h_kv}, {width}] {p.kv_format} cache (the plan's)",
                     f"{tuple(part.shape)} {part.dtype}")
            check_last_dim_contiguous(name, part)
            if num_pages is None:
                num_pages = part.shape[0]
            elif part.shape[0] != num_pages:
                fail(name, f"{num_pages} pages (like k_cache)", part.shape[0])
    _check_int32("block_table", block_table, "q", q, 2)
    if block_table.shape[1] != p.max_pages:
        fail("block_table", f"{p.max_pages} pages per request (the plan's)", block_table.shape[1])
    _check_int32("cache_seqlens", cache_seqlens, "q", q, 1)
    scales = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if p.kv_format == "fp8":
            scales.append(_scale_tensor(name, 1.0 if scale is None else scale, "q", q, num_pages, p.h_kv, True))
        elif p.kv_format == "nvfp4":
            if scale is None:
                fail(name, "nvfp4's one-element fp32 tensor scale (from quantize_kv)", None)
            scales.append(_scale_tensor(name, scale, "q", q, None, p.h_kv, False))
        elif scale is not None:
            fail(name, f"None for kv_format {p.kv_format!r}", type(scale).__name__)
        else:
            scales.append(None)
        if scales[-1] is not None:
            check_no_grad(name, scales[-1], "paged_decode")
    if host_reads_allowed(q):
        _check_table_values(num_pages, p.page_size, block_table, cache_seqlens, p.s_q)
    return scales[0], scales[1]


def _scale_tensor(name, scale, ref_name, ref, num_pages, h_kv, per_page_ok):
    """A scale as the kernel takes it: an fp32 tensor of one element, or [num_pages, h_kv] when per_page_ok;
    floats become one-element tensors. Finite and > 0 (read on the host once per tensor value, not under capture)."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        check_positive_float(name, float(scale), allow_none=False)
        return torch.full((1,), float(scale), dtype=torch.float32, device=ref.device)
    check_tensor(name, scale)
    check_same_device(name, scale, ref_name, ref)
    check_dtype(name, scale, (torch.float32,))
    if scale.numel() != 1 and not (per_page_ok and scale.dim() == 2 and scale.shape[1] == h_kv and
                                   (num_pages is None or scale.shape[0] == num_pages)):
        fail(name, "a float, a one-element fp32 tensor" + (f", or fp32 [num_pages, {h_kv}] (per page and head)"
                                                          if per_page_ok else ""), tuple(scale.shape))
    # the range a float scale is held to (check_positive_float): 3e38 would make every dequantised value inf
    if host_reads_allowed(scale) and not read_once(
            (scale,), ("scale",), lambda: bool(((scale >= FP32_TINY) & (scale <= SCALE_MAX)).all())):
        fail(name, f"finite scales > 0 from {FP32_TINY:.2g} to {SCALE_MAX:g}",
             "a NaN, inf, zero, negative or out-of-range scale")
    return scale


def _overlaps(a, b) -> bool:
    """Whether a and b (one dtype; one shape but maybe for the last dim) have an element at the same address. Views of
    one buffer that interleave without overlapping (k = kv[:, 0], v = kv[:, 1] of a [pages, 2, page, h_kv, width]
    buffer, or an FP4 pair's values and scales as row[..., :d/2] and row[..., d/2:]) do not: with equal strides, a
    bounded search for index differences whose strides add up to the offset between them (a last dim of stride 1 as
    a window, so its extents may differ); with different strides or leading shapes over shared bytes, True.
    Metadata only (no device read); meta tensors and a torch.compile trace (no addresses) are not checked."""
    if a.numel() == 0 or b.numel() == 0 or a.device.type == "meta" or torch.compiler.is_compiling():
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    delta = b.storage_offset() - a.storage_offset()
    span_a, span_b = (sum((n - 1) * st for st, n in zip(t.stride(), t.shape)) for t in (a, b))
    if not -span_b <= delta <= span_a:  # apart in memory
        return False
    tail = a.stride()[-1:] == (1,)   # the last dim: a window of element differences, each tensor its own extent
    if a.stride() != b.stride() or a.shape[:-1] != b.shape[:-1] or (not tail and a.shape != b.shape):
        return True
    ta, tb = (a.shape[-1], b.shape[-1]) if tail else (1, 1)
    lead = list(zip(a.stride(), a.shape))[:-1] if tail else list(zip(a.stride(), a.shape))
    dims = sorted(((st, n) for st, n in lead if n > 1 and st > 0), reverse=True)
    reach = [0] * (len(dims) + 1)  # reach[i]: the largest offset dims i.. can span
    for i in range(len(dims) - 1, -1, -1):
        reach[i] = reach[i + 1] + (dims[i][1] - 1) * dims[i][0]
    budget = [4096]  # nested strides leave at most 3 candidates a dim; stranger ones give up as overlapping

    def hits(rest, i):  # rest: what dims i.. and the window (a's element j minus b's j') must make up
        if i == len(dims):
            return 1 - tb <= rest <= ta - 1
        budget[0] -= 1
        if budget[0] < 0:
            return True
        st, n = dims[i]
        lo = max(1 - n, -((reach[i + 1] + ta - 1 - rest) // st))
        hi = min(n - 1, (rest + reach[i + 1] + tb - 1) // st)
        return any(hits(rest - d * st, i + 1) for d in range(lo, hi + 1))
    return hits(delta, 0)


def _check_int32(name, t, ref_name, ref, rank):
    """An int32 tensor of this rank on ref's device, one row per request of ref (q or k_new: [b, ...])."""
    check_tensor(name, t)
    check_same_device(name, t, ref_name, ref)
    check_rank(name, t, rank)
    check_dtype(name, t, (torch.int32,))
    if t.shape[0] != ref.shape[0]:
        fail(name, f"leading dim {ref.shape[0]} ({ref_name}'s batch)", tuple(t.shape))
    check_last_dim_contiguous(name, t)


def _check_table_values(num_pages, page, block_table, cache_seqlens, s_q):
    """Every request's length within its pages and at least s_q; every page it uses in [0, num_pages): one device
    reduction and one read-back, the details only on failure."""
    capacity = block_table.shape[1] * page
    lens = cache_seqlens.long()
    used = torch.arange(block_table.shape[1], device=lens.device)[None, :] < ((lens + page - 1) // page)[:, None]
    bad_pages = used & ((block_table < 0) | (block_table >= num_pages))
    if not bool(((lens < s_q) | (lens > capacity)).any() | bad_pages.any()):
        return
    lens = lens.cpu()
    if bool((lens < s_q).any()):
        fail("cache_seqlens", f"values >= s_q ({s_q}: the new tokens are in the cache)", lens.tolist()[:8])
    if bool((lens > capacity).any()):
        fail("cache_seqlens", f"values <= {capacity} (block_table pages x page_size)", int(lens.max()))
    i, j = (int(x) for x in bad_pages.nonzero()[0])
    fail("block_table", f"page indices in [0, {num_pages})", f"{int(block_table[i, j])} at [{i}, {j}]")


def _check_append_values(cache_seqlens, entries, targets, num_pages, capacity, s_new, tokens):
    """append_kv's values: room for the s_new tokens in every request's pages, the block-table entries they go
    through (entries [b, s_new]) in [0, num_pages), a slot of its own for every new token (targets [b, s_new]:
    page · page_size + slot; a sort of b · s_new ids), and the tokens (k_new, v_new of a quantised cache: a NaN
    would poison its block scales) finite. One device reduction and one read-back, the details only on failure."""
    lens = cache_seqlens.long()
    bad_lens = (lens < 0) | (lens + s_new > capacity)
    bad_pages = (entries < 0) | (entries >= num_pages)
    ordered = targets.reshape(-1).sort().values
    flags = [bad_lens.any(), bad_pages.any(), (ordered[1:] == ordered[:-1]).any()] + \
        [~torch.isfinite(t).all() for t in tokens]
    bad = torch.stack(flags).tolist()
    if bad[0]:
        fail("cache_seqlens", f"values from 0 to {capacity - s_new} (room for {s_new} new tokens in the "
             f"{capacity} slots of the table's pages)", cache_seqlens.tolist()[:8])
    if bad[1]:
        i, j = (int(x) for x in bad_pages.nonzero()[0])
        fail("block_table", f"page indices in [0, {num_pages}) where the new tokens go",
             f"{int(entries[i, j])} for request {i}'s token {int(lens[i]) + j}")
    if bad[2]:
        flat = targets.reshape(-1)
        ordered, order = flat.sort(stable=True)
        first = int((ordered[1:] == ordered[:-1]).nonzero()[0])
        (r0, t0), (r1, t1) = (divmod(int(order[n]), s_new) for n in (first, first + 1))
        fail("block_table", "a page slot of its own for every new token (two requests may share pages they read, "
             "not the slots they write)", f"request {r0}'s token {int(lens[r0]) + t0} and request {r1}'s token "
             f"{int(lens[r1]) + t1} both written to page {int(entries[r0, t0])}")
    for name, is_bad in zip(("k_new", "v_new"), bad[3:]):
        if is_bad:
            fail(name, "finite values (a NaN or inf has no place in a quantised cache)", "NaN or inf")
