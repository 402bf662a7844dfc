"""MLA decode: `mla_decode` (FlashMLA's call on warpforge kernels) and `quantize_kv`.

validate -> pick backend -> (reference | torch.library custom op over the Triton split-KV kernels)
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ...errors import (check_choice, check_dtype, check_last_dim_contiguous, check_rank, check_same_device,
                       check_tensor, fail)
from ...runtime import arch_key, eager_or_op, resolve_backend, sm_count
from .reference import (D_QK, D_V, ROW_BYTES, dequantize_kv_reference, mla_decode_reference,
                        nvfp4_tensor_scale, quantize_kv_reference)

__all__ = ["mla_decode", "quantize_kv", "nvfp4_tensor_scale", "mla_decode_reference", "dequantize_kv_reference",
           "KV_FORMATS", "planned_num_splits", "flash_mla_with_kvcache", "get_mla_metadata", "MLASchedule"]

KV_FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
H_Q = (16, 32, 64, 128)
QUANTIZE_ROWS = 1 << 16
PAGE_SIZES = (16, 32, 64)

# decode_kernel.MLACfg (BLOCK_H query rows, BLOCK_N tokens, warps, stages[, fp16_math, prefetch]) per arch, for
# few (<= 16) and many query rows (h_q * s_q); "few-<format>" / "many-<format>" override them for one cache
# format. sm90 from scripts/tune_mla.py on an H200 (benchmarks/NOTES.md): FP8 at h_q 16 is fastest with fp16
# math, 32-token steps and the next step's bytes prefetched into registers (0.50 ms vs 0.62 without, 0.72 with
# neither, at b128 L8k), FP4 with 32-token steps (0.87 vs 1.00 ms). (An fp8-dot
# variant, e4m3 q and P, was slower everywhere and missed FP8's cosine bar: removed; NOTES.md has its numbers.)
CONFIGS = {
    "cpu": {"few": (16, 16, 1, 1), "many": (16, 16, 1, 1)},
    "default": {"few": (16, 32, 4, 2), "many": (64, 32, 8, 2)},
    "sm90": {"few": (16, 64, 4, 2), "many": (64, 64, 8, 2), "few-fp8": (16, 32, 4, 3, True, True),
             "few-nvfp4": (16, 32, 4, 2), "few-mxfp4": (16, 32, 4, 2)},
}


def _config(device: torch.device, rows: int, kv_format: str = "bf16"):
    table = CONFIGS.get(arch_key(device), CONFIGS["default"])
    size = "few" if rows <= 16 else "many"
    return table.get(f"{size}-{kv_format}", table[size])


def _mla_decode_impl(q: torch.Tensor, kv_cache: torch.Tensor, block_table: Optional[torch.Tensor],
                     cache_seqlens: Optional[torch.Tensor], kv_scale: Optional[torch.Tensor], scale: float,
                     causal: bool, kv_format: str, num_splits: int, indices: Optional[torch.Tensor] = None,
                     topk_length: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    from .decode_kernel import mla_decode_fwd

    cfg = _config(q.device, q.shape[1] * q.shape[2], kv_format)
    return mla_decode_fwd(q, kv_cache, block_table, cache_seqlens, scale, causal, kv_format, kv_scale, num_splits,
                          cfg, indices, topk_length)


_mla_decode_op = torch.library.custom_op("warpforge::mla_decode", _mla_decode_impl, mutates_args=())


@_mla_decode_op.register_fake
def _(q, kv_cache, block_table, cache_seqlens, kv_scale, scale, causal, kv_format, num_splits, indices=None,
      topk_length=None):
    b, s_q, h_q, _ = q.shape
    return q.new_empty((b, s_q, h_q, D_V)), q.new_empty((b, h_q, s_q), dtype=torch.float32)


_mla_decode_call = eager_or_op(_mla_decode_op, _mla_decode_impl)  # the custom op under torch.compile only


def quantize_kv(latent: torch.Tensor, kv_format: str, kv_scale=None) -> torch.Tensor:
    """latent [..., 576] -> cache rows in `kv_format`: "bf16" unchanged; "fp8" / "nvfp4" / "mxfp4" uint8
    [..., 656 / 416 / 400] (layouts in reference.py). "nvfp4" takes the cache-wide fp32 kv_scale, fixed for
    the cache's life (e.g. nvfp4_tensor_scale of calibration data); pass the same to mla_decode."""
    check_tensor("latent", latent)
    check_choice("kv_format", kv_format, KV_FORMATS)
    if latent.shape[-1] != D_QK:
        fail("latent", f"last dim {D_QK}", tuple(latent.shape))
    if kv_format == "nvfp4" and kv_scale is None:
        fail("kv_scale", "the cache-wide fp32 scale for nvfp4 (see nvfp4_tensor_scale)", None)
    if kv_format == "bf16":
        return latent
    # in slices of rows: the reference quantiser's fp32 temporaries are ~10x the slice (a 10 GB cache at once
    # ran an H200 out of memory)
    rows = latent.reshape(-1, D_QK)
    out = torch.empty(rows.shape[0], ROW_BYTES[kv_format], dtype=torch.uint8, device=latent.device)
    for i in range(0, rows.shape[0], QUANTIZE_ROWS):
        out[i:i + QUANTIZE_ROWS] = quantize_kv_reference(rows[i:i + QUANTIZE_ROWS], kv_format, kv_scale)
    return out.reshape(*latent.shape[:-1], ROW_BYTES[kv_format])


