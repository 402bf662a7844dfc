"""warpforge: portable Triton kernels for the building blocks of large models.

    import warpforge as wf
    out = wf.flash_attention(q, k, v, causal=True)
"""
from . import nn
from .errors import WarpforgeInputError
from .ops import mla, moe, paged
from .ops.attention import flash_attention, flash_attention_fp8
from .ops.evoformer import evoformer_attention
from .ops.linear_ce import linear_cross_entropy
from .ops.mla import mla_decode
from .ops.moe import fused_moe
from .ops.monarch import monarch_linear
from .ops.norm import add_rms_norm, layer_norm, rms_norm
from .ops.paged import paged_decode
from .ops.rope import apply_rope
from .ops.sparse import select_blocks, sparse_attention, sparse_attention_index_loss
from .ops.swiglu import swiglu

__version__ = "0.1.0"
__all__ = ["WarpforgeInputError", "flash_attention", "flash_attention_fp8", "evoformer_attention", "mla", "mla_decode", "moe", "fused_moe",
           "paged", "paged_decode", "rms_norm", "add_rms_norm", "layer_norm", "apply_rope", "swiglu",
           "linear_cross_entropy", "monarch_linear", "sparse_attention", "select_blocks",
           "sparse_attention_index_loss", "nn", "__version__"]
