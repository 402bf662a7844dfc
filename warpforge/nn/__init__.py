"""Drop-in torch.nn modules over warpforge ops."""
from .attention import Attention
from .moe import MoE

__all__ = ["Attention", "MoE"]
