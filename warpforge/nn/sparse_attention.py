"""`SparseAttention`: causal self-attention whose core is `sparse_attention` (top-k block-sparse, MiniMax Sparse
Attention style), with its index branch and index loss."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..errors import check_int, check_positive_float, fail
from . import functional as F
from .attention import Attention, KVCache


class SparseAttention(Attention):
    """x [b, s, dim] -> [b, s, dim]: each query block (block_size tokens) of each kv head's group attends its own
    block and the top-`topk` earlier blocks chosen by a small index branch: one index query head of `index_dim` per
    kv head and one shared index key head, projected from x. After each training forward, `aux_loss` holds
    index_loss_coef × the index branch's KL loss (the branch reads x detached, so that loss trains the
    index projections only): add it to the
    training loss. Decoding with a KVCache attends densely to the cache (the selection is a training-time
    saving). Everything else is `Attention`'s (rotary positions, GQA, projections)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, *, block_size: int = 128,
                 topk: int = 16, index_dim: int = 32, index_loss_coef: float = 1.0, bias: bool = False,
                 softmax_scale: float | None = None, rotary: bool = True, max_seq_len: int = 65536,
                 rope_base: float = 10000.0, backend: F.Backend = None):
        super().__init__(dim, n_heads, n_kv_heads, causal=True, bias=bias, softmax_scale=softmax_scale,
                         rotary=rotary, max_seq_len=max_seq_len, rope_base=rope_base, backend=backend)
        check_int("block_size", block_size, 16, 256, what="a power of two from 16 to 256")
        if block_size & (block_size - 1):
            fail("block_size", "a power of two from 16 to 256", block_size)
        check_int("topk", topk, 1)
        check_int("index_dim", index_dim, 8, 128)
        if index_dim % 8:
            fail("index_dim", "a multiple of 8 from 8 to 128", index_dim)
        check_positive_float("index_loss_coef", index_loss_coef, allow_none=False, allow_zero=True)
        self.block_size, self.topk, self.index_loss_coef = block_size, topk, index_loss_coef
        self.index_q = nn.Linear(dim, self.n_kv_heads * index_dim, bias=False)
        self.index_k = nn.Linear(dim, index_dim, bias=False)
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None:  # decoding: dense over the cache
            if self.context is not None:
                fail("cache", "None under context parallelism", "a KVCache")
            return super().forward(x, cache)
        F.check_input(x, self.qkv.in_features, self.qkv.weight, ranks=3)
        b, s, _ = x.shape
        qkv = self.qkv(x).unflatten(-1, (self.n_heads + 2 * self.n_kv_heads, self.head_dim))
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=-2)
        if self.context is not None:  # this rank's chunk of each sequence: rotated by its whole-sequence positions
            q, k = self._rotate_at(q, k, self.context.positions(s, q.device), s * self.context.world)
        elif self.cos is not None:
            q, k = self._rotate(q, k, 0, None, None)
        # the index branch reads x detached: its loss trains its own projections, never the model under it
        iq = self.index_q(x.detach()).unflatten(-1, (self.n_kv_heads, -1))
        ik = self.index_k(x.detach()).unsqueeze(-2)
        dtype = F.compute_dtype(x.device, q.dtype)  # the index branch in the dtype attention sees (autocast's)
        iq, ik = iq.to(dtype), ik.to(dtype)
        kw = dict(block_size=self.block_size, softmax_scale=self.softmax_scale)
        if self.context is not None:
            backend = F.backend_across_ranks(self.backend, "sparse")
            out, lse, idx = self.context.attend_sparse(q, k, v, iq, ik, topk=self.topk, backend=backend, **kw)
            index_loss = partial(self.context.sparse_index_loss, backend=backend)
        else:
            out, lse, idx = F.sparse_attention(q, k, v, iq, ik, topk=self.topk, backend=self.backend, **kw)
            index_loss = partial(F.sparse_index_loss, backend=self.backend)
        if torch.is_grad_enabled() and self.index_loss_coef > 0:
            self.aux_loss = self.index_loss_coef * index_loss(q, k, lse, iq, ik, idx, **kw)
        else:
            self.aux_loss = torch.zeros((), device=x.device)
        return self.proj(out.reshape(b, s, self.n_heads * self.head_dim))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", block_size={self.block_size}, topk={self.topk}"
