"""Drop-in torch.nn modules over warpforge ops. Each takes `backend` (see `functional`): warpforge's ops
(None, "triton", "reference"), plain PyTorch ("torch"), or a dict choosing per op."""
from . import functional
from .attention import Attention, KVCache
from .evoformer import MSAColumnAttention, MSARowAttentionWithPairBias, TriangleAttention
from .mla import MLACache, MLAttention
from .mlp import SwiGLU
from .monarch import MonarchLinear
from .moe import MoE
from .norm import RMSNorm
from .sparse_attention import SparseAttention

__all__ = ["Attention", "KVCache", "MLAttention", "MLACache", "MoE", "MonarchLinear", "RMSNorm", "SparseAttention", "SwiGLU", "MSARowAttentionWithPairBias",
           "MSAColumnAttention", "TriangleAttention", "functional"]
