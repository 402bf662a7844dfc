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

from .kv_format import D_V, KV_FORMATS

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def nvfp4_tensor_scale(latent: torch.Tensor) -> torch.Tensor:
    """A cache-wide fp32 scale for NVFP4 that maps amax to the largest e2m1 (6) times the largest e4m3 (448)."""
    return (latent[..., :D_V].float().abs().amax() / (6.0 * 448.0)).clamp(min=1e-30).reshape(())


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (sign in bit 3) of each value of x (already scaled into [-6, 6])."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=x.device)
    mag = (x.abs()[..., None] > mids).sum(-1)
    return (mag | ((x < 0).long() << 3)).to(torch.uint8)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1, device=codes.device)
    vals = table[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -vals, vals)


def _pack_rope(latent):
    return latent[..., D_V:].to(torch.bfloat16).contiguous().view(torch.uint8)


def quantize_kv_reference(latent: torch.Tensor, kv_format: str, kv_scale=None) -> torch.Tensor:
    """latent [..., 576] -> the cache rows of `kv_format` (uint8 for quantized formats). nvfp4 needs the
    cache-wide kv_scale (see nvfp4_tensor_scale)."""
    fmt = KV_FORMATS[kv_format]
    if not fmt.quantized:
        return latent
    lead = latent.shape[:-1]
    blocks = latent[..., :D_V].float().unflatten(-1, (D_V // fmt.group, fmt.group))
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    if kv_format == "fp8":
        # power-of-two scales: dequantising is an exact exponent shift
        scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
        data = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(-2).view(torch.uint8)
        scale_bytes = scale.squeeze(-1).float().contiguous().view(torch.uint8).reshape(*lead, -1)
    else:
        if kv_format == "nvfp4":
            ts = torch.as_tensor(kv_scale, dtype=torch.float32, device=latent.device)
            scale = (amax / 6.0 / ts).clamp(max=448.0).to(torch.float8_e4m3fn)
            eff = scale.float() * ts
            scale_bytes = scale.squeeze(-1).view(torch.uint8)
        else:  # mxfp4: of the two powers of two around amax / 6, the one with the smaller block error
            hi = torch.ceil(torch.log2(amax / 6.0)).clamp(-126, 127)
            errs = []
            for exp in (hi, hi - 1):
                deq = _e2m1_values(_e2m1_codes((blocks / torch.exp2(exp)).clamp(-6, 6))) * torch.exp2(exp)
                errs.append((deq - blocks).square().sum(-1, keepdim=True))
            exp = torch.where(errs[1] < errs[0], hi - 1, hi)
            eff = torch.exp2(exp)
            scale_bytes = (exp.squeeze(-1) + 127).to(torch.uint8)
        codes = _e2m1_codes((blocks / eff.clamp(min=1e-30)).clamp(-6, 6)).flatten(-2)
        data = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.cat([data, scale_bytes, _pack_rope(latent)], -1)


def dequantize_kv_reference(cache: torch.Tensor, kv_format: str, kv_scale=None) -> torch.Tensor:
    """Cache rows of `kv_format` -> [..., 576] float32."""
    fmt = KV_FORMATS[kv_format]
    if not fmt.quantized:
        return cache.float()
    n_scales = D_V // fmt.group
    scale_bytes = cache[..., fmt.scale_offset:fmt.rope_offset].contiguous()
    if kv_format == "fp8":
        vals = cache[..., :D_V].contiguous().view(torch.float8_e4m3fn).float()
        scale = scale_bytes.view(torch.float32)
    else:
        packed = cache[..., :fmt.scale_offset]
        vals = _e2m1_values(torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2))
        if kv_format == "nvfp4":
            scale = scale_bytes.view(torch.float8_e4m3fn).float() * torch.as_tensor(
                kv_scale, dtype=torch.float32, device=cache.device)
        else:
            scale = torch.exp2(scale_bytes.float() - 127)
    nope = (vals.unflatten(-1, (n_scales, fmt.group)) * scale[..., None]).flatten(-2)
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
