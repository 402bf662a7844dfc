"""Rotary position tables of a served model: inverse frequencies as transformers computes them (rope_theta, and
the "linear" and "llama3" scalings), cos / sin per position, read by the forward for each token's position."""
from __future__ import annotations

import math

import torch

from ..ops.rope import rope_tables
from .loader import ModelSpec


def inv_freq(spec: ModelSpec) -> torch.Tensor:
    """fp32 [head_dim / 2], exactly transformers' default formula (then scaled), so that fp32 logits match."""
    d = spec.head_dim
    freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = spec.rope_scaling
    if s is None:
        return freq
    factor = float(s["factor"])
    if s["rope_type"] == "linear":
        return freq / factor
    # llama3: long wavelengths slowed by factor, short ones kept, a smooth blend between
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def tables(spec: ModelSpec, positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [positions, head_dim / 2] (apply_rope's tables)."""
    if spec.rope_tables == "warpforge":  # the GPT was trained with ops.rope's tables
        return rope_tables(positions, spec.head_dim, spec.rope_theta, device=device)
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq(spec))
    return angles.cos().to(device), angles.sin().to(device)
