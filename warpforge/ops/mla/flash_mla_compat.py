"""FlashMLA's call on warpforge: `get_mla_metadata` and `flash_mla_with_kvcache`, for users switching over.

Both FlashMLA interfaces are accepted: the current one (get_mla_metadata() returns a schedule object that
the first decode call fills; num_splits is None) and the older one (get_mla_metadata(cache_seqlens,
s_q * h_q // h_kv, h_kv) returning tensors that were passed back in). Our schedule depends on shapes only,
so the object just remembers the split count and the shapes it was planned for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...errors import fail


@dataclass
class MLASchedule:
    """What FlashMLA calls tile-scheduler metadata: planned on the first call, reused after."""
    num_splits: Optional[int] = None
    planned_for: Optional[tuple] = None


def get_mla_metadata(*args, **kwargs):
    """Returns (MLASchedule(), None), like FlashMLA's current interface; the arguments of the older interface
    are accepted and ignored (the plan needs only shapes, which the first decode call brings)."""
    return MLASchedule(), None


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata=None,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                           attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None):
    """FlashMLA's decode call; returns (out [b, s_q, h_q, 512], lse [b, h_q, s_q] fp32)."""
    from . import mla_decode
    for name, value in (("attn_sink", attn_sink), ("extra_k_cache", extra_k_cache),
                        ("extra_indices_in_kvcache", extra_indices_in_kvcache),
                        ("extra_topk_length", extra_topk_length)):
        if value is not None:
            fail(name, "None (not supported by warpforge yet)", "a tensor")
    sched = tile_scheduler_metadata if isinstance(tile_scheduler_metadata, MLASchedule) else None
    shapes = (tuple(q.shape), tuple(k_cache.shape), None if indices is None else tuple(indices.shape))
    schedule = None
    if sched is not None and sched.num_splits is not None:
        if sched.planned_for != shapes:
            fail("tile_scheduler_metadata", f"a schedule planned for shapes {sched.planned_for}",
                 f"a call with shapes {shapes} (get a new one from get_mla_metadata)")
        schedule = sched.num_splits
    kv_format = "fp8" if is_fp8_kvcache else "bf16"
    out, lse = mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v=head_dim_v,
                          softmax_scale=softmax_scale, causal=causal, kv_format=kv_format,
                          indices=indices, topk_length=topk_length, schedule=schedule)
    if sched is not None and sched.num_splits is None:
        from . import planned_num_splits
        sched.num_splits = planned_num_splits(q, k_cache, block_table, indices, kv_format)
        sched.planned_for = shapes
    return out, lse


__all__ = ["MLASchedule", "get_mla_metadata", "flash_mla_with_kvcache"]
