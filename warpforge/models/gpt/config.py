"""GPT shapes and training settings, and the named presets."""
from __future__ import annotations

from dataclasses import dataclass, fields

from ...errors import check_bool, check_choice, check_int, check_positive_float, fail


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256        # bytes (tokenizer "gpt2": 50304)
    tokenizer: str = "bytes"     # "bytes" (UTF-8) or "gpt2" (GPT-2's BPE through tiktoken; models/gpt/tokenizer.py)
    seq_len: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_kv_head: int = 6           # < n_head: grouped-query attention
    d_model: int = 384
    ffn_mult: float = 8 / 3      # SwiGLU hidden = ffn_mult * d_model, rounded up to a multiple of 64
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    # DeepSeek-style blocks: Multi-head Latent Attention, Mixture-of-Experts feed-forward
    attention: str = "mha"           # "mha" (GQA when n_kv_head < n_head), "mla", or "sparse" (top-k block-sparse)
    mla_head_dim: int = 32           # per-head nope and v width of MLA (its latent is 512 + 64 rope)
    moe_experts: int = 0             # 0: dense SwiGLU everywhere
    moe_topk: int = 2
    moe_ffn_dim: int = 256           # per expert
    moe_shared_experts: int = 1
    moe_first_dense: int = 1         # the first layers keep a dense feed-forward
    sparse_block: int = 128          # attention="sparse": block size, blocks kept per query block, index head width
    sparse_topk: int = 16
    sparse_index_dim: int = 32
    mlp: str = "swiglu"              # the dense feed-forward's projections: "swiglu" (nn.Linear) or "monarch"
    monarch_blocks: int = 4          # blocks of each MonarchLinear with mlp="monarch"

    def __post_init__(self):
        """Shapes GPT can build, each checked under its own name (the modules' checks would name theirs). The MoE
        and MLA widths are checked by MoE and MLAttention."""
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model"):
            check_int(name, getattr(self, name), lo=1)
        if self.d_model % self.n_head:
            fail("d_model", f"a multiple of n_head ({self.n_head})", self.d_model)
        if self.n_head % self.n_kv_head:
            fail("n_kv_head", f"a divisor of n_head ({self.n_head})", self.n_kv_head)
        check_positive_float("ffn_mult", self.ffn_mult, allow_none=False)
        check_positive_float("rope_base", self.rope_base, allow_none=False)
        check_bool("tie_embeddings", self.tie_embeddings)
        check_choice("attention", self.attention, ("mha", "mla", "sparse"))
        if self.attention == "sparse":
            check_int("sparse_block", self.sparse_block, 16, 256, what="a power of two from 16 to 256")
            if self.sparse_block & (self.sparse_block - 1):
                fail("sparse_block", "a power of two from 16 to 256", self.sparse_block)
            check_int("sparse_topk", self.sparse_topk, lo=1)
            check_int("sparse_index_dim", self.sparse_index_dim, 8, 128, what="a multiple of 8 from 8 to 128")
            if self.sparse_index_dim % 8:
                fail("sparse_index_dim", "a multiple of 8 from 8 to 128", self.sparse_index_dim)
            if self.head_dim % 8:
                fail("d_model", "a head dim (d_model / n_head) that is a multiple of 8 with sparse attention",
                     self.head_dim)
        check_int("moe_experts", self.moe_experts, lo=0, what="an int >= 0 (0: no MoE)")
        check_int("moe_first_dense", self.moe_first_dense, lo=0)
        check_choice("tokenizer", self.tokenizer, ("bytes", "gpt2"))
        if self.tokenizer == "gpt2" and self.vocab_size < 50257:
            fail("vocab_size", "at least 50257 (GPT-2's ids) with tokenizer 'gpt2'", self.vocab_size)
        check_choice("mlp", self.mlp, ("swiglu", "monarch"))
        check_int("monarch_blocks", self.monarch_blocks, lo=1)
        if self.mlp == "monarch":
            for name, width in (("d_model", self.d_model), ("ffn_mult", self.ffn_dim)):
                if width % self.monarch_blocks:
                    fail(name, f"a feed-forward width divisible by monarch_blocks ({self.monarch_blocks})",
                         f"{width}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def ffn_dim(self) -> int:
        return -(-int(self.ffn_mult * self.d_model) // 64) * 64


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 32
    max_steps: int = 2000
    max_minutes: float | None = None  # stop (and save) when this much wall time has passed
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_batches: int = 20
    ckpt_every: int = 500
    data: str = "shakespeare"        # "random" (throughput runs, no prepare needed), or a folder of train.bin /
                                     # val.bin holding uint16 token ids (nanoGPT's format; --vocab_size=N to fit)
    compile: str = "auto"            # torch.compile the step: "on", "off", "graphs" (compiled and replayed from
                                     # CUDA graphs), "auto" (graphs on CUDA, where launch overhead otherwise bounds
                                     # the step and DDP cannot scale; off on CPU)
    parallel: str = "ddp"            # several processes (torchrun): "ddp" (replicated), "zero2" (replicated parameters,
                                     # gradients reduce-scattered and optimizer state sharded: ZeRO stage 2) or
                                     # "fsdp" (FSDP2: parameters, gradients and optimizer state sharded across ranks)
    batch_scaling: str = "strong"    # several processes: "strong" (batch_size is the global batch, split across the
                                     # processes) or "weak" (batch_size is each process's: the global batch grows with
                                     # the processes, as users scale out)
    checkpoint_activations: bool = False  # recompute each block's activations in the backward instead of keeping them
                                     # (long sequences: the memory of one block's input per layer)
    context_parallel: bool = False   # several processes: each sequence is split across them and attention runs across
                                     # them (dense: ring attention over zigzag shards; sparse: sparse_attention_cp over
                                     # contiguous chunks); every process reads the same sequences
    expert_parallel: bool = False    # several processes, an MoE model: each process keeps num_experts / W experts of
                                     # every MoE layer and tokens reach them by all-to-all (DDP for the rest)
    ddp_bucket_mb: float = 25.0      # DDP's gradient bucket size: each bucket is one all-reduce, and under
                                     # torch.compile one graph split (DDPOptimizer), so fewer buckets fuse more
    ddp_bf16_grads: bool = False     # DDP: all-reduce gradients in bf16 (half the bytes; rounded once a step)
    seed: int = 1337
    teacher: str = ""                # a trained run's folder (or its ckpt.pt): train to its next-token distributions
                                     # (KL(teacher || model) per token, not the data's cross-entropy): a draft model
                                     # for speculative decoding that agrees with its target; "": off
    wandb: str = ""                  # a Weights & Biases project to log to (rank 0; needs `pip install wandb`); "": off


@dataclass(frozen=True)
class Preset:
    model: GPTConfig
    train: TrainConfig


PRESETS = {
    # CPU-sized: trains on a 2-core CPU within its time limit (the CPU bar: val <= 2.2 nats/byte within 5 minutes).
    "tiny": Preset(GPTConfig(seq_len=128, n_layer=4, n_head=4, n_kv_head=4, d_model=128),
                   TrainConfig(batch_size=32, max_steps=400, max_minutes=4.5, lr=3e-3, warmup_steps=30,
                               eval_every=100, eval_batches=10, ckpt_every=100, weight_decay=0.0)),
    # ~10M parameters, for one GPU; 600 steps, since longer runs overfit the plays.
    "shakespeare": Preset(GPTConfig(seq_len=512, n_layer=8, n_head=5, n_kv_head=5, d_model=320),
                          TrainConfig(batch_size=64, max_steps=600, max_minutes=10, lr=2e-3, warmup_steps=60,
                                      eval_every=100, ckpt_every=300)),
    # GPT-2 small's shape, for throughput (bf16, seq 1024, batch 16, random tokens by default).
    "gpt2-124m": Preset(GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, n_kv_head=12,
                                  d_model=768, ffn_mult=4.0),
                        TrainConfig(batch_size=16, max_steps=200, lr=6e-4, warmup_steps=20, eval_every=10**9,
                                    ckpt_every=10**9, data="random")),
    # MLA attention + MoE feed-forward, DeepSeek-V3's blocks at toy size (the MLA decode kernel wants 16+ heads);
    # for a GPU: slow on a CPU.
    # Top-k block-sparse attention (MiniMax Sparse Attention style) over 32k-byte windows of Shakespeare read as one
    # long stream: each 128-byte block keeps its own and 16 earlier blocks (1/15 of causal attention at 32k). For a
    # GPU; `--attention=mha` trains the dense twin for the comparison.
    "long": Preset(GPTConfig(seq_len=32768, n_layer=4, n_head=8, n_kv_head=2, d_model=256, attention="sparse",
                             sparse_block=128, sparse_topk=16, sparse_index_dim=32),
                   TrainConfig(batch_size=2, max_steps=300, max_minutes=10, lr=2e-3, warmup_steps=30,
                               eval_every=100, eval_batches=4, ckpt_every=10**9)),
    "deepseek-mini": Preset(GPTConfig(seq_len=256, n_layer=4, n_head=16, n_kv_head=16, d_model=256,
                                      attention="mla", mla_head_dim=32, moe_experts=8, moe_topk=2, moe_ffn_dim=256),
                            TrainConfig(batch_size=32, max_steps=2000, max_minutes=10, lr=2e-3, warmup_steps=100,
                                        eval_every=250, ckpt_every=500)),
}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


# fields older checkpoints may carry that no longer exist, with the value that meant "off"
_RETIRED = {"dropout": 0.0}


def from_dict(cls, d: dict):
    """A GPTConfig / TrainConfig from a checkpoint's dict; retired fields are dropped while they hold their no-op
    value (else a ValueError, as for an unknown field)."""
    known = {f.name for f in fields(cls)}
    extra = {k: v for k, v in d.items() if k not in known}
    if any(k not in _RETIRED or _RETIRED[k] != v for k, v in extra.items()):
        raise ValueError(f"{cls.__name__} has no fields {sorted(extra)}")
    return cls(**{k: v for k, v in d.items() if k in known})
