"""`SwiGLU`: the gated feed-forward down(silu(gate(x)) · up(x)), gate and up in one matmul (dense, or Monarch)."""
from __future__ import annotations

import torch
from torch import nn

from . import functional as F
from .monarch import MonarchLinear


class SwiGLU(nn.Module):
    """x [..., dim] -> [..., dim] through hidden_dim: gate_up (one Linear, gate first), swiglu, down.
    monarch_blocks > 0: both projections are MonarchLinear layers of that many blocks (dim and hidden_dim
    divisible by it)."""

    def __init__(self, dim: int, hidden_dim: int, *, bias: bool = False, backend: F.Backend = None,
                 monarch_blocks: int = 0):
        super().__init__()
        F.check_size("dim", dim)
        F.check_size("hidden_dim", hidden_dim)
        F.check_size("monarch_blocks", monarch_blocks, lo=0)
        self.backend = F.check_backend(backend)
        if monarch_blocks:
            self.gate_up = MonarchLinear(dim, 2 * hidden_dim, monarch_blocks, bias=bias, backend=backend)
            self.down = MonarchLinear(hidden_dim, dim, monarch_blocks, bias=bias, backend=backend)
        else:
            self.gate_up = nn.Linear(dim, 2 * hidden_dim, bias=bias)
            self.down = nn.Linear(hidden_dim, dim, bias=bias)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F.check_input(x, self.dim, next(self.gate_up.parameters()))
        return self.down(F.swiglu(self.gate_up(x), backend=self.backend))
