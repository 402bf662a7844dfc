"""Mixture-of-Experts in plain PyTorch: what `fused_moe` computes.

out[t] = Σ_k weight[t, k] · W2[e] · (SiLU(gate) ⊙ up),  [gate; up] = W13[e] · hidden[t],  e = ids[t, k]
with W13 [E, 2I, H] (gate rows, then up rows) and W2 [E, H, I].

Routing (`route_reference`): "softmax" scores = softmax(logits); "sigmoid" scores = sigmoid(logits), as
DeepSeek-V3's router (group top-k: experts in num_expert_group groups, a group scored by the sum of its
two best experts, only the topk_group best groups eligible). The top-k weights are renormalised to sum to
one when asked, then multiplied by routed_scaling_factor.

Choosing, both backends alike: equal scores go to the lower expert id (groups likewise), a NaN score ranks
below every number (and an expert of a group left out below that), so the ids of a row are always k distinct
experts in [0, E). Non-finite logits follow from the scores: a softmax row with a NaN or +inf logit, or with
every logit -inf, is NaN throughout, so its token gets experts 0..k-1 with NaN weights (a NaN output row);
under sigmoid only the NaN logit's own score is NaN.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

NAN_RANK = -1.0       # a NaN score when choosing: below every score (scores lie in [0, 1])
LEFT_OUT_RANK = -2.0  # an expert of a group not kept: below that


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row, equal entries in index order (lowest first)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def route_reference(router_logits, topk, *, renormalize=True, scoring="softmax", num_expert_group=None,
                    topk_group=None, routed_scaling_factor=1.0):
    """router_logits [T, E] -> (topk_weights fp32 [T, k], topk_ids int32 [T, k])."""
    logits = router_logits.float()
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choose = scores.detach().nan_to_num(nan=NAN_RANK)
    if num_expert_group:
        t, e = scores.shape
        grouped = choose.view(t, num_expert_group, e // num_expert_group)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, top_indices(group_score, topk_group),
                                                                        True)
        choose = grouped.masked_fill(~keep[..., None], LEFT_OUT_RANK).view(t, e)
    ids = top_indices(choose, topk)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def experts_reference(hidden, w13, w2, topk_weights, topk_ids):
    """The expert computation for given routing, in fp32, looping over experts. Returns out in hidden's dtype."""
    t, h = hidden.shape
    inter = w2.shape[2]
    # zero-sized slices of every input: 0 with zero gradients, so that out stays in the graph (as the kernels' does)
    # when no expert gets a token (t 0)
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device) + sum(
        a[:0].float().sum() for a in (hidden, w13, w2, topk_weights))
    x = hidden.float()
    for e in range(w13.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate_up = x[tok] @ w13[e].float().T
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tok, (act @ w2[e].float().T) * topk_weights[tok, slot, None].float())
    return out.to(hidden.dtype)


def fused_moe_reference(hidden, w13, w2, router_logits, topk, **route_kw):
    weights, ids = route_reference(router_logits, topk, **route_kw)
    return experts_reference(hidden, w13, w2, weights, ids)


FP8_BLOCK = 128


def quantize_weights_reference(w: torch.Tensor, block: int = FP8_BLOCK):
    """w [E, rows, cols] -> (e4m3 [E, rows, cols], fp32 scales [E, ceil(rows/128), ceil(cols/128)]), one scale
    per 128 x 128 block (DeepSeek-V3's layout): amax / 448."""
    e, r, c = w.shape
    rb, cb = -(-r // block), -(-c // block)
    padded = torch.zeros(e, rb * block, cb * block, dtype=torch.float32, device=w.device)
    padded[:, :r, :c] = w.float()
    tiles = padded.view(e, rb, block, cb, block)
    scale = (tiles.abs().amax(dim=(2, 4)) / 448.0).clamp(min=1e-12)
    q = (tiles / scale[:, :, None, :, None]).clamp(-448, 448).view(e, rb * block, cb * block)[:, :r, :c]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_weights_reference(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    e, r, c = q.shape
    full = scale.repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :r, :c]
    return q.float() * full
