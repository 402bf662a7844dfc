"""`MLAttention`: DeepSeek-V3's Multi-head Latent Attention.

Training and prefill use the non-absorbed form: per-head keys [nope 128 | shared rope 64] and values
128, attended by `flash_attention` (its V head dim may differ from Q/K's); the softmax scale is passed
explicitly.
Decode uses the absorbed form: the cache keeps one 576-wide latent per token ([normalised c_kv 512 | roped
k 64]), and the queries are moved into the latent space (q_nope · W_UK) so that `mla_decode` reads the paged
cache once for all heads; its 512-wide output is mapped back by W_UV.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import check_int, check_positive_float, fail
from ..ops.attention import MAX_HEAD_DIM
from ..ops.mla import PAGE_SIZES
from ..ops.rope import rope_tables
from . import functional as F


@dataclass
class MLACache:
    """A paged latent cache: kv_cache [num_pages, page_size, 1, 576], block_table int32 [b, pages per request],
    cache_seqlens int32 [b] (tokens written so far, what mla_decode reads). Every step writes all b requests (they
    advance together), and `length` is their common count on the host, so a decode step never reads the device
    back."""
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    length: int = 0

    @classmethod
    def allocate(cls, batch: int, max_tokens: int, page_size: int = 64, device=None, dtype=torch.bfloat16):
        for name, size in (("batch", batch), ("max_tokens", max_tokens), ("page_size", page_size)):
            F.check_size(name, size)
        if page_size not in PAGE_SIZES:   # refused here, not at the first decode step after a prefill
            fail("page_size", f"one of mla_decode's page sizes {PAGE_SIZES}", page_size)
        pages = -(-max_tokens // page_size)
        kv = torch.zeros(batch * pages, page_size, 1, 576, device=device, dtype=dtype)
        table = torch.arange(batch * pages, device=device, dtype=torch.int32).view(batch, pages)
        return cls(kv, table, torch.zeros(batch, device=device, dtype=torch.int32))

    def check_step(self, batch: int, tokens: int) -> None:
        """A step of `tokens` new tokens for each of `batch` requests fits: the cache's batch, within its pages."""
        if batch != self.block_table.shape[0]:
            fail("cache", f"a cache of x's batch, {batch} (its requests advance together)",
                 f"a cache of batch {self.block_table.shape[0]}")
        end, room = self.length + tokens, self.block_table.shape[1] * self.kv_cache.shape[1]
        if end > room:
            fail("cache", f"room for {end} tokens", f"a cache of {room}")


