"""warpforge.compat.flash_attn: flash-attn 2's call sites, unchanged, against warpforge's references on both
backends (the Triton interpreter on CPU); bad input raises WarpforgeInputError naming the argument."""
import math

import pytest
import torch

import warpforge.compat.flash_attn as flash_attn
from warpforge import WarpforgeInputError
from warpforge.ops.attention import attention_reference, attention_varlen_reference
from warpforge.ops.paged import paged_decode_reference
from warpforge.testing import REL_L2, device_under_test, dtypes_under_test, poisoned_outputs, ragged_cu_seqlens, rel_l2

DEV = device_under_test()
DTYPE = dtypes_under_test()[-1]
BACKENDS = ["triton", "reference"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("WARPFORGE_BACKEND", request.param)  # flash-attn's calls take no backend argument
    return request.param


def _rn(*shape, dtype=DTYPE):
    return torch.randn(*shape, device=DEV, dtype=dtype)


def _inf_lse(lse):
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def _close(out, ref, dtype=DTYPE):
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_l2(out, ref) <= REL_L2[dtype]


# ------------------------------------------------------------------------------------------ dense
def test_issue_call_causal_window(backend):
    """The issue's line: flash_attn_func(q, k, v, 0.0, None, True, (256, 0)), GQA, s_q != s_k."""
    q, k, v = _rn(2, 21, 4, 32), _rn(2, 27, 2, 32), _rn(2, 27, 2, 32)
    with poisoned_outputs():
        out = flash_attn.flash_attn_func(q, k, v, 0.0, None, True, (256, 0))
    ref, _ = attention_reference(q.float(), k.float(), v.float(), causal=True, window=(256, 0))
    _close(out, ref)


@pytest.mark.parametrize("kw", [
    dict(window_size=(4, 2)),
    dict(causal=True, window_size=(6, -1), softcap=3.0),
    dict(alibi_slopes="per-head", softmax_scale=0.3),
    dict(causal=True, deterministic=True),
])
def test_keywords_and_lse(backend, kw):
    kw = dict(kw)
    q, k, v = _rn(2, 13, 4, 32), _rn(2, 11, 2, 32), _rn(2, 11, 2, 16)  # separate V head dim
    if kw.get("alibi_slopes") == "per-head":
        kw["alibi_slopes"] = torch.rand(4, device=DEV) * 0.5
    out, lse, probs = flash_attn.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    ref_kw = dict(causal=kw.get("causal", False), softmax_scale=kw.get("softmax_scale"),
                  window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap"),
                  alibi_slopes=kw.get("alibi_slopes"))
    ref, ref_lse = attention_reference(q.float(), k.float(), v.float(), **ref_kw)
    _close(out, ref)
    assert probs is None and lse.shape == (2, 4, 13) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, _inf_lse(ref_lse), atol=2e-3, rtol=2e-3)


def test_fully_masked_rows_get_zero_and_plus_inf(backend):
    """causal with s_q > s_k: the first queries see nothing; flash-attn gives them out 0 and lse +inf."""
    q, k, v = _rn(1, 6, 2, 16), _rn(1, 3, 2, 16), _rn(1, 3, 2, 16)
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[0, :3], torch.zeros_like(out[0, :3]))
    assert bool((lse[0, :, :3] == float("inf")).all()) and bool(torch.isfinite(lse[0, :, 3:]).all())


def test_head_dim_not_a_multiple_of_8_is_padded(backend):
    q, k, v = _rn(1, 9, 2, 59), _rn(1, 9, 2, 59), _rn(1, 9, 2, 59)
    out = flash_attn.flash_attn_func(q, k, v, causal=True)
    ref, _ = attention_reference(q.float(), k.float(), v.float(), causal=True)  # scale of d = 59, not 64
    _close(out, ref)


