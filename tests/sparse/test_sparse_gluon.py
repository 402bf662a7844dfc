"""The Hopper Gluon forward of sparse_attention (ops/sparse/sparse_gluon_kernel.py over the kernel it shares with dense
attention, ops/_gluon_flash_fwd.py): its gate, a compile for sm_90 on CPU where the installed Triton is one its Gluon
API was written for, and on an sm_90 GPU its outputs against the fp32 reference and the portable kernel (forced on
with WARPFORGE_SPARSE_GLUON=1 while configs.GLUON_DEFAULT is off)."""
import os

import pytest
import torch

import warpforge as wf
from warpforge.ops import _gluon_flash_fwd as fg
from warpforge.ops._gluon import compile_in_subprocess, import_loads_gluon
from warpforge.ops.sparse import api, configs, sparse_attention_reference
from warpforge.ops.sparse import sparse_gluon_kernel as sg
from warpforge.testing import REL_L2, gluon_triton, on_sm90_gluon, poisoned_outputs, rel_l2, spy_launches, \
    triton_version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_table_fits_and_import_is_lazy():
    assert configs.GLUON_TRITON_VERSIONS == fg.GLUON_TRITON_VERSIONS
    for d, (block_n, stages, _, persistent) in configs.GLUON_FWD.items():
        assert d in fg.HEAD_DIMS and stages >= 2 and fg.smem_bytes(d, block_n, stages, persistent) <= fg.SMEM_MAX
    assert not import_loads_gluon(("warpforge.ops.sparse.sparse_gluon_kernel",), ROOT)


def test_gate_off_where_it_does_not_apply(monkeypatch):
    monkeypatch.setenv(configs.GLUON_ENV, "1")
    q = torch.randn(1, 256, 2, 128, dtype=torch.bfloat16)
    assert not api.gluon_gate(q, q, q, None, 128)  # a CPU tensor
    monkeypatch.setattr(api, "arch_key", lambda device: "sm90")
    assert not api.gluon_gate(q, q, q, None, 128)  # still a CPU tensor
    monkeypatch.setenv(configs.GLUON_ENV, "0")
    assert not api.gluon_gate(q, q, q, None, 128)


