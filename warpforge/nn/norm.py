"""`RMSNorm`: rms_norm, or with a residual the fused add_rms_norm (the residual add and the next norm in one
pass over memory)."""
from __future__ import annotations

import torch
from torch import nn

from ..errors import check_positive_float, check_same_device
from . import functional as F


class RMSNorm(nn.Module):
    """x [..., dim] -> x / rms(x) · weight. Under autocast it writes autocast's dtype: the next matmul reads that,
    so the norm makes the cast without another pass over the (fp32) residual stream."""

    def __init__(self, dim: int, eps: float = 1e-6, *, backend: F.Backend = None):
        super().__init__()
        F.check_size("dim", dim)
        check_positive_float("eps", eps, allow_none=False)
        self.eps, self.backend = eps, F.check_backend(backend)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual)."""
        F.check_input(x, self.weight.shape[0])  # the op would name its weight; x is what does not fit
        check_same_device("x", x, "the module's weights", self.weight)  # (any float dtype goes: no dtype check)
        dtype = F.compute_dtype(x.device, x.dtype)
        if residual is None:
            return F.rms_norm(x, self.weight, self.eps, dtype, backend=self.backend)
        return F.add_rms_norm(x, residual, self.weight, self.eps, dtype, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
