"""`MoE`: a Mixture-of-Experts SwiGLU feed-forward over `moe.route` and `moe.experts` (`fused_moe` in two
steps), with optional shared experts and the load-balancing auxiliary loss."""
from __future__ import annotations

import torch
from torch import nn

from ..errors import check_positive_float
from ..ops.moe import check_routing  # moe.route's check of its settings: the one place they are checked
from . import functional as F


class MoE(nn.Module):
    """x [..., dim] -> [..., dim]. After each forward, `aux_loss` holds the Switch-Transformer balance loss
    E · Σ_e f_e · P_e (f_e: fraction of routed slots on expert e, P_e: mean router probability of e), scaled
    by aux_loss_coef; add it to the training loss."""

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, topk: int, *, num_shared_experts: int = 0,
                 scoring: str = "softmax", num_expert_group: int | None = None, topk_group: int | None = None,
                 routed_scaling_factor: float = 1.0, renormalize: bool = True, aux_loss_coef: float = 0.01,
                 backend: F.Backend = None):
        super().__init__()
        F.check_size("dim", dim)
        F.check_size("ffn_dim", ffn_dim)
        F.check_size("num_experts", num_experts)
        F.check_size("num_shared_experts", num_shared_experts, lo=0)
        check_positive_float("aux_loss_coef", aux_loss_coef, allow_none=False, allow_zero=True)
        self.topk, self.backend, self.aux_loss_coef = topk, F.check_backend(backend), aux_loss_coef
        self.route_kw = dict(renormalize=renormalize, scoring=scoring, num_expert_group=num_expert_group,
                             topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)
        # the routing settings are checked now rather than at the first forward (the torch backend's routing
        # does not check them at all), on router logits of no tokens
        check_routing(torch.empty(0, num_experts), topk, scoring, num_expert_group, topk_group, renormalize,
                       routed_scaling_factor)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.randn(num_experts, 2 * ffn_dim, dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, ffn_dim) * ffn_dim ** -0.5)
        self.shared_gate_up = self.shared_down = None
        if num_shared_experts:
            self.shared_gate_up = nn.Linear(dim, 2 * ffn_dim * num_shared_experts, bias=False)
            self.shared_down = nn.Linear(ffn_dim * num_shared_experts, dim, bias=False)
        self.aux_loss = torch.zeros(())
        self.num_experts = num_experts
        # how the experts run: None = all of them here; warpforge.distributed.shard_experts sets an all-to-all over
        # ranks that each hold a share (expert parallelism). Called as (h, w13, w2, topk_weights, topk_ids).
        self.dispatch = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F.check_input(x, self.router.in_features, self.router.weight)
        h = x.reshape(-1, x.shape[-1])
        logits = self.router(h)
        # routed once: the weights carry the router's gradient, the ids also feed the balance loss
        weights, ids = F.route(logits, self.topk, backend=self.backend, **self.route_kw)
        if self.dispatch is not None:
            out = self.dispatch(h, self.w13.to(h.dtype), self.w2.to(h.dtype), weights, ids)
        else:
            out = F.moe_experts(h, self.w13.to(h.dtype), self.w2.to(h.dtype), weights, ids, backend=self.backend)
        if self.shared_gate_up is not None:
            out = out + self.shared_down(F.swiglu(self.shared_gate_up(h), backend=self.backend))
        self.aux_loss = self.aux_loss_coef * self._balance_loss(logits, ids)
        return out.reshape(x.shape)

    def _balance_loss(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        e = logits.shape[-1]
        probs = logits.float().softmax(-1) if self.route_kw["scoring"] == "softmax" else logits.float().sigmoid()
        flat = ids.reshape(-1).long()
        frac = torch.zeros(e, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        frac = frac / max(ids.numel(), 1)  # scatter_add, not bincount: no host sync in the training step
        mean_probs = probs.sum(0) / max(probs.shape[0], 1)  # not mean(0): no tokens give 0, not NaN
        return e * (frac * mean_probs).sum()
