"""The Llama-style decoder, served: Llama 2/3, Mistral, Qwen2 (qkv biases), Qwen3 (q/k RMSNorm per head) and the
warpforge GPT share it. Pre-norm blocks: RMSNorm -> GQA attention with RoPE over the paged cache -> RMSNorm ->
SwiGLU MLP, residuals around both; a final RMSNorm and the LM head (the embedding when tied).

The forward takes a StepBatch (every scheduled sequence's new tokens packed into one row, [T, hidden]) and returns
fp32 logits only for the rows the step samples from. It holds weights as plain tensors (no nn.Module: nothing
here trains) fused as loader.py returns them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...ops.norm import add_rms_norm, rms_norm
from ...ops.rope import apply_rope
from ...ops.swiglu import swiglu
from .. import rope
from ..attention import attend
from ..batch import StepBatch
from ..kv_cache import PagedKVCache
from ..loader import ModelSpec


class LlamaModel:
    def __init__(self, spec: ModelSpec, weights: dict, max_positions: int, device):
        self.spec, self.w = spec, weights
        self.dtype = weights["embed"].dtype
        self.device = torch.device(device)
        self.cos, self.sin = rope.tables(spec, max_positions, device)
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self.q_width, self.kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim

    @torch.no_grad()
    def forward(self, batch: StepBatch, cache: PagedKVCache) -> torch.Tensor:
        """fp32 logits [len(batch.logits_index), vocab]."""
        s, w = self.spec, self.w
        t = batch.num_tokens
        x = F.embedding(batch.input_ids, w["embed"])
        cos = self.cos[batch.positions].to(self.dtype)  # transformers casts its tables to the model's dtype
        sin = self.sin[batch.positions].to(self.dtype)
        residual = None
        for i in range(s.num_layers):
            if residual is None:
                h, residual = rms_norm(x, w[f"{i}.attn_norm"], s.rms_norm_eps), x
            else:
                h, residual = add_rms_norm(x, residual, w[f"{i}.attn_norm"], s.rms_norm_eps)
            qkv = F.linear(h, w[f"{i}.qkv"], w.get(f"{i}.qkv_bias"))
            heads = qkv.view(t, s.num_heads + 2 * s.num_kv_heads, s.head_dim)
            v = heads[:, s.num_heads + s.num_kv_heads:]
            if s.qk_norm:
                q = rms_norm(heads[:, :s.num_heads], w[f"{i}.q_norm"], s.rms_norm_eps)
                k = rms_norm(heads[:, s.num_heads:s.num_heads + s.num_kv_heads], w[f"{i}.k_norm"], s.rms_norm_eps)
                q = apply_rope(q[None], cos, sin)[0]
                k = apply_rope(k[None], cos, sin)[0]
            else:  # q's and k's heads lie side by side in qkv: one rotation for both, no copies (a decode step's
                # launches are what keep it from the weight-read floor)
                qk = apply_rope(heads[None, :, :s.num_heads + s.num_kv_heads], cos, sin)[0]
                q, k = qk[:, :s.num_heads], qk[:, s.num_heads:]
            o = attend(i, q, k, v, cache, batch, softmax_scale=self.scale, window=s.sliding_windows[i])
            x = F.linear(o.reshape(t, self.q_width), w[f"{i}.o"], w.get(f"{i}.o_bias"))
            h, residual = add_rms_norm(x, residual, w[f"{i}.mlp_norm"], s.rms_norm_eps)
            x = F.linear(swiglu(F.linear(h, w[f"{i}.gate_up"])), w[f"{i}.down"])
        h, _ = add_rms_norm(x, residual, w["norm"], s.rms_norm_eps)
        if not batch.all_logits:
            h = h[batch.logits_index]
        return F.linear(h, w["lm_head"]).float()
