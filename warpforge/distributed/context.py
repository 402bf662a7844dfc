"""Context parallelism for `nn.Attention` layers: every rank of a group holds a shard of each sequence (ring
attention's zigzag layout), rotates its queries and keys by their positions in the whole sequence, and attends
through `ring_attention`. `context_parallel(model)` sets this up on every attention layer of a model; the caller
feeds each rank its shard of the tokens (`ContextParallel.shard`) and averages the ranks' losses, whose tokens
are equal in number (DDP over the same group does that for the gradients)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..errors import fail
from .group import resolve_group
from .ring_attention import LAYOUTS, ring_attention, shard_sequence


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


def context_parallel(model: torch.nn.Module, group: Optional[dist.ProcessGroup] = None,
                     layout: str = "zigzag") -> ContextParallel:
    """Make every `nn.Attention` of model attend across the ranks of `group` (default: the world) by ring attention,
    in place, and return the settings (whose `shard` cuts a batch's tokens for this rank). The layers must be plain
    nn.Attention (dense; no sliding window; rotary or not); a forward with a KV cache or a packed batch is refused
    while set. Every rank calls it."""
    from ..nn import Attention, MLAttention, SparseAttention
    cp = ContextParallel(group, layout)
    found = 0
    for name, mod in model.named_modules():
        if isinstance(mod, (SparseAttention, MLAttention)):
            fail(name or "model", "dense nn.Attention layers for context parallelism", type(mod).__name__)
        if isinstance(mod, Attention):
            if mod.window != (-1, -1):
                fail(f"{name}.window", "(-1, -1) under context parallelism", mod.window)
            mod.context = cp
            found += 1
    if not found:
        fail("model", "a module with nn.Attention layers", "none")
    return cp
