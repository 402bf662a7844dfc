"""Training across processes on torch.distributed: expert parallelism for MoE (all-to-all), context
parallelism for long attention (ring attention; sparse attention over gathered keys), and a ZeRO-2-style sharded
optimizer. The GPT's trainer
(models/gpt/train.py) uses them; each also works on its own in any torch.distributed program (gloo on CPU,
NCCL on GPUs)."""
from .context import ContextParallel, context_parallel
from .sparse_attention_cp import sparse_attention_cp, sparse_attention_index_loss_cp
from .expert_parallel import expert_parallel_experts, local_expert_range, shard_experts
from .ring_attention import ring_attention, shard_sequence, unshard_sequence
from .zero import ShardedAdamW

__all__ = ["ContextParallel", "ShardedAdamW", "context_parallel", "expert_parallel_experts", "local_expert_range",
           "ring_attention", "shard_experts", "shard_sequence", "sparse_attention_cp", "sparse_attention_index_loss_cp",
           "unshard_sequence"]
