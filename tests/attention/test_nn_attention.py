"""warpforge.nn.Attention: the module matches the same computation written out with the reference."""
import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.ops.attention import attention_reference
from warpforge.testing import device_under_test, dtypes_under_test, ragged_cu_seqlens, rel_l2

DEV = device_under_test()


def _by_hand(mod, x):
    qkv = mod.qkv(x).unflatten(-1, (mod.n_heads + 2 * mod.n_kv_heads, mod.head_dim))
    q, k, v = qkv.split([mod.n_heads, mod.n_kv_heads, mod.n_kv_heads], dim=-2)
    out, _ = attention_reference(q.float(), k.float(), v.float(), causal=mod.causal, window=mod.window)
    return mod.proj(out.to(x.dtype).flatten(-2))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_module_matches_by_hand(kv_heads):
    dtype = dtypes_under_test()[-1]
    mod = wf.nn.Attention(128, 4, kv_heads, causal=True, backend="triton").to(DEV, dtype)
    x = torch.randn(2, 23, 128, device=DEV, dtype=dtype, requires_grad=True)
    out = mod(x)
    ref = _by_hand(mod, x)
    assert out.shape == x.shape
    assert rel_l2(out, ref) <= 1e-2
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    (rx,) = torch.autograd.grad(ref, x, g)
    assert rel_l2(gx, rx) <= 1e-2


def test_module_packed_varlen():
    dtype = dtypes_under_test()[-1]
    mod = wf.nn.Attention(64, 2, causal=True, backend="triton").to(DEV, dtype)
    lengths = [5, 17, 1]
    x = torch.randn(sum(lengths), 64, device=DEV, dtype=dtype)
    out = mod(x, cu_seqlens=ragged_cu_seqlens(lengths, DEV))
    start = 0
    for n in lengths:  # each packed sequence attends only to itself
        ref = _by_hand(mod, x[None, start:start + n])[0]
        assert rel_l2(out[start:start + n], ref) <= 1e-2
        start += n


def test_module_bad_config():
    with pytest.raises(WarpforgeInputError, match="^n_kv_heads"):
        wf.nn.Attention(128, 4, 3)
    with pytest.raises(WarpforgeInputError, match="^dim"):
        wf.nn.Attention(130, 4)


def test_rotary_kv_cache_decoding_matches_full_attention():
    """With rotary positions, a prompt into a KVCache and then a token at a time give what attention over the
    whole sequence gives; the cache's position lives on the host."""
    dtype = dtypes_under_test()[-1]
    torch.manual_seed(0)
    mod = wf.nn.Attention(128, 4, 2, rotary=True, max_seq_len=32, backend="triton").to(DEV, dtype)
    x = torch.randn(2, 11, 128, device=DEV, dtype=dtype)
    with torch.no_grad():
        full = mod(x)
        cache = mod.new_cache(2, 16, device=DEV, dtype=dtype)
        parts = [mod(x[:, :8], cache)] + [mod(x[:, t:t + 1], cache) for t in range(8, 11)]
    assert cache.length == 11
    assert rel_l2(torch.cat(parts, 1), full) <= 1e-2
    with pytest.raises(WarpforgeInputError, match="^cache"):
        mod(torch.randn(2, 6, 128, device=DEV, dtype=dtype), cache)  # 17 tokens into a cache of 16


def test_rotary_packed_sequences_each_start_at_position_zero():
    dtype = dtypes_under_test()[-1]
    mod = wf.nn.Attention(64, 2, rotary=True, max_seq_len=32, backend="triton").to(DEV, dtype)
    lengths = [5, 17, 1]
    x = torch.randn(sum(lengths), 64, device=DEV, dtype=dtype)
    out = mod(x, cu_seqlens=ragged_cu_seqlens(lengths, DEV), max_seqlen=max(lengths))
    start = 0
    for n in lengths:
        assert rel_l2(out[start:start + n], mod(x[None, start:start + n])[0]) <= 1e-2
        start += n


def test_rotary_positions_past_the_tables_fail():
    mod = wf.nn.Attention(64, 2, rotary=True, max_seq_len=8)
    with pytest.raises(WarpforgeInputError, match="max_seq_len"):
        mod(torch.randn(1, 9, 64))


def test_torch_backend_matches():
    torch.manual_seed(0)
    ours = wf.nn.Attention(128, 4, 2, rotary=True, max_seq_len=32)
    plain = wf.nn.Attention(128, 4, 2, rotary=True, max_seq_len=32, backend="torch")
    plain.load_state_dict(ours.state_dict())
    x = torch.randn(2, 9, 128)
    torch.testing.assert_close(ours(x), plain(x), rtol=1e-4, atol=1e-5)


def test_cu_seqlens_by_position_is_caught():
    mod = wf.nn.Attention(64, 2)
    with pytest.raises(WarpforgeInputError, match="^cache.*by keyword"):
        mod(torch.randn(6, 64), ragged_cu_seqlens([2, 4], "cpu"))
