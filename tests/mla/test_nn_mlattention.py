"""nn.MLAttention: absorbed decode over the paged cache equals the non-absorbed attention it stands for."""
import pytest
import torch

import warpforge as wf
from warpforge.testing import device_under_test, dtypes_under_test, rel_l2

DEV = device_under_test()
DTYPE = dtypes_under_test()[-1]


@pytest.mark.parametrize("q_lora_rank", [None, 96])
def test_decode_with_cache_matches_full_attention(q_lora_rank):
    torch.manual_seed(0)
    mod = wf.nn.MLAttention(64, 16, q_lora_rank=q_lora_rank, qk_nope_head_dim=32, v_head_dim=32, max_seq_len=64,
                            backend="triton").to(DEV, DTYPE)
    x = torch.randn(2, 21, 64, device=DEV, dtype=DTYPE) * 2
    with torch.no_grad():
        full = mod(x)  # non-absorbed causal attention over all 21 tokens
        cache = wf.nn.MLACache.allocate(2, 32, page_size=16, device=DEV, dtype=DTYPE)
        first = mod(x[:, :17], cache)  # prefill 17 tokens into the paged cache
        steps = [mod(x[:, t:t + 1], cache) for t in range(17, 20)]  # three absorbed decode steps
        mtp = mod(x[:, 20:21], cache)
    assert rel_l2(first, full[:, :17]) <= 1e-2
    for i, step in enumerate(steps):
        assert rel_l2(step, full[:, 17 + i:18 + i]) <= 2e-2
    assert rel_l2(mtp, full[:, 20:21]) <= 2e-2
    assert cache.cache_seqlens.tolist() == [21, 21]


def test_training_gradients_flow():
    mod = wf.nn.MLAttention(64, 16, q_lora_rank=None, qk_nope_head_dim=32, v_head_dim=32, max_seq_len=32,
                            backend="triton").to(DEV, DTYPE)
    x = torch.randn(1, 9, 64, device=DEV, dtype=DTYPE, requires_grad=True)
    mod(x).float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and mod.wkv_b.weight.grad is not None
