"""RMSNorm and LayerNorm in plain PyTorch: what the norm kernels compute (and their CPU fallback)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x, weight, eps=1e-6):
    """x / sqrt(mean(x², -1) + eps) * weight, computed in fp32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def add_rms_norm_reference(x, residual, weight, eps=1e-6):
    """(rms_norm_reference(x + residual), x + residual), the sum in x's and residual's promoted dtype."""
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


def layer_norm_reference(x, weight, bias, eps=1e-5):
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)
