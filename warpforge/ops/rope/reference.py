"""Rotary position embedding in plain PyTorch: the angle tables and what `apply_rope` computes."""
from __future__ import annotations

import torch

from ...errors import check_int, check_positive_float, fail


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0, device=None):
    """cos, sin [seq_len, head_dim / 2]: position t rotates pair (x_i, x_{i + head_dim/2}) by
    t · base^(-2i/head_dim)."""
    check_int("seq_len", seq_len, lo=0)
    check_int("head_dim", head_dim, lo=2)
    if head_dim % 2:
        fail("head_dim", "an even head dim (rotated in pairs)", head_dim)
    check_positive_float("base", base, allow_none=False)
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rope_reference(x, cos, sin):
    """Rotate pairs (x_i, x_{i + d/2}) of x [b, s, h, d] by angles with cos/sin [s, d/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.float()[None, :, None, :], sin.float()[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).to(x.dtype)
