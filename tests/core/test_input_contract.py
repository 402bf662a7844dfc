"""One contract on both backends: what every public op refuses (with a WarpforgeInputError naming the argument),
what it accepts, and what it answers at the edges, whichever backend runs it. Found by trying to break it."""
import math

import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.ops.attention import attention_varlen_reference
from warpforge.testing import rel_l2

from .contract import BACKENDS, DEV, ON_CPU, raises as _raises



# ------------------------------------------------------------------------------ linear + cross-entropy
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label", [50, -1, -7, 10**9])
def test_ce_labels_out_of_range(backend, label):
    h = torch.randn(4, 8, device=DEV)
    w = torch.randn(50, 8, device=DEV)
    t = torch.tensor([1, label, 3, -100], device=DEV)
    _raises("targets", lambda: wf.linear_cross_entropy(h, w, t, backend=backend))


def test_ce_bad_label_under_compile_is_nan_not_a_stray_read():
    """While torch.compile traces (as under CUDA-graph capture) the labels cannot be read on the host: a label out
    of range then gives a NaN loss and never reads outside the logits."""
    h = torch.randn(4, 8, device=DEV)
    w = torch.randn(50, 8, device=DEV)
    t = torch.tensor([1, 10**9, 3, -100], device=DEV)
    step = torch.compile(lambda h, w, t: wf.linear_cross_entropy(h, w, t, backend="triton"), fullgraph=True,
                         backend="aot_eager" if ON_CPU else "inductor")
    assert math.isnan(step(h, w, t).item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [0, 5])
def test_ce_nothing_counted_is_zero_with_zero_gradients(backend, rows):
    h = torch.randn(rows, 8, device=DEV, requires_grad=True)
    w = torch.randn(30, 8, device=DEV, requires_grad=True)
    t = torch.full((rows,), -100, device=DEV)
    loss = wf.linear_cross_entropy(h, w, t, backend=backend)
    assert loss.item() == 0.0
    dh, dw = torch.autograd.grad(loss, (h, w))
    assert torch.all(dh == 0) and torch.all(dw == 0)


# ------------------------------------------------------------------------------------ varlen attention
def _packed(lengths, h=2, d=32):
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, device=DEV, dtype=torch.float16) for _ in range(3))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEV)
    return q, k, v, cu


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_max_seqlen_smaller_than_a_sequence(backend):
    q, k, v, cu = _packed([9, 30])
    _raises("max_seqlen_q", lambda: wf.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9,
                                                       max_seqlen_k=30, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offsets,why", [([0, 100], "last entry"), ([0, 4, 2, 6], "non-decreasing"),
                                         ([1, 6], "first entry")])
def test_varlen_offsets_outside_the_tensors(backend, offsets, why):
    q, k, v, _ = _packed([6])
    cu = torch.tensor(offsets, dtype=torch.int32, device=DEV)
    with pytest.raises(WarpforgeInputError, match=f"^cu_seqlens_q: expected {why}"):
        wf.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6,
                           backend=backend)


def test_varlen_under_compile_clamps_offsets_to_the_tensors():
    """Offsets cannot be read while torch.compile traces: they are clamped into the tensors on the device, so bad
    ones give wrong rows, never a read or write outside the tensors; right ones give the right answer."""
    q, k, v, cu = _packed([5, 7])

    def attend(q, k, v, cu):
        return wf.flash_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7,
                                  max_seqlen_k=7, backend="triton")
    step = torch.compile(attend, fullgraph=True, backend="aot_eager" if ON_CPU else "inductor")
    ref, _ = attention_varlen_reference(q.float(), k.float(), v.float(), cu, cu, causal=True)
    assert rel_l2(step(q, k, v, cu), ref) <= 1e-2
    bad = torch.tensor([0, 100, 50], dtype=torch.int32, device=DEV)
    assert step(q, k, v, bad).shape == q.shape  # no crash, no stray access


