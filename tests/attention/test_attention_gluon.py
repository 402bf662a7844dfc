"""The Hopper Gluon forward of flash_attention (ops/attention/flash_gluon_kernel.py): compiled for sm_90 on CPU when
the installed Triton is one its Gluon API was written for, and checked against the fp32 reference on an sm_90 GPU
(forced on with WARPFORGE_ATTN_GLUON=1 while configs.GLUON_DEFAULT is off)."""
import os

import pytest
import torch

import warpforge as wf
from warpforge.ops._gluon import compile_in_subprocess, import_loads_gluon
from warpforge.ops.attention import api, attention_reference, configs
from warpforge.ops.attention import flash_gluon_kernel as fg
from warpforge.testing import (REL_L2, gluon_triton, on_sm90_gluon, poisoned_outputs, rel_l2, spy_launches,
                               triton_version)

KNOB_ENV = ("WARPFORGE_ATTN_GLUON_BLOCK_N", "WARPFORGE_ATTN_GLUON_STAGES", "WARPFORGE_ATTN_GLUON_PINGPONG",
            "WARPFORGE_ATTN_GLUON_PERSISTENT")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gluon_triton() -> bool:
    return gluon_triton(fg.GLUON_TRITON_VERSIONS)


def _on_h200() -> bool:
    return on_sm90_gluon(fg.GLUON_TRITON_VERSIONS)


def test_gate_constants_agree_and_import_is_lazy():
    assert configs.GLUON_TRITON_VERSIONS == fg.GLUON_TRITON_VERSIONS
    assert tuple(configs.GLUON_HEAD_DIMS) == tuple(fg.HEAD_DIMS)
    for (d, _), (block_n, stages, _, persistent) in configs.GLUON_FWD.items():
        assert fg.smem_bytes(d, block_n, stages, persistent) <= fg.SMEM_MAX and stages >= 2
    # importing warpforge (and the kernel module) does not load Gluon: it is built on first use
    assert not import_loads_gluon(("warpforge.ops.attention.flash_gluon_kernel",), ROOT)


def test_gate_off_where_it_does_not_apply(monkeypatch):
    monkeypatch.setenv(configs.GLUON_ENV, "1")
    q = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16)
    big = 1 << 30
    assert not api.gluon_gate(q, q, q, big, 0)  # a CPU tensor
    monkeypatch.setattr(api, "arch_key", lambda device: "sm90")
    assert not api.gluon_gate(q, q, q, big, big)  # still a CPU tensor


@pytest.mark.parametrize("s_q, s_k, left, right, want", [
    (100, 100, 1 << 30, 0, True), (100, 100, 1 << 30, 1 << 30, True), (100, 100, 1 << 30, 99, True),
    (100, 100, 99, 0, False),                 # a left window: the FP8 kernel's gate sends it to the portable kernel
    (1000, 100, 1 << 30, 200, False),         # right >= s_k, yet queries 0..698 see no key: a real bound
    (1000, 100, 1 << 30, 999, True), (77, 1000, 1 << 30, 50, False), (77, 1000, 1 << 30, 76, True)])
def test_only_causal_or_unmasked_bands_reach_the_fp8_gluon_kernel(s_q, s_k, left, right, want):
    """Bottom-right aligned bands: query c sees keys up to c + s_k - s_q + right. The bf16 Gluon kernels share the
    right-side rule (causal_or_open_right) and take left windows as well."""
    assert api.causal_or_unmasked(s_q, s_k, left, right) is want
    assert api.causal_or_open_right(s_q, right) is (want or left < s_k)


def test_knobs_come_from_the_table_and_the_environment(monkeypatch):
    for name in KNOB_ENV:
        monkeypatch.delenv(name, raising=False)
    assert api.gluon_knobs(128, True) == configs.GLUON_FWD[(128, True)]
    monkeypatch.setenv("WARPFORGE_ATTN_GLUON_BLOCK_N", "64")
    monkeypatch.setenv("WARPFORGE_ATTN_GLUON_STAGES", "3")
    monkeypatch.setenv("WARPFORGE_ATTN_GLUON_PINGPONG", "0")
    monkeypatch.setenv("WARPFORGE_ATTN_GLUON_PERSISTENT", "1")
    assert api.gluon_knobs(64, False) == (64, 3, False, True)


def test_bad_knobs_are_refused():
    """One ring slot would deadlock (S_j is issued before tile j-1's slot is freed); too much shared memory
    would not launch."""
    with pytest.raises(ValueError, match="stages must be >= 2"):
        fg.launch_args(torch.empty(1, 1, 1, 64), None, None, None, None, 1.0, False, 128, 1, True)
    with pytest.raises(ValueError, match="shared memory"):
        fg.launch_args(torch.empty(1, 1, 1, 128), None, None, None, None, 1.0, False, 128, 4, True)
    with pytest.raises(ValueError, match="shared memory"):  # fits with one Q slot, not with the persistent two
        fg.launch_args(torch.empty(1, 1, 1, 128), None, None, None, None, 1.0, False, 128, 3, True, True)