class MLAttention(nn.Module):
    """x [b, s, dim] -> [b, s, dim], causal; with an `MLACache` (from `new_cache`) x's tokens are appended to it
    (see forward). backend: see `warpforge.nn.functional` (its "mla" op is the absorbed decode)."""

    def __init__(self, dim: int, n_heads: int, *, q_lora_rank: int | None = 1536, kv_lora_rank: int = 512,
                 qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64, v_head_dim: int = 128,
                 max_seq_len: int = 4096, rope_base: float = 10000.0, mscale: float = 1.0,
                 backend: F.Backend = None):
        super().__init__()
        F.check_size("dim", dim)
        F.check_size("n_heads", n_heads)
        if q_lora_rank is not None:
            check_int("q_lora_rank", q_lora_rank, lo=1, hi=F.MAX_SIZE,
                      what=f"an int from 1 to {F.MAX_SIZE}, or None for no query compression")
        if kv_lora_rank != 512 or qk_rope_head_dim != 64:
            fail("kv_lora_rank", "512 with qk_rope_head_dim 64 (the 576-wide latent mla_decode reads)",
                 (kv_lora_rank, qk_rope_head_dim))
        # the prefill's flash_attention takes head dims that are multiples of 8 up to MAX_HEAD_DIM: v's, and q/k's
        # of qk_nope_head_dim + qk_rope_head_dim
        for name, width, widest in (("qk_nope_head_dim", qk_nope_head_dim, MAX_HEAD_DIM - qk_rope_head_dim),
                                    ("v_head_dim", v_head_dim, MAX_HEAD_DIM)):
            what = f"a multiple of 8 from 8 to {widest} (flash_attention's head dims)"
            check_int(name, width, lo=8, hi=widest, what=what)
            if width % 8:
                fail(name, what, width)
        F.check_size("max_seq_len", max_seq_len)
        check_positive_float("rope_base", rope_base, allow_none=False)
        check_positive_float("mscale", mscale, allow_none=False)
        self.n_heads, self.nope, self.rope_dim, self.v_dim = n_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_rank, self.backend = kv_lora_rank, F.check_backend(backend)
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        # YaRN's attention temperature enters as mscale² on the softmax scale
        self.softmax_scale = mscale * mscale / math.sqrt(qk_dim)
        if q_lora_rank:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = nn.Parameter(torch.ones(q_lora_rank))
            self.wq_b = nn.Linear(q_lora_rank, n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = nn.Parameter(torch.ones(kv_lora_rank))
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        cos, sin = rope_tables(max_seq_len, qk_rope_head_dim, rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    # ----------------------------------------------------------------------------------- pieces
    def _queries(self, x, pos):
        q = self.wq_b(F.rms_norm(self.wq_a(x), self.q_norm, backend=self.backend)) if hasattr(self, "wq_a") \
            else self.wq(x)
        q = q.view(*x.shape[:2], self.n_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        return q_nope, self._rope(q_rope, pos)

    def _latents(self, x, pos):
        """[normalised c_kv | roped k]: [b, s, 576], what the cache keeps."""
        c_kv, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        k_rope = self._rope(k_rope[:, :, None, :], pos)[:, :, 0]
        return torch.cat([F.rms_norm(c_kv, self.kv_norm, backend=self.backend), k_rope], dim=-1)

    def _rope(self, t, pos):
        s = t.shape[1]
        if pos + s > self.cos.shape[0]:
            fail("x", f"at most max_seq_len ({self.cos.shape[0]}) positions", pos + s)
        return F.rope(t.contiguous(), self.cos[pos:pos + s], self.sin[pos:pos + s], backend=self.backend)

    def _w_uk_uv(self):
        w = self.wkv_b.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_rank)
        return w[:, :self.nope], w[:, self.nope:]  # [h, 128, 512] each for k and v

    # ---------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, cache: MLACache | None = None) -> torch.Tensor:
        """x [b, s, dim]. Without a cache: causal self-attention over x (training). With a cache: x's tokens
        are appended; a first call (empty cache) is a prefill, later calls decode (s ≤ 4) in absorbed form.
        The requests of a batch advance together, from the cache's host-side `length`."""
        if cache is not None and not isinstance(cache, MLACache):
            fail("cache", "an MLACache or None", type(cache).__name__)
        F.check_input(x, self.wkv_a.in_features, self.wkv_a.weight, ranks=3)
        b, s, _ = x.shape
        if cache is None:
            return self._prefill(x, 0)
        cache.check_step(b, s)
        start = cache.length
        latents = self._latents(x, start)
        self._write(cache, latents, start)
        if start == 0:
            out = self._prefill(x, 0, latents)
        else:
            out = self._decode(x, cache, start)
        cache.cache_seqlens += s
        cache.length += s
        return out

    def new_cache(self, batch: int, max_tokens: int, device=None, dtype=torch.bfloat16,
                  page_size: int = 16) -> MLACache:
        """An empty MLACache for this layer (dtype: the latents' as they arrive, autocast's if on)."""
        return MLACache.allocate(batch, max_tokens, page_size=page_size, device=device, dtype=dtype)

    def _prefill(self, x, pos, latents=None):
        b, s, _ = x.shape
        q_nope, q_rope = self._queries(x, pos)
        latents = self._latents(x, pos) if latents is None else latents
        kv = self.wkv_b(latents[..., :self.kv_rank]).view(b, s, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = latents[..., None, self.kv_rank:].expand(b, s, self.n_heads, self.rope_dim)
        out = F.attention(torch.cat([q_nope, q_rope], -1), torch.cat([k_nope, k_rope], -1), v,
                          causal=True, softmax_scale=self.softmax_scale, backend=self.backend)
        return self.wo(out.reshape(b, s, self.n_heads * self.v_dim))  # (no -1: x may have no tokens)

    def _decode(self, x, cache, start):
        b, s, _ = x.shape
        q_nope, q_rope = self._queries(x, start)
        w_uk, w_uv = self._w_uk_uv()
        q_latent = torch.einsum("bshd,hdc->bshc", q_nope, w_uk.to(q_nope.dtype))
        q = torch.cat([q_latent, q_rope], dim=-1).to(cache.kv_cache.dtype)
        out_latent = F.mla_decode(q, cache.kv_cache, cache.block_table, cache.cache_seqlens + s,
                                  softmax_scale=self.softmax_scale, causal=s > 1, backend=self.backend)
        out = torch.einsum("bshc,hdc->bshd", out_latent.to(x.dtype), w_uv.to(x.dtype))
        return self.wo(out.reshape(b, s, self.n_heads * self.v_dim))

    @staticmethod
    def _write(cache, latents, start):
        b, s, _ = latents.shape
        page = cache.kv_cache.shape[1]
        t = torch.arange(start, start + s, device=latents.device)
        pages = cache.block_table[:, t // page].long()  # [b, s]
        cache.kv_cache[pages, (t % page)[None, :].expand(b, s), 0] = latents.to(cache.kv_cache.dtype)
