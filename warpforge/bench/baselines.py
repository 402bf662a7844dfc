"""What each kernel is measured against: the best thing a user could run instead of warpforge, in one place.

The plain-PyTorch forms of the hot ops are nn.functional's "torch" backend (the same code a model runs with
backend="torch"); this file adds the library kernels a user would pick (cuDNN and flash SDPA, FlexAttention)
and the slow-but-obvious paths (a per-expert loop).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from ..nn import functional as wf_functional

# the hot ops written as a PyTorch user writes them
rms_norm = partial(wf_functional.rms_norm, backend="torch")
add_rms_norm = partial(wf_functional.add_rms_norm, backend="torch")
rope = partial(wf_functional.rope, backend="torch")
swiglu = partial(wf_functional.swiglu, backend="torch")
linear_cross_entropy = partial(wf_functional.linear_cross_entropy, backend="torch")
grouped_mm_experts = wf_functional.grouped_mm_experts
gathered_mla_decode = wf_functional.gathered_mla_decode


def layer_norm(x, weight, bias, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def sdpa(backend_name: str):
    """scaled_dot_product_attention pinned to one backend ("CUDNN_ATTENTION", "FLASH_ATTENTION"), on
    [b, h, s, d] inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def flex_block_mask(causal, window, s, doc_ids=None, device="cuda"):
    """FlexAttention's block mask for causal / sliding-window / packed-document attention over s tokens."""
    from torch.nn.attention.flex_attention import create_block_mask
    left = window[0]

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= 0
        if causal:
            keep = keep & (q_idx >= kv_idx)
        if left >= 0:
            keep = keep & (q_idx - kv_idx <= left)
        if doc_ids is not None:
            keep = keep & (doc_ids[q_idx] == doc_ids[kv_idx])
        return keep
    return create_block_mask(mask_mod, None, None, s, s, device=device)


_FLEX = {}


def flex_attention():
    """torch.compile'd flex_attention, compiled once per shape and mask."""
    if "fn" not in _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention as flex
        # one compiled graph per shape and mask: without room for them all, dynamo falls back to eager
        # flex_attention, which materialises the scores (slow, and out of memory at long lengths)
        torch._dynamo.config.cache_size_limit = 256
        torch._dynamo.config.accumulated_cache_size_limit = 4096
        _FLEX["fn"] = torch.compile(flex, dynamic=False)
    return _FLEX["fn"]


def per_expert_loop(hidden, w13, w2, weights, ids):
    """MoE as a loop over the experts that have tokens (reads the expert lists on the host)."""
    inter = w2.shape[2]
    out = torch.zeros_like(hidden)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = hidden[tok] @ w13[e].T
        out.index_add_(0, tok, (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2[e].T
                       * weights[tok, slot, None].to(hidden.dtype))
    return out