def test_packed_forms_equal_unpacked(backend):
    qkv = _rn(2, 10, 3, 4, 32)
    q, k, v = qkv.unbind(2)
    want = flash_attn.flash_attn_func(q, k, v, 0.0, None, True)
    assert torch.equal(flash_attn.flash_attn_qkvpacked_func(qkv, 0.0, None, True), want)
    kv = torch.stack([k, v], 2)
    assert torch.equal(flash_attn.flash_attn_kvpacked_func(q, kv, 0.0, None, True), want)


def test_gradients_through_the_packed_call(backend):
    qkv = _rn(1, 9, 3, 2, 16, dtype=torch.float32).requires_grad_()
    out = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True)
    ref_in = qkv.detach().clone().requires_grad_()
    ref, _ = attention_reference(*ref_in.unbind(2), causal=True)
    assert rel_l2(out, ref) <= 1e-5
    g = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, qkv, g)
    (exp,) = torch.autograd.grad(ref, ref_in, g)
    assert rel_l2(got, exp) <= 1e-4


# ------------------------------------------------------------------------------------------ varlen
def test_varlen_with_max_seqlen(backend):
    lens_q, lens_k = [5, 1, 9, 0], [7, 4, 9, 3]
    cu_q, cu_k = ragged_cu_seqlens(lens_q, DEV), ragged_cu_seqlens(lens_k, DEV)
    q, k, v = _rn(sum(lens_q), 4, 32), _rn(sum(lens_k), 2, 32), _rn(sum(lens_k), 2, 32)
    with poisoned_outputs():
        out, lse, _ = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), 0.0, None,
                                                        True, (3, 0), return_attn_probs=True)
    ref, ref_lse = attention_varlen_reference(q.float(), k.float(), v.float(), cu_q, cu_k, causal=True, window=(3, 0))
    _close(out, ref)
    assert lse.shape == (4, sum(lens_q))
    torch.testing.assert_close(lse, _inf_lse(ref_lse), atol=2e-3, rtol=2e-3)


def test_varlen_packed_forms(backend):
    lens = [4, 7]
    cu = ragged_cu_seqlens(lens, DEV)
    qkv = _rn(sum(lens), 3, 2, 32)
    q, k, v = qkv.unbind(1)
    want = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)
    assert torch.equal(flash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu, 7, causal=True), want)
    kv = torch.stack([k, v], 1)
    assert torch.equal(flash_attn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 7, 7, causal=True), want)
    # max_seqlen as a one-element tensor, as some callers keep it
    assert torch.equal(flash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu, torch.tensor(7), causal=True), want)


