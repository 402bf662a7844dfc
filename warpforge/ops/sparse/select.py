"""The block lists the kernels walk, made on the GPU with tensor ops (no host sync, CUDA-graph safe).

- `canonical(block_indices, ...)`: a user's (or the selector's) block_indices -> (sel, n_sel): per query block the
  kept blocks other than its own, ascending, each once, in range for its sequence (and earlier when causal), -1
  after the n_sel valid ones.
- `kept_by(sel, n_key_blocks)`: the same lists the other way round (CSR): for each key block, the query blocks
  that kept it, ascending, for the backward's dk/dv pass.
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


def kept_by(sel: torch.Tensor, n_key_blocks: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets int32 [b · h_kv · nkb + 1], qblocks int32): key block (b, g, j)'s query blocks are
    qblocks[offsets[key] : offsets[key + 1]], key = (b · h_kv + g) · nkb + j, ascending. nkb: the number of key
    blocks, the number of query blocks by default."""
    b, h_kv, nqb, topk = sel.shape
    nkb = nqb if n_key_blocks is None else n_key_blocks
    buckets = b * h_kv * nkb
    base = torch.arange(b * h_kv, device=sel.device).view(b, h_kv, 1, 1) * nkb
    key = torch.where(sel >= 0, base + sel.long(), buckets).flatten()
    counts = torch.zeros(buckets + 1, device=sel.device, dtype=torch.int64)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.zeros(buckets + 1, device=sel.device, dtype=torch.int64)
    offsets[1:] = counts[:-1].cumsum(0)
    order = torch.sort(key, stable=True).indices
    qblocks = (order // max(topk, 1)) % nqb
    return offsets.to(torch.int32), qblocks.to(torch.int32)


def top_blocks(z: torch.Tensor, topk: int, causal: bool) -> torch.Tensor:
    """block_indices int32 [b, h_kv, nqb, topk]: each query block's top-k candidate blocks by score (not its own;
    earlier ones when causal; none of score -inf), ascending, -1 padded. z [b, h_kv, nqb, nb]: the queries are the
    last nqb of the nb blocks (query block i is key block i + nb - nqb)."""
    b, h_kv, nqb, nb = z.shape
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
