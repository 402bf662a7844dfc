"""Trainable block-sparse attention (MiniMax Sparse Attention style) in plain PyTorch, written to be read.

Layouts (FlashAttention's): q [b, s, h_q, d], k / v [b, s, h_kv, d]; query head h reads kv head h // (h_q // h_kv).
The sequence is cut into blocks of `block_size` tokens (the last one may be short). Selection is per query
block and per GQA group (kv head): block_indices [b, h_kv, n_blocks, topk] int, -1 for "no block".

- The kept key blocks of query block i (group g): its own block i, plus every entry j of block_indices[b, g, i]
  with 0 <= j < n_blocks, j != i, and j < i when causal; duplicates count once.
- Query t sees key u iff u's block is kept for t's block, u < s, and u <= t when causal.
- The index branch: one small query head per group, index_q [b, s, h_kv, d_i], and one shared key head,
  index_k [b, s, 1, d_i]. Block score Z[b, g, i, j] = the max over block j's keys u of (the mean of index_q[t, g]
  over block i's tokens t) · index_k[u] · index_scale: the per-token scores averaged over the query block (a mean
  of dot products is the dot product with the mean query, so the quadratic part costs one row per query block,
  not per token) and max-pooled over the key block; no exp. The selection is the top-`topk` of Z[b, g, i, :] over
  the candidate blocks (j != i, j < i when causal), ascending, -1 padded.
- The index loss, per query token t and group g, over t's kept blocks c: the main attention's block mass
  m[t, c] = mean over g's query heads of the probability on block c's keys (it sums to 1: the attention sees
  only kept blocks), the index branch's distribution softmax_c(z[t, c]) with z[t, c] = the max over block c's
  visible keys u of index_q[t, g] · index_k[u] · index_scale; loss = the mean over (b, g, t) of
  KL(m[t] ‖ softmax(z[t])). Its gradient flows to index_q and index_k only.
Varlen: q [total, h, d] with cu_seqlens; blocks are numbered within each sequence, block_indices is
[n_seqs, h_kv, cdiv(max_seqlen, block_size), topk].

Queries that are the last s_q of s_k keys (batched form only; s_k - s_q a multiple of block_size, as a rank of
context parallelism holds its chunk's queries against the keys up to it): query t sits at position
off + t, off = s_k - s_q, bottom-right aligned like flash-attn's causal with s_q < s_k. Key blocks are numbered
over the keys, query blocks over the queries: query block i is key block i + off / block_size, its own block;
block_indices is [b, h_kv, cdiv(s_q, block_size), topk] of key blocks, and Z [b, h_kv, n_q_blocks, n_k_blocks].
Everything above holds with positions in place of indices (u <= off + t when causal, j < i + off / block_size).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .select import top_blocks  # the selection itself is plain tensor ops: one copy serves both


def n_blocks(s: int, block_size: int) -> int:
    return -(-s // block_size)


def kept_blocks(block_indices: torch.Tensor, nb: int, causal: bool, q_off_blocks: int = 0) -> torch.Tensor:
    """[b, h_kv, n_q_blocks, nb] bool: which of the nb key blocks each query block keeps (its own always); query
    block i is key block i + q_off_blocks."""
    b, h_kv, nqb, _ = block_indices.shape
    i = torch.arange(nqb, device=block_indices.device)[:, None] + q_off_blocks
    idx = block_indices.long()
    ok = (idx >= 0) & (idx < nb) & (idx != i)
    if causal:
        ok &= idx < i
    kept = torch.zeros(b, h_kv, nqb, nb + 1, dtype=torch.bool, device=block_indices.device)
    kept.scatter_(-1, torch.where(ok, idx, nb), True)  # column nb collects the dropped entries
    kept = kept[..., :nb]
    own = torch.arange(max(min(nqb, nb - q_off_blocks), 0), device=block_indices.device)
    kept[:, :, own, own + q_off_blocks] = True
    return kept


def token_mask(kept: torch.Tensor, s: int, block_size: int, causal: bool, s_k: Optional[int] = None) -> torch.Tensor:
    """[b, h_kv, s, s_k] bool: query t (at position s_k - s + t) may see key u. s_k defaults to s."""
    s_k = s if s_k is None else s_k
    q_blk = torch.arange(s, device=kept.device) // block_size
    k_blk = torch.arange(s_k, device=kept.device) // block_size
    mask = kept[:, :, q_blk][:, :, :, k_blk]
    if causal:
        mask &= torch.ones(s, s_k, dtype=torch.bool, device=kept.device).tril(s_k - s)
    return mask


def sparse_attention_reference(q, k, v, block_indices, *, block_size=128, causal=True, softmax_scale=None,
                               compute_dtype=torch.float32):
    """Batched form. (out [b, s, h_q, d_v] in q's dtype, lse fp32 [b, h_q, s]); differentiable. k / v may be longer
    than q (s_k - s a multiple of block_size): q is then their last s positions."""
    b, s, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    group = h_q // h_kv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    mask = token_mask(kept_blocks(block_indices, n_blocks(s_k, block_size), causal, (s_k - s) // block_size), s,
                      block_size, causal, s_k)
    mask = mask.repeat_interleave(group, dim=1)  # [b, h_q, s, s_k]
    qf, kf, vf = (t.to(compute_dtype) for t in (q, k, v))
    kf = kf.repeat_interleave(group, dim=2)
    vf = vf.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).masked_fill(~mask, 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out.to(q.dtype), lse.float()


def _padded(x: torch.Tensor, s: int, block_size: int, dim: int = 1) -> torch.Tensor:
    """x with its dim (of size s) zero-padded to whole blocks."""
    dim = dim % x.dim()
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1 - dim) + (0, n_blocks(s, block_size) * block_size - s))


def index_block_scores_reference(index_q, index_k, *, block_size=128, index_scale=None):
    """Z [b, h_kv, nqb, nkb] fp32: query block i's mean index query against key block j's keys, max-pooled over the
    keys (the selection takes the top-k of each row over its candidate blocks). index_k may be longer than index_q
    (its last tokens are the queries'): nkb = cdiv(s_k, block_size), nqb = cdiv(s_q, block_size)."""
    b, s, h_kv, d_i = index_q.shape
    s_k = index_k.shape[1]
    scale = index_scale if index_scale is not None else 1.0 / math.sqrt(d_i)
    nb, nkb = n_blocks(s, block_size), n_blocks(s_k, block_size)
    iq = _padded(index_q.float(), s, block_size).view(b, nb, block_size, h_kv, d_i)
    count = torch.full((nb,), float(block_size), device=index_q.device)
    if nb:
        count[-1] = s - (nb - 1) * block_size
    pooled = iq.sum(2) / count[None, :, None, None]  # [b, nb, h_kv, d_i]
    scores = torch.einsum("bihd,bud->bhiu", pooled, index_k.float()[:, :, 0]) * scale  # [b, h_kv, nb, s_k]
    scores = _padded(scores, s_k, block_size, dim=-1).view(b, h_kv, nb, nkb, block_size)
    return scores.masked_fill(_padded_key_mask(s_k, block_size, index_q.device), float("-inf")).amax(-1)


def index_loss_reference(q, k, index_q, index_k, block_indices, *, block_size=128, causal=True, softmax_scale=None,
                         index_scale=None):
    """The index branch's KL loss (a scalar, fp32), differentiable in index_q and index_k only. k and index_k may be
    longer than q and index_q (the queries are the last tokens, as in sparse_attention_reference)."""
    b, s, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    group = h_q // h_kv
    nb = n_blocks(s_k, block_size)
    kept = kept_blocks(block_indices, nb, causal, (s_k - s) // block_size)
    with torch.no_grad():
        _, lse = sparse_attention_reference(q, k, k, block_indices, block_size=block_size, causal=causal,
                                            softmax_scale=softmax_scale)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        mask = token_mask(kept, s, block_size, causal, s_k)  # [b, h_kv, s, s_k]
        kf = k.float().repeat_interleave(group, dim=2)
        probs = torch.exp(torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale - lse[..., None])
        probs = probs.masked_fill(~mask.repeat_interleave(group, dim=1), 0.0)
        probs = probs.view(b, h_kv, group, s, s_k).mean(2)
        mass = _padded(probs, s_k, block_size, dim=-1)  # keys padded: [b, h_kv, s, nb*bs]
        mass = mass.view(b, h_kv, s, nb, block_size).sum(-1)  # [b, h_kv, s, nb]
    scale_i = index_scale if index_scale is not None else 1.0 / math.sqrt(index_q.shape[-1])
    z = torch.einsum("bthd,bud->bhtu", index_q.float(), index_k.float()[:, :, 0]) * scale_i
    blk = torch.arange(s, device=q.device) // block_size
    tok_kept = kept[:, :, blk]  # [b, h_kv, s, nb]: the blocks kept for token t
    visible = torch.ones(s, s_k, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril(s_k - s)
    z = z.masked_fill(~visible, float("-inf"))
    z = _padded(z, s_k, block_size, dim=-1).view(b, h_kv, s, nb, block_size)
    z = z.masked_fill(_padded_key_mask(s_k, block_size, q.device), float("-inf")).amax(-1)  # [b, h_kv, s, nb]
    z = z.masked_fill(~tok_kept, float("-inf"))
    logp = torch.log_softmax(z, dim=-1)
    kl = torch.where(mass > 0, mass * (torch.log(mass.clamp_min(1e-30)) - logp), torch.zeros_like(mass))
    return kl.sum(-1).mean()


def _padded_key_mask(s, block_size, device):
    nb = n_blocks(s, block_size)
    return (torch.arange(nb * block_size, device=device) >= s).view(nb, block_size)


def sparse_attention_varlen_reference(q, k, v, block_indices, cu_seqlens, **kw):
    """Packed form: q [total, h_q, d], cu_seqlens [n + 1]; (out [total, h_q, d_v], lse [h_q, total])."""
    cu = cu_seqlens.tolist()
    outs, lses = [], []
    for i in range(len(cu) - 1):
        s = cu[i + 1] - cu[i]
        nb = n_blocks(s, kw.get("block_size", 128))
        o, lse = sparse_attention_reference(q[None, cu[i]:cu[i + 1]], k[None, cu[i]:cu[i + 1]],
                                            v[None, cu[i]:cu[i + 1]], block_indices[i:i + 1, :, :nb], **kw)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


def sparse_attention_full_reference(q, k, v, index_q: Optional[torch.Tensor], index_k: Optional[torch.Tensor],
                                    block_indices: Optional[torch.Tensor], *, block_size=128, topk=16, causal=True,
                                    softmax_scale=None, index_scale=None):
    """Selection (when block_indices is None) then the sparse attention: (out, lse, block_indices)."""
    if block_indices is None:
        z = index_block_scores_reference(index_q, index_k, block_size=block_size, index_scale=index_scale)
        block_indices = top_blocks(z, topk, causal)
    out, lse = sparse_attention_reference(q, k, v, block_indices, block_size=block_size, causal=causal,
                                          softmax_scale=softmax_scale)
    return out, lse, block_indices
