"""FlashMLA's call on warpforge: `get_mla_metadata` and `flash_mla_with_kvcache`, for users switching over.

Both FlashMLA interfaces are accepted: the current one (get_mla_metadata() returns a schedule object that the
first decode call fills; num_splits is None) and the older one (get_mla_metadata(cache_seqlens,
s_q * h_q // h_kv, h_kv) returning tensors that were passed back in). warpforge plans from shapes alone, so
the schedule object holds the `warpforge.mla.MLAPlan` made on the first call and runs it on every later one.

What FlashMLA's dense decode takes is taken: any h_q from 1 to 128, h_kv >= 1 latent heads with h_q divisible by
h_kv (each group of h_q / h_kv query heads reads its own head of the cache, a strided view: no copy), s_q 1-4.
FlashMLA's conventions hold here, not warpforge.mla_decode's: a query that sees no token gets out 0 and lse +inf.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import check_bool, check_rank, check_tensor, fail
from ..ops import mla


@dataclass
class MLASchedule:
    """What FlashMLA calls tile-scheduler metadata: planned on the first call, reused after."""
    plan: Optional[mla.MLAPlan] = None


def get_mla_metadata(*args, **kwargs):
    """Returns (MLASchedule(), None), like FlashMLA's current interface; the arguments of the older interface
    are accepted and ignored (the plan needs only shapes, which the first decode call brings)."""
    return MLASchedule(), None


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata=None,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                           attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None):
    """FlashMLA's decode call; returns (out [b, s_q, h_q, 512], lse [b, h_q, s_q] fp32)."""
    for name, value in (("attn_sink", attn_sink), ("extra_k_cache", extra_k_cache),
                        ("extra_indices_in_kvcache", extra_indices_in_kvcache),
                        ("extra_topk_length", extra_topk_length)):
        if value is not None:
            fail(name, "None (not supported by warpforge yet)", "a tensor")
    check_bool("is_fp8_kvcache", is_fp8_kvcache)
    # the older interface passes get_mla_metadata's tensors back in (ignored: the plan needs only shapes)
    for name, value, kinds in (("tile_scheduler_metadata", tile_scheduler_metadata, (MLASchedule, torch.Tensor)),
                               ("num_splits", num_splits, (torch.Tensor,))):
        if value is not None and not isinstance(value, kinds):
            fail(name, f"None or {' or '.join('a ' + k.__name__ for k in kinds)} (from get_mla_metadata)",
                 type(value).__name__)
    check_tensor("q", q)
    check_tensor("k_cache", k_cache)
    check_rank("q", q, 4)
    check_rank("k_cache", k_cache, 4)
    h_q, h_kv = q.shape[2], k_cache.shape[2]
    if h_kv < 1 or h_q % h_kv:
        fail("k_cache", f"h_kv heads dividing q's {h_q} (dim 2)", h_kv)
    group = h_q // h_kv
    sched = tile_scheduler_metadata if isinstance(tile_scheduler_metadata, MLASchedule) else None
    kv_format = "fp8" if is_fp8_kvcache else "bf16"
    heads = [(q[:, :, g * group:(g + 1) * group], k_cache[:, :, g:g + 1]) for g in range(h_kv)]
    p = mla.plan(heads[0][0], heads[0][1], block_table, indices=indices, kv_format=kv_format,
                 softmax_scale=softmax_scale, causal=causal, head_dim_v=head_dim_v)
    if sched is not None:
        if sched.plan is None:
            sched.plan = p
        elif sched.plan.shapes != p.shapes or sched.plan.dtype != p.dtype:
            fail("tile_scheduler_metadata", f"a schedule planned for shapes {sched.plan.shapes} {sched.plan.dtype}",
                 f"a call with shapes {p.shapes} {p.dtype} (get a new one from get_mla_metadata)")
        else:  # the planned split and tiles, with this call's causal and softmax_scale
            p = dataclasses.replace(sched.plan, causal=p.causal, softmax_scale=p.softmax_scale)
    results = [p.run(q_g.contiguous() if h_kv > 1 else q_g, k_g, block_table, cache_seqlens, indices=indices,
                     topk_length=topk_length) for q_g, k_g in heads]
    out = results[0][0] if h_kv == 1 else torch.cat([r[0] for r in results], dim=2)
    lse = results[0][1] if h_kv == 1 else torch.cat([r[1] for r in results], dim=1)
    return out, lse.masked_fill(lse == float("-inf"), float("inf"))  # FlashMLA: a lonely query's lse is +inf


__all__ = ["MLASchedule", "get_mla_metadata", "flash_mla_with_kvcache"]
