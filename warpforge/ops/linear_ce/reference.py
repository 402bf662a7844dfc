"""Linear + cross-entropy in plain PyTorch: what `linear_cross_entropy` computes."""
from __future__ import annotations

import torch.nn.functional as F


def linear_cross_entropy_reference(hidden, weight, targets, ignore_index=-100):
    """Mean cross-entropy of logits = hidden @ weightᵀ against targets, over targets != ignore_index; 0 (with zero
    gradients) when no target counts, as in a batch of padding only."""
    logits = hidden.float() @ weight.float().T
    counted = (targets != ignore_index).sum().clamp(min=1)
    return F.cross_entropy(logits, targets.long(), ignore_index=ignore_index, reduction="sum") / counted
