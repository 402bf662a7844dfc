"""The Hopper Gluon paged decode (ops/paged/decode_gluon_kernel.py): the api gate, the column relabelling, compiled
for sm_90 on CPU when the installed Triton is one its Gluon API was written for, and checked against the fp32
reference on an sm_90 GPU (the family's other GPU tests take it too wherever the gate holds)."""
import os

import pytest
import torch

import warpforge as wf
from warpforge.ops._gluon import SMEM_MAX, compile_in_subprocess, import_loads_gluon
from warpforge.ops.paged import configs
from warpforge.ops.paged import decode_gluon_kernel as dg
from warpforge.testing import REL_L2, cosine, gluon_triton, on_sm90_gluon, rel_l2, spy_launches, triton_version

from .test_paged_decode import DEV, _check, _decode, _problem, _reference, _to_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _on_h200_gate() -> bool:
    return on_sm90_gluon(dg.GLUON_TRITON_VERSIONS) and os.environ.get(configs.GLUON_ENV, "1") != "0"


def test_gate_constants_agree_and_import_is_lazy():
    assert configs.GLUON_TRITON_VERSIONS == dg.GLUON_TRITON_VERSIONS
    assert all(c.gluon and c.block_n % 4 == 0 and c.block_n // 4 in (16, 32) for c in configs.GLUON.values())
    assert not import_loads_gluon(("warpforge.ops.paged.decode_gluon_kernel",), ROOT)


def test_column_relabellings_are_permutations():
    """The score dot reads cache column sigma_k(k) as its column k (q's loaded the same way), and P·V's column n is
    cache column sigma_v(n) (stored back there): both permutations of 0..127."""
    assert sorted(dg.sigma_k(k) for k in range(128)) == list(range(128))
    assert sorted(dg.sigma_v(n) for n in range(128)) == list(range(128))


def test_nvfp4_word_decode():
    """_e2m1_words' arithmetic, replayed in torch on a row of 16 random words: each nibble becomes the e4m3 byte of
    its value times 2^-6, and the joins' column c holds head-dim value perm_c(c)."""
    from warpforge.quant import e2m1_values
    w = torch.randint(0, 2**32, (16,), dtype=torch.int64)
    lo = ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080)
    hi = ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)

    def byte(x, k):
        return ((x >> (8 * k)) & 0xFF).to(torch.uint8)

    join = lambda a, b: torch.stack([a, b], -1)   # gl.join: a new last dim
    lo_up, hi_up = (lo * 65536) >> 32, (hi * 65536) >> 32   # umulhi(x, 2^16)
    x = join(join(join(byte(lo, 0), byte(hi, 0)), join(byte(lo_up, 0), byte(hi_up, 0))),
             join(join(byte(lo, 1), byte(hi, 1)), join(byte(lo_up, 1), byte(hi_up, 1))))
    decoded = x.view(torch.float8_e4m3fn).float().reshape(128) * 64.0
    packed = torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], -1).reshape(64)
    values = e2m1_values(torch.stack([packed & 0xF, packed >> 4], -1).flatten())
    assert sorted(dg.perm_c(c) for c in range(128)) == list(range(128))
    assert torch.equal(decoded, values[[dg.perm_c(c) for c in range(128)]].float())


