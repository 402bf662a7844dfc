"""The Hopper Gluon MLA decode (ops/mla/decode_gluon_kernel.py): compiled for sm_90 on CPU when the installed
Triton is one its Gluon API was written for, and checked against the fp32 reference on an sm_90 GPU."""
import os

import pytest
import torch

import warpforge as wf
from warpforge.ops._gluon import SMEM_MAX, compile_in_subprocess, import_loads_gluon
from warpforge.ops.mla import api, configs
from warpforge.ops.mla import decode_gluon_kernel as dg
from warpforge.ops.mla import mla_decode_reference
from warpforge.ops.mla.kv_format import KV_FORMATS
from warpforge.testing import cosine, gluon_triton, on_sm90_gluon, poisoned_outputs, spy_launches, triton_version

from .test_mla_decode import _check, _problem, assert_matches, check_dequantised, graph_replayed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gluon_triton() -> bool:
    return gluon_triton(dg.GLUON_TRITON_VERSIONS)


def _on_h200_gate() -> bool:
    return on_sm90_gluon(dg.GLUON_TRITON_VERSIONS) and os.environ.get(configs.GLUON_ENV, "1") != "0"


def test_gate_constants_agree_and_import_is_lazy():
    assert configs.GLUON_TRITON_VERSIONS == dg.GLUON_TRITON_VERSIONS
    assert configs.GLUON_PAGE == dg.PAGE and configs.GLUON_BLOCK_H == dg.BLOCK_M
    # importing warpforge (and the kernel module) does not load Gluon: it is built on first use
    assert not import_loads_gluon(("warpforge.ops.mla.decode_gluon_kernel",), ROOT)


def test_gate_off_where_it_does_not_apply(monkeypatch):
    q, _, cache, table, _, _ = _problem(2, 1, 64, 64, [70, 5], "bf16")
    plan = wf.mla.plan(q, cache, table)
    if not _on_h200_gate() or q.dtype != torch.bfloat16:
        assert not plan.gluon
    small = wf.mla.plan(q[:, :, :16].contiguous(), cache, table)  # 16 rows < 64
    assert not small.gluon
    # quantized caches: dequantised pages on the Gluon kernel where the gate holds (dequant_kernel.py), unless off
    fp8 = wf.mla.quantize_kv(torch.randn(4, 64, 1, 576, device=q.device), "fp8")
    on = _on_h200_gate() and q.dtype == torch.bfloat16
    assert wf.mla.plan(q, fp8, table[:, :1].contiguous(), kv_format="fp8").gluon == on
    monkeypatch.setenv(configs.GLUON_DEQUANT_ENV, "0")
    assert not wf.mla.plan(q, fp8, table[:, :1].contiguous(), kv_format="fp8").gluon


# ------------------------------------------------------------------------------------ compile for sm_90
COMPILE_CASES = [
    dict(h_q=128, s_q=1, causal=False, num_splits=1),
    dict(h_q=64, s_q=2, causal=True, num_splits=3),
    dict(h_q=96, s_q=1, causal=False, num_splits=2),
    dict(h_q=128, s_q=1, causal=False, num_splits=1, fmt=KV_FORMATS["fp8"]._asdict()),
    dict(h_q=64, s_q=2, causal=True, num_splits=3, fmt=KV_FORMATS["fp8"]._asdict()),
    dict(h_q=128, s_q=1, causal=False, num_splits=1, fmt=KV_FORMATS["nvfp4"]._asdict()),
    dict(h_q=64, s_q=2, causal=True, num_splits=3, fmt=KV_FORMATS["mxfp4"]._asdict()),
]
QUANT_SPILL_BYTES = 64  # the quantized builds spill a few registers, outside their page loop (prologue, epilogue)

def _compile_in_subprocess(case):
    return compile_in_subprocess("warpforge.ops.mla.decode_gluon_kernel", case, ROOT)


