"""`Attention`: multi-head self-attention (MHA/GQA/MQA) whose core is `flash_attention`."""
from __future__ import annotations

import torch
from torch import nn

from ..errors import fail
from ..ops.attention import flash_attention


class Attention(nn.Module):
    """x [b, s, dim] -> [b, s, dim]; or packed x [total, dim] with cu_seqlens (int32 [batch + 1]).

    n_kv_heads < n_heads gives grouped-query attention (1: multi-query). causal and window follow
    `flash_attention`. Projections are plain nn.Linear, so autocast and weight loading work as usual.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, *, causal: bool = True,
                 window: tuple[int, int] = (-1, -1), bias: bool = False, softmax_scale: float | None = None,
                 backend: str | None = None):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if dim % n_heads:
            fail("dim", f"a multiple of n_heads ({n_heads})", dim)
        if n_heads % n_kv_heads:
            fail("n_kv_heads", f"a divisor of n_heads ({n_heads})", n_kv_heads)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.causal, self.window, self.softmax_scale, self.backend = causal, tuple(window), softmax_scale, backend
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias)
        self.proj = nn.Linear(n_heads * self.head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        qkv = self.qkv(x).unflatten(-1, (self.n_heads + 2 * self.n_kv_heads, self.head_dim))
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=-2)
        out = flash_attention(q, k, v, causal=self.causal, window=self.window, softmax_scale=self.softmax_scale,
                              cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                              max_seqlen_k=max_seqlen, backend=self.backend)
        return self.proj(out.reshape(*lead, -1))

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"causal={self.causal}, window={self.window}")
