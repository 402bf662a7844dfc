"""`SwiGLU`: the gated feed-forward down(silu(gate(x)) · up(x)), gate and up in one matmul."""
from __future__ import annotations

import torch
from torch import nn

from . import functional as F


class SwiGLU(nn.Module):
    """x [..., dim] -> [..., dim] through hidden_dim: gate_up (one Linear, gate first), swiglu, down."""

    def __init__(self, dim: int, hidden_dim: int, *, bias: bool = False, backend: F.Backend = None):
        super().__init__()
        F.check_size("dim", dim)
        F.check_size("hidden_dim", hidden_dim)
        self.backend = F.check_backend(backend)
        self.gate_up = nn.Linear(dim, 2 * hidden_dim, bias=bias)
        self.down = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F.check_input(x, self.gate_up.in_features, self.gate_up.weight)
        return self.down(F.swiglu(self.gate_up(x), backend=self.backend))
