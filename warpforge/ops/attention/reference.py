"""Dense attention in plain PyTorch: what `flash_attention` computes, written to be read.

Conventions (FlashAttention's):
- q [b, s_q, h_q, d], k [b, s_k, h_kv, d], v [b, s_k, h_kv, d_v]; query head i reads kv head i // (h_q // h_kv).
- scores = q · kᵀ · scale; with softcap c, c · tanh(scores / c); with ALiBi slopes (per query head, or per batch
  and head), minus slope · |i + s_k − s_q − j|. Then the mask, and the softmax.
- Query i may see key j iff  i + (s_k - s_q) - left <= j <= i + (s_k - s_q) + right, with -1 meaning
  unbounded on that side; causal is right = 0. The mask is aligned bottom-right, so the last query
  sees the last key whatever s_q and s_k are.
- A query that sees no key gets output 0 and lse = -inf (the log of an empty sum).
- lse is the natural-log logsumexp of the scaled scores, [b, h_q, s_q] in fp32.
The varlen form packs sequences along dim 0 (q [total_q, h_q, d]) with cu_seqlens offsets; lse is then
[h_q, total_q].
"""
from __future__ import annotations

import math

import torch


def visible_mask(s_q: int, s_k: int, window: tuple[int, int], device=None) -> torch.Tensor:
    """[s_q, s_k] bool: True where query i may attend key j."""
    left, right = window
    i = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    j = torch.arange(s_k, device=device)[None, :]
    mask = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def effective_window(causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    left, right = window
    if causal:
        right = 0
    return left, right


def attention_reference(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=None,
                        alibi_slopes=None, compute_dtype=torch.float32):
    """Batched form. Returns (out [b, s_q, h_q, d_v] in q's dtype, lse fp32 [b, h_q, s_q]); differentiable."""
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    group = h_q // h_kv
    qf, kf, vf = (t.to(compute_dtype) for t in (q, k, v))
    kf = kf.repeat_interleave(group, dim=2)
    vf = vf.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        i = torch.arange(s_q, device=q.device)[:, None] + (s_k - s_q)
        j = torch.arange(s_k, device=q.device)[None, :]
        slopes = alibi_slopes.to(compute_dtype).expand(b, h_q) if alibi_slopes.dim() == 2 else \
            alibi_slopes.to(compute_dtype)[None].expand(b, h_q)
        scores = scores - slopes[:, :, None, None] * (i - j).abs().to(compute_dtype)
    mask = visible_mask(s_q, s_k, effective_window(causal, window), device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf on rows that see nothing
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    probs = probs.masked_fill(~mask, 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out.to(q.dtype), lse.float()


def attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None,
                               window=(-1, -1), softcap=None, alibi_slopes=None, compute_dtype=torch.float32):
    """Packed form. q [total_q, h_q, d]; returns (out [total_q, h_q, d_v], lse fp32 [h_q, total_q])."""
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(len(cq) - 1):
        slopes = None if alibi_slopes is None else (alibi_slopes[i] if alibi_slopes.dim() == 2 else alibi_slopes)
        o, lse = attention_reference(
            q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]], v[None, ck[i]:ck[i + 1]],
            causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap, alibi_slopes=slopes,
            compute_dtype=compute_dtype)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)