@pytest.mark.skipif(not _gluon_triton(), reason=f"the Gluon kernel is written for Triton {dg.GLUON_TRITON_VERSIONS} "
                    f"(installed: {triton_version()}); its API differs between releases")
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: "-".join(f"{k}{v['name'] if k == 'fmt' else v}"
                                                                       for k, v in c.items()))
def test_compiles_for_sm90(case):
    r = _compile_in_subprocess(case)
    print(f"\n{case}: {r['registers']} registers/thread (ptxas cap; setmaxnreg {r['setmaxnreg_values']}), "
          f"spills {r['spill_stores']}/{r['spill_loads']} B, shared {r['shared_bytes']} B, warps {r['num_warps']}")
    assert r["wgmma"] and r["tma"] and r["setmaxnreg"] and r["mbarrier"]
    assert r["warp_specialize"] and r["num_warps"] == 8  # two warpgroups, no producer warp
    assert r["ptxas_rc"] == 0, r["ptxas_log"]
    # the wgmma descriptors are rebuilt at their use in the loops (_mma_views): nothing spills
    limit = QUANT_SPILL_BYTES if case.get("fmt") else 0
    assert r["spill_stores"] <= limit and r["spill_loads"] <= limit, r["ptxas_log"]
    assert r["shared_bytes"] <= SMEM_MAX
    assert min(r["setmaxnreg_values"]) >= 232  # both warpgroups hold a 64 x 256 fp32 accumulator


# ------------------------------------------------------------------------------------------ GPU numerics
needs_gate = pytest.mark.skipif(not _on_h200_gate(), reason="the Gluon path runs on sm_90 with Triton "
                                f"{dg.GLUON_TRITON_VERSIONS} (and {configs.GLUON_ENV} != 0)")
LENS = [0, 1, 63, 64, 65, 1000, 129, 2047]


