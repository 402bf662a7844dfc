"""A small GPT that reads in one sitting, built from `warpforge.nn` modules.

Pre-norm decoder: RMSNorm -> attention with rotary positions (grouped-query when n_kv_head < n_head; or
DeepSeek's Multi-head Latent Attention) -> RMSNorm -> SwiGLU MLP (or a Mixture of Experts), residuals around
both, tied input/output embeddings. The next-token loss is cross-entropy on bytes (nats per byte), computed
without materialising the logits.

backend picks every hot op (attention, norms, RoPE, SwiGLU, the loss, MLA decode, MoE): None (warpforge's ops:
the Triton kernels on a GPU, their PyTorch references on a CPU), "triton", "reference", "torch" (the same model
on plain PyTorch ops, the benchmarks' baseline), or a dict {op: backend, "*": default} (see
`warpforge.nn.functional`).
"""
from __future__ import annotations

import math

import torch
import torch.utils.checkpoint
from torch import nn

from ...errors import check_dtype, check_int, check_positive_float, check_rank, check_tensor, fail, \
    host_reads_allowed
from ...nn import Attention, MLAttention, MoE, RMSNorm, SparseAttention, SwiGLU
from ...nn import functional as F
from .config import GPTConfig


def _attention(cfg: GPTConfig, backend: F.Backend) -> nn.Module:
    if cfg.attention == "mla":
        return MLAttention(cfg.d_model, cfg.n_head, q_lora_rank=None, qk_nope_head_dim=cfg.mla_head_dim,
                           v_head_dim=cfg.mla_head_dim, max_seq_len=cfg.seq_len, rope_base=cfg.rope_base,
                           backend=backend)
    if cfg.attention == "sparse":
        return SparseAttention(cfg.d_model, cfg.n_head, cfg.n_kv_head, block_size=cfg.sparse_block,
                               topk=cfg.sparse_topk, index_dim=cfg.sparse_index_dim, max_seq_len=cfg.seq_len,
                               rope_base=cfg.rope_base, backend=backend)
    return Attention(cfg.d_model, cfg.n_head, cfg.n_kv_head, causal=True, rotary=True, max_seq_len=cfg.seq_len,
                     rope_base=cfg.rope_base, backend=backend)


