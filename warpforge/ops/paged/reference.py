"""Paged GQA decode in plain PyTorch: what `paged_decode` computes, and the cache formats' quantise / dequantise.

Conventions (FlashAttention's flash_attn_with_kvcache, vLLM's and FlashInfer's cache layout):
- q [b, s_q, h_q, d]: the s_q newest tokens of each request (1 for plain decode, more for speculative
  verification); k_cache / v_cache [num_pages, page_size, h_kv, width]; query head i reads kv head
  i // (h_q / h_kv). Token t of request b is row t % page_size of page block_table[b, t // page_size].
- cache_seqlens[b] counts the tokens in the cache including the s_q new ones (append them first, `append_kv`).
  Query j sits at position p = cache_seqlens[b] - s_q + j and sees tokens t <= p (causal within the new tokens),
  and with window w only t >= p - w.
- scores = q · kᵀ · scale, with softcap c then c · tanh(scores / c); a query that sees no token gets output 0 and
  lse -inf; lse [b, h_q, s_q] is natural-log.
"""
from __future__ import annotations

import math

import torch

from ... import quant
from ...errors import host_reads_allowed
from .kv_format import KV_FORMATS, split_fp4


def fp8_scales(x: torch.Tensor, per_page: bool) -> torch.Tensor:
    """e4m3 scales of values x [num_pages, page_size, h_kv, d]: amax / 448 per page and head ([num_pages, h_kv])
    or over the whole tensor (one element)."""
    if x.numel() == 0:  # no pages (nothing to reduce): the scale of zeros
        amax = x.new_zeros((x.shape[0], x.shape[2]) if per_page else (1,), dtype=torch.float32)
    else:
        amax = x.float().abs().amax(dim=(1, 3)) if per_page else x.float().abs().amax().reshape(1)
    return (amax / quant.E4M3_MAX).clamp(min=1e-12)