def _validate(q, kv_cache, block_table, cache_seqlens, head_dim_v, kv_format, kv_scale, causal, indices,
              topk_length, backend):
    sparse = indices is not None
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        check_tensor(name, t)
        check_same_device(name, t, "q", q)
    check_rank("q", q, 4)
    check_dtype("q", q, (torch.bfloat16, torch.float16) + ((torch.float32,) if backend == "reference" else ()))
    b, s_q, h_q, d = q.shape
    if d != D_QK:
        fail("q", f"head dim {D_QK} (512 latent + 64 rope)", d)
    if head_dim_v != D_V:
        fail("head_dim_v", f"{D_V}", head_dim_v)
    if h_q not in H_Q:
        fail("q", f"h_q in {H_Q}", h_q)
    if not 1 <= s_q <= 4:
        fail("q", "s_q from 1 to 4", s_q)
    check_last_dim_contiguous("q", q)
    check_choice("kv_format", kv_format, KV_FORMATS)
    check_rank("kv_cache", kv_cache, 4)
    if kv_cache.shape[2] != 1:
        fail("kv_cache", "one latent head: [num_pages, page_size, 1, width]", tuple(kv_cache.shape))
    if kv_cache.shape[1] not in PAGE_SIZES:
        fail("kv_cache", f"page size in {PAGE_SIZES}", kv_cache.shape[1])
    width = D_QK if kv_format == "bf16" else ROW_BYTES[kv_format]
    if kv_format == "bf16":
        check_dtype("kv_cache", kv_cache, (q.dtype,))
    else:
        check_dtype("kv_cache", kv_cache, (torch.uint8,))
    if kv_cache.shape[3] != width:
        fail("kv_cache", f"{width} {'values' if kv_format == 'bf16' else 'bytes'} per token for {kv_format}",
             kv_cache.shape[3])
    if kv_format == "nvfp4":
        if not isinstance(kv_scale, torch.Tensor) or kv_scale.numel() != 1 or kv_scale.dtype != torch.float32:
            fail("kv_scale", "a one-element fp32 tensor (nvfp4's cache-wide scale)", kv_scale)
        check_same_device("kv_scale", kv_scale, "q", q)
    if not kv_cache.is_contiguous():
        fail("kv_cache", "a contiguous tensor", f"strides {kv_cache.stride()}")
    if not isinstance(causal, bool):
        fail("causal", "a bool", type(causal).__name__)
    if sparse:
        _validate_indices(q, kv_cache, indices, topk_length, causal)
    else:
        _validate_table(q, kv_cache, block_table, cache_seqlens)


def _capturing(q) -> bool:
    """Values are read on the host, so those checks are skipped while a CUDA graph is being captured or
    torch.compile is tracing (shapes and dtypes are still checked)."""
    if torch.compiler.is_compiling():
        return True
    return q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_int32(name, t, q, rank, lead):
    """An int32 tensor on q's device of the given rank whose leading dims are `lead` (batch first)."""
    check_tensor(name, t)
    check_same_device(name, t, "q", q)
    check_rank(name, t, rank)
    check_dtype(name, t, (torch.int32,))
    if tuple(t.shape[:len(lead)]) != tuple(lead):
        fail(name, f"leading dims {tuple(lead)} (batch{', s_q' if len(lead) > 1 else ''} of q)", tuple(t.shape))
    check_last_dim_contiguous(name, t)


