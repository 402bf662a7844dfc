"""Context parallelism for `nn.Attention` and `nn.SparseAttention` layers: every rank of a group holds a shard of
each sequence (ring attention's zigzag layout, or contiguous chunks where sparse attention needs them), rotates its
queries and keys by their positions in the whole sequence, and attends through `ring_attention` (dense) or
`sparse_attention_cp` (top-k sparse, with its index loss). `context_parallel(model)` sets this up on every attention layer of a model; the caller
feeds each rank its shard of the tokens (`ContextParallel.shard`) and averages the ranks' losses, whose tokens
are equal in number (DDP over the same group does that for the gradients)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..errors import fail
from .group import resolve_group
from .ring_attention import LAYOUTS, ring_attention, shard_sequence
from .sparse_attention_cp import sparse_attention_cp, sparse_attention_index_loss_cp


class ContextParallel:
    """One group's context-parallel settings, shared by the attention layers of a model (their `context`)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag"):
        grp = resolve_group(group, "each sequence is split over its ranks")
        if layout not in LAYOUTS:
            fail("layout", f"one of {LAYOUTS}", repr(layout))
        self.group, self.rank, self.world = grp
        self.layout = layout
        self._positions = {}

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of x, a whole sequence along dim (tokens, targets): contiguous."""
        return shard_sequence(x, self.rank, self.world, self.layout, dim).contiguous()

    def positions(self, s_local: int, device) -> torch.Tensor:
        """The positions in the whole sequence (int64 [s_local]) of this rank's s_local tokens."""
        key = (s_local, str(device))
        if key not in self._positions:
            whole = torch.arange(s_local * self.world, device=device)
            self._positions[key] = shard_sequence(whole, self.rank, self.world, self.layout, 0)
        return self._positions[key]

    def attend(self, q, k, v, *, causal: bool, softmax_scale, backend):
        return ring_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=self.layout,
                              group=self.group, backend=backend)

    def attend_sparse(self, q, k, v, index_q, index_k, *, block_size: int, topk: int, softmax_scale, backend):
        """(out, lse, block_indices) of this rank's chunk (the contiguous layout)."""
        return sparse_attention_cp(q, k, v, index_q=index_q, index_k=index_k, block_size=block_size, topk=topk,
                                   group=self.group, softmax_scale=softmax_scale, return_lse=True,
                                   return_indices=True, backend=backend)

    def sparse_index_loss(self, q, k, lse, index_q, index_k, block_indices, *, block_size: int, softmax_scale,
                          backend):
        """The index branch's loss over this rank's chunk (the whole sequence's: the ranks' mean)."""
        return sparse_attention_index_loss_cp(q, k, lse, index_q, index_k, block_indices, block_size=block_size,
                                              group=self.group, softmax_scale=softmax_scale, backend=backend)


def context_parallel(model: torch.nn.Module, group: Optional[dist.ProcessGroup] = None,
                     layout: Optional[str] = None) -> ContextParallel:
    """Make every `nn.Attention` / `nn.SparseAttention` of model attend across the ranks of `group` (default: the
    world), in place, and return the settings (whose `shard` cuts a batch's tokens for this rank). Dense layers run
    ring attention, sparse ones sparse_attention_cp. layout: "zigzag" (balanced causal work; dense layers only) or
    "contiguous"; None picks zigzag unless a sparse layer needs contiguous chunks. No sliding windows, no MLA; a
    forward with a KV cache or a packed batch is refused while set. Every rank calls it."""
    from ..nn import Attention, MLAttention, SparseAttention
    mods = list(model.named_modules())
    sparse = any(isinstance(m, SparseAttention) for _, m in mods)
    if layout is None:
        layout = "contiguous" if sparse else "zigzag"
    if sparse and layout != "contiguous":
        fail("layout", "'contiguous' (sparse attention's chunks) for a model with nn.SparseAttention layers",
             repr(layout))
    cp = ContextParallel(group, layout)
    found = 0
    for name, mod in mods:
        if isinstance(mod, MLAttention):
            fail(name or "model", "nn.Attention or nn.SparseAttention layers for context parallelism",
                 type(mod).__name__)
        if isinstance(mod, Attention):
            if mod.window != (-1, -1):
                fail(f"{name}.window", "(-1, -1) under context parallelism", mod.window)
            mod.context = cp
            found += 1
    if not found:
        fail("model", "a module with nn.Attention layers", "none")
    return cp
