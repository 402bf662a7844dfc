"""A small GPT that reads in one sitting.

Pre-norm decoder: RMSNorm -> attention with rotary positions (grouped-query when n_kv_head < n_head)
-> RMSNorm -> SwiGLU MLP, residuals around both, tied input/output embeddings. Every hot op is a
warpforge op (flash_attention, rms_norm / add_rms_norm, apply_rope, swiglu, linear_cross_entropy): the
Triton kernels on a GPU, their PyTorch references on a CPU. The next-token loss is cross-entropy on bytes
(nats per byte), computed without materialising the logits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...nn.mla import MLACache, MLAttention
from ...nn.moe import MoE
from ...ops.attention import flash_attention
from ...ops.fused import add_rms_norm, apply_rope, linear_cross_entropy, rms_norm, rope_tables, swiglu
from .config import GPTConfig


@dataclass(frozen=True)
class Ops:
    """The model's hot ops, swappable: warpforge's kernels, or plain PyTorch (the benchmark's baseline)."""
    attention: Callable  # (q, k, v) [b, s, h, d] -> causal attention, bottom-right aligned
    rms_norm: Callable   # (x, weight, eps, out_dtype)
    add_rms_norm: Callable  # (x, residual, weight, eps, out_dtype) -> (norm of x + residual, x + residual)
    rope: Callable       # (x, cos, sin)
    swiglu: Callable     # (gate_up) -> silu(gate) * up
    linear_ce: Callable  # (hidden [N, H], weight [V, H], targets [N]) -> mean loss


def _torch_attention(q, k, v):
    s_q, s_k = q.shape[1], k.shape[1]
    mask = None if s_q == s_k else torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=mask is None, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _torch_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _torch_add_rms_norm(x, residual, weight, eps, out_dtype):
    total = x + residual
    return F.rms_norm(total, (total.shape[-1],), weight, eps).to(out_dtype), total


def _torch_swiglu(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


WARPFORGE_OPS = Ops(attention=lambda q, k, v: flash_attention(q, k, v, causal=True),
                    rms_norm=lambda x, w, eps, out_dtype: rms_norm(x, w, eps, out_dtype=out_dtype),
                    add_rms_norm=lambda x, r, w, eps, out_dtype: add_rms_norm(x, r, w, eps, out_dtype=out_dtype),
                    rope=apply_rope, swiglu=swiglu, linear_ce=linear_cross_entropy)
PYTORCH_OPS = Ops(attention=_torch_attention,
                  rms_norm=lambda x, w, eps, out_dtype: F.rms_norm(x, (x.shape[-1],), w, eps).to(out_dtype),
                  add_rms_norm=_torch_add_rms_norm, rope=_torch_rope,
                  swiglu=_torch_swiglu,
                  linear_ce=lambda h, w, t: F.cross_entropy((h @ w.T).float(), t))


def _compute_dtype(device: torch.device, default: torch.dtype) -> torch.dtype:
    """The dtype matmuls run in here: autocast's when it is on (custom ops and caches do not see autocast)."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else default


class RMSNorm(nn.Module):
    def __init__(self, dim: int, ops: Ops, eps: float = 1e-6):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, residual=None):
        """norm(x); with a residual, (norm(x + residual), x + residual) in one pass over memory."""
        # under autocast the next matmul reads bf16: the norm writes it, one pass less over the fp32 residual
        dtype = _compute_dtype(x.device, x.dtype)
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps, dtype)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, dtype)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, ops: Ops):
        super().__init__()
        self.ops = ops
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, cache=None, pos: int = 0):
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.n_head + 2 * self.n_kv_head, self.head_dim)
        q, k, v = qkv.split([self.n_head, self.n_kv_head, self.n_kv_head], dim=2)
        q, k = self.ops.rope(q, cos, sin), self.ops.rope(k, cos, sin)
        if cache is not None:  # decoding: append to this layer's cache, attend to everything so far
            cache["k"][:b, pos:pos + s] = k
            cache["v"][:b, pos:pos + s] = v
            k, v = cache["k"][:b, :pos + s], cache["v"][:b, :pos + s]
        out = self.ops.attention(q, k, v)  # bottom-right causal: new queries see the whole cache
        return self.proj(out.reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, cfg: GPTConfig, ops: Ops):
        super().__init__()
        self.ops = ops
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down(self.ops.swiglu(self.gate_up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, ops: Ops, layer: int):
        super().__init__()
        self.mla = cfg.attention == "mla"
        if self.mla:  # its own rotary tables and latent cache (MLACache)
            attn = MLAttention(cfg.d_model, cfg.n_head, q_lora_rank=None, qk_nope_head_dim=cfg.mla_head_dim,
                               v_head_dim=cfg.mla_head_dim, max_seq_len=cfg.seq_len, rope_base=cfg.rope_base)
        else:
            attn = Attention(cfg, ops)
        if cfg.moe_experts and layer >= cfg.moe_first_dense:
            mlp = MoE(cfg.d_model, cfg.moe_ffn_dim, cfg.moe_experts, cfg.moe_topk,
                      num_shared_experts=cfg.moe_shared_experts)
        else:
            mlp = MLP(cfg, ops)
        self.norm1, self.attn = RMSNorm(cfg.d_model, ops), attn
        self.norm2, self.mlp = RMSNorm(cfg.d_model, ops), mlp

    def forward(self, x, cos, sin, cache=None, pos: int = 0):
        h = self.norm1(x)
        a = self.attn(h, cache) if self.mla else self.attn(h, cos, sin, cache, pos)
        h, x = self.norm2(x, a)  # x + a and its norm
        return x + self.mlp(h)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, ops: Ops = WARPFORGE_OPS):
        super().__init__()
        if cfg.d_model % cfg.n_head or cfg.n_head % cfg.n_kv_head:
            raise ValueError("d_model must divide by n_head, and n_head by n_kv_head")
        self.cfg, self.ops = cfg, ops
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, ops, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, ops)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # residual branches start small (GPT-2)
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets=None, cache=None, pos: int = 0):
        """idx [b, s] token ids. With targets: mean cross-entropy (nats per token). Else: logits [b, s, vocab]."""
        s = idx.shape[1]
        if pos + s > self.cfg.seq_len:
            raise ValueError(f"sequence of {pos + s} tokens is longer than seq_len {self.cfg.seq_len}")
        x = self.embed(idx)
        cos, sin = self.cos[pos:pos + s], self.sin[pos:pos + s]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if cache is None else cache[i], pos)
        x = self.norm(x)
        if targets is None:
            return self.head(x)
        h = x.reshape(-1, x.shape[-1])
        dtype = _compute_dtype(h.device, h.dtype)  # cast as a Linear under autocast would
        loss = self.ops.linear_ce(h.to(dtype), self.head.weight.to(dtype), targets.reshape(-1))
        for block in self.blocks:  # MoE layers' load-balancing losses
            if isinstance(block.mlp, MoE):
                loss = loss + block.mlp.aux_loss
        return loss

    def num_params(self, active: bool = False) -> int:
        """All parameters, or (active=True) those one token uses: topk of each MoE layer's experts."""
        total = sum(p.numel() for p in self.parameters())
        if active:
            for block in self.blocks:
                if isinstance(block.mlp, MoE):
                    experts = block.mlp.w13.numel() + block.mlp.w2.numel()
                    total -= experts * (1 - block.mlp.topk / block.mlp.w13.shape[0])
        return int(total)

    def flops_per_token(self) -> float:
        """llm.c's count: 6N (active parameters) for the matmuls of forward + backward, plus 6·L·C·T for
        attention."""
        c = self.cfg
        return 6 * self.num_params(active=True) + 6 * c.n_layer * c.d_model * c.seq_len

    def new_cache(self, batch: int, device, dtype):
        c = self.cfg
        if c.attention == "mla":
            return [MLACache.allocate(batch, c.seq_len, page_size=16, device=device, dtype=dtype)
                    for _ in range(c.n_layer)]
        return [{"k": torch.empty(batch, c.seq_len, c.n_kv_head, c.head_dim, device=device, dtype=dtype),
                 "v": torch.empty(batch, c.seq_len, c.n_kv_head, c.head_dim, device=device, dtype=dtype)}
                for _ in range(c.n_layer)]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None):
        """Continue idx [b, s] by max_new_tokens with a KV cache: the prompt in one pass, then a token a step.
        When the context is full, the cache restarts from the last half of it (a sliding window)."""
        c = self.cfg
        b = idx.shape[0]
        dtype = _compute_dtype(idx.device, self.embed.weight.dtype)  # the cache holds k/v as attention sees them
        cache = self.new_cache(b, idx.device, dtype)
        out = idx
        window = idx[:, -c.seq_len:]
        logits = self(window, cache=cache, pos=0)[:, -1]
        pos = window.shape[1]
        for _ in range(max_new_tokens):
            nxt = sample_next(logits.float(), temperature, top_k, top_p, generator)
            out = torch.cat([out, nxt], dim=1)
            if pos == c.seq_len:  # full: re-read the last half of the context into a fresh cache
                window = out[:, -(c.seq_len // 2):]
                cache = self.new_cache(b, idx.device, dtype)
                logits = self(window, cache=cache, pos=0)[:, -1]
                pos = window.shape[1]
            else:
                logits = self(nxt, cache=cache, pos=pos)[:, -1]
                pos += 1
        return out


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row of logits [b, vocab]: greedy at temperature 0, else top-k / top-p sampling."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)
