"""warpforge: portable Triton kernels for the building blocks of large models.

    import warpforge as wf
    out = wf.flash_attention(q, k, v, causal=True)
"""
from . import nn
from .errors import WarpforgeInputError
from .ops import mla
from .ops.attention import flash_attention
from .ops.mla import mla_decode

__version__ = "0.1.0"
__all__ = ["WarpforgeInputError", "flash_attention", "mla", "mla_decode", "nn", "__version__"]