# ------------------------------------------------------------------------------------ compile for sm_90
COMPILE_CASES = [
    dict(d=128, causal=True, block_n=128, stages=2, pingpong=True),
    dict(d=128, causal=False, block_n=128, stages=2, pingpong=True, h_q=4, h_kv=4),
    dict(d=64, causal=True, block_n=128, stages=4, pingpong=True, h_q=8, h_kv=1),
    dict(d=64, causal=False, block_n=64, stages=2, pingpong=False, dtype="float16"),
    dict(d=128, causal=True, block_n=128, stages=2, pingpong=True, persistent=True),
]


def _compile_in_subprocess(case):
    return compile_in_subprocess("warpforge.ops.attention.flash_gluon_kernel", case, ROOT)


@pytest.mark.skipif(not _gluon_triton(), reason=f"the Gluon kernel is written for Triton {fg.GLUON_TRITON_VERSIONS} "
                    f"(installed: {triton_version()}); its API differs between releases")
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_compiles_for_sm90(case):
    r = _compile_in_subprocess(case)
    print(f"\n{case}: {r['registers']} registers/thread (ptxas cap; setmaxnreg {r['setmaxnreg_values']}), "
          f"spills {r['spill_stores']}/{r['spill_loads']} B, shared {r['shared_bytes']} B, warps {r['num_warps']}")
    assert r["wgmma"] and r["tma"] and r["setmaxnreg"] and r["mbarrier"]
    assert r["warp_specialize"] and r["num_warps"] == 12  # 2 consumer warpgroups + the producer's warpgroup
    assert r["ptxas_rc"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas_log"]
    assert not r["wgmma_serialized"], r["ptxas_log"]
    assert r["shared_bytes"] <= fg.SMEM_MAX
    assert fg.CONSUMER_REGS in r["setmaxnreg_values"] and fg.PRODUCER_REGS in r["setmaxnreg_values"]
    # P·V takes P from registers (wgmma's A operand as a register list): half the wgmmas
    assert 0 < r["wgmma_reg_a"] < r["wgmma_count"]


# ------------------------------------------------------------------------------------------ GPU numerics
needs_h200 = pytest.mark.skipif(not _on_h200(), reason="the Gluon forward runs on sm_90 with Triton "
                                f"{fg.GLUON_TRITON_VERSIONS}")


@pytest.fixture
def gluon_on(monkeypatch):
    """The gate switched on; records causal of each Gluon launch made through api's dispatch."""
    return spy_launches(monkeypatch, fg, "flash_fwd_gluon", lambda args: args[4], {configs.GLUON_ENV: "1"}, KNOB_ENV)


def _inputs(b, s_q, s_k, h_q, h_kv, d, dtype=torch.bfloat16, grad=False):
    q = torch.randn(b, s_q, h_q, d, device="cuda", dtype=dtype)
    k = torch.randn(b, s_k, h_kv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, s_k, h_kv, d, device="cuda", dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _check(q, k, v, causal, out, lse):
    ref_out, ref_lse = attention_reference(q.detach().float(), k.detach().float(), v.detach().float(), causal=causal)
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    assert rel_l2(out, ref_out) <= REL_L2[q.dtype]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "rows that see no key must have lse -inf"
    assert torch.all(lse[~finite] == float("-inf"))
    if finite.any():
        assert rel_l2(lse[finite], ref_lse[finite]) <= 1e-3
    if (~finite).any():  # those rows' outputs are 0
        assert torch.all(out.transpose(1, 2)[~finite] == 0)


SHAPES = [  # b, s_q, s_k, h_q, h_kv
    (1, 1, 1, 2, 2),
    (2, 77, 77, 4, 2),
    (2, 1000, 1000, 4, 4),
    (1, 4096 + 13, 4096 + 13, 2, 1),
    (3, 128, 128, 8, 2),
    (2, 77, 1000, 4, 1),    # fewer queries than keys (bottom-right causal)
    (2, 1000, 77, 4, 4),    # more queries than keys: causal rows that see nothing
]


@pytest.mark.gpu
@needs_h200
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-sq{}-sk{}-hq{}-hkv{}".format(*s))
def test_gpu_matches_reference(shape, causal, d, gluon_on):
    q, k, v = _inputs(*shape, d)
    with poisoned_outputs():
        out, lse = wf.flash_attention(q, k, v, causal=causal, return_lse=True)
    assert gluon_on == [causal]  # the gated path ran, not the portable kernel
    _check(q, k, v, causal, out, lse)


@pytest.mark.gpu
@needs_h200
@pytest.mark.parametrize("block_n,stages,pingpong,persistent", [(128, 2, False, False), (64, 4, True, False),
                                                                (128, 3, True, False), (128, 2, True, True)])
def test_gpu_knobs(block_n, stages, pingpong, persistent):
    """Every knob the sweep varies gives the same answer (direct calls; fp16 too). Persistent: more work items than
    SMs, items without keys (s_q > s_k, causal) among them."""
    for d, dtype, causal, shape in ((128, torch.bfloat16, True, (3, 1000 + 5, 1000 + 5, 16, 2)),
                                    (64, torch.float16, False, (2, 1000 + 5, 1000 + 5, 4, 2)),
                                    (128, torch.bfloat16, True, (5, 1100, 300, 8, 8))):
        q, k, v = _inputs(*shape, d, dtype)
        if fg.smem_bytes(d, block_n, stages, persistent) > fg.SMEM_MAX:
            continue
        with poisoned_outputs():
            out, lse = fg.flash_fwd_gluon(q, k, v, d ** -0.5, causal, block_n=block_n, stages=stages,
                                          pingpong=pingpong, persistent=persistent)
        _check(q, k, v, causal, out, lse)


@pytest.mark.gpu
@needs_h200
def test_gpu_strided_inputs_and_backward(gluon_on):
    """q, k, v as views of one packed qkv tensor (TMA descriptors over their strides), and the portable backward
    on the Gluon forward's out / lse."""
    b, s, h, d = 2, 333, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].detach().requires_grad_() for i in range(3))
    with poisoned_outputs():
        out, lse = wf.flash_attention(q, k, v, causal=True, return_lse=True)
    assert gluon_on == [True]
    _check(q, k, v, True, out, lse)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_reference(*ref_in, causal=True)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    grads_r = torch.autograd.grad(ref_out, ref_in, d_out.float())
    for g, r in zip(grads, grads_r):
        assert rel_l2(g, r) <= 2e-2