def _feed_forward(cfg: GPTConfig, layer: int, backend: F.Backend) -> nn.Module:
    if cfg.moe_experts and layer >= cfg.moe_first_dense:
        return MoE(cfg.d_model, cfg.moe_ffn_dim, cfg.moe_experts, cfg.moe_topk,
                   num_shared_experts=cfg.moe_shared_experts, backend=backend)
    return SwiGLU(cfg.d_model, cfg.ffn_dim, backend=backend, monarch_blocks=cfg.monarch_blocks if cfg.mlp == "monarch"
                  else 0)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int, backend: F.Backend = None):
        super().__init__()
        attn, mlp = _attention(cfg, backend), _feed_forward(cfg, layer, backend)
        self.norm1, self.attn = RMSNorm(cfg.d_model, backend=backend), attn
        self.norm2, self.mlp = RMSNorm(cfg.d_model, backend=backend), mlp

    def forward(self, x, cache=None):
        """x [b, s, d_model]; cache: this layer's KVCache / MLACache when decoding."""
        a = self.attn(self.norm1(x), cache)
        h, x = self.norm2(x, a)  # x + a and its norm
        return x + self.mlp(h)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, backend: F.Backend = None):
        super().__init__()
        if not isinstance(cfg, GPTConfig):  # a GPTConfig checks its fields as it is made
            fail("cfg", "a GPTConfig", type(cfg).__name__)
        self.cfg, self.backend = cfg, F.check_backend(backend)
        # activation checkpointing (a training setting: gpt train --checkpoint-activations): each block's activations
        # are recomputed in the backward instead of kept, for sequences whose activations do not fit
        self.checkpoint_blocks = False
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i, backend) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, backend=backend)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.apply(self._init)
        for name, p in self.named_parameters():  # residual branches start small (GPT-2)
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
            elif name.endswith("down.w_left"):  # a Monarch down projection: its last factor, scaled alike
                with torch.no_grad():
                    p.mul_(1 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets=None, cache=None):
        """idx [b, s] token ids. With targets: mean cross-entropy (nats per token). Else: logits [b, s, vocab].
        cache (from new_cache): idx continues the tokens cached so far (decoding)."""
        self._check_idx(idx, cache[0].length if cache is not None else 0)
        return self._run(idx, targets, cache)

    def _check_idx(self, idx, cached: int | None = 0) -> None:
        """idx: int token ids [b, s], s >= 1, in the vocabulary, within seq_len with the `cached` tokens before
        them (cached None: of any length, as generate keeps its own window). The ids are read on the host (a sync,
        as linear_cross_entropy's check of the targets), except while compiling or capturing a CUDA graph."""
        check_tensor("idx", idx)
        check_rank("idx", idx, 2)
        check_dtype("idx", idx, (torch.int64, torch.int32))
        if idx.numel() == 0:  # nothing to predict from: the loss would be NaN, generate has no last token
            fail("idx", "at least one row of at least one token", f"shape {tuple(idx.shape)}")
        end = None if cached is None else cached + idx.shape[1]
        if end is not None and end > self.cfg.seq_len:
            fail("idx", f"at most seq_len ({self.cfg.seq_len}) tokens, the cached ones included", end)
        if host_reads_allowed(idx):
            lo, hi = torch.aminmax(idx)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= self.cfg.vocab_size:
                fail("idx", f"token ids in [0, {self.cfg.vocab_size})", f"ids from {lo} to {hi}")

    def _run(self, idx, targets, cache):
        """forward's work on checked idx (generate checks its prompt once, not every token it feeds back)."""
        x = self.embed(idx)
        recompute = self.checkpoint_blocks and cache is None and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if recompute:  # only the block's input is kept; its insides are recomputed in the backward
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, None if cache is None else cache[i])
        x = self.norm(x)
        if targets is None:
            return self.head(x)
        h = x.reshape(-1, x.shape[-1])
        dtype = F.compute_dtype(h.device, h.dtype)  # cast as a Linear under autocast would
        loss = F.linear_cross_entropy(h.to(dtype), self.head.weight.to(dtype), targets.reshape(-1),
                                      backend=self.backend)
        for block in self.blocks:  # MoE layers' load-balancing losses, sparse attention's index losses
            if isinstance(block.mlp, MoE):
                loss = loss + block.mlp.aux_loss
            if isinstance(block.attn, SparseAttention):
                loss = loss + block.attn.aux_loss
        return loss

    def num_params(self, active: bool = False) -> int:
        """All parameters, or (active=True) those one token uses: topk of each MoE layer's experts. Counted for the
        whole model under expert parallelism too (each process holds a share of the experts)."""
        total = sum(p.numel() for p in self.parameters())
        for block in self.blocks:
            if isinstance(block.mlp, MoE):
                held = block.mlp.w13.numel() + block.mlp.w2.numel()
                # every expert, also where this process holds a share of them (expert parallelism)
                experts = held * block.mlp.num_experts // block.mlp.w13.shape[0]
                total += experts - held
                if active:
                    total -= experts * (1 - block.mlp.topk / block.mlp.num_experts)
        return int(total)

    def flops_per_token(self) -> float:
        """llm.c's count: 6N (active parameters) for the matmuls of forward + backward, plus 6·L·C·T for
        attention."""
        c = self.cfg
        return 6 * self.num_params(active=True) + 6 * c.n_layer * c.d_model * c.seq_len

    def new_cache(self, batch: int, device, dtype) -> list:
        """One empty cache per layer (KVCache, or MLACache for MLA) for up to seq_len tokens; dtype: the one
        k/v arrive in (autocast's, if on)."""
        return [block.attn.new_cache(batch, self.cfg.seq_len, device=device, dtype=dtype) for block in self.blocks]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None):
        """Continue idx [b, s] by max_new_tokens with a KV cache: the prompt in one pass, then a token a step.
        When the context is full, the cache restarts from the last half of it (a sliding window). The settings
        are those of `sample_next`."""
        c = self.cfg
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        self._check_idx(idx, cached=None)  # once: the tokens fed back are sampled from the vocabulary
        b = idx.shape[0]
        dtype = F.compute_dtype(idx.device, self.embed.weight.dtype)  # the cache holds k/v as attention sees them
        cache = self.new_cache(b, idx.device, dtype)
        logits = self._run(idx[:, -c.seq_len:], None, cache)[:, -1]
        out = idx
        for i in range(max_new_tokens):
            nxt = sample_next(logits.float(), temperature, top_k, top_p, generator)
            out = torch.cat([out, nxt], dim=1)
            if i == max_new_tokens - 1:
                break
            if cache[0].length == c.seq_len:  # full: re-read the last half of the context into a fresh cache
                cache = self.new_cache(b, idx.device, dtype)
                logits = self._run(out[:, -(c.seq_len // 2):], None, cache)[:, -1]
            else:
                logits = self._run(nxt, None, cache)[:, -1]
        return out


def check_sampling(max_new_tokens, temperature, top_k, top_p) -> None:
    """The settings of `GPT.generate` (and `sample`): WarpforgeInputErrors naming the one that cannot sample."""
    check_int("max_new_tokens", max_new_tokens, lo=1)
    check_positive_float("temperature", temperature, allow_none=False, allow_zero=True)
    if top_k is not None:
        check_int("top_k", top_k, lo=1, what="a positive int or None")
    if top_p is not None and not (isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and
                                  0 < top_p <= 1):
        fail("top_p", "a probability in (0, 1] or None", repr(top_p))


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row of logits [b, vocab]: greedy at temperature 0, else top-k / top-p sampling."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    # in float64, where any temperature > 0 is nonzero, and shifted so that the largest logit is 0: a tiny
    # temperature sends the others to -inf (sampling tends to greedy) instead of overflowing to inf (NaN softmax)
    logits = logits.double()
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature
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
