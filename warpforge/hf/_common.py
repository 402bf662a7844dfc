"""What the Hugging Face patches share: the one-time fallback log and the autocast-aware compute dtype."""
from __future__ import annotations

import logging

import torch

from ..nn import functional as nn_functional

logger = logging.getLogger("warpforge.hf")
_logged: set = set()


def fall_back(op: str, reason: object) -> None:
    """Log, once per (op, reason), that `op` runs transformers' own code instead of warpforge's."""
    key = (op, str(reason))
    if key not in _logged:
        _logged.add(key)
        logger.warning("warpforge.hf: %s falls back to the transformers implementation: %s", op, reason)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on t runs in: autocast's when autocast is on for t's device, else t's own."""
    return nn_functional.compute_dtype(t.device, t.dtype)