def test_varlen_over_paged_kv(backend):
    lens_q, lens_k, page = [2, 3], [13, 6], 4
    cu_q, cu_k = ragged_cu_seqlens(lens_q, DEV), ragged_cu_seqlens(lens_k, DEV)
    q, k, v = _rn(sum(lens_q), 4, 32), _rn(sum(lens_k), 2, 32), _rn(sum(lens_k), 2, 32)
    order = torch.randperm(8, device=DEV)
    table = order.reshape(2, 4).to(torch.int32)
    k_pages, v_pages = torch.zeros(8, page, 2, 32, device=DEV, dtype=DTYPE), torch.zeros(8, page, 2, 32,
                                                                                           device=DEV, dtype=DTYPE)
    for i, (start, n) in enumerate(zip(cu_k.tolist(), lens_k)):
        for t in range(n):
            k_pages[table[i, t // page], t % page] = k[start + t]
            v_pages[table[i, t // page], t % page] = v[start + t]
    want = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 13, causal=True)
    got = flash_attn.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 3, 13, causal=True, block_table=table)
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------ kv cache
def _cache_reference(q, k_cache, v_cache, rows, lengths, causal, window=(-1, -1), softcap=None, alibi=None):
    outs, lses = [], []
    for i, (row, n) in enumerate(zip(rows, lengths)):
        o, lse = attention_reference(q[i:i + 1].float(), k_cache[row:row + 1, :n].float(),
                                     v_cache[row:row + 1, :n].float(), causal=causal, window=window,
                                     softcap=softcap, alibi_slopes=alibi)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), _inf_lse(torch.cat(lses))


@pytest.mark.parametrize("s_q,d,causal,window,alibi", [
    (1, 64, True, (-1, -1), False),    # decode: paged_decode over the cache seen as pages
    (3, 64, True, (5, 0), False),      # speculative verification with a window: paged_decode
    (3, 64, False, (-1, -1), False),   # non-causal, several queries: flash_attention over the gathered tokens
    (2, 32, True, (-1, -1), False),    # a head dim paged_decode does not take
    (1, 64, True, (-1, -1), True),     # ALiBi
])
def test_kvcache_contiguous_appends_in_place(backend, s_q, d, causal, window, alibi):
    b, s_cache, h_q, h_kv = 3, 40, 4, 2
    k_cache, v_cache = _rn(b, s_cache, h_kv, d), _rn(b, s_cache, h_kv, d)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    seqlens = torch.tensor([5, 17, 0], device=DEV, dtype=torch.int32)
    q, k, v = _rn(b, s_q, h_q, d), _rn(b, s_q, h_kv, d), _rn(b, s_q, h_kv, d)
    slopes = torch.rand(h_q, device=DEV) * 0.5 if alibi else None
    out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=causal,
                                                  window_size=window, alibi_slopes=slopes, return_softmax_lse=True)
    for i, n in enumerate(seqlens.tolist()):  # the new tokens landed at cache_seqlens, nothing else changed
        assert torch.equal(k_cache[i, n:n + s_q], k[i]) and torch.equal(v_cache[i, n:n + s_q], v[i])
        assert torch.equal(k_cache[i, :n], before_k[i, :n]) and torch.equal(k_cache[i, n + s_q:], before_k[i, n + s_q:])
    ref, ref_lse = _cache_reference(q, k_cache, v_cache, range(b), (seqlens + s_q).tolist(), causal, window,
                                    alibi=slopes)
    _close(out, ref)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


def test_kvcache_batch_idx_and_int_seqlens(backend):
    k_cache, v_cache = _rn(4, 16, 2, 64), _rn(4, 16, 2, 64)
    q = _rn(2, 1, 4, 64)
    rows = torch.tensor([3, 1], device=DEV, dtype=torch.int32)
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=9, cache_batch_idx=rows, causal=True)
    ref, _ = _cache_reference(q, k_cache, v_cache, rows.tolist(), [9, 9], True)
    _close(out, ref)


