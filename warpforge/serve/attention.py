"""Self-attention of one layer over the paged cache, for every sequence of a step: the new K/V are written into
their pages first (one paged.append_kv_slots call), then each group of the StepBatch attends (batch.py says which op serves which group).

Windows are given as Hugging Face's sliding_window: the tokens a query sees, itself included (None: all).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops import paged
from ..ops.attention import flash_attention
from .batch import StepBatch
from .kv_cache import PagedKVCache


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, batch: StepBatch,
           *, softmax_scale: float, window: Optional[int] = None) -> torch.Tensor:
    """q [T, h_q, d], k / v [T, h_kv, d] of the step's packed tokens -> out [T, h_q, d] in q's dtype."""
    cache.write(layer, k, v, batch.slots)
    dtype = cache.attn_dtype
    groups = batch.decode_groups + ([batch.varlen] if batch.varlen is not None else [])
    if len(groups) == 1 and groups[0].token_index is None:  # one group holding every token: no scatter
        return _run(groups[0], layer, q, k, v, cache, batch, dtype, softmax_scale, window).to(q.dtype)
    out = q.new_empty(q.shape)
    for g in groups:
        out[g.token_index] = _run(g, layer, q, k, v, cache, batch, dtype, softmax_scale, window).to(q.dtype)
    return out


def _run(group, layer, q, k, v, cache, batch, dtype, scale, window):
    idx = group.token_index
    qg = (q if idx is None else q[idx]).to(dtype)
    if group is batch.varlen:
        if group.context_slots is None:  # prefill from scratch: the new K/V are the whole context
            kg, vg = ((k if idx is None else k[idx]).to(dtype), (v if idx is None else v[idx]).to(dtype))
        else:
            kg, vg = cache.gather(layer, group.context_slots, dtype)
        return flash_attention(qg, kg, vg, causal=True, softmax_scale=scale,
                               window=(-1, -1) if window is None else (window - 1, 0),
                               cu_seqlens_q=group.cu_seqlens_q, cu_seqlens_k=group.cu_seqlens_k,
                               max_seqlen_q=group.max_seqlen_q, max_seqlen_k=group.max_seqlen_k)
    b, s_q = len(group.rows), group.s_q
    qg = qg.view(b, s_q, *q.shape[1:])
    key = (window, scale)
    plan = group.plans.get(key)
    if plan is None:  # shapes only: one plan serves every layer of the step
        plan = group.plans[key] = paged.plan(qg, cache.k[layer], group.block_table, kv_format=cache.kv_format,
                                             softmax_scale=scale, window=None if window is None else window - 1)
    out = plan.run(qg, cache.k[layer], cache.v[layer], group.block_table, group.seqlens, k_scale=cache.k_scale,
                   v_scale=cache.v_scale)
    return out.view(b * s_q, *q.shape[1:])
