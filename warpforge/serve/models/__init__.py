"""Served model families, one file each; `build` picks the forward for a ModelSpec's family. Mixture-of-Experts
(Mixtral, Qwen3-MoE through fused_moe) and MLA (DeepSeek) families are added as files beside llama.py and a line
in FAMILIES (loader.py) and here."""
from __future__ import annotations

from ..loader import ModelSpec
from .llama import LlamaModel

_BUILDERS = {"llama": LlamaModel}


def build(spec: ModelSpec, weights: dict, max_positions: int, device):
    return _BUILDERS[spec.family](spec, weights, max_positions, device)


__all__ = ["build", "LlamaModel"]
