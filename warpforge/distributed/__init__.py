"""Training across processes on torch.distributed: expert parallelism for MoE (all-to-all), context
parallelism for long attention (ring attention), and a ZeRO-2-style sharded optimizer. The GPT's trainer
(models/gpt/train.py) uses them; each also works on its own in any torch.distributed program (gloo on CPU,
NCCL on GPUs)."""
from .expert_parallel import expert_parallel_experts, local_expert_range, shard_experts
from .ring_attention import ring_attention, shard_sequence, unshard_sequence
from .zero import ShardedAdamW

__all__ = ["ShardedAdamW", "expert_parallel_experts", "local_expert_range", "ring_attention", "shard_experts",
           "shard_sequence", "unshard_sequence"]