def test_cache_layouts_the_kernel_reads(monkeypatch):
    """FP8: 16-byte aligned rows (16-byte copies), any strides else; FP4: values and block scales (the row
    layout's views, or a pair) in packed rows, K's pitches V's (constexpr pitches)."""
    fp8 = torch.zeros(4, 16, 2, 128, dtype=torch.float8_e4m3fn)
    assert dg.cache_ok(fp8, fp8, 1)
    assert dg.cache_ok(fp8[:, :, 1:], fp8[:, :, 1:], 1)   # one head of two: strided, rows still aligned
    odd = torch.zeros(4, 16, 2, 136, dtype=torch.float8_e4m3fn)[..., :128]   # 136-byte head stride
    assert not dg.cache_ok(odd, fp8, 1)
    def parts(c):
        return c[..., :64], c[..., 64:]
    fp4 = torch.zeros(4, 16, 2, 72, dtype=torch.uint8)
    assert dg.cache_ok(parts(fp4)[0], parts(fp4)[0], 2, parts(fp4)[1], parts(fp4)[1])
    pair = (torch.zeros(4, 16, 2, 64, dtype=torch.uint8), torch.zeros(4, 16, 2, 8, dtype=torch.uint8))
    assert dg.cache_ok(pair[0], pair[0], 2, pair[1], pair[1])
    # but api holds an NVFP4 pair back unless configs.GLUON_NVFP4_PAIR_ENV is "1" (session 42); MXFP4's and a row
    # cache's views go
    held = wf.ops.paged.api.nvfp4_pair_held_back
    nv, mx = wf.paged.KV_FORMATS["nvfp4"], wf.paged.KV_FORMATS["mxfp4"]
    monkeypatch.delenv(configs.GLUON_NVFP4_PAIR_ENV, raising=False)
    assert held(nv, *pair) and not held(mx, *pair) and not held(nv, *parts(fp4))
    monkeypatch.setenv(configs.GLUON_NVFP4_PAIR_ENV, "1")
    assert not held(nv, *pair)
    wide = torch.zeros(4, 16, 2, 80, dtype=torch.uint8)[..., :72]   # 80-byte rows: packed, 16-byte aligned
    assert dg.cache_ok(parts(wide)[0], parts(wide)[0], 2, parts(wide)[1], parts(wide)[1])
    assert not dg.cache_ok(parts(fp4)[0], parts(wide)[0], 2, parts(fp4)[1], parts(wide)[1])   # K's pitch not V's
    one_head = parts(fp4[:, :, 1:])   # rows 144 bytes apart a token, one head: not packed
    assert not dg.cache_ok(one_head[0], one_head[0], 2, one_head[1], one_head[1])


def test_gate_off_where_it_does_not_apply(monkeypatch):
    p = _problem(2, 1, 8, 2, 128, 16, [37, 5], "fp8", torch.float16)
    on = _on_h200_gate()
    plan = wf.paged.plan(p["q"], p["k_cache"], p["block_table"], kv_format="fp8")
    assert plan.config.gluon == on
    # not for: softcap, a window, d != 128, more than 16 rows per kv head, the switch off, other formats
    assert not wf.paged.plan(p["q"], p["k_cache"], p["block_table"], kv_format="fp8", softcap=30.0).config.gluon
    assert not wf.paged.plan(p["q"], p["k_cache"], p["block_table"], kv_format="fp8", window=8).config.gluon
    q64 = p["q"][..., :64].contiguous()
    assert not wf.paged.plan(q64, p["k_cache"][..., :64].contiguous(), p["block_table"], kv_format="fp8").config.gluon
    q5 = p["q"].expand(2, 5, 8, 128).contiguous()   # GQA 4 · s_q 5 = 20 rows
    assert not wf.paged.plan(q5, p["k_cache"], p["block_table"], kv_format="fp8").config.gluon
    bf = _problem(2, 1, 8, 2, 128, 16, [37, 5], "fp16", torch.float16)
    assert not wf.paged.plan(bf["q"], bf["k_cache"], bf["block_table"], kv_format="fp16").config.gluon
    # FP4 too; MXFP4 only under bf16 q (its dots run in bf16)
    nv = _problem(2, 1, 8, 2, 128, 16, [37, 5], "nvfp4", torch.float16)
    assert wf.paged.plan(nv["q"], nv["k_cache"], nv["block_table"], kv_format="nvfp4").config.gluon == on
    mx = _problem(2, 1, 8, 2, 128, 16, [37, 5], "mxfp4", torch.float16)
    assert not wf.paged.plan(mx["q"], mx["k_cache"], mx["block_table"], kv_format="mxfp4").config.gluon
    assert (wf.paged.plan(mx["q"].to(torch.bfloat16), mx["k_cache"], mx["block_table"], kv_format="mxfp4").config.gluon
            == on)
    monkeypatch.setenv(configs.GLUON_ENV, "0")
    assert not wf.paged.plan(p["q"], p["k_cache"], p["block_table"], kv_format="fp8").config.gluon


