"""The Gluon MLA decode for at most 16 query rows over FP8 caches (ops/mla/decode_rows16_gluon_kernel.py): compiled
for sm_90 on CPU when the installed Triton is one its Gluon API was written for, and checked against the fp32
reference on an sm_90 GPU."""
import os

import pytest
import torch

import warpforge as wf
from warpforge.ops._gluon import compile_in_subprocess, import_loads_gluon
from warpforge.ops.mla import api, configs
from warpforge.ops.mla import decode_rows16_gluon_kernel as d16
from warpforge.ops.mla import mla_decode_reference
from warpforge.testing import cosine, gluon_triton, on_sm90_gluon, poisoned_outputs, spy_launches, triton_version

from .test_mla_decode import LSE_TOL_ROWS16, _check, _problem, assert_matches, graph_replayed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _on_h200_gate() -> bool:
    return on_sm90_gluon(d16.GLUON_TRITON_VERSIONS) and os.environ.get(configs.GLUON_ROWS16_ENV, "1") != "0" and \
        os.environ.get(configs.GLUON_ENV, "1") != "0"


def test_constants_agree_and_import_is_lazy():
    assert configs.GLUON_TRITON_VERSIONS == d16.GLUON_TRITON_VERSIONS
    assert configs.GLUON_ROWS16_MAX_ROWS == d16.ROWS
    fp8 = api.KV_FORMATS["fp8"]
    assert (fp8.scale_offset, fp8.rope_offset, fp8.group) == (d16.SCALE_OFF, d16.ROPE_OFF, 128)
    assert not import_loads_gluon(("warpforge.ops.mla.decode_rows16_gluon_kernel",), ROOT)


def test_gate(monkeypatch):
    """Only FP8 caches, dense, at most 16 rows, on sm_90 with a Gluon Triton; the switch turns it off."""
    q, _, cache, table, _, _ = _problem(2, 1, 16, 16, [70, 5], "fp8")
    on = _on_h200_gate() and q.dtype == torch.bfloat16
    assert wf.mla.plan(q, cache, table, kv_format="fp8").rows16 == on
    assert not wf.mla.plan(torch.cat([q, q], 2), cache, table, kv_format="fp8").rows16   # 32 rows
    assert not wf.mla.plan(torch.cat([q, q[:, :, :1]], 2), cache, table, kv_format="fp8").rows16   # 17 rows
    indices = torch.zeros(2, 1, 8, dtype=torch.int32, device=q.device)
    assert not wf.mla.plan(q, cache, None, indices=indices, kv_format="fp8").rows16   # sparse
    bf16 = torch.randn(4, 16, 1, 576, device=q.device, dtype=q.dtype)
    assert not wf.mla.plan(q, bf16, table).rows16
    monkeypatch.setenv(configs.GLUON_ROWS16_ENV, "0")
    assert not wf.mla.plan(q, cache, table, kv_format="fp8").rows16
    monkeypatch.setenv(configs.GLUON_ROWS16_ENV, "1")
    monkeypatch.setenv(configs.GLUON_ENV, "0")   # every Gluon path off
    assert not wf.mla.plan(q, cache, table, kv_format="fp8").rows16


def test_cache_ok():
    """Caches TMA reads as they are; anything else goes to the portable kernel (no GPU needed: shapes, strides and
    addresses only)."""
    def cache(pages=4, page=64, width=656, offset=0):
        flat = torch.zeros(pages * page * width + offset + 64, dtype=torch.uint8)
        base = (-flat.data_ptr()) % 16 + offset
        return flat[base:base + pages * page * width].view(pages, page, 1, width)
    assert all(d16.cache_ok(cache(page=p)) for p in (16, 32, 64))
    assert not d16.cache_ok(cache(page=128))
    assert not d16.cache_ok(cache(pages=0))
    assert not d16.cache_ok(cache(offset=8))                          # base not 16-byte aligned
    assert not d16.cache_ok(cache(width=768)[..., :656])              # rows 768 bytes apart
    assert not d16.cache_ok(cache(width=656 * 2).view(4, 64, 2, 656)[:, :, 1:])   # one head of two
    assert not d16.cache_ok(cache(width=576 * 2).view(torch.bfloat16))            # a bf16 cache


