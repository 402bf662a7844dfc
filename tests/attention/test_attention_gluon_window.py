"""Sliding windows (a left window, right 0 = causal or unbounded) in the Hopper Gluon forward and backward, and the
GQA group split of the Gluon backward (flash_gluon_kernel.py, flash_gluon_bwd_kernel.py): the forward's tile walk
replayed in float64 on CPU (the backward's is in test_attention_gluon_bwd.py), the gates, compiled for sm_90 on CPU
when the installed Triton is one the Gluon API was written for, and checked against the reference / the portable
kernels on an sm_90 GPU."""
import itertools
import math
import os

import pytest
import torch

import warpforge as wf
from warpforge.ops._gluon import compile_in_subprocess
from warpforge.ops.attention import api, attention_reference, configs
from warpforge.ops.attention import flash_gluon_bwd_kernel as fb
from warpforge.ops.attention import flash_gluon_kernel as fg
from warpforge.testing import (REL_L2, assert_qkv_grads_close, gluon_triton, on_sm90_gluon, poisoned_outputs, rel_l2,
                               triton_version)

from tests.attention.test_attention_gluon_bwd import _inputs  # CUDA q, k, v with grads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIG = 1 << 30


# ------------------------------------------------------------------------- the forward's window walk, emulated
def _emulate_fwd(q, k, v, causal, left, BLOCK_N=128):
    """flash_gluon_kernel's _tile / _consumer in float64: items of 128 rows (two 64-row warpgroups) walk key tiles
    j0 .. j0 + n_tiles; only tiles with jj >= first_masked or jj < lo_full get the element mask (so a wrong branch
    condition leaves masked keys in)."""
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    G = h_q // h_kv
    scale = d ** -0.5
    shift = s_k - s_q
    out = torch.zeros_like(q)
    lse = torch.full((b, h_q, s_q), -math.inf, dtype=torch.float64)
    n_m = -(-s_q // 128)
    for bb, h, pid_m in itertools.product(range(b), range(h_q), range(n_m)):
        m_lo = pid_m * 128
        hi = min(min(m_lo + 128, s_q) + shift, s_k) if causal else s_k
        n_hi = max(-(-hi // BLOCK_N), 0)
        j0 = min(max(m_lo + shift - left, 0) // BLOCK_N, n_hi) if left is not None else 0
        for wg in range(2):
            r0 = m_lo + 64 * wg
            rows = torch.arange(r0, r0 + 64)
            first_masked = (min(s_k, r0 + shift + 1) if causal else s_k) // BLOCK_N
            lo_full = (max(r0 + 63 + shift - left, 0) + BLOCK_N - 1) // BLOCK_N if left is not None else 0
            live = rows < s_q
            Q = torch.zeros(64, d, dtype=torch.float64)
            Q[live] = q[bb, rows[live], h]
            scores, values = [], []
            for jj in range(j0, n_hi):
                cols = torch.arange(jj * BLOCK_N, (jj + 1) * BLOCK_N)
                kv_live = cols < s_k
                K = torch.zeros(BLOCK_N, d, dtype=torch.float64)
                V = torch.zeros(BLOCK_N, d, dtype=torch.float64)
                K[kv_live] = k[bb, cols[kv_live], h // G]
                V[kv_live] = v[bb, cols[kv_live], h // G]
                S = Q @ K.T * scale
                if jj >= first_masked or jj < lo_full:
                    ok = kv_live[None, :].expand(64, -1)
                    if causal:
                        ok = ok & (cols[None, :] <= (rows + shift)[:, None])
                    if left is not None:
                        ok = ok & (cols[None, :] >= (rows + shift - left)[:, None])
                    S = torch.where(ok, S, -math.inf)
                scores.append(S)
                values.append(V)
            if not scores:
                continue
            S = torch.cat(scores, 1)
            m = S.max(1, keepdim=True).values
            m = torch.where(torch.isinf(m), 0.0, m)
            P = torch.exp(S - m)
            l = P.sum(1)
            o = (P @ torch.cat(values, 0)) / torch.where(l == 0, 1.0, l)[:, None]
            row_lse = torch.where(l == 0, -math.inf, m[:, 0] + torch.log(torch.where(l == 0, 1.0, l)))
            out[bb, rows[live], h] = o[live]
            lse[bb, h, rows[live]] = row_lse[live]
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left", [0, 37, 128, 200, 299])
@pytest.mark.parametrize("shape", [(1, 300, 300, 2, 1, 8), (1, 130, 300, 2, 2, 8), (1, 300, 130, 4, 2, 8)],
                         ids=lambda s: "b{}-sq{}-sk{}-hq{}-hkv{}-d{}".format(*s))
def test_forward_window_walk_matches_reference(shape, causal, left):
    b, s_q, s_k, h_q, h_kv, d = shape
    torch.manual_seed(0)
    q = torch.randn(b, s_q, h_q, d, dtype=torch.float64)
    k = torch.randn(b, s_k, h_kv, d, dtype=torch.float64)
    v = torch.randn(b, s_k, h_kv, d, dtype=torch.float64)
    want, want_lse = attention_reference(q, k, v, window=(left, 0 if causal else -1), compute_dtype=torch.float64)
    got, got_lse = _emulate_fwd(q, k, v, causal, left)
    assert rel_l2(got, want) <= 1e-10
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse), finite)
    assert torch.allclose(got_lse[finite], want_lse[finite].double(), rtol=1e-5)


# --------------------------------------------------------------------------------------------- gates and knobs
def test_window_gate_and_switch(monkeypatch):
    """WARPFORGE_ATTN_GLUON_WINDOW switches left windows on / off (the gate on real tensors: the GPU tests); a left
    side that bounds nothing (>= s_k - 1) is no window."""
    k = torch.randn(1, 300, 2, 128, dtype=torch.bfloat16)
    monkeypatch.setenv(configs.GLUON_WINDOW_ENV, "1")
    assert api._gluon_window_switch()
    monkeypatch.setenv(configs.GLUON_WINDOW_ENV, "0")
    assert not api._gluon_window_switch()
    monkeypatch.delenv(configs.GLUON_WINDOW_ENV)
    assert api._gluon_window_switch() is configs.GLUON_WINDOW_DEFAULT
    assert api._gluon_left(k, 64) == 64 and api._gluon_left(k, 298) == 298
    assert api._gluon_left(k, 299) is None and api._gluon_left(k, BIG) is None


def test_group_split_knob(monkeypatch):
    monkeypatch.delenv("WARPFORGE_ATTN_GLUON_BWD_GROUP_SPLIT", raising=False)
    knobs = (64, 3, 64, True, True)
    for d, table in configs.GLUON_BWD_GROUP_SPLIT.items():
        assert api.gluon_bwd_group_split(d, 8, *knobs) == min(table or 8, 8)
    assert api.gluon_bwd_group_split(96, 8, *knobs) == 1  # a head dim the table does not name: no split
    for want, group, got in (("0", 8, 8), ("8", 8, 8), ("4", 8, 4), ("3", 8, 2), ("16", 4, 4), ("0", 1, 1),
                             ("2", 6, 2), ("4", 6, 3)):
        monkeypatch.setenv("WARPFORGE_ATTN_GLUON_BWD_GROUP_SPLIT", want)
        assert api.gluon_bwd_group_split(128, group, *knobs) == got, (want, group)
    monkeypatch.setenv("WARPFORGE_ATTN_GLUON_BWD_GROUP_SPLIT", "0")
    assert api.gluon_bwd_group_split(128, 8, 64, 3, 64, True, False) == 1  # needs dq_tma (the staging and the reduce)


def test_group_split_bad_values_are_refused():
    q = torch.empty(1, 64, 8, 128)
    k = torch.empty(1, 64, 2, 128)
    s_pad, lse2, delta, dq_acc = fb._buffers(q, 64)
    with pytest.raises(ValueError, match="group_split must divide"):
        fb.launch_args(q, k, k, q, lse2, delta, k, k, dq_acc, s_pad, 1.0, True, 64, 3, None, True, True, 3)
    with pytest.raises(ValueError, match="needs dq_tma"):
        fb.launch_args(q, k, k, q, lse2, delta, k, k, dq_acc, s_pad, 1.0, True, 64, 3, None, True, False, 2)
    with pytest.raises(ValueError, match="accumulator"):
        fb.launch_args(q, k, k, q, lse2, delta, k, k, dq_acc, s_pad, 1.0, True, 64, 3, None, True, True, 2)


# ------------------------------------------------------------------------------------------- compile for sm_90
needs_gluon_triton = pytest.mark.skipif(
    not gluon_triton(fg.GLUON_TRITON_VERSIONS),
    reason=f"the Gluon kernels are written for Triton {fg.GLUON_TRITON_VERSIONS} (installed: {triton_version()})")

FWD_CASES = [dict(d=128, causal=True, left=100), dict(d=64, causal=False, stages=4, left=100, dtype="float16"),
             dict(d=128, causal=True, left=100, persistent=True)]


@needs_gluon_triton
@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_forward_window_compiles_for_sm90(case):
    r = compile_in_subprocess("warpforge.ops.attention.flash_gluon_kernel", case, ROOT)
    assert r["wgmma"] and r["tma"] and r["setmaxnreg"] and r["warp_specialize"] and r["num_warps"] == 12
    assert r["ptxas_rc"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas_log"]
    assert not r["wgmma_serialized"] and r["shared_bytes"] <= fg.SMEM_MAX


BWD_CASES = [  # none spills since the loop's wgmma descriptors are rebuilt at use (session 15; d 128 spilled 100-300 B)
    dict(d=128, causal=True, stages=3, dq_split=True, dq_tma=True, left=100),
    dict(d=128, causal=True, stages=3, dq_split=True, dq_tma=True, h_q=32, h_kv=4, group_split=8),
    dict(d=128, causal=True, stages=3, dq_split=True, dq_tma=True, h_q=32, h_kv=4, group_split=2),
    dict(d=64, causal=True, stages=4, dq_n=64, dq_tma=True, left=100, h_q=8, h_kv=1, group_split=8),
    dict(d=64, causal=False, stages=4, dq_n=64, dq_tma=True, left=100, dtype="float16"),
]


@needs_gluon_triton
@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_backward_window_and_group_split_compile_for_sm90(case):
    r = compile_in_subprocess("warpforge.ops.attention.flash_gluon_bwd_kernel", case, ROOT)
    print(f"\n{case}: spills {r['spill_stores']}/{r['spill_loads']} B, shared {r['shared_bytes']} B")
    assert r["wgmma"] and r["tma"] and r["setmaxnreg"] and r["ptxas_rc"] == 0, r.get("ptxas_log")
    assert r["tma_reduce"] and not r["red"]
    assert r["warp_specialize"] and r["num_warps"] == 12 and not r["wgmma_serialized"]
    assert r["shared_bytes"] <= fg.SMEM_MAX
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas_log"]


# ------------------------------------------------------------------------------------------------ GPU numerics
needs_h200 = pytest.mark.skipif(not on_sm90_gluon(fg.GLUON_TRITON_VERSIONS),
                                reason=f"the Gluon kernels run on sm_90 with Triton {fg.GLUON_TRITON_VERSIONS}")


@pytest.fixture
def spies(monkeypatch):
    """Both Gluon kernels and the window switched on; records (kernel, left) of each Gluon launch through api."""
    monkeypatch.setenv(configs.GLUON_ENV, "1")
    monkeypatch.setenv(configs.GLUON_BWD_ENV, "1")
    monkeypatch.setenv(configs.GLUON_WINDOW_ENV, "1")
    for name in list(os.environ):
        if name.startswith(("WARPFORGE_ATTN_GLUON_BWD_", "WARPFORGE_ATTN_GLUON_BLOCK", "WARPFORGE_ATTN_GLUON_STAGES",
                            "WARPFORGE_ATTN_GLUON_PINGPONG", "WARPFORGE_ATTN_GLUON_PERSISTENT")):
            monkeypatch.delenv(name)
    calls = []
    real_f, real_b = fg.flash_fwd_gluon, fb.flash_bwd_gluon

    def spy_f(*args, **kwargs):
        calls.append(("fwd", kwargs.get("left")))
        return real_f(*args, **kwargs)

    def spy_b(*args, **kwargs):
        calls.append(("bwd", kwargs.get("left"), kwargs.get("group_split")))
        return real_b(*args, **kwargs)
    monkeypatch.setattr(fg, "flash_fwd_gluon", spy_f)
    monkeypatch.setattr(fb, "flash_bwd_gluon", spy_b)
    return calls


WINDOW_SHAPES = [  # b, s_q, s_k, h_q, h_kv, left
    (2, 1000, 1000, 4, 2, 256),
    (1, 2048 + 13, 2048 + 13, 4, 1, 300),
    (2, 77, 1000, 4, 4, 100),     # fewer queries than keys
    (2, 1000, 77, 4, 4, 30),      # more queries than keys: rows that see nothing
    (1, 700, 700, 2, 2, 0),       # the diagonal only (causal) / one key per row's left edge
    (1, 700, 700, 8, 1, 63),      # a window narrower than a tile, MQA
]


@pytest.mark.gpu
@needs_h200
@pytest.mark.parametrize("d,causal", [(128, True), (128, False), (64, True)])  # (d 64 left-only: the knob tests)
@pytest.mark.parametrize("shape", WINDOW_SHAPES, ids=lambda s: "b{}-sq{}-sk{}-hq{}-hkv{}-left{}".format(*s))
def test_gpu_window_matches_reference(shape, causal, d, spies):
    *dims, left = shape
    q, k, v = _inputs(*dims, d)
    window = (left, 0 if causal else -1)
    with poisoned_outputs():
        out, lse = wf.flash_attention(q, k, v, window=window, return_lse=True)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_reference(*ref_in, window=window)
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref_out) <= REL_L2[q.dtype]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert rel_l2(lse[finite], ref_lse[finite]) <= 1e-3
    d_out = torch.randn_like(out)
    with poisoned_outputs():
        grads = torch.autograd.grad(out, (q, k, v), d_out)
    want = torch.autograd.grad(ref_out, ref_in, d_out.float())
    assert [c[:2] for c in spies] == [("fwd", left), ("bwd", left)]
    assert_qkv_grads_close(grads, want, 2e-2)


@pytest.mark.gpu
@needs_h200
def test_gpu_window_switch_off_is_portable_and_agrees(spies, monkeypatch):
    q, k, v = _inputs(2, 4096, 4096, 8, 2, 128)
    d_out = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    on = wf.flash_attention(q, k, v, causal=True, window=(1024, 0))
    g_on = torch.autograd.grad(on, (q, k, v), d_out)
    assert len(spies) == 2
    monkeypatch.setenv(configs.GLUON_WINDOW_ENV, "0")
    off = wf.flash_attention(q, k, v, causal=True, window=(1024, 0))
    g_off = torch.autograd.grad(off, (q, k, v), d_out)
    assert len(spies) == 2
    assert rel_l2(on, off) <= 1e-2
    for g, w in zip(g_on, g_off):
        assert rel_l2(g, w) <= 1e-2


@pytest.mark.gpu
@needs_h200
@pytest.mark.parametrize("split,d", [("0", 128), ("2", 128), ("0", 64)])
def test_gpu_group_split_matches_portable(split, d, spies, monkeypatch):
    """GQA with the group split across programs (dK / dV in fp32 by TMA reduce-adds), causal and not, with a window
    too, against the portable backward."""
    monkeypatch.setenv("WARPFORGE_ATTN_GLUON_BWD_GROUP_SPLIT", split)
    for causal, window, shape in ((True, (-1, -1), (2, 1000 + 5, 1000 + 5, 8, 2)),
                                  (False, (-1, -1), (1, 700, 900, 8, 1)),
                                  (False, (300, -1), (2, 1500, 1500, 8, 2))):
        q, k, v = _inputs(*shape, d)
        d_out = torch.randn(q.shape, device="cuda", dtype=q.dtype)
        out = wf.flash_attention(q, k, v, causal=causal, window=window)
        with poisoned_outputs():
            got = torch.autograd.grad(out, (q, k, v), d_out)
        assert spies[-1][0] == "bwd" and spies[-1][2] == api.gluon_bwd_group_split(d, shape[3] // shape[4],
                                                                                    *api.gluon_bwd_knobs(d, causal))
        monkeypatch.setenv(configs.GLUON_BWD_ENV, "0")
        want = torch.autograd.grad(wf.flash_attention(q, k, v, causal=causal, window=window), (q, k, v), d_out)
        monkeypatch.setenv(configs.GLUON_BWD_ENV, "1")
        assert_qkv_grads_close(got, want, 1e-2, f"split {split} causal {causal} window {window}")
