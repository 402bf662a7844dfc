"""Drop-in torch.nn modules over warpforge ops."""
from .attention import Attention
from .mla import MLACache, MLAttention
from .moe import MoE

__all__ = ["Attention", "MLAttention", "MLACache", "MoE"]