def test_column_relabelling_is_a_permutation():
    """The kernel inlines sigma_v (the output's columns); it is paged decode's, and touches every column of a
    128-wide chunk once."""
    from warpforge.ops.paged import decode_gluon_kernel as paged
    assert sorted(map(d16.sigma_v, range(128))) == list(range(128))
    assert all(d16.sigma_v(k) == paged.sigma_v(k) for k in range(128))


def test_plan_carries_the_flag_to_the_op():
    assert "rows16" in str(api._mla_decode.op._schema)


# ------------------------------------------------------------------------------------ compile for sm_90
COMPILE_CASES = [
    dict(h_q=16, s_q=1, causal=False, num_splits=1, page=64),
    dict(h_q=8, s_q=2, causal=True, num_splits=3, page=16),
    dict(h_q=1, s_q=1, causal=False, num_splits=2, page=32),
]


@pytest.mark.skipif(not gluon_triton(d16.GLUON_TRITON_VERSIONS), reason=f"the Gluon kernel is written for Triton "
                    f"{d16.GLUON_TRITON_VERSIONS} (installed: {triton_version()}); its API differs between releases")
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_compiles_for_sm90(case):
    r = compile_in_subprocess("warpforge.ops.mla.decode_rows16_gluon_kernel", case, ROOT)
    print(f"\n{case}: {r['registers']} registers, spills {r['spill_stores']}/{r['spill_loads']} B, shared "
          f"{r['shared_bytes']} B, warps {r['num_warps']}")
    assert r["ptxas_rc"] == 0, r["ptxas_log"]
    assert r["num_warps"] == 4 and r["wgmma"] and r["tma"] and r["mbarrier"]
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas_log"]
    assert 2 * r["registers"] * 128 <= 65536   # two programs an SM
    assert 2 * (r["shared_bytes"] + 1024) <= 228 * 1024   # two programs' shared memory and their reserved 1 KB


# ------------------------------------------------------------------------------------------ GPU numerics
needs_gate = pytest.mark.skipif(not _on_h200_gate(), reason="the rows16 Gluon path runs on sm_90 with Triton "
                                f"{d16.GLUON_TRITON_VERSIONS} (and {configs.GLUON_ROWS16_ENV} != 0)")
LENS = [0, 1, 31, 32, 33, 1000, 129, 2047]


@pytest.fixture
def calls(monkeypatch):
    """Records num_splits of each launch made through api's dispatch."""
    return spy_launches(monkeypatch, d16, "mla_decode_rows16_gluon", lambda args: args[6])


