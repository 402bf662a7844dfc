"""Multi-head Latent Attention decode, absorbed form, in plain PyTorch: what `mla_decode` computes.

Every query head attends to one shared latent KV head of width 576 (512 latent + 64 rope); V is the first
512 columns. The cache is paged: token t of request b lives at row t % page_size of page
block_table[b, t // page_size]. With s_q > 1 and causal=True (multi-token prediction) query i of s_q sees
the first cache_seqlens[b] - s_q + 1 + i tokens (bottom-right aligned). A request with no visible token
gets output 0 and lse -inf.

Cache formats (one row per token): kv_format.py.
"""
from __future__ import annotations

import math

import torch

from ... import quant
from ...errors import check_dtype, check_tensor, fail, host_reads_allowed
from .kv_format import D_QK, D_V, KV_FORMATS



def nvfp4_tensor_scale(latent: torch.Tensor) -> torch.Tensor:
    """A cache-wide fp32 scale for NVFP4 over the latents' 512 quantized columns (see quant.nvfp4_tensor_scale),
    from calibration latents [..., 576]: at least one row, finite."""
    check_tensor("latent", latent)
    check_dtype("latent", latent, (torch.bfloat16, torch.float16, torch.float32))
    if latent.dim() == 0 or latent.shape[-1] != D_QK or latent.numel() == 0:
        fail("latent", f"calibration latents [..., {D_QK}] with at least one row", f"shape {tuple(latent.shape)}")
    if host_reads_allowed(latent) and not bool(torch.isfinite(latent).all()):
        fail("latent", "finite values", "NaN or inf")
    return quant.nvfp4_tensor_scale(latent[..., :D_V])


def _pack_rope(latent):
    return latent[..., D_V:].to(torch.bfloat16).contiguous().view(torch.uint8)


def quantize_kv_reference(latent: torch.Tensor, kv_format: str, kv_scale=None) -> torch.Tensor:
    """latent [..., 576] -> the cache rows of `kv_format` (uint8 for quantized formats). nvfp4 needs the
    cache-wide kv_scale (see nvfp4_tensor_scale)."""
    fmt = KV_FORMATS[kv_format]
    if not fmt.quantized:
        return latent
    lead = latent.shape[:-1]
    if kv_format == "fp8":
        codes, scale = quant.quantize_fp8_pow2(latent[..., :D_V], fmt.group)
        data = codes.view(torch.uint8)
        scale_bytes = scale.contiguous().view(torch.uint8).reshape(*lead, -1)
    else:
        data, scale_bytes = quant.quantize_fp4(latent[..., :D_V], kv_format, kv_scale)
    return torch.cat([data, scale_bytes, _pack_rope(latent)], -1)