def _past_the_ends(cache, table, lens):
    """[num_pages, 64] True for every cache row no request reads (page tails past the lengths, unused and spare
    pages): the rows the Gluon kernel loads with whole pages and must keep out of S and P·V."""
    used = torch.zeros(cache.shape[0], 64, dtype=torch.bool, device=cache.device)
    for i, n in enumerate(lens):
        for p in range(-(-n // 64)):
            used[table[i, p], : min(64, n - 64 * p)] = True
    return ~used


@pytest.fixture
def gluon_calls(monkeypatch):
    """Records num_splits of each Gluon launch made through api's dispatch."""
    return spy_launches(monkeypatch, dg, "mla_decode_gluon", lambda args: args[6])


@pytest.mark.gpu
@needs_gate
@pytest.mark.parametrize("h_q,s_q,causal", [(64, 1, False), (128, 1, False), (64, 2, True), (128, 2, True)])
@pytest.mark.parametrize("splits", [None, 1, 3, 7])
def test_gpu_matches_reference(h_q, s_q, causal, splits, gluon_calls):
    q, _, cache, table, seqlens, _ = _problem(len(LENS), s_q, h_q, 64, LENS, "bf16", torch.bfloat16)
    _check(q, cache, table, seqlens, "bf16", causal, splits)
    assert len(gluon_calls) == 1  # the gated path ran, not the portable kernel


@pytest.mark.gpu
@needs_gate
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("page,h_q,s_q,causal", [(64, 128, 1, False), (32, 64, 2, True)])
@pytest.mark.parametrize("slices", [1, 3])
def test_gpu_quantized_caches_on_dequantised_pages(fmt, page, h_q, s_q, causal, slices, gluon_calls, monkeypatch):
    """Quantized caches at 64+ rows: pages dequantised to bf16 scratch (dequant_kernel.py), then the Gluon kernel,
    in `slices` launches; against the fp32 reference on the quantized cache. (Quantized caches of page 64 may be read
    by the kernel itself instead, api.quantized_in_kernel: switched off here.)"""
    from warpforge.ops.mla import dequant_kernel
    monkeypatch.setenv(configs.GLUON_IN_KERNEL_ENV, "0")
    lens = [0, 1, 63, 64, 65, 1000, 129]
    q, _, cache, table, seqlens, kv_scale = _problem(len(lens), s_q, h_q, page, lens, fmt, torch.bfloat16)
    per_request = -(-table.shape[1] * page // 64) * 64 * 576 * 2
    monkeypatch.setattr(dequant_kernel, "SCRATCH_BYTES", per_request * -(-len(lens) // slices))
    out, lse = wf.mla_decode(q, cache, table, seqlens, causal=causal, kv_format=fmt, kv_scale=kv_scale)
    assert len(gluon_calls) == slices
    check_dequantised(out, lse, q, cache, table, seqlens, fmt, causal, kv_scale)


@pytest.mark.gpu
@needs_gate
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("h_q,s_q,causal", [(128, 1, False), (64, 2, True), (96, 1, False)])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_gpu_quantized_cache_read_by_the_kernel(fmt, h_q, s_q, causal, splits, gluon_calls, monkeypatch):
    """A quantized cache of page 64 at 64+ rows: the Gluon kernel reads its codes, scales and rope itself (no
    dequantisation pass), against the fp32 reference on the quantized cache, with 0x7F (e4m3 NaN) in every byte
    past the requests' ends (whole pages come in through TMA)."""
    from warpforge.ops.mla import dequant_kernel
    passes = spy_launches(monkeypatch, dequant_kernel, "mla_decode_dequantized", lambda args: 1)
    monkeypatch.setattr(dequant_kernel, "SCRATCH_BYTES", 1)  # FP4 takes the kernel where the pass would slice
    q, _, cache, table, seqlens, kv_scale = _problem(len(LENS), s_q, h_q, 64, LENS, fmt, torch.bfloat16)
    cache[_past_the_ends(cache, table, LENS)] = 0x7F  # e4m3 NaN (FP8's codes, scales and rope; NVFP4's scales)
    out, lse = wf.mla_decode(q, cache, table, seqlens, causal=causal, kv_format=fmt, kv_scale=kv_scale,
                             num_splits=splits)
    assert len(gluon_calls) == 1 and not passes
    check_dequantised(out, lse, q, cache, table, seqlens, fmt, causal, kv_scale)


@pytest.mark.gpu
@needs_gate
def test_gpu_mxfp4_with_the_largest_scales_read_by_the_kernel(gluon_calls, monkeypatch):
    """MXFP4 block scales up to 2^127 (e8m0 bytes 241+, where 2^14 more overflows fp32): the kernel's in-place pass
    gives the reference's finite answer (latents of ~1e36, which bf16 holds)."""
    from warpforge.ops.mla import dequant_kernel
    monkeypatch.setattr(dequant_kernel, "SCRATCH_BYTES", 1)  # FP4 takes the kernel where the pass would slice
    q, latent, _, table, seqlens, _ = _problem(2, 1, 128, 64, [300, 65], "mxfp4", torch.bfloat16)
    cache = wf.mla.quantize_kv((latent.float() * 1e36).to(torch.bfloat16), "mxfp4")
    assert int(cache[..., 256:272].max()) >= 241
    out, lse = wf.mla_decode(q * 1e-36, cache, table, seqlens, kv_format="mxfp4")
    assert len(gluon_calls) == 1 and torch.isfinite(out).all()
    check_dequantised(out, lse, q * 1e-36, cache, table, seqlens, "mxfp4", False, None)


@pytest.mark.gpu
@needs_gate
def test_gpu_gated_path_is_taken(gluon_calls, monkeypatch):
    q, _, cache, table, seqlens, _ = _problem(4, 1, 128, 64, [300, 1000, 5, 64], "bf16", torch.bfloat16)
    plan = wf.mla.plan(q, cache, table)
    assert plan.gluon and plan.num_splits >= 1
    out, lse = plan.run(q, cache, table, seqlens)
    assert gluon_calls == [plan.num_splits]
    monkeypatch.setenv(configs.GLUON_ENV, "0")
    off = wf.mla.plan(q, cache, table)
    assert not off.gluon
    want, want_lse = off.run(q, cache, table, seqlens, backend="triton")
    assert len(gluon_calls) == 1
    assert_matches(out, lse, want, want_lse)


@pytest.mark.gpu
@needs_gate
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_garbage_past_the_end_stays_out(splits, gluon_calls):
    """Cache rows past each request's length (the last page's tail, unused and spare pages) hold NaN: the
    kernel reads whole pages through TMA, so it must keep them out of both S and P·V."""
    lens = [65, 1000, 1, 127]
    q, _, cache, table, seqlens, _ = _problem(len(lens), 1, 128, 64, lens, "bf16", torch.bfloat16)
    cache[_past_the_ends(cache, table, lens)] = float("nan")
    _check(q, cache, table, seqlens, "bf16", False, splits)
    assert len(gluon_calls) == 1


@pytest.mark.gpu
@needs_gate
@pytest.mark.parametrize("h_q", [96, 128])  # 96: the second row tile is part-filled
def test_gpu_direct_call(h_q):
    lens = [0, 63, 1000, 4096 + 3]
    q, _, cache, table, seqlens, _ = _problem(len(lens), 1, h_q, 64, lens, "bf16", torch.bfloat16)
    with poisoned_outputs():
        out, lse = dg.mla_decode_gluon(q, cache, table, seqlens, 576 ** -0.5, False, 3)
    assert_matches(out, lse, *mla_decode_reference(q.float(), cache.float(), table, seqlens))


@pytest.mark.gpu
@needs_gate
def test_gpu_cuda_graph_capture(gluon_calls):
    q, _, cache, table, seqlens, _ = _problem(4, 1, 128, 64, [300, 1000, 5, 64], "bf16", torch.bfloat16)
    g_out, _ = graph_replayed(wf.mla.plan(q, cache, table), q, cache, table, seqlens)
    want, _ = mla_decode_reference(q.float(), cache.float(), table, seqlens)
    assert 1 - cosine(g_out, want) <= 1e-5
    assert len(gluon_calls) == 2


def test_which_quantized_caches_the_kernel_reads(monkeypatch):
    """On any machine: FP8 always; FP4 only where the dequantisation pass would slice the batch; none when off."""
    fp8, nvfp4, mxfp4 = (KV_FORMATS[n] for n in ("fp8", "nvfp4", "mxfp4"))
    assert api.quantized_in_kernel(fp8, 128, 128) and api.quantized_in_kernel(fp8, 128, 64)
    for fmt in (nvfp4, mxfp4):
        assert not api.quantized_in_kernel(fmt, 128, 128) and api.quantized_in_kernel(fmt, 128, 93)
    monkeypatch.setenv(configs.GLUON_IN_KERNEL_ENV, "0")
    assert not api.quantized_in_kernel(fp8, 128, 64) and not api.quantized_in_kernel(nvfp4, 128, 1)


@pytest.mark.gpu
@needs_gate
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_gpu_cuda_graph_capture_quantized_in_kernel(fmt, gluon_calls, monkeypatch):
    """A quantized cache read by the kernel itself, captured once and replayed with longer requests."""
    from warpforge.ops.mla import dequant_kernel
    monkeypatch.setattr(dequant_kernel, "SCRATCH_BYTES", 1)  # FP4 takes the kernel where the pass would slice
    q, _, cache, table, seqlens, kv_scale = _problem(4, 1, 128, 64, [300, 1000, 5, 64], fmt, torch.bfloat16)
    g_out, g_lse = graph_replayed(wf.mla.plan(q, cache, table, kv_format=fmt), q, cache, table, seqlens, kv_scale)
    check_dequantised(g_out, g_lse, q, cache, table, seqlens, fmt, False, kv_scale)
    assert len(gluon_calls) == 2


def test_plan_carries_the_flag_to_the_op():
    """On any machine: a plan's gluon flag reaches the op (the op's schema takes it)."""
    assert "gluon" in str(api._mla_decode.op._schema)