def _poison_past_the_ends(cache, table, lens):
    """0xFF (NaN as e4m3, as the scales' fp32 and as the rope's bf16) in every cache row no request reads."""
    used = torch.zeros(cache.shape[0], cache.shape[1], dtype=torch.bool, device=cache.device)
    page = cache.shape[1]
    for i, n in enumerate(lens):
        for p in range(-(-n // page)):
            used[table[i, p], : min(page, n - page * p)] = True
    cache[~used] = 0xFF


@pytest.mark.gpu
@needs_gate
@pytest.mark.parametrize("h_q,s_q,causal,page", [(16, 1, False, 64), (16, 1, False, 16), (8, 2, True, 32),
                                                 (4, 4, True, 16), (1, 1, False, 64), (5, 3, True, 64)])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_gpu_matches_reference(h_q, s_q, causal, page, splits, calls):
    q, _, cache, table, seqlens, _ = _problem(len(LENS), s_q, h_q, page, LENS, "fp8", torch.bfloat16)
    _poison_past_the_ends(cache, table, LENS)
    _check(q, cache, table, seqlens, "fp8", causal, splits)
    assert len(calls) == 1  # the gated path ran, not the portable kernel


@pytest.mark.gpu
@needs_gate
def test_gpu_against_the_portable_kernel(calls, monkeypatch):
    q, _, cache, table, seqlens, _ = _problem(8, 1, 16, 64, [4096, 5, 100, 3000, 1, 64, 65, 777], "fp8",
                                              torch.bfloat16)
    plan = wf.mla.plan(q, cache, table, kv_format="fp8")
    assert plan.rows16
    out, lse = plan.run(q, cache, table, seqlens)
    assert calls == [plan.num_splits]
    monkeypatch.setenv(configs.GLUON_ROWS16_ENV, "0")
    off = wf.mla.plan(q, cache, table, kv_format="fp8")
    want, want_lse = off.run(q, cache, table, seqlens, backend="triton")
    assert len(calls) == 1
    assert_matches(out, lse, want, want_lse, lse_tol=LSE_TOL_ROWS16)


@pytest.mark.gpu
@needs_gate
def test_gpu_direct_call():
    lens = [0, 63, 1000, 4096 + 3]
    q, _, cache, table, seqlens, _ = _problem(len(lens), 1, 16, 64, lens, "fp8", torch.bfloat16)
    with poisoned_outputs():
        out, lse = d16.mla_decode_rows16_gluon(q, cache, table, seqlens, 576 ** -0.5, False, 3,
                                               configs.GLUON_ROWS16_STAGES)
    assert_matches(out, lse, *mla_decode_reference(q.float(), cache, table, seqlens, kv_format="fp8"),
                   lse_tol=LSE_TOL_ROWS16)


@pytest.mark.gpu
@needs_gate
def test_gpu_cuda_graph_capture(calls):
    q, _, cache, table, seqlens, _ = _problem(4, 1, 16, 64, [300, 1000, 5, 64], "fp8", torch.bfloat16)
    g_out, _ = graph_replayed(wf.mla.plan(q, cache, table, kv_format="fp8"), q, cache, table, seqlens)
    want, _ = mla_decode_reference(q.float(), cache, table, seqlens, kv_format="fp8")
    assert 1 - cosine(g_out, want) <= 1e-5
    assert len(calls) == 2


@pytest.mark.gpu
@needs_gate
def test_gpu_shared_views_read_what_tma_wrote():
    """One step's rows by the kernel's TMA descriptors (a page-64 latent box of [4, 64, 128], the scales) into its
    shared-memory tiles, read back through the views and register layouts the step uses (each half's V as LV, the
    scales as the score rows' [64, 4]): each must be the cache's bytes at the right (chunk, token, column). A
    transposed view of a scales tile read the wrong words on the H200 once (session 21), with every shape
    compiling."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    _, _, _, _, _, lv, _, smem_lv, smem_rope, smem_s, _ = d16._layouts(gl)

    @gluon.jit
    def views(kn_desc, ks_desc, OUT_K, OUT_S, LV: gl.constexpr, SMEM_LV: gl.constexpr, SMEM_S: gl.constexpr):
        ring = gl.allocate_shared_memory(gl.uint8, [1, 4, 64, 128], SMEM_LV)
        s_tma = gl.allocate_shared_memory(gl.float32, [1, 64, 4], SMEM_S)
        bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bar.index(0), count=1)
        mbarrier.init(bar.index(1), count=1)
        mbarrier.expect(bar.index(0), 64 * 512)
        mbarrier.expect(bar.index(1), 64 * 16)
        tma.async_copy_global_to_shared(kn_desc, [0, 0, 0], bar.index(0), ring.index(0))
        tma.async_copy_global_to_shared(ks_desc, [0, 128], bar.index(1), s_tma.index(0))
        mbarrier.wait(bar.index(0), 0)
        mbarrier.wait(bar.index(1), 0)
        for h in gl.static_range(2):
            k = ring.index(0).slice(h * 32, 32, dim=1).load(LV)                 # [4, 32, 128] (chunk, token, byte)
            w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, LV)))
            t = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LV)))
            c = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, LV)))
            gl.store(OUT_K + w[:, None, None] * 8192 + (h * 32 + t)[None, :, None] * 128 + c[None, None, :], k)
        SCL: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 4])
        sc = s_tma.index(0).load(SCL)
        ts = gl.arange(0, 64, layout=gl.SliceLayout(1, SCL))
        cs = gl.arange(0, 4, layout=gl.SliceLayout(0, SCL))
        gl.store(OUT_S + ts[:, None] * 4 + cs[None, :], sc)

    cache = torch.randint(0, 120, (2, 64, 1, 656), dtype=torch.uint8, device="cuda")
    kn, _, ks = d16._descriptors(cache, (smem_lv, smem_rope, smem_s))
    out_k = torch.zeros(4, 64, 128, dtype=torch.uint8, device="cuda")
    out_s = torch.zeros(64, 4, dtype=torch.float32, device="cuda")
    views[(1,)](kn, ks, out_k, out_s, lv, smem_lv, smem_s, num_warps=4)
    rows = cache.view(-1, 656)[:64]
    assert torch.equal(out_k, rows[:, :512].reshape(64, 4, 128).permute(1, 0, 2))
    assert torch.equal(out_s, rows[:, 512:528].contiguous().view(torch.float32))


@pytest.mark.gpu
@needs_gate
def test_gpu_cache_tma_cannot_read_takes_the_portable_kernel(calls):
    """A cache 8 bytes off 16-byte alignment (a view into a larger buffer): the plan says rows16, the run falls back
    to the portable kernel, and the result is right."""
    lens = [300, 1000, 5, 64]
    q, _, cache, table, seqlens, _ = _problem(len(lens), 1, 16, 64, lens, "fp8", torch.bfloat16)
    buf = torch.empty(cache.numel() + 8, dtype=torch.uint8, device=cache.device)
    shifted = buf[8:].view(cache.shape)
    shifted.copy_(cache)
    assert not d16.cache_ok(shifted)
    _check(q, shifted, table, seqlens, "fp8", False)   # the portable kernel: exact fp16 scores
    assert calls == []


@pytest.mark.gpu
@needs_gate
@pytest.mark.parametrize("magnitude", [1e-3, 1e-4])
@pytest.mark.parametrize("splits", [None, 3])
def test_gpu_small_latents(magnitude, splits, calls):
    """P times the tokens' chunk scales relative to the program's first step (fp16 P·V): P times the scale itself
    (~|latent| / 448) underflowed fp16, 4% error at latents ~1e-4 (benchmarks/NOTES.md, session 40)."""
    lens = [40, 1000, 21]
    q, latent, _, table, seqlens, _ = _problem(len(lens), 1, 4, 16, lens, "fp8", torch.bfloat16)
    latent = latent.float() * magnitude
    latent[:, :4] *= 16   # scales differ across the tokens of one step
    cache = wf.mla.quantize_kv(latent, "fp8")
    q = q * 1e3
    out, lse = wf.mla_decode(q, cache, table, seqlens, kv_format="fp8", num_splits=splits)
    assert len(calls) == 1
    ref, ref_lse = mla_decode_reference(q.float(), cache, table, seqlens, kv_format="fp8")
    floor = ((ref.bfloat16().float() - ref).norm() / ref.norm()).item()   # the output's own bf16 rounding
    assert ((out.float() - ref).norm() / ref.norm()).item() <= 2 * floor + 1e-3
    assert torch.allclose(lse, ref_lse, rtol=LSE_TOL_ROWS16, atol=LSE_TOL_ROWS16)