def _scale_view(scale, x: torch.Tensor, lead_dims: int) -> torch.Tensor:
    """A scale broadcastable over x [..., h_kv, d]: a one-element scale, or [num_pages, h_kv] against pages."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if scale.numel() == 1:
        return scale.reshape(())
    return scale.reshape(scale.shape[0], *([1] * (lead_dims - 1)), scale.shape[1], 1)


def quantize_kv_reference(x: torch.Tensor, kv_format: str, scale=None, split_scales: bool = False):
    """Values x [..., h_kv, d] -> cache entries of kv_format. fp8: x / scale in e4m3 (scale one element, or
    [num_pages, h_kv] when x is [num_pages, page_size, h_kv, d]); nvfp4: packed e2m1 + e4m3 block scales under
    the fp32 tensor scale; mxfp4: packed e2m1 + e8m0 block scales (split_scales: the pair (values, block scales),
    else one row each); values formats: x in that dtype."""
    fmt = KV_FORMATS[kv_format]
    if not fmt.quantized:
        return x.to(fmt.storage)
    if kv_format == "fp8":
        scaled = x.float() / _scale_view(scale, x, x.dim() - 2)
        return scaled.clamp(-quant.E4M3_MAX, quant.E4M3_MAX).to(torch.float8_e4m3fn)
    packed, scale_bytes = quant.quantize_fp4(x, kv_format, scale)
    return (packed, scale_bytes) if split_scales else torch.cat([packed, scale_bytes], -1)


def dequantize_kv_reference(cache, kv_format: str, scale=None) -> torch.Tensor:
    """Cache entries [num_pages, page_size, h_kv, width] of kv_format (FP4: or the pair (values, block scales)) ->
    fp32 values [..., d]."""
    fmt = KV_FORMATS[kv_format]
    if kv_format == "fp8":
        return cache.float() * _scale_view(scale if scale is not None else 1.0, cache, cache.dim() - 2)
    if not fmt.fp4:
        return cache.float()
    if isinstance(cache, (tuple, list)):
        return quant.dequantize_fp4(cache[0], cache[1], kv_format, scale)
    values, scales = split_fp4(cache, fmt.head_dim(cache.shape[-1]))
    return quant.dequantize_fp4(values, scales, kv_format, scale)


def paged_decode_reference(q, k_cache, v_cache, block_table, cache_seqlens, *, softmax_scale=None, kv_format=None,
                           k_scale=None, v_scale=None, softcap=None, window=None):
    """(out [b, s_q, h_q, d] in q's dtype, lse [b, h_q, s_q] fp32): one request at a time, in fp32.

    Lengths are clamped to the block table's tokens and page numbers into the cache, as the kernel does (the values
    go unchecked under capture). Tokens a query does not see are masked with torch.where, never multiplied by 0, so
    garbage (NaN) in them cannot reach its output. The lengths are read on the host only where that is allowed: on
    meta tensors, under torch.compile or a CUDA-graph capture every request spans the table's tokens, masked."""
    b, s_q, h_q, d = q.shape
    kv_format = kv_format or "bf16"
    num_pages, page_size, h_kv = (k_cache[0] if isinstance(k_cache, (tuple, list)) else k_cache).shape[:3]
    capacity = block_table.shape[1] * page_size if num_pages else 0
    if window is not None:
        window = min(window, capacity)  # a wider window hides nothing (and 2**70 overflows int64)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    keys = dequantize_kv_reference(k_cache, kv_format, k_scale)
    values = dequantize_kv_reference(v_cache, kv_format, v_scale)
    lengths = cache_seqlens.long().clamp(0, capacity)
    spans = lengths.tolist() if host_reads_allowed(cache_seqlens) else [capacity] * b  # tokens to gather per request
    out = torch.zeros(b, s_q, h_q, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h_q, s_q), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(b):
        t = torch.arange(spans[i], device=q.device)
        pages = block_table[i, t // page_size].long().clamp(0, max(num_pages - 1, 0))
        k = keys[pages, t % page_size].repeat_interleave(h_q // h_kv, dim=1)  # [span, h_q, d]
        v = values[pages, t % page_size].repeat_interleave(h_q // h_kv, dim=1)
        scores = torch.einsum("jhd,thd->hjt", q[i].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        pos = lengths[i] - s_q + torch.arange(s_q, device=q.device)
        seen = t[None, :] <= pos[:, None]  # [s_q, span]; pos < length, so only tokens in the cache
        if window is not None:
            seen &= t[None, :] >= pos[:, None] - window
        scores = torch.where(seen[None], scores, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [h_q, s_q]; -inf where a query sees nothing
        probs = torch.where(seen[None], torch.exp(scores - row_lse[..., None]), 0.0)
        seen_v = torch.where(seen[:, :, None, None], v[None], 0.0)  # [s_q, span, h_q, d]: each query's tokens only
        out[i] = torch.einsum("hjt,jthd->jhd", probs, seen_v)
        lse[i] = row_lse
    return out.to(q.dtype), lse


def append_kv_slots_reference(k_cache, v_cache, k, v, slot_mapping, kv_format, k_scale=None, v_scale=None) -> None:
    """append_kv_slots in PyTorch: token t of k / v [T, h_kv, d] quantised into slot slot_mapping[t] (page ·
    page_size + offset) of each cache (FP4: a tensor or the pair (values, block scales)), slots < 0 or past the
    cache skipped (a boolean selection: reads the mask back, so not for a CUDA-graph capture)."""
    pair = isinstance(k_cache, (tuple, list))
    num_pages, page = (k_cache[0] if pair else k_cache).shape[:2]
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < num_pages * page)
    slots = slots[keep]
    for cache, new, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        write_entries(cache, (slots // page, slots % page), quantize_kv_reference(new[keep], kv_format, scale, pair))


def write_entries(cache, index, entries) -> None:
    """cache[index] = entries, in the cache's dtype; an FP4 pair's values and block scales each from their own."""
    if isinstance(cache, (tuple, list)):
        for part, new in zip(cache, entries):
            part[index] = new.to(part.dtype)
    else:
        cache[index] = entries.to(cache.dtype)