def _validate_table(q, kv_cache, block_table, cache_seqlens):
    b = q.shape[0]
    _check_int32("block_table", block_table, q, 2, (b,))
    _check_int32("cache_seqlens", cache_seqlens, q, 1, (b,))
    if _capturing(q):
        return
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


def _validate_indices(q, kv_cache, indices, topk_length, causal):
    b, s_q = q.shape[:2]
    _check_int32("indices", indices, q, 3, (b, s_q))
    if indices.shape[2] < 1:
        fail("indices", f"[{b}, {s_q}, topk >= 1]", tuple(indices.shape))
    if causal:
        fail("causal", "False with indices (the index list already says what each query sees)", causal)
    if topk_length is not None:
        _check_int32("topk_length", topk_length, q, 1, (b,))
    if _capturing(q):
        return
    slots = kv_cache.shape[0] * kv_cache.shape[1]
    bad_idx = ((indices < -1) | (indices >= slots)).any()  # one read-back for both checks, as above
    bad_len = ((topk_length < 0) | (topk_length > indices.shape[2])).any() if topk_length is not None else bad_idx
    if not bool(bad_idx | bad_len):
        return
    if bool(bad_idx):
        fail("indices", f"slots in [-1, {slots})", f"min {int(indices.min())}, max {int(indices.max())}")
    fail("topk_length", f"values in [0, {indices.shape[2]}]", topk_length.tolist()[:8])


def planned_num_splits(q, kv_cache, block_table, indices=None, kv_format="bf16") -> int:
    """The KV split count `mla_decode` plans when schedule=None: from shapes only (CUDA-graph safe)."""
    from .decode_kernel import plan_num_splits
    b, s_q, h_q, _ = q.shape
    if indices is not None:  # programs own one query position's heads
        cfg = _config(q.device, h_q, kv_format)
        return plan_num_splits(b * s_q, h_q, indices.shape[2], cfg[0], sm_count(q.device))
    cfg = _config(q.device, s_q * h_q, kv_format)
    return plan_num_splits(b, s_q * h_q, block_table.shape[1] * kv_cache.shape[1], cfg[0], sm_count(q.device))


def mla_decode(q, kv_cache, block_table, cache_seqlens, *, head_dim_v=D_V, softmax_scale=None, causal=False,
               kv_format="bf16", kv_scale=None, indices=None, topk_length=None, schedule=None, backend=None):
    """Absorbed-MLA decode over a paged latent cache. Returns (out [b, s_q, h_q, 512] like q, lse [b, h_q, s_q]
    fp32, natural log).

    q [b, s_q, h_q, 576]; kv_cache [num_pages, page_size, 1, width]: bf16 in q's dtype (width 576), or uint8
    rows of "fp8" (656), "nvfp4" (416; kv_scale: its one-element fp32 tensor scale) or "mxfp4" (400), made by
    `quantize_kv`; block_table int32 [b, max_pages]; cache_seqlens int32 [b]. schedule: None (planned from
    shapes) or an int number of KV splits.

    Sparse (top-k) variant: indices int32 [b, s_q, topk] of absolute cache slots (page * page_size + offset,
    -1 skipped) replace the block table walk (block_table / cache_seqlens may then be None); topk_length
    int32 [b] optionally limits each request's list.
    """
    if isinstance(q, torch.Tensor):
        backend = resolve_backend(backend, q.device)
    _validate(q, kv_cache, block_table, cache_seqlens, head_dim_v, kv_format, kv_scale, causal, indices,
              topk_length, backend)
    kv_scale = kv_scale if kv_format == "nvfp4" else None
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(D_QK)
    if backend == "reference":
        return mla_decode_reference(q, kv_cache, block_table, cache_seqlens, softmax_scale=scale, causal=causal,
                                    kv_format=kv_format, kv_scale=kv_scale, indices=indices, topk_length=topk_length)
    if schedule is None:
        schedule = planned_num_splits(q, kv_cache, block_table, indices, kv_format)
    if not isinstance(schedule, int) or schedule < 1:
        fail("schedule", "None or a positive int (number of KV splits)", schedule)
    return _mla_decode_call(q, kv_cache, block_table, cache_seqlens, kv_scale, scale, causal, kv_format,
                            schedule, indices, topk_length)


from .flash_mla_compat import MLASchedule, flash_mla_with_kvcache, get_mla_metadata  # noqa: E402