@pytest.mark.parametrize("s_q,page", [(1, 16), (2, 16), (2, 4)])
def test_kvcache_paged(backend, s_q, page):
    b, h_q, h_kv, d, pages_per_seq = 2, 4, 2, 64, 3
    num_pages = b * pages_per_seq + 1
    k_cache, v_cache = _rn(num_pages, page, h_kv, d), _rn(num_pages, page, h_kv, d)
    table = torch.randperm(num_pages, device=DEV)[:b * pages_per_seq].reshape(b, pages_per_seq).to(torch.int32)
    seqlens = torch.tensor([page * 2 + 1, page - 1], device=DEV, dtype=torch.int32)
    q, k, v = _rn(b, s_q, h_q, d), _rn(b, s_q, h_kv, d), _rn(b, s_q, h_kv, d)
    with poisoned_outputs():
        out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                      block_table=table, causal=True, return_softmax_lse=True)
    for i, n in enumerate(seqlens.tolist()):
        for j in range(s_q):
            t = n + j
            assert torch.equal(k_cache[table[i, t // page], t % page], k[i, j])
    ref, ref_lse = paged_decode_reference(q, k_cache, v_cache, table, seqlens + s_q)
    _close(out, ref.float())
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


def test_kvcache_paged_page_size_paged_decode_does_not_take(backend):
    """flash-attn's own paged cache uses 256-token pages; any page size runs (gathered when paged_decode cannot)."""
    k_cache, v_cache = _rn(3, 6, 2, 64), _rn(3, 6, 2, 64)
    table = torch.tensor([[2, 0], [1, 2]], device=DEV, dtype=torch.int32)
    seqlens = torch.tensor([11, 4], device=DEV, dtype=torch.int32)
    q = _rn(2, 1, 4, 64)
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    ref, _ = paged_decode_reference(q, k_cache, v_cache, table, seqlens)
    _close(out, ref.float())


# ------------------------------------------------------------------------------------------ bad input
def _raises(name, fn):
    with pytest.raises(WarpforgeInputError, match=rf"^{name}"):
        fn()


def test_bad_input_names_the_argument():
    q, k, v = _rn(1, 4, 2, 32), _rn(1, 4, 2, 32), _rn(1, 4, 2, 32)
    _raises("dropout_p", lambda: flash_attn.flash_attn_func(q, k, v, 0.1))
    _raises("softcap", lambda: flash_attn.flash_attn_func(q, k, v, softcap=-1.0))
    _raises("window_size", lambda: flash_attn.flash_attn_func(q, k, v, window_size=(3,)))
    _raises("return_attn_probs", lambda: flash_attn.flash_attn_func(q, k, v, return_attn_probs=1))
    _raises("qkv", lambda: flash_attn.flash_attn_qkvpacked_func(_rn(1, 4, 2, 2, 32)))
    _raises("kv", lambda: flash_attn.flash_attn_kvpacked_func(q, _rn(1, 4, 3, 2, 32)))
    kc, vc = _rn(1, 8, 2, 64), _rn(1, 8, 2, 64)
    q1 = _rn(1, 1, 2, 64)
    kw = dict(cache_seqlens=2)
    _raises("rotary_cos", lambda: flash_attn.flash_attn_with_kvcache(q1, kc, vc, rotary_cos=_rn(8, 32), **kw))
    _raises("cache_leftpad", lambda: flash_attn.flash_attn_with_kvcache(
        q1, kc, vc, cache_leftpad=torch.zeros(1, dtype=torch.int32), **kw))
    _raises("k/v", lambda: flash_attn.flash_attn_with_kvcache(q1, kc, vc, k=_rn(1, 1, 2, 64), **kw))
    _raises("cache_seqlens", lambda: flash_attn.flash_attn_with_kvcache(
        q1, kc, vc, _rn(1, 1, 2, 64), _rn(1, 1, 2, 64), cache_seqlens=8))
    _raises("cache_seqlens", lambda: flash_attn.flash_attn_with_kvcache(q1, kc, vc, _rn(1, 1, 2, 64), _rn(1, 1, 2, 64)))
    _raises("num_splits", lambda: flash_attn.flash_attn_with_kvcache(q1, kc, vc, num_splits=-1, **kw))
    pages = _rn(4, 4, 2, 64)
    table = torch.tensor([[0, 9]], dtype=torch.int32, device=DEV)
    _raises("block_table", lambda: flash_attn.flash_attn_with_kvcache(q1, pages, pages.clone(), cache_seqlens=6,
                                                                      block_table=table))
    rows = torch.zeros(1, dtype=torch.int32, device=DEV)
    _raises("cache_batch_idx", lambda: flash_attn.flash_attn_with_kvcache(
        q1, pages, pages.clone(), cache_seqlens=2, block_table=table, cache_batch_idx=rows))
    _raises("k_cache", lambda: flash_attn.flash_attn_with_kvcache(_rn(2, 1, 2, 64), kc, vc, **kw))
    _raises("cache_batch_idx", lambda: flash_attn.flash_attn_with_kvcache(
        q1, kc, vc, cache_batch_idx=torch.tensor([5], dtype=torch.int32), **kw))
    assert math.isfinite(flash_attn.flash_attn_func(q, k, v, 0, None, True).float().sum().item())  # int 0 is fine