@pytest.mark.gpu
@needs_h200
def test_gpu_switch_and_fallbacks(gluon_on, monkeypatch):
    """Off by WARPFORGE_ATTN_GLUON=0 (the portable kernel then agrees); the gate says no to a window, d 96, fp32
    and unaligned strides, and the op sends softcap (a score modifier) to the portable kernel."""
    q, k, v = _inputs(2, 300, 300, 4, 2, 128)
    on = wf.flash_attention(q, k, v, causal=True)
    assert gluon_on == [True]
    monkeypatch.setenv(configs.GLUON_ENV, "0")
    assert not api.gluon_gate(q, k, v, 1 << 30, 0)
    off = wf.flash_attention(q, k, v, causal=True)
    assert len(gluon_on) == 1
    assert rel_l2(on, off) <= 1e-2
    monkeypatch.setenv(configs.GLUON_ENV, "1")
    big = 1 << 30
    assert api.gluon_gate(q, k, v, big, 0) and api.gluon_gate(q, k, v, big, big)
    monkeypatch.setenv(configs.GLUON_WINDOW_ENV, "0")
    assert not api.gluon_gate(q, k, v, 64, 0)  # a left window with its switch off
    monkeypatch.setenv(configs.GLUON_WINDOW_ENV, "1")
    assert api.gluon_gate(q, k, v, 64, 0) and api.gluon_gate(q, k, v, 64, big)  # a left window (sliding)
    assert not api.gluon_gate(q, k, v, 64, 5)  # two-sided
    assert not api.gluon_gate(q, k, v, big, 5)  # a one-sided band
    q96, k96, v96 = _inputs(1, 64, 64, 2, 2, 96)
    assert not api.gluon_gate(q96, k96, v96, big, 0)
    assert not api.gluon_gate(q.float(), k.float(), v.float(), big, 0)
    odd = torch.randn(2, 300, 4, 129, device="cuda", dtype=torch.bfloat16)[..., :128]  # row stride 129 elements
    assert not api.gluon_gate(odd, k, v, big, 0)
    wf.flash_attention(q, k, v, softcap=30.0)
    assert len(gluon_on) == 1


@pytest.mark.gpu
@needs_h200
def test_gpu_long_sequence_matches_portable(gluon_on, monkeypatch):
    """A bench-sized problem (b 1, h 4, s 8192, d 128) against the portable kernel (the fp32 reference would need
    1 GB of scores per head)."""
    q, k, v = _inputs(1, 8192, 8192, 4, 4, 128)
    for causal in (True, False):
        out, lse = wf.flash_attention(q, k, v, causal=causal, return_lse=True)
        monkeypatch.setenv(configs.GLUON_ENV, "0")
        want, want_lse = wf.flash_attention(q, k, v, causal=causal, return_lse=True)
        monkeypatch.setenv(configs.GLUON_ENV, "1")
        assert rel_l2(out, want) <= 1e-2
        assert torch.allclose(lse, want_lse, rtol=1e-4, atol=1e-4)
    assert gluon_on == [True, False]
