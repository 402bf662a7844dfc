"""`Attention`: multi-head self-attention (MHA/GQA/MQA) whose core is `flash_attention`, with optional rotary
positions and a `KVCache` for decoding."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import check_bool, check_cu_seqlens, check_positive_float, fail, host_reads_allowed, read_once
from ..ops.rope import rope_tables
from . import functional as F


@dataclass
class KVCache:
    """One layer's keys and values so far: k, v [batch, max_tokens, kv_heads, head_dim], of which the first
    `length` tokens are written. Every step writes all `batch` rows (they advance together: one step with fewer
    rows would leave the others behind), and `length` lives on the host, so a decode step never reads the device
    back."""
    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    @classmethod
    def allocate(cls, batch: int, max_tokens: int, n_kv_heads: int, head_dim: int, device=None,
                 dtype=torch.bfloat16) -> "KVCache":
        for name, size in (("batch", batch), ("max_tokens", max_tokens), ("n_kv_heads", n_kv_heads),
                           ("head_dim", head_dim)):
            F.check_size(name, size)
        shape = (batch, max_tokens, n_kv_heads, head_dim)
        return cls(torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype))

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [batch, s, kv_heads, head_dim] after the cached tokens; return every key and value so far."""
        if k.shape[0] != self.k.shape[0]:
            fail("cache", f"a cache of x's batch, {k.shape[0]} (its rows advance together)",
                 f"a cache of batch {self.k.shape[0]}")
        if k.shape[2:] != self.k.shape[2:]:
            fail("cache", f"(kv_heads, head_dim) {tuple(k.shape[2:])} (this layer's)", tuple(self.k.shape[2:]))
        start, end = self.length, self.length + k.shape[1]
        if end > self.k.shape[1]:
            fail("cache", f"room for {end} tokens", f"a cache of {self.k.shape[1]}")
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        self.length = end
        return self.k[:, :end], self.v[:, :end]


