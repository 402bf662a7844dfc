"""The part of a decode plan every paged-decode family shares (FlashInfer's plan/run): what a step's shapes fix
once, so that run() does no planning and a captured CUDA graph can replay it. A family's plan adds its own fields
and run()."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodePlan:
    batch: int
    s_q: int
    h_q: int
    page_size: int
    kv_format: str
    softmax_scale: float
    dtype: torch.dtype   # q's
    num_splits: int      # KV splits per request, from shapes only (never from cache_seqlens values)