# ---------------------------------------------------------------------------------- arguments refused
@pytest.mark.parametrize("backend", BACKENDS)
def test_arguments_refused_on_both_backends(backend):
    x = torch.randn(3, 8, device=DEV)
    w = torch.ones(8, device=DEV)
    q = torch.randn(1, 4, 2, 32, device=DEV, dtype=torch.float16)
    _raises("window", lambda: wf.flash_attention(q, q, q, window=(True, False), backend=backend))
    for scale in (float("inf"), float("nan"), -1.0, 0.0, True):
        _raises("softmax_scale", lambda: wf.flash_attention(q, q, q, softmax_scale=scale, backend=backend))
    _raises("causal", lambda: wf.flash_attention(q, q, q, causal=1, backend=backend))
    _raises("x", lambda: wf.rms_norm(torch.tensor(1.0, device=DEV), torch.ones(1, device=DEV), backend=backend))
    _raises("x", lambda: wf.rms_norm(torch.randn(3, 0, device=DEV), torch.ones(0, device=DEV), backend=backend))
    _raises("gate_up", lambda: wf.swiglu(torch.tensor(2.0, device=DEV), backend=backend))
    for eps in (0.0, -1e-6, float("nan"), float("inf")):
        _raises("eps", lambda: wf.rms_norm(x, w, eps, backend=backend))
        _raises("eps", lambda: wf.layer_norm(x, w, w, eps, backend=backend))
    _raises("ignore_index", lambda: wf.linear_cross_entropy(x, w[None].expand(5, 8), torch.zeros(3, dtype=torch.long,
                                                                                                  device=DEV),
                                                            ignore_index=1.5, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_arguments_refused_on_both_backends(backend):
    t, e, h, i = 3, 4, 16, 8
    hidden = torch.randn(t, h, device=DEV, dtype=torch.float16)
    w13 = torch.randn(e, 2 * i, h, device=DEV, dtype=torch.float16)
    w2 = torch.randn(e, h, i, device=DEV, dtype=torch.float16)
    logits = torch.randn(t, e, device=DEV)
    _raises("num_expert_group", lambda: wf.fused_moe(hidden, w13, w2, logits, 2, num_expert_group=0, topk_group=1,
                                                     backend=backend))
    _raises("topk", lambda: wf.fused_moe(hidden, w13, w2, logits, True, backend=backend))
    _raises("routed_scaling_factor", lambda: wf.fused_moe(hidden, w13, w2, logits, 2,
                                                          routed_scaling_factor=float("nan"), backend=backend))
    ids = torch.tensor([[0, 1], [2, 4], [3, 0]], device=DEV)
    _raises("topk_ids", lambda: wf.moe.experts(hidden, w13, w2, torch.ones(t, 2, device=DEV), ids, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_arguments_refused_on_both_backends(backend):
    q = torch.randn(1, 1, 16, 576, device=DEV, dtype=torch.float16)
    cache = torch.randn(2, 16, 1, 576, device=DEV, dtype=torch.float16)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([20], dtype=torch.int32, device=DEV)
    _raises("num_splits", lambda: wf.mla_decode(q, cache, table, lens, num_splits=0, backend=backend))
    _raises("softmax_scale", lambda: wf.mla_decode(q, cache, table, lens, softmax_scale=-0.1, backend=backend))
    _raises("softmax_scale", lambda: wf.mla_decode(q, cache, table, lens, softmax_scale=float("nan"),
                                                   backend=backend))


def test_quantize_kv_refuses_nan_and_integer_latents():
    latent = torch.randn(4, 576)
    latent[1, 3] = float("nan")
    _raises("latent", lambda: wf.mla.quantize_kv(latent, "fp8"))
    _raises("latent", lambda: wf.mla.quantize_kv(torch.ones(4, 576, dtype=torch.int32), "fp8"))


def test_flash_mla_call_without_tensors():
    from warpforge.compat.flash_mla import flash_mla_with_kvcache
    _raises("q", lambda: flash_mla_with_kvcache(None, None, None, None, 512))


# --------------------------------------------------------------------- the same inputs on both backends
def test_fp32_runs_on_both_backends():
    """fp32 inputs: the Triton kernels multiply in full fp32, and agree with the reference to fp32 precision."""
    q, k, v = (torch.randn(2, 19, 4, 32, device=DEV) for _ in range(3))
    got = wf.flash_attention(q, k, v, causal=True, backend="triton")
    assert got.dtype == torch.float32
    assert rel_l2(got, wf.flash_attention(q, k, v, causal=True, backend="reference")) <= 1e-5
    t, e, h, i = 5, 4, 16, 24
    hidden = torch.randn(t, h, device=DEV)
    w13, w2 = torch.randn(e, 2 * i, h, device=DEV) / 4, torch.randn(e, h, i, device=DEV) / 4
    logits = torch.randn(t, e, device=DEV)
    assert rel_l2(wf.fused_moe(hidden, w13, w2, logits, 2, backend="triton"),
                  wf.fused_moe(hidden, w13, w2, logits, 2, backend="reference")) <= 1e-5
    q, cache = torch.randn(1, 1, 16, 576, device=DEV), torch.randn(3, 16, 1, 576, device=DEV)
    table = torch.tensor([[2, 0]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([27], dtype=torch.int32, device=DEV)
    got, _ = wf.mla_decode(q, cache, table, lens, backend="triton")
    assert rel_l2(got, wf.mla_decode(q, cache, table, lens, backend="reference")[0]) <= 1e-5


@pytest.mark.skipif(not ON_CPU, reason="the Triton interpreter runs on CPU only")
def test_bf16_refused_by_the_interpreter():
    """The interpreter's bf16 matmuls return garbage: the ops whose kernels multiply matrices refuse bf16 there
    (the reference backend computes it, and a GPU runs it)."""
    q = torch.randn(1, 8, 2, 32, dtype=torch.bfloat16)
    _raises("q", lambda: wf.flash_attention(q, q, q, backend="triton"))
    assert wf.flash_attention(q, q, q, backend="reference").dtype == torch.bfloat16
    hidden = torch.randn(3, 16, dtype=torch.bfloat16)
    w13, w2 = torch.randn(4, 16, 16, dtype=torch.bfloat16), torch.randn(4, 16, 8, dtype=torch.bfloat16)
    _raises("hidden", lambda: wf.fused_moe(hidden, w13, w2, torch.randn(3, 4), 2, backend="triton"))
    mq = torch.randn(1, 1, 16, 576, dtype=torch.bfloat16)
    cache = torch.randn(1, 16, 1, 576, dtype=torch.bfloat16)
    _raises("q", lambda: wf.mla_decode(mq, cache, torch.zeros(1, 1, dtype=torch.int32),
                                       torch.ones(1, dtype=torch.int32), backend="triton"))


def test_varlen_offsets_read_once_while_unchanged(monkeypatch):
    """The layers of a step pass the same offsets: they are read back once; changed in place, read again."""
    from warpforge import errors
    reads = []
    real = errors.check_cu_seqlens

    def counting(name, cu, ref, read_values=True):
        reads.append(read_values)
        return real(name, cu, ref, read_values)
    monkeypatch.setattr("warpforge.ops.attention.api.check_cu_seqlens", counting)
    q, k, v, cu = _packed([5, 7])
    for _ in range(3):
        wf.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7,
                           backend="reference")
    assert sum(reads) == 2  # cu_seqlens_q and cu_seqlens_k, read once
    cu[1] = 9  # in place: sequences of 9 and 3 now, longer than max_seqlen_q
    _raises("max_seqlen_q", lambda: wf.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7,
                                                       max_seqlen_k=7, backend="reference"))