class Attention(nn.Module):
    """x [b, s, dim] -> [b, s, dim]; or packed x [total, dim] with cu_seqlens (int32 [batch + 1]).

    n_kv_heads < n_heads gives grouped-query attention (1: multi-query). causal and window follow
    `flash_attention`. rotary: rotate q and k by their positions (RoPE, tables for max_seq_len positions; in a
    packed batch each sequence starts at position 0). A `KVCache` (from `new_cache`) makes forward append x's
    keys and values and attend to all cached tokens (decoding; bottom-right causal). Projections are plain
    nn.Linear, so autocast and weight loading work as usual. backend: see `warpforge.nn.functional`.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, *, causal: bool = True,
                 window: tuple[int, int] = (-1, -1), bias: bool = False, softmax_scale: float | None = None,
                 rotary: bool = False, max_seq_len: int = 4096, rope_base: float = 10000.0,
                 backend: F.Backend = None):
        super().__init__()
        F.check_size("dim", dim)
        F.check_size("n_heads", n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        F.check_size("n_kv_heads", n_kv_heads)
        if dim % n_heads:
            fail("dim", f"a multiple of n_heads ({n_heads})", dim)
        if n_heads % n_kv_heads:
            fail("n_kv_heads", f"a divisor of n_heads ({n_heads})", n_kv_heads)
        if not isinstance(window, (tuple, list)) or len(window) != 2:  # its values: flash_attention checks them
            fail("window", "(left, right)", repr(window))
        check_bool("rotary", rotary)
        F.check_size("max_seq_len", max_seq_len)
        check_positive_float("rope_base", rope_base, allow_none=False)  # 0 would make every angle NaN
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.causal, self.window, self.softmax_scale, self.backend = causal, tuple(window), softmax_scale, \
            F.check_backend(backend)
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias)
        self.proj = nn.Linear(n_heads * self.head_dim, dim, bias=bias)
        cos, sin = rope_tables(max_seq_len, self.head_dim, rope_base) if rotary else (None, None)
        self.register_buffer("cos", cos, persistent=False)  # tables, not weights: not in the state dict
        self.register_buffer("sin", sin, persistent=False)
        # context parallelism (warpforge.distributed.context_parallel sets it): x is this rank's shard of each
        # sequence; its tokens' positions and the attention across ranks come from here
        self.context = None

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None) -> torch.Tensor:
        if cache is not None and not isinstance(cache, KVCache):  # e.g. cu_seqlens passed by position
            fail("cache", "a KVCache or None (pass cu_seqlens by keyword)", type(cache).__name__)
        if cache is not None and cu_seqlens is not None:
            fail("cache", "None with a packed batch (cu_seqlens)", type(cache).__name__)
        F.check_input(x, self.qkv.in_features, self.qkv.weight, ranks=3 if cu_seqlens is None else 2)
        lead = x.shape[:-1]
        qkv = self.qkv(x).unflatten(-1, (self.n_heads + 2 * self.n_kv_heads, self.head_dim))
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=-2)
        if self.context is not None:
            return self.proj(self._attend_across_ranks(q, k, v, cache, cu_seqlens).reshape(
                *lead, self.n_heads * self.head_dim))
        if self.cos is not None:
            q, k = self._rotate(q, k, cache.length if cache is not None else 0, cu_seqlens, max_seqlen)
        if cache is not None:  # decoding: the new queries see the whole cache
            k, v = cache.append(k, v)
        out = F.attention(q, k, v, causal=self.causal, window=self.window, softmax_scale=self.softmax_scale,
                          cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, backend=self.backend)
        return self.proj(out.reshape(*lead, self.n_heads * self.head_dim))  # (no -1: x may have no tokens)

    def _attend_across_ranks(self, q, k, v, cache, cu_seqlens):
        """Context parallelism: q, k, v [b, s_local, h, d] are this rank's shard of each sequence."""
        if cache is not None or cu_seqlens is not None:
            fail("x", "a padded batch without a KV cache under context parallelism", "a cache or cu_seqlens")
        q, k = self._rotate_at(q, k, self.context.positions(q.shape[1], q.device), q.shape[1] * self.context.world)
        return self.context.attend(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale,
                                   backend=F.backend_across_ranks(self.backend, "attention"))

    def _rotate_at(self, q, k, positions: torch.Tensor, length: int):
        """q, k [b, s, h, d] rotated by positions (int64 [s]) in a sequence of `length` tokens (context
        parallelism: a rank's shard); as they are without rotary tables."""
        if self.cos is None:
            return q, k
        if length > self.cos.shape[0]:
            fail("x", f"at most max_seq_len ({self.cos.shape[0]}) positions over the ranks", length)
        cos, sin = self.cos[positions], self.sin[positions]
        return F.rope(q, cos, sin, backend=self.backend), F.rope(k, cos, sin, backend=self.backend)

    def _rotate(self, q, k, pos: int, cu_seqlens, max_seqlen):
        if cu_seqlens is None:  # [b, s, h, d] at positions pos, pos + 1, ...
            s = q.shape[1]
            if pos + s > self.cos.shape[0]:
                fail("x", f"at most max_seq_len ({self.cos.shape[0]}) positions", pos + s)
            cos, sin = self.cos[pos:pos + s], self.sin[pos:pos + s]
            return F.rope(q, cos, sin, backend=self.backend), F.rope(k, cos, sin, backend=self.backend)
        self._check_packed_lengths(q, cu_seqlens, max_seqlen)
        # packed [total, h, d]: each token's position inside its own sequence, found on the device
        t = torch.arange(q.shape[0], device=q.device, dtype=cu_seqlens.dtype)
        pos = (t - cu_seqlens[torch.searchsorted(cu_seqlens[1:], t, right=True)]).long()
        cos, sin = self.cos[pos], self.sin[pos]
        return F.rope(q[None], cos, sin, backend=self.backend)[0], F.rope(k[None], cos, sin, backend=self.backend)[0]

    def _check_packed_lengths(self, q, cu_seqlens, max_seqlen) -> None:
        """Every packed sequence fits the rotary tables (a position past them would index out of range). The
        offsets are read on the host once for as long as they do not change (the layers of a step share them), as
        flash_attention reads them; while compiling or capturing, max_seqlen (which flash_attention then
        requires) bounds them instead."""
        limit = self.cos.shape[0]
        check_cu_seqlens("cu_seqlens", cu_seqlens, q, read_values=False)
        if host_reads_allowed(q):
            host = read_once((cu_seqlens,), ("nn.Attention rotary", q.shape[0]),
                             lambda: check_cu_seqlens("cu_seqlens", cu_seqlens, q))
            longest = int((host[1:] - host[:-1]).max())
        else:
            longest = max_seqlen or 0
        if longest > limit:
            fail("x", f"packed sequences of at most max_seq_len ({limit}) tokens", f"one of {longest}")

    def new_cache(self, batch: int, max_tokens: int, device=None, dtype=torch.bfloat16) -> KVCache:
        """An empty KVCache for this layer: dtype is the one k and v arrive in (autocast's, if on)."""
        return KVCache.allocate(batch, max_tokens, self.n_kv_heads, self.head_dim, device, dtype)

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"causal={self.causal}, window={self.window}, rotary={self.cos is not None}")
