"""warpforge: portable Triton kernels for the building blocks of large models.

    import warpforge as wf
    out = wf.flash_attention(q, k, v, causal=True)
"""
from . import nn
from .errors import WarpforgeInputError
from .ops.attention import flash_attention

__version__ = "0.1.0"
__all__ = ["WarpforgeInputError", "flash_attention", "nn", "__version__"]