def test_bad_sparse_blocks_are_refused():
    """An item of 128 query rows must lie in one query block, and a block in whole key tiles."""
    q = torch.empty(1, 256, 2, 128)
    sel, n_sel = torch.empty(1, 2, 4, 2, dtype=torch.int32), torch.empty(1, 2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 128"):
        fg.launch_args(q, q, q, q, torch.empty(1, 2, 256), 1.0, True, 128, 2, True, blocks=(sel, n_sel, 64))


# ------------------------------------------------------------------------------------ compile for sm_90
COMPILE_CASES = [  # (module, its compile_sm90's arguments): the forward's, then the backward's
    ("_gluon_flash_fwd", dict(d=128, causal=True, block_n=128, stages=2, block_size=128)),
    ("_gluon_flash_fwd", dict(d=64, causal=False, block_n=64, stages=3, block_size=256, h_q=4, h_kv=4,
                              dtype="float16")),
    ("_gluon_flash_bwd", dict(d=128, causal=True, stages=3, dq_split=True, dq_tma=True, group_split=2,
                              block_size=128)),
    ("_gluon_flash_bwd", dict(d=64, causal=False, stages=4, dq_tma=True, block_size=256, dtype="float16")),
]


@pytest.mark.skipif(not gluon_triton(fg.GLUON_TRITON_VERSIONS), reason=f"the Gluon kernel is written for Triton "
                    f"{fg.GLUON_TRITON_VERSIONS} (installed: {triton_version()}); its API differs between releases")
@pytest.mark.parametrize("module, case", COMPILE_CASES,
                         ids=[m[-3:] + "-" + "-".join(f"{k}{v}" for k, v in c.items()) for m, c in COMPILE_CASES])
def test_compiles_for_sm90(module, case):
    r = compile_in_subprocess("warpforge.ops." + module, case, ROOT)
    assert r["wgmma"] and r["tma"] and r["setmaxnreg"] and r["warp_specialize"] and r["num_warps"] == 12
    assert r["ptxas_rc"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas_log"]
    assert not r["wgmma_serialized"], r["ptxas_log"]


# ------------------------------------------------------------------------------------------ GPU numerics
needs_h200 = pytest.mark.skipif(not on_sm90_gluon(fg.GLUON_TRITON_VERSIONS),
                                reason=f"the Gluon forward runs on sm_90 with Triton {fg.GLUON_TRITON_VERSIONS}")


def _grads(q, k, v, idx, bs, causal, d_out):
    """out, lse and (dq, dk, dv) of wf.sparse_attention (the kernels the gate picks)."""
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with poisoned_outputs():
        out, lse = wf.sparse_attention(*ins, block_indices=idx, block_size=bs, causal=causal, return_lse=True)
        grads = torch.autograd.grad(out, ins, d_out)
    return out, lse, grads


@pytest.mark.gpu
@needs_h200
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal, s_q, s_k, h_q, h_kv, d, bs, topk", [
    (True, 1000, 1000, 8, 2, 128, 128, 3),    # a partial last block, GQA 4
    (True, 384, 1152, 4, 1, 64, 128, 4),      # keys longer than the queries by 6 blocks, MQA
    (False, 1000, 1000, 4, 4, 128, 256, 2),   # blocks of two items; a kept block may be the partial last one
    (True, 640, 640, 16, 2, 128, 256, 8),     # top-k past the blocks a query block can see; GQA 8
    (True, 1024, 1024, 8, 1, 128, 128, 1),    # every query block keeps block 0: one key block walked by all
])
def test_gpu_matches_reference_and_portable_kernels(monkeypatch, dtype, causal, s_q, s_k, h_q, h_kv, d, bs, topk):
    """Forward and backward on the Gluon kernels against the fp32 reference and the portable kernels."""
    dev = "cuda"
    q = torch.randn(2, s_q, h_q, d, device=dev, dtype=dtype)
    k = torch.randn(2, s_k, h_kv, d, device=dev, dtype=dtype)
    v = torch.randn(2, s_k, h_kv, d, device=dev, dtype=dtype)
    nqb, nkb = -(-s_q // bs), -(-s_k // bs)
    idx = torch.randint(-1, nkb, (2, h_kv, nqb, topk), device=dev, dtype=torch.int32)  # repeats and own included
    if topk == 1:
        idx.zero_()
    d_out = torch.randn(2, s_q, h_q, d, device=dev, dtype=dtype)
    fwd = spy_launches(monkeypatch, sg, "sparse_fwd_gluon", lambda args: args[5], {configs.GLUON_ENV: "1"})
    bwd = spy_launches(monkeypatch, sg, "sparse_bwd_gluon", lambda args: args[8])
    out, lse, grads = _grads(q, k, v, idx, bs, causal, d_out)
    assert fwd == [bs] and bwd == [bs]
    monkeypatch.setenv(configs.GLUON_ENV, "0")
    out_p, lse_p, grads_p = _grads(q, k, v, idx, bs, causal, d_out)
    assert len(fwd) == 1 and len(bwd) == 1
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = sparse_attention_reference(*ref_in, idx, block_size=bs, causal=causal)
    want = torch.autograd.grad(ref_out, ref_in, d_out.float())
    assert rel_l2(out, ref_out) <= REL_L2[dtype]
    assert rel_l2(lse, ref_lse) <= 1e-3
    assert rel_l2(out, out_p) <= REL_L2[dtype] and rel_l2(lse, lse_p) <= 1e-3
    for name, g, g_p, r in zip(("dq", "dk", "dv"), grads, grads_p, want):
        assert rel_l2(g, r) <= 2e-2, name
        assert rel_l2(g, g_p) <= 2e-2, name
