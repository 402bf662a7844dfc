"""Property-based tests: the Triton kernels against their references over shapes hypothesis draws (odd sizes,
empty and length-1 sequences, skewed routing). On CPU they run through the interpreter, so the shapes stay small
and the examples few: a few minutes in all."""
import pytest
import torch

import warpforge as wf
from warpforge.ops.attention import attention_reference
from warpforge.ops.moe import experts_reference, route_reference
from warpforge.ops.norm import rms_norm_reference
from warpforge.testing import device_under_test, poisoned_outputs, rel_l2

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DEV = device_under_test()
DTYPE = torch.float16
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _seeded(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


@SETTINGS
@given(b=st.integers(1, 2), s_q=st.integers(0, 40), s_k=st.integers(1, 40), group=st.sampled_from([1, 2]),
       h_kv=st.integers(1, 2), d=st.sampled_from([32, 64]), causal=st.booleans(),
       left=st.sampled_from([-1, 0, 3, 17]), seed=st.integers(0, 2**16))
def test_attention_matches_reference(b, s_q, s_k, group, h_kv, d, causal, left, seed):
    gen = _seeded(seed)
    q = torch.randn(b, s_q, h_kv * group, d, generator=gen).to(DEV, DTYPE)
    k, v = (torch.randn(b, s_k, h_kv, d, generator=gen).to(DEV, DTYPE) for _ in range(2))
    with poisoned_outputs():
        out, lse = wf.flash_attention(q, k, v, causal=causal, window=(left, -1), return_lse=True, backend="triton")
    ref, ref_lse = attention_reference(q.float(), k.float(), v.float(), causal=causal, window=(left, -1))
    assert rel_l2(out, ref) <= 1e-2
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))


@SETTINGS
@given(rows=st.integers(0, 9), cols=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_rms_norm_matches_reference(rows, cols, seed):
    gen = _seeded(seed)
    x = torch.randn(rows, cols, generator=gen).to(DEV, DTYPE)
    w = torch.randn(cols, generator=gen).to(DEV, DTYPE)
    with poisoned_outputs():
        y = wf.rms_norm(x, w, backend="triton")
    assert rel_l2(y, rms_norm_reference(x.float(), w.float())) <= 1e-2


@SETTINGS
@given(rows=st.integers(0, 9), half=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_swiglu_matches_reference(rows, half, seed):
    gu = torch.randn(rows, 2 * half, generator=_seeded(seed)).to(DEV, DTYPE)
    with poisoned_outputs():
        out = wf.swiglu(gu, backend="triton")
    assert rel_l2(out, wf.swiglu(gu.float(), backend="reference")) <= 1e-2


@SETTINGS
@given(rows=st.integers(0, 12), vocab=st.integers(2, 700), ignored=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_linear_cross_entropy_matches_reference(rows, vocab, ignored, seed):
    gen = _seeded(seed)
    h = torch.randn(rows, 16, generator=gen).to(DEV)
    w = torch.randn(vocab, 16, generator=gen).to(DEV)
    t = torch.randint(0, vocab, (rows,), generator=gen).to(DEV)
    t[torch.rand(rows, generator=gen).to(DEV) < ignored] = -100
    got = wf.linear_cross_entropy(h, w, t, backend="triton")
    want = wf.linear_cross_entropy(h, w, t, backend="reference")
    assert abs(got.item() - want.item()) <= 1e-4 * max(1.0, abs(want.item()))


@SETTINGS
@given(t=st.integers(0, 20), e=st.sampled_from([2, 5, 8]), k=st.integers(1, 2), skew=st.floats(0, 6),
       seed=st.integers(0, 2**16))
def test_moe_matches_reference(t, e, k, skew, seed):
    gen = _seeded(seed)
    h, i = 32, 40
    hidden = torch.randn(t, h, generator=gen).to(DEV, DTYPE)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / 6).to(DEV, DTYPE)
    w2 = (torch.randn(e, h, i, generator=gen) / 6).to(DEV, DTYPE)
    prior = torch.arange(1, e + 1, dtype=torch.float32).pow(-1.2).log()  # Zipf popularity, scaled by skew
    logits = (torch.randn(t, e, generator=gen) + skew * prior).to(DEV)
    with poisoned_outputs():
        out = wf.fused_moe(hidden, w13, w2, logits, k, backend="triton")
    weights, ids = route_reference(logits, k)
    ref = experts_reference(hidden.float(), w13.float(), w2.float(), weights, ids)
    assert out.shape == (t, h) and rel_l2(out, ref) <= 1e-2


@SETTINGS
@given(b=st.integers(1, 3), s_q=st.integers(1, 2), page=st.sampled_from([16, 32]), lens=st.lists(
       st.integers(0, 70), min_size=3, max_size=3), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_mla_decode_matches_reference(b, s_q, page, lens, causal, seed):
    gen = _seeded(seed)
    lens = lens[:b]
    pages = max(1, -(-max(lens) // page))
    q = torch.randn(b, s_q, 16, 576, generator=gen).to(DEV, DTYPE)
    cache = torch.randn(b * pages + 1, page, 1, 576, generator=gen).to(DEV, DTYPE)
    table = (torch.randperm(b * pages + 1, generator=gen)[: b * pages].view(b, pages)).int().to(DEV)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    with poisoned_outputs():
        out, lse = wf.mla_decode(q, cache, table, seqlens, causal=causal, backend="triton")
    ref, ref_lse = wf.mla.mla_decode_reference(q.float(), cache.float(), table, seqlens, causal=causal)
    if ref.abs().sum() > 0:
        assert rel_l2(out, ref) <= 1e-2
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
