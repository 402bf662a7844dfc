"""Multi-head Latent Attention decode, absorbed form, in plain PyTorch: what `mla_decode` computes.

Every query head attends to one shared latent KV head of width 576 (512 latent + 64 rope); V is the first
512 columns. The cache is paged: token t of request b lives at row t % page_size of page
block_table[b, t // page_size]. With s_q > 1 and causal=True (multi-token prediction) query i of s_q sees
the first cache_seqlens[b] - s_q + 1 + i tokens (bottom-right aligned). A request with no visible token
gets output 0 and lse -inf.

Cache formats (per token, one row of the cache):
- "bf16": 576 values in q's dtype.
- "fp8":  656 bytes = 512 e4m3 + 4 fp32 scales (one per 128 latent values, powers of two) + 64 bf16 rope.
"""
from __future__ import annotations

import math

import torch

D_QK, D_V, D_ROPE = 576, 512, 64
FP8_GROUP = 128
FP8_ROW_BYTES = D_V + 4 * (D_V // FP8_GROUP) + 2 * D_ROPE  # 656
ROW_BYTES = {"fp8": FP8_ROW_BYTES}


def quantize_kv_reference(latent: torch.Tensor, kv_format: str) -> torch.Tensor:
    """latent [..., 576] (bf16/fp16/fp32) -> the cache rows of `kv_format` (uint8 for quantized formats)."""
    if kv_format == "bf16":
        return latent
    if kv_format != "fp8":
        raise ValueError(kv_format)
    lead = latent.shape[:-1]
    nope = latent[..., :D_V].float().unflatten(-1, (D_V // FP8_GROUP, FP8_GROUP))
    amax = nope.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    # power-of-two scales: dequantising is an exact exponent shift
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    codes = (nope / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    rope = latent[..., D_V:].to(torch.bfloat16)
    out = torch.empty(*lead, FP8_ROW_BYTES, dtype=torch.uint8, device=latent.device)
    out[..., :D_V] = codes.flatten(-2).view(torch.uint8)
    out[..., D_V:D_V + 16] = scale.squeeze(-1).float().contiguous().view(torch.uint8).reshape(*lead, 16)
    out[..., D_V + 16:] = rope.contiguous().view(torch.uint8).reshape(*lead, 2 * D_ROPE)
    return out


def dequantize_kv_reference(cache: torch.Tensor, kv_format: str) -> torch.Tensor:
    """Cache rows of `kv_format` -> [..., 576] float32."""
    if kv_format == "bf16":
        return cache.float()
    if kv_format != "fp8":
        raise ValueError(kv_format)
    lead = cache.shape[:-1]
    codes = cache[..., :D_V].contiguous().view(torch.float8_e4m3fn).float()
    scale = cache[..., D_V:D_V + 16].contiguous().view(torch.float32).reshape(*lead, D_V // FP8_GROUP)
    nope = (codes.unflatten(-1, (D_V // FP8_GROUP, FP8_GROUP)) * scale[..., None]).flatten(-2)
    rope = cache[..., D_V + 16:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], -1)


def gather_tokens(kv_cache: torch.Tensor, block_table: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """The first `length` cache rows of request b, in order: [length, row]."""
    page_size = kv_cache.shape[1]
    t = torch.arange(length, device=kv_cache.device)
    pages = block_table[b, t // page_size].long()
    return kv_cache[pages, t % page_size, 0]


def mla_decode_reference(q, kv_cache, block_table, cache_seqlens, *, head_dim_v=D_V, softmax_scale=None,
                         causal=False, kv_format="bf16", indices=None, topk_length=None):
    """Returns (out [b, s_q, h_q, 512] in q's dtype, lse [b, h_q, s_q] fp32), computed in fp32.

    indices (sparse variant): int32 [b, s_q, topk] absolute token slots (page * page_size + offset), -1
    skipped; replaces the block table walk (causal does not apply). topk_length [b] limits each row's list.
    """
    b, s_q, h_q, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
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
                kv = dequantize_kv_reference(flat[idx], kv_format)
            else:
                length = int(cache_seqlens[i])
                visible = length - s_q + 1 + j if causal else length
                visible = max(0, min(visible, length))
                kv = dequantize_kv_reference(gather_tokens(kv_cache, block_table, i, visible), kv_format)
            if kv.shape[0] == 0:
                continue
            scores = q[i, j].float() @ kv.T * scale  # [h_q, n]
            row_lse = torch.logsumexp(scores, -1)
            out[i, j] = torch.softmax(scores, -1) @ kv[:, :head_dim_v]
            lse[i, :, j] = row_lse
    return out.to(q.dtype), lse
