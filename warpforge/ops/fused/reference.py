"""The GPT's training ops in plain PyTorch: what the fused kernels compute (and their CPU fallback)."""
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


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0, device=None):
    """cos, sin [seq_len, head_dim / 2]: position t rotates pair (x_i, x_{i + head_dim/2}) by
    t · base^(-2i/head_dim)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rope_reference(x, cos, sin):
    """Rotate pairs (x_i, x_{i + d/2}) of x [b, s, h, d] by angles with cos/sin [s, d/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.float()[None, :, None, :], sin.float()[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).to(x.dtype)


def swiglu_reference(gate_up):
    """gate_up [..., 2I] (gate first, then up) -> silu(gate) * up [..., I]."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def linear_cross_entropy_reference(hidden, weight, targets, ignore_index=-100):
    """Mean cross-entropy of logits = hidden @ weightᵀ against targets, over targets != ignore_index."""
    logits = hidden.float() @ weight.float().T
    return F.cross_entropy(logits, targets, ignore_index=ignore_index)