def dequantize_kv_reference(cache: torch.Tensor, kv_format: str, kv_scale=None) -> torch.Tensor:
    """Cache rows of `kv_format` -> [..., 576] float32."""
    fmt = KV_FORMATS[kv_format]
    if not fmt.quantized:
        return cache.float()
    scale_bytes = cache[..., fmt.scale_offset:fmt.rope_offset].contiguous()
    if kv_format == "fp8":
        vals = cache[..., :D_V].contiguous().view(torch.float8_e4m3fn).float()
        nope = (vals.unflatten(-1, (D_V // fmt.group, fmt.group)) * scale_bytes.view(torch.float32)[..., None])
        nope = nope.flatten(-2)
    else:
        nope = quant.dequantize_fp4(cache[..., :fmt.scale_offset], scale_bytes, kv_format, kv_scale)
    rope = cache[..., fmt.rope_offset:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], -1)


def gather_tokens(kv_cache: torch.Tensor, block_table: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """The first `length` cache rows of request b, in order: [length, row]."""
    page_size = kv_cache.shape[1]
    t = torch.arange(length, device=kv_cache.device)
    pages = block_table[b, t // page_size].long()
    return kv_cache[pages, t % page_size, 0]


def mla_decode_reference(q, kv_cache, block_table, cache_seqlens, *, head_dim_v=D_V, softmax_scale=None,
                         causal=False, kv_format="bf16", kv_scale=None, indices=None, topk_length=None):
    """Returns (out [b, s_q, h_q, 512] in q's dtype, lse [b, h_q, s_q] fp32), computed in fp32.

    indices (sparse variant): int32 [b, s_q, topk] absolute token slots (page * page_size + offset), -1
    skipped; replaces the block table walk (causal does not apply). topk_length [b] limits each row's list.
    """
    b, s_q, h_q, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if not host_reads_allowed(q):  # meta tensors, torch.compile, a CUDA-graph capture: no value read on the host
        return _masked_reference(q, kv_cache, block_table, cache_seqlens, scale, causal, kv_format, kv_scale, indices,
                                 topk_length, head_dim_v)
    out = torch.zeros(b, s_q, h_q, head_dim_v, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h_q, s_q), float("-inf"), dtype=torch.float32, device=q.device)
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    for i in range(b):
        for j in range(s_q):
            if indices is not None:
                idx = indices[i, j].long()
                if topk_length is not None:
                    idx = idx[: int(topk_length[i])]
                idx = idx[idx >= 0]
                kv = dequantize_kv_reference(flat[idx], kv_format, kv_scale)
            else:
                length = int(cache_seqlens[i])
                visible = length - s_q + 1 + j if causal else length
                visible = max(0, min(visible, length))
                kv = dequantize_kv_reference(gather_tokens(kv_cache, block_table, i, visible), kv_format, kv_scale)
            if kv.shape[0] == 0:
                continue
            scores = q[i, j].float() @ kv.T * scale  # [h_q, n]
            row_lse = torch.logsumexp(scores, -1)
            out[i, j] = torch.softmax(scores, -1) @ kv[:, :head_dim_v]
            lse[i, :, j] = row_lse
    return out.to(q.dtype), lse


def _masked_reference(q, kv_cache, block_table, cache_seqlens, scale, causal, kv_format, kv_scale, indices,
                      topk_length, head_dim_v):
    """mla_decode_reference without reading a value on the host: every request gathers all the tokens it could
    see (the table's, or its topk slots) and masks the ones it does not with torch.where. Page ids, lengths and
    slots are clamped into the cache (they go unchecked here): a bad one gives wrong rows, never an index error."""
    b, s_q, h_q, _ = q.shape
    num_pages, page = kv_cache.shape[:2]
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    slots = flat.shape[0]
    if indices is not None:
        idx = indices.long()  # [b, s_q, topk]
        seen = (idx >= 0) & (idx < slots)
        if topk_length is not None:
            seen &= torch.arange(idx.shape[2], device=q.device) < topk_length.long()[:, None, None]
        rows = idx.clamp(0, max(slots - 1, 0))
    else:
        n = block_table.shape[1] * page if num_pages else 0
        t = torch.arange(n, device=q.device)
        pages = block_table.long()[:, t // page].clamp(0, max(num_pages - 1, 0))  # [b, n]
        rows = (pages * page + t % page)[:, None, :].expand(b, s_q, n)
        lens = cache_seqlens.long().clamp(0, n)[:, None]  # [b, 1]
        visible = lens - s_q + 1 + torch.arange(s_q, device=q.device) if causal else lens.expand(b, s_q)
        seen = t[None, None, :] < visible[:, :, None]  # [b, s_q, n]
    if slots == 0:  # no cache rows to gather: nobody sees a token
        rows, seen = rows[..., :0], seen[..., :0]
    kv = dequantize_kv_reference(flat[rows], kv_format, kv_scale)  # [b, s_q, n, 576]
    scores = torch.einsum("bjhd,bjnd->bjhn", q.float(), kv) * scale
    scores = torch.where(seen[:, :, None, :], scores, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [b, s_q, h_q]; -inf where a query sees nothing
    probs = torch.where(seen[:, :, None, :], torch.exp(scores - lse[..., None]), 0.0)
    values = torch.where(seen[..., None], kv[..., :head_dim_v], 0.0)
    out = torch.einsum("bjhn,bjnd->bjhd", probs, values)
    return out.to(q.dtype), lse.permute(0, 2, 1).contiguous()
