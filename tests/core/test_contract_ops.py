"""The second adversarial sweep's findings in attention, MLA, the fused ops and the FlashMLA call: each test failed
before its fix. One contract on both backends: refuse with a WarpforgeInputError naming the argument, or answer
what the reference answers; never read outside a tensor."""
import numpy as np
import pytest
import torch

import warpforge as wf
from warpforge.compat.flash_mla import flash_mla_with_kvcache, get_mla_metadata
from warpforge.ops.rope import rope_tables

from .contract import BACKENDS, DEV, ON_CPU, raises as _raises



def _rn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEV, dtype=dtype)


# ------------------------------------------------------------------------------------------- attention
def _varlen(lengths, h=2, d=32):
    total = sum(lengths)
    q, k, v = (_rn(total, h, d) for _ in range(3))
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32, device=DEV)
    return q, k, v, cu


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_cu_seqlens_read_by_their_stride(backend):
    q, k, v, cu = _varlen([3, 5])
    strided = torch.stack([cu, cu], 1)[:, 0]
    assert strided.stride(0) == 2
    out = wf.flash_attention(q, k, v, cu_seqlens_q=strided, cu_seqlens_k=strided, backend=backend)
    ref = wf.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, backend=backend)
    torch.testing.assert_close(out, ref)


@pytest.mark.skipif(not ON_CPU, reason="numpy shares memory with CPU tensors only")
def test_cu_seqlens_rewritten_behind_torch_stays_inside_the_tensors():
    """Offsets rewritten through numpy keep their version counter, so the cached check cannot see it: the kernel
    clamps them into the tensors (wrong rows at worst, never a stray read or write; this used to segfault)."""
    q, k, v, _ = _varlen([3, 5])
    buf = np.array([0, 3, 8], dtype=np.int32)
    cu = torch.from_numpy(buf)
    wf.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="triton")
    buf[:] = [0, 1, 5000]
    out = wf.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="triton")
    assert out.shape == q.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_flags_and_values(backend):
    q = _rn(1, 8, 2, 32)
    _raises("return_lse", lambda: wf.flash_attention(q, q, q, return_lse="no", backend=backend))
    _raises("return_lse", lambda: wf.flash_attention(q, q, q, return_lse=0, backend=backend))
    _raises("max_seqlen_q", lambda: wf.flash_attention(q, q, q, max_seqlen_q=-5, backend=backend))
    _raises("softmax_scale", lambda: wf.flash_attention(q, q, q, softmax_scale=1.7e308, backend=backend))
    nan_slopes = torch.tensor([0.5, float("nan")], device=DEV)
    _raises("alibi_slopes", lambda: wf.flash_attention(q, q, q, alibi_slopes=nan_slopes, backend=backend))
    slopes = torch.tensor([0.5, 0.25], device=DEV, requires_grad=True)
    _raises("alibi_slopes", lambda: wf.flash_attention(q, q, q, alibi_slopes=slopes, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_side_past_int64_is_unbounded(backend):
    q, k, v = (_rn(1, 8, 2, 32) for _ in range(3))
    out = wf.flash_attention(q, k, v, window=(2**63, 0), backend=backend)
    torch.testing.assert_close(out, wf.flash_attention(q, k, v, causal=True, backend="reference"))


@pytest.mark.parametrize("softcap", [50.0, 1e4, 1e8])
def test_large_softcap_keeps_precision(softcap):
    """c · tanh(s / c) for a large c: tanh's exp form keeps only ~1e-7 absolute near 0, which c multiplied back."""
    q, k, v = (_rn(1, 8, 2, 32) for _ in range(3))
    out = wf.flash_attention(q, k, v, softcap=softcap, backend="triton")
    torch.testing.assert_close(out, wf.flash_attention(q, k, v, softcap=softcap, backend="reference"),
                               atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------------------------- MLA
def _mla_inputs(b=1, s_q=1):
    q = _rn(b, s_q, 16, 576)
    cache = _rn(2, 16, 1, 576)
    table = torch.tensor([[0, 1]] * b, dtype=torch.int32, device=DEV)
    lens = torch.tensor([29] * b, dtype=torch.int32, device=DEV)
    return q, cache, table, lens


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_plan_refuses_sparse_arguments(backend):
    """A dense plan used to pass indices to the kernel unchecked (a segfault with wild ones)."""
    q, cache, table, lens = _mla_inputs()
    p = wf.mla.plan(q, cache, table)
    wild = torch.tensor([[[0, 5, 10**7, 2**30, -5, 1, 2, 3]]], dtype=torch.int32, device=DEV)
    _raises("indices", lambda: p.run(q, cache, table, lens, indices=wild, backend=backend))
    _raises("topk_length", lambda: wf.mla_decode(q, cache, table, lens, backend=backend,
                                                 topk_length=torch.ones(1, dtype=torch.int32, device=DEV)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_scalar_arguments(backend):
    q, cache, table, lens = _mla_inputs()
    _raises("softmax_scale", lambda: wf.mla_decode(q, cache, table, lens, softmax_scale=True, backend=backend))
    _raises("num_splits", lambda: wf.mla_decode(q, cache, table, lens, num_splits=10**9, backend=backend))
    _raises("kv_scale", lambda: wf.mla_decode(q, cache, table, lens, kv_scale="garbage", backend=backend))


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_nvfp4_scale_must_be_finite_and_positive(value):
    latent = _rn(3, 576)
    bad = torch.tensor(value, device=DEV)
    _raises("kv_scale", lambda: wf.mla.quantize_kv(latent, "nvfp4", bad))
    q, _, table, lens = _mla_inputs()
    scale = wf.mla.nvfp4_tensor_scale(latent)
    cache = wf.mla.quantize_kv(_rn(2, 16, 1, 576), "nvfp4", scale)
    _raises("kv_scale", lambda: wf.mla_decode(q, cache, table, lens, kv_format="nvfp4", kv_scale=bad,
                                              backend="reference"))


def test_nvfp4_tensor_scale_needs_rows():
    _raises("latent", lambda: wf.mla.nvfp4_tensor_scale(torch.zeros(0, 576, device=DEV)))


@pytest.mark.parametrize("change", [dict(causal=True), dict(softmax_scale=0.01)])
def test_flash_mla_reused_schedule_follows_each_call(change):
    q, cache, table, lens = _mla_inputs(s_q=2)
    sched, _ = get_mla_metadata()
    flash_mla_with_kvcache(q, cache, table, lens, 512, sched, softmax_scale=0.1)
    kw = {"softmax_scale": 0.1, **change}
    reused = flash_mla_with_kvcache(q, cache, table, lens, 512, sched, **kw)[0]
    fresh = flash_mla_with_kvcache(q, cache, table, lens, 512, get_mla_metadata()[0], **kw)[0]
    torch.testing.assert_close(reused, fresh)


def test_flash_mla_fp8_flag_is_a_bool():
    q, cache, table, lens = _mla_inputs()
    _raises("is_fp8_kvcache", lambda: flash_mla_with_kvcache(q, cache, table, lens, 512, is_fp8_kvcache="no"))


# ---------------------------------------------------------------------------------------- fused ops
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ignore_index", [2**40, 2**32 + 5])
def test_ce_int32_targets_with_a_wide_ignore_index(backend, ignore_index):
    h, w = _rn(5, 8), _rn(11, 8)
    t = torch.tensor([1, 0, 10, 3, 5], dtype=torch.int32, device=DEV)
    expected = torch.nn.functional.cross_entropy(h @ w.T, t.long())
    torch.testing.assert_close(wf.linear_cross_entropy(h, w, t, ignore_index=ignore_index, backend=backend),
                               expected, rtol=1e-4, atol=1e-4)
    _raises("ignore_index", lambda: wf.linear_cross_entropy(h, w, t, ignore_index=2**64, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ce_fp16_logits_past_fp16_range(backend):
    h, w = (_rn(5, 8) * 100).half(), (_rn(11, 8) * 100).half()
    t = torch.tensor([1, 0, 10, 3, 2], device=DEV)
    expected = torch.nn.functional.cross_entropy(h.float() @ w.float().T, t)
    torch.testing.assert_close(wf.linear_cross_entropy(h, w, t, backend=backend), expected, rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ce_empty_vocabulary_with_every_target_ignored(backend):
    h = _rn(3, 8, dtype=torch.float32)
    loss = wf.linear_cross_entropy(h, _rn(0, 8), torch.full((3,), -100, device=DEV), backend=backend)
    assert loss.item() == 0.0


def test_kernel_backward_is_not_silently_differentiated_twice():
    h = _rn(4, 8).requires_grad_()
    w = _rn(11, 8)
    loss = wf.linear_cross_entropy(h, w, torch.tensor([1, 2, 3, 4], device=DEV), backend="triton")
    (g,) = torch.autograd.grad(loss, h, create_graph=True)
    with pytest.raises(RuntimeError, match="first-order only"):
        (g * g).sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_rms_norm_output_in_the_sums_dtype(backend):
    x, residual = _rn(4, 16).half(), _rn(4, 16)
    y, total = wf.add_rms_norm(x, residual, _rn(16), backend=backend)
    assert y.dtype == total.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_eps_refused(backend):
    _raises("eps", lambda: wf.rms_norm(torch.zeros(2, 16, device=DEV), torch.ones(16, device=DEV), 1e-300,
                                       backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_swiglu_with_no_columns(backend):
    assert wf.swiglu(_rn(3, 0), backend=backend).shape == (3, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_tables_are_not_differentiated(backend):
    x = _rn(1, 8, 2, 32)
    cos, sin = rope_tables(8, 32, device=DEV)
    _raises("cos", lambda: wf.apply_rope(x, cos.requires_grad_(), sin, backend=backend))


@pytest.mark.parametrize("kwargs,name", [(dict(seq_len=8, head_dim=31), "head_dim"),
                                         (dict(seq_len=8.0, head_dim=32), "seq_len"),
                                         (dict(seq_len=8, head_dim=32, base=0.0), "base"),
                                         (dict(seq_len=8, head_dim=32, base=float("nan")), "base")])
def test_rope_tables_arguments(kwargs, name):
    _raises(name, lambda: rope_tables(**kwargs))
