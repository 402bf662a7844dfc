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
    assert cache.cache_seqlens.tolist() == [21, 21] and cache.length == 21


def test_training_gradients_flow():
    mod = wf.nn.MLAttention(64, 16, q_lora_rank=None, qk_nope_head_dim=32, v_head_dim=32, max_seq_len=32,
                            backend="triton").to(DEV, DTYPE)
    x = torch.randn(1, 9, 64, device=DEV, dtype=DTYPE, requires_grad=True)
    mod(x).float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and mod.wkv_b.weight.grad is not None


def test_position_comes_from_the_host_side_length():
    """Decoding takes the position from cache.length (host), not from cache_seqlens (device)."""
    torch.manual_seed(0)
    mod = wf.nn.MLAttention(64, 16, q_lora_rank=None, qk_nope_head_dim=32, v_head_dim=32, max_seq_len=32,
                            backend="reference").to(DEV, DTYPE)
    x = torch.randn(1, 6, 64, device=DEV, dtype=DTYPE)
    cache = mod.new_cache(1, 32, device=DEV, dtype=DTYPE)
    with torch.no_grad():
        mod(x[:, :5], cache)
        first = cache.kv_cache[0, 0].clone()
        cache.cache_seqlens.zero_()  # disagrees with cache.length (5) now: reading it would write at position 0
        mod(x[:, 5:], cache)
    assert cache.length == 6
    assert torch.equal(cache.kv_cache[0, 0], first) and cache.kv_cache[0, 5].abs().sum() > 0


def test_torch_backend_matches():
    torch.manual_seed(0)
    kw = dict(q_lora_rank=96, qk_nope_head_dim=32, v_head_dim=32, max_seq_len=32)
    ours = wf.nn.MLAttention(64, 16, **kw, backend="reference").to(DEV, DTYPE)
    plain = wf.nn.MLAttention(64, 16, **kw, backend="torch").to(DEV, DTYPE)
    plain.load_state_dict(ours.state_dict())
    x = torch.randn(2, 9, 64, device=DEV, dtype=DTYPE)
    with torch.no_grad():
        caches = [m.new_cache(2, 32, device=DEV, dtype=DTYPE) for m in (ours, plain)]
        for m, c in zip((ours, plain), caches):
            m(x[:, :8], c)
        a, b = ours(x[:, 8:], caches[0]), plain(x[:, 8:], caches[1])
        assert rel_l2(ours(x), plain(x)) <= 1e-2
    assert rel_l2(a, b) <= 2e-2
