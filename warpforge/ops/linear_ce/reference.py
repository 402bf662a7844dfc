"""Linear + cross-entropy in plain PyTorch: what `linear_cross_entropy` computes."""
from __future__ import annotations

import torch


def linear_cross_entropy_reference(hidden, weight, targets, ignore_index=-100, bias=None, reduction="mean",
                                   label_smoothing=0.0, lse_square_scale=0.0, softcap=None):
    """Cross-entropy of logits z = hidden @ weightᵀ (+ bias; then softcap · tanh(z / softcap) where softcap is
    given) against targets, fp32 math. Per counted row (target != ignore_index):

        loss = lse(z) − (1 − ε) z_target − ε · mean(z) + lse_square_scale · lse(z)²

    (label smoothing ε as torch's F.cross_entropy; the z-loss term as Liger-Kernel's). reduction "mean" divides the
    sum by the rows counted (0, with zero gradients, when none counts), "sum" sums, "none" returns the fp32 per-row
    losses [N] (0 on ignored rows)."""
    logits = hidden.float() @ weight.float().T
    if bias is not None:
        logits = logits + bias.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    counted = targets != ignore_index
    if logits.shape[1] == 0:  # no vocabulary: every target was ignored (the op's door checks)
        loss = logits.sum(-1)
    else:
        lse = torch.logsumexp(logits, -1)
        z_t = logits.gather(1, torch.where(counted, targets, 0).long()[:, None])[:, 0]
        # the mean only with smoothing: 0 · it is NaN when a logit is -inf (a masked vocabulary entry)
        smooth = label_smoothing * logits.mean(-1) if label_smoothing else 0.0
        loss = lse - (1 - label_smoothing) * z_t - smooth + lse_square_scale * lse ** 2
    loss = torch.where(counted, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / counted.sum().clamp(min=1)