# ------------------------------------------------------------------------------------ compile for sm_90
COMPILE_CASES = [
    dict(group=4, s_q=1, num_splits=1, page=16, scale_mode=1),
    dict(group=8, s_q=2, num_splits=3, page=1, scale_mode=2),
    dict(group=1, s_q=1, num_splits=2, page=64, scale_mode=0),
    dict(group=4, s_q=1, num_splits=1, page=16, code=2),
    dict(group=8, s_q=2, num_splits=3, page=1, code=3),
    # the sweep's other tiles: 2 slots, 64-token steps
    dict(group=4, s_q=1, num_splits=1, page=16, scale_mode=1, cfg=list(configs.PagedCfg(16, 128, 4, 2, gluon=True))),
    dict(group=4, s_q=1, num_splits=1, page=16, code=2, cfg=list(configs.PagedCfg(16, 64, 4, 4, gluon=True))),
    # q's fragments from shared memory (configs.PagedCfg.q_shared)
    dict(group=4, s_q=1, num_splits=1, page=16, code=2, cfg=list(configs.PagedCfg(16, 128, 4, 2, gluon=True,
                                                                                  q_shared=True))),
    dict(group=8, s_q=2, num_splits=3, page=1, code=3, cfg=list(configs.PagedCfg(16, 128, 4, 2, gluon=True,
                                                                                 q_shared=True))),
    dict(group=4, s_q=1, num_splits=1, page=16, scale_mode=2, cfg=list(configs.PagedCfg(16, 128, 4, 3, gluon=True,
                                                                                        q_shared=True))),
]


SPILL_BYTES = 32


def _case_id(c):
    return "-".join(f"{k}{v}" for k, v in c.items() if k != "cfg") + (
        f"-tile{c['cfg'][1]}x{c['cfg'][3]}" + ("-qshared" if configs.PagedCfg(*c["cfg"]).q_shared else "")
        if "cfg" in c else "")


@pytest.mark.skipif(not gluon_triton(dg.GLUON_TRITON_VERSIONS), reason="the Gluon kernel is written for Triton "
                    f"{dg.GLUON_TRITON_VERSIONS} (installed: {triton_version()}); its API differs between releases")
@pytest.mark.parametrize("case", COMPILE_CASES, ids=_case_id)
def test_compiles_for_sm90(case):
    fmt = {1: "fp8", 2: "nvfp4", 3: "mxfp4"}[case.get("code", 1)]
    cfg = configs.PagedCfg(*case["cfg"]) if "cfg" in case else configs.GLUON[fmt]
    r = compile_in_subprocess("warpforge.ops.paged.decode_gluon_kernel", dict(case, cfg=cfg._asdict()), ROOT)
    print(f"\n{case}: {r['registers']} registers/thread, spills {r['spill_stores']}/{r['spill_loads']} B, "
          f"shared {r['shared_bytes']} B, warps {r['num_warps']}")
    assert r["ptxas_rc"] == 0, r["ptxas_log"]
    assert r["num_warps"] == 4 and r["shared_bytes"] <= SMEM_MAX
    # ptxas keeps some builds near 168 registers and spills a few bytes (8-16 B seen in session 19): more would
    # say the tiles no longer fit
    assert r["spill_stores"] <= SPILL_BYTES and r["spill_loads"] <= SPILL_BYTES, r["ptxas_log"]
    assert r["registers"] <= 255
    # two programs per SM at least (their rings and the epilogue's scratch)
    assert 2 * r["shared_bytes"] <= SMEM_MAX


# ------------------------------------------------------------------------------------------ GPU numerics
needs_gate = pytest.mark.skipif(not _on_h200_gate(), reason="the Gluon path runs on sm_90 with Triton "
                                f"{dg.GLUON_TRITON_VERSIONS} (and {configs.GLUON_ENV} != 0)")


@pytest.fixture
def gluon_calls(monkeypatch):
    """Records num_splits of each Gluon launch made through api's dispatch."""
    return spy_launches(monkeypatch, dg, "paged_decode_gluon", lambda args: args[8])


