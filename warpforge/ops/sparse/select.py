"""The block lists the kernels walk, made on the GPU with tensor ops (no host sync, CUDA-graph safe).

- `canonical(block_indices, ...)`: a user's (or the selector's) block_indices -> (sel, n_sel): per query block the
  kept blocks other than its own, ascending, each once, in range for its sequence (and earlier when causal), -1
  after the n_sel valid ones.
- `top_blocks(z, topk, causal)`: the selection from the index branch's block scores (exp-free: a top-k of raw
  scores), in canonical's form already.

Queries may be the last blocks of a longer key sequence (reference.py): query block i is then key block
i + q_off_blocks, its own, and the lists hold key blocks.
"""
from __future__ import annotations

from typing import Optional

import torch


def blocks_per_sequence(cu_seqlens: Optional[torch.Tensor], batch: int, max_s: int, block_size: int,
                        device) -> torch.Tensor:
    """[batch] int64: each sequence's number of blocks."""
    if cu_seqlens is None:
        return torch.full((batch,), -(-max_s // block_size), device=device, dtype=torch.int64)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().clamp(0, max_s)
    return (lengths + block_size - 1) // block_size


def canonical(block_indices: torch.Tensor, nb_seq: torch.Tensor, causal: bool,
              q_off_blocks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(sel int32 [b, h_kv, nqb, topk] contiguous, n_sel int32 [b, h_kv, nqb] contiguous). nb_seq: each sequence's
    number of key blocks; query block i is key block i + q_off_blocks."""
    nqb = block_indices.shape[2]
    big = torch.iinfo(torch.int64).max
    idx = block_indices.long()
    i = torch.arange(nqb, device=idx.device)[:, None] + q_off_blocks
    ok = (idx >= 0) & (idx < nb_seq[:, None, None, None]) & (idx != i)
    if causal:
        ok &= idx < i
    key = torch.where(ok, idx, big).sort(dim=-1).values
    if key.shape[-1] > 1:
        dup = torch.cat([torch.zeros_like(key[..., :1], dtype=torch.bool), key[..., 1:] == key[..., :-1]], -1)
        key = torch.where(dup, big, key).sort(dim=-1).values
    valid = key != big
    sel = torch.where(valid, key, -1).to(torch.int32).contiguous()
    return sel, valid.sum(-1, dtype=torch.int32).contiguous()


def top_blocks(z: torch.Tensor, topk: int, causal: bool, masked: bool = False) -> torch.Tensor:
    """block_indices int32 [b, h_kv, nqb, topk]: each query block's top-k candidate blocks by score (not its own;
    earlier ones when causal; none of score -inf), ascending, -1 padded. z [b, h_kv, nqb, nb]: the queries are the
    last nqb of the nb blocks (query block i is key block i + nb - nqb). masked: z is -inf wherever a block is not a
    candidate already (the index scores kernel's output), so the mask is not applied again."""
    b, h_kv, nqb, nb = z.shape
    if not masked:
        i = torch.arange(nqb, device=z.device)[:, None] + (nb - nqb)
        j = torch.arange(nb, device=z.device)[None, :]
        candidate = (j < i) if causal else (j != i)
        z = z.masked_fill(~candidate, float("-inf"))
    k = min(topk, nb)
    vals, idx = z.topk(k, dim=-1)
    idx = torch.where(vals == float("-inf"), nb, idx).sort(dim=-1).values
    idx = torch.where(idx == nb, -1, idx)
    if k < topk:
        idx = torch.nn.functional.pad(idx, (0, topk - k), value=-1)
    return idx.to(torch.int32)
