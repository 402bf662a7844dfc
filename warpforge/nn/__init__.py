"""Drop-in torch.nn modules over warpforge ops."""
from .attention import Attention

__all__ = ["Attention"]