# (b, s_q, h_q, h_kv, page, lens, splits): GQA 4 / 8 / 1 / 16 rows, pages 16 / 1 / 64, lengths shorter than a step,
# across steps and pages, == s_q; splits planned / 1 / 3 / more than the steps
GPU_SHAPES = [
    (3, 1, 32, 8, 16, [1000, 37, 1], None),
    (2, 2, 16, 2, 1, [50, 2], 3),
    (2, 1, 8, 8, 64, [300, 129], 1),
    (2, 4, 32, 8, 16, [700, 4], 7),
    (1, 1, 16, 1, 32, [4097], None),
]


@pytest.mark.gpu
@needs_gate
@pytest.mark.parametrize("fmt", ["fp8", "fp8-page", "fp8-float", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,s_q,h_q,h_kv,page,lens,splits", GPU_SHAPES)
def test_gpu_matches_reference(b, s_q, h_q, h_kv, page, lens, splits, fmt, q_dtype, gluon_calls):
    """Against fp32 on the same cache (the unused slots hold NaN codes): within fp16 (MXFP4: bf16) dots' rounding."""
    if fmt == "mxfp4" and q_dtype != torch.bfloat16:
        pytest.skip("MXFP4 takes the Gluon kernel under bf16 q only")
    p = _problem(b, s_q, h_q, h_kv, 128, page, lens, fmt, q_dtype)
    out, lse = _decode(p, num_splits=splits)
    assert gluon_calls
    ref, ref_lse = _reference(p)
    assert rel_l2(out, ref) <= REL_L2[q_dtype] and 1 - cosine(out, ref) <= 1e-5
    assert torch.isfinite(lse).all() and torch.allclose(lse, ref_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@needs_gate
@pytest.mark.parametrize("fmt,pair", [("fp8", False), ("fp8-page", False), ("nvfp4", False), ("mxfp4", False),
                                      ("nvfp4", True), ("mxfp4", True)])
@pytest.mark.parametrize("b,s_q,h_q,h_kv,page,lens,splits", GPU_SHAPES[:3])
def test_gpu_q_from_shared_memory_is_the_same(b, s_q, h_q, h_kv, page, lens, splits, fmt, pair, monkeypatch):
    """configs.PagedCfg.q_shared (q's fragments loaded from shared memory each step): the same answer, bitwise, in
    both FP4 layouts (the pair: 16-byte value copies, the build whose registers the option cuts)."""
    q_shared = spy_launches(monkeypatch, dg, "paged_decode_gluon", lambda args: args[9].q_shared)
    monkeypatch.setenv(configs.GLUON_NVFP4_PAIR_ENV, "1")   # the NVFP4 pair on the Gluon kernel too
    p = _problem(b, s_q, h_q, h_kv, 128, page, lens, fmt, torch.bfloat16)
    if pair:
        p.update({name: (p[name][..., :64].contiguous(), p[name][..., 64:].contiguous())
                  for name in ("k_cache", "v_cache")})
    want = _decode(p, num_splits=splits)
    kv = fmt.split("-")[0]   # the cache format ("fp8-page": fp8 with per-page scales)
    monkeypatch.setitem(configs.GLUON, kv, configs.GLUON[kv]._replace(q_shared=True))
    got = _decode(p, num_splits=splits)
    assert q_shared == [False, True]
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


@pytest.mark.gpu
@needs_gate
def test_gpu_same_answer_as_the_portable_kernel(monkeypatch, gluon_calls):
    """The Gluon kernel and the Triton kernel on one problem (Llama-3-8B's heads, per-page scales)."""
    p = _problem(4, 1, 32, 8, 128, 16, [4096, 3001, 17, 1], "fp8-page", torch.bfloat16)
    out = _decode(p)[0]
    assert gluon_calls
    monkeypatch.setenv(configs.GLUON_ENV, "0")
    portable = _decode(p)[0]
    assert 1 - cosine(out, portable) <= 1e-5 and rel_l2(out, portable) <= REL_L2[torch.bfloat16]


@pytest.mark.gpu
@needs_gate
def test_gpu_check_helper_passes(gluon_calls):
    """The family's own _check (fp16 q) on the Gluon path."""
    _check(_problem(2, 1, 8, 2, 128, 16, [37, 5], "fp8", torch.float16))
    assert gluon_calls
    assert DEV.type == "cuda"


@pytest.mark.gpu
@needs_gate
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_padded_and_scattered_fp4_rows(fmt, gluon_calls):
    """FP4 rows padded to a wider pitch (a view into a wider buffer) still run on the Gluon kernel, which reads at the
    rows' pitch (session 40); pages that are not one run of rows (every other page of a buffer) take the portable
    kernel. The same answer either way."""
    p = _problem(2, 1, 32, 8, 128, 16, [300, 17], fmt, torch.bfloat16)
    ref = _decode(p)[0]
    assert gluon_calls
    for wider, every in ((8, 1), (0, 2)):
        gluon_calls.clear()
        q = dict(p)
        for name in ("k_cache", "v_cache"):
            c = p[name]
            wide = torch.zeros(c.shape[0] * every, *c.shape[1:3], c.shape[3] + wider, dtype=c.dtype, device=c.device)
            wide[::every, ..., :c.shape[3]] = c
            q[name] = wide[::every, ..., :c.shape[3]]
        out = _decode(q)[0]
        assert 1 - cosine(out, ref) <= 1e-5, (wider, every)
        assert bool(gluon_calls) == (every == 1), (wider, every)


@pytest.mark.gpu
@needs_gate
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_bench_case_both_layouts_score_right(fmt, monkeypatch):
    """The family bench's FP4 case as it runs (b 64, L 4k, rotated sets, each layout replayed from CUDA graphs, the
    score's reference computed between): both layouts right. Session 42 on an H100: the NVFP4 pair read 1 - cos 1.0
    (an output of ~1e-37) here, 3 runs of 3, while eager calls, a lone capture and the same graphs replayed without
    the reference computed in between were right (NOTES "Session 42")."""
    from warpforge.bench.paged_cases import paged_setup
    monkeypatch.setenv(configs.GLUON_NVFP4_PAIR_ENV, "1")   # the pair on the Gluon kernel, off by default for this
    st = paged_setup(torch.device("cuda"), False, L=4096, fmt=fmt)
    for name, fn in st.impls.items():
        st.reset()
        err = st.score(fn())
        assert err <= st.tol, (name, err)


@pytest.mark.gpu
@needs_gate
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("b,s_q,h_q,h_kv,page,lens,splits", GPU_SHAPES[:3])
def test_gpu_split_scales_read_as_the_rows(b, s_q, h_q, h_kv, page, lens, splits, fmt, gluon_calls, monkeypatch):
    """An FP4 cache as the pair (values, block scales) (16-byte copies of its 64-byte value rows) gives the row
    layout's answer, bitwise, both on the Gluon kernel (the NVFP4 pair forced there: configs.GLUON_NVFP4_PAIR_ENV)."""
    monkeypatch.setenv(configs.GLUON_NVFP4_PAIR_ENV, "1")
    p = _problem(b, s_q, h_q, h_kv, 128, page, lens, fmt, torch.bfloat16)
    rows = _decode(p, num_splits=splits)
    pair = {name: (p[name][..., :64].contiguous(), p[name][..., 64:].contiguous()) for name in ("k_cache", "v_cache")}
    split = _decode({**p, **pair}, num_splits=splits)
    assert len(gluon_calls) == 2
    assert torch.equal(rows[0], split[0]) and torch.equal(rows[1], split[1])


@pytest.mark.gpu
@needs_gate
def test_gpu_small_values_under_per_page_scales(gluon_calls):
    """Per-page V scales of a cache of small values (|V| ~ 1e-4) under fp16 q: p takes them relative to the first
    page's, so p · v_scale does not sink into fp16's subnormals (NOTES session 40)."""
    p = _problem(2, 1, 32, 8, 128, 16, [700, 37], "fp8-page", torch.float16)
    p["v_cache"], p["v_scale"] = _to_cache(p["v"] * 1e-4, "fp8-page")
    out = _decode(p)[0]
    assert gluon_calls
    assert rel_l2(out, _reference(p)[0]) <= REL_L2[torch.float16]
