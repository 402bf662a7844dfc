"""The fifth adversarial sweep: MLA and paged decode, their plans and cache helpers, and the FlashMLA call. Each test
failed before its fix. One contract on both backends: refuse with a WarpforgeInputError naming the argument, or
answer what the reference answers; never read outside a tensor, also where values cannot be checked."""
import pytest
import torch

import warpforge as wf
from warpforge.compat.flash_mla import flash_mla_with_kvcache, get_mla_metadata
from warpforge.ops.mla.reference import nvfp4_tensor_scale
from warpforge.testing import rel_l2

from .contract import BACKENDS, DEV, ON_CPU, raises as _raises
I32 = torch.int32



def _t(values):
    return torch.tensor(values, dtype=I32, device=DEV)


def _mla(h=16, pages=2, dtype=torch.float16):
    q = torch.randn(1, 1, h, 576, device=DEV, dtype=dtype)
    cache = torch.randn(pages, 16, 1, 576, device=DEV, dtype=dtype)
    return q, cache, _t([[0, 1]]), _t([20])


def _compiled(fn):
    return torch.compile(fn, fullgraph=True, backend="aot_eager" if ON_CPU else "inductor")


# ---------------------------------------------------------------------------- MLA: values that go unchecked
@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_unchecked_table_and_lengths_stay_inside_the_cache(backend):
    """Under torch.compile (as under a CUDA-graph capture) run() cannot read the table or lengths: the Triton
    kernel read page 10**6 or length 10**6 as given (SIGSEGV); the reference failed to trace (data-dependent
    UserError). Now both give the right answer for good values and stay inside the cache for bad ones."""
    q, cache, table, lens = _mla()
    step = _compiled(lambda q, c, t, l: wf.mla_decode(q, c, t, l, causal=False, backend=backend))
    want = wf.mla_decode(q, cache, table, lens, backend="reference")
    got = step(q, cache, table, lens)
    assert rel_l2(got[0], want[0]) <= 2e-3 and rel_l2(got[1], want[1]) <= 1e-4
    for bad_table, bad_lens in ((_t([[0, 10**6]]), lens), (_t([[0, -10**6]]), lens), (table, _t([10**6])),
                                (table, _t([-5]))):
        out, lse = step(q, cache, bad_table, bad_lens)
        assert out.shape == (1, 1, 16, 512) and lse.shape == (1, 16, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_unchecked_sparse_slots_stay_inside_the_cache(backend):
    q, cache, _, _ = _mla()
    idx = _t([[[0, 5, -1, 31]]])
    step = _compiled(lambda q, c, i, k: wf.mla_decode(q, c, None, None, indices=i, topk_length=k, backend=backend))
    want = wf.mla_decode(q, cache, None, None, indices=idx, topk_length=_t([3]), backend="reference")
    got = step(q, cache, idx, _t([3]))
    assert rel_l2(got[0], want[0]) <= 2e-3
    for bad_idx, bad_len in ((_t([[[0, 10**6]]]), _t([2])), (_t([[[0, -10**6]]]), _t([2])), (idx, _t([10**6])),
                             (idx, _t([-3]))):
        out, _ = step(q, cache, bad_idx, bad_len)
        assert out.shape == (1, 1, 16, 512)


def test_mla_reference_on_meta_tensors():
    """Shape inference on meta tensors: the reference raised "Tensor.item() cannot be called on meta tensors" (dense)
    and NotImplementedError for torch.nonzero (sparse); paged decode's reference already answered."""
    q, cache, table, lens = (t.to("meta") for t in _mla())
    out, lse = wf.mla_decode(q, cache, table, lens, backend="reference")
    assert out.shape == (1, 1, 16, 512) and out.dtype == torch.float16 and out.device.type == "meta"
    assert lse.shape == (1, 16, 1) and lse.dtype == torch.float32
    out, lse = wf.mla_decode(q, cache, None, None, indices=_t([[[0, 5, -1]]]).to("meta"), backend="reference")
    assert out.shape == (1, 1, 16, 512) and lse.shape == (1, 16, 1)
    out, lse = flash_mla_with_kvcache(q, cache, table, lens, 512)
    assert out.shape == (1, 1, 16, 512) and lse.shape == (1, 16, 1)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("causal", [False, True])
def test_mla_reference_without_host_reads_matches_the_loop(monkeypatch, fmt, causal):
    """The reference's masked path (used where values cannot be read) against its loop, s_q 2 and an empty request."""
    from warpforge.ops.mla import reference
    q = torch.randn(3, 2, 5, 576, device=DEV)
    lat = torch.randn(4, 16, 1, 576, device=DEV)
    cache = lat if fmt == "bf16" else wf.mla.quantize_kv(lat, fmt)
    table, lens = _t([[3, 0], [1, 2], [0, 0]]), _t([17, 1, 0])
    want = reference.mla_decode_reference(q, cache, table, lens, causal=causal, kv_format=fmt)
    idx, topk_len = _t([[[0, 63, -1]] * 2, [[5, 5, 2]] * 2, [[-1, -1, -1]] * 2]), _t([2, 3, 3])
    want_sparse = reference.mla_decode_reference(q, cache, None, None, kv_format=fmt, indices=idx,
                                                 topk_length=topk_len)
    monkeypatch.setattr(reference, "host_reads_allowed", lambda t: False)
    got = reference.mla_decode_reference(q, cache, table, lens, causal=causal, kv_format=fmt)
    got_sparse = reference.mla_decode_reference(q, cache, None, None, kv_format=fmt, indices=idx,
                                                topk_length=topk_len)
    for (o, l), (wo, wl) in ((got, want), (got_sparse, want_sparse)):
        torch.testing.assert_close(o, wo, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(l, wl, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- scales in the fp32 range
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [3e38, 1e-45])
def test_mla_nvfp4_scale_in_the_fp32_range(backend, value):
    """kv_scale 3e38 was accepted and every output was inf / NaN on both backends; 1e-45 (a denormal, which GPUs flush
    to 0) likewise: the tensor scale is held to the range a float scale is (check_positive_float)."""
    q, _, table, lens = _mla()
    lat = torch.randn(2, 16, 1, 576, device=DEV)
    scale = nvfp4_tensor_scale(lat).reshape(1)
    cache = wf.mla.quantize_kv(lat, "nvfp4", scale)
    bad = torch.full((1,), value, device=DEV)
    _raises("kv_scale", lambda: wf.mla_decode(q, cache, table, lens, kv_format="nvfp4", kv_scale=bad,
                                              backend=backend))
    _raises("kv_scale", lambda: wf.mla.quantize_kv(lat, "nvfp4", bad))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [3e38, 1e-45])
def test_paged_tensor_scales_in_the_fp32_range(backend, value):
    """A float k_scale of 3e38 or 1e-45 was refused but the same one-element tensor accepted (inf / NaN outputs)."""
    x = torch.randn(3, 8, 2, 64, device=DEV)
    k, _ = wf.paged.quantize_kv(x, "fp8")
    q = torch.randn(1, 1, 4, 64, device=DEV, dtype=torch.float16)
    bad = torch.full((1,), value, device=DEV)
    _raises("k_scale", lambda: wf.paged_decode(q, k, k, _t([[0, 2]]), _t([11]), k_scale=bad, backend=backend))
    _raises("scale", lambda: wf.paged.quantize_kv(x, "fp8", scale=bad))
    caches = torch.zeros(2, 3, 8, 2, 64, device=DEV, dtype=torch.float8_e4m3fn)
    new = torch.randn(1, 2, 2, 64, device=DEV, dtype=torch.float16)
    _raises("v_scale", lambda: wf.paged.append_kv(caches[0], caches[1], new, new, _t([[0, 2]]), _t([7]),
                                                  v_scale=bad))


# ---------------------------------------------------------------------------------------------- append_kv
@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_append_kv_refuses_an_expanded_cache(which):
    """An expanded cache (page stride 0) was written in place: the tokens for page 2 appeared in every page."""
    fresh = torch.zeros(3, 8, 2, 64, device=DEV, dtype=torch.float16)
    expanded = torch.zeros(1, 8, 2, 64, device=DEV, dtype=torch.float16).expand(3, 8, 2, 64)
    k, v = (expanded, fresh) if which == "k_cache" else (fresh, expanded)
    new = torch.randn(1, 2, 2, 64, device=DEV, dtype=torch.float16)
    _raises(which, lambda: wf.paged.append_kv(k, v, new, new, _t([[0, 2]]), _t([7])))


def test_append_kv_takes_interleaved_views_of_one_buffer():
    """k = kv[:, 0], v = kv[:, 1]: strided, not self-overlapping, still accepted and written where they belong."""
    kv = torch.zeros(3, 2, 8, 2, 64, device=DEV, dtype=torch.float16)
    k_new, v_new = (torch.randn(1, 2, 2, 64, device=DEV, dtype=torch.float16) for _ in range(2))
    wf.paged.append_kv(kv[:, 0], kv[:, 1], k_new, v_new, _t([[0, 2]]), _t([7]))
    assert torch.equal(kv[0, 0, 7], k_new[0, 0]) and torch.equal(kv[2, 1, 0], v_new[0, 1])


# ----------------------------------------------------------------------------------- sparse MLA arguments
@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_mla_checks_the_table_and_lengths_it_is_given(backend):
    """With indices the table walk is replaced, so block_table and cache_seqlens may be None; given, they were not
    checked at all (a float table, or the string "x" for the lengths, ran)."""
    q, cache, _, _ = _mla()
    idx = _t([[[0, 5, -1]]])
    _raises("block_table", lambda: wf.mla_decode(q, cache, torch.zeros(1, 2, device=DEV), None, indices=idx,
                                                 backend=backend))
    _raises("cache_seqlens", lambda: wf.mla_decode(q, cache, None, "x", indices=idx, backend=backend))
    _raises("cache_seqlens", lambda: wf.mla_decode(q, cache, None, _t([20, 20]), indices=idx, backend=backend))
    out, _ = wf.mla_decode(q, cache, _t([[0, 1]]), _t([20]), indices=idx, backend=backend)  # valid ones still run
    assert out.shape == (1, 1, 16, 512)


# ------------------------------------------------------------------------------------------ FlashMLA call
def test_flash_mla_schedule_reused_with_another_dtype():
    """A schedule planned on fp16 q and reused with fp32 q was refused naming q, "(the plan's)", a plan the FlashMLA
    user never made: it names tile_scheduler_metadata, as for other shape changes."""
    q, cache, table, lens = _mla()
    sched, _ = get_mla_metadata()
    flash_mla_with_kvcache(q, cache, table, lens, 512, sched)
    _raises("tile_scheduler_metadata", lambda: flash_mla_with_kvcache(q.float(), cache.float(), table, lens, 512,
                                                                      sched))


def test_flash_mla_metadata_arguments_are_what_get_mla_metadata_returns():
    q, cache, table, lens = _mla()
    _raises("tile_scheduler_metadata", lambda: flash_mla_with_kvcache(q, cache, table, lens, 512, "x"))
    _raises("num_splits", lambda: flash_mla_with_kvcache(q, cache, table, lens, 512, num_splits=3))
    old = torch.zeros(4, 8, dtype=I32, device=DEV)  # the older interface's tensors are taken (and ignored)
    out, _ = flash_mla_with_kvcache(q, cache, table, lens, 512, old, _t([0, 1]))
    assert out.shape == (1, 1, 16, 512)


# ------------------------------------------------------------------------------------ issue 21, defect 10
def test_cpu_bench_table_names_what_ran_has_no_rates_and_gives_the_verdict():
    from warpforge.bench.report import table
    machine = {"gpu": "cpu (Triton interpreter)", "torch": "x", "triton": "y", "git_commit": "0123456789abc",
               "interpreter": True}
    rows = [dict(family="linear_ce", case="llama3 b8 V128k", ran="T64 V512", impl="warpforge", ms=120.0,
                 tflops=22.6, err=3e-3, err_kind="rel", ok=True, tol=1e-2),
            dict(family="linear_ce", case="llama3 b8 V128k", ran="T64 V512", impl="torch", ms=80.0, tflops=30.0,
                 err=0.5, err_kind="rel", ok=False, tol=1e-2)]
    text = table({"machine": machine, "rows": rows})
    assert "T64 V512" in text and "TFLOP/s" not in text and "22.6" not in text
    assert "ok" in text and "WRONG (tol 1e-02)" in text and "1 output(s) outside tolerance" in text
