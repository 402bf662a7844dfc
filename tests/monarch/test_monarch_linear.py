"""monarch_linear vs its reference (and the reference vs a dense Monarch matrix built independently): values and
gradients, shapes that cross tile and block edges, bad input, poisoned outputs; MonarchLinear and the projection."""
import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.nn import MonarchLinear
from warpforge.ops.monarch import (monarch_dense_reference, monarch_linear_reference, monarch_project,
                                   monarch_project_reference)
from warpforge.ops.monarch import configs
from warpforge.testing import REL_L2, device_under_test, graph_replayed, poisoned_outputs, rel_l2

DEV = device_under_test()
ON_CPU = DEV.type == "cpu"
ON_GPU = DEV.type == "cuda"
# (d_in, d_mid, d_out, nblocks): square, rectangular both ways, blocks narrower and wider than a CPU tile (16),
# block sizes that are no power of two, nblocks 1 (a dense layer), 3 (no power of two) and 16 (blocks of 4), and
# d_mid / nblocks not divisible by nblocks
SHAPES = [(48, 48, 48, 4), (32, 64, 96, 2), (96, 40, 56, 4), (40, 40, 40, 1), (36, 36, 36, 4), (64, 128, 32, 4),
          (48, 24, 36, 3), (64, 64, 64, 16), (32, 256, 64, 8)]


def _factors(d_in, d_mid, d_out, nb, dtype=torch.float32, scale=True):
    w_right = torch.randn(nb, d_mid // nb, d_in // nb, device=DEV)
    w_left = torch.randn(nb, d_out // nb, d_mid // nb, device=DEV)
    if scale:
        w_right /= (d_in // nb) ** 0.5
        w_left /= (d_mid // nb) ** 0.5
    return w_left.to(dtype), w_right.to(dtype)


def _shuffle(d, nb):
    """The permutation matrix of the perfect shuffle: P @ v reorders v viewed as [d/nb, nb] into [nb, d/nb]."""
    idx = torch.arange(d).reshape(d // nb, nb).T.reshape(-1)
    return torch.eye(d, dtype=torch.float64)[idx]


def test_reference_is_the_paper_form():
    """The reference against M = P_out · blockdiag(L) · P_mid · blockdiag(R) written with dense matrices, and for a
    square M, P_out = P_midᵀ: M = P L Pᵀ R."""
    for d_in, d_mid, d_out, nb in SHAPES:
        w_left, w_right = (w.double().cpu() for w in _factors(d_in, d_mid, d_out, nb))
        p_mid = _shuffle(d_mid, nb)
        p_out = _shuffle(d_out, d_out // nb)  # block l's si-th output -> column si·nb + l
        m = p_out @ torch.block_diag(*w_left) @ p_mid @ torch.block_diag(*w_right)
        torch.testing.assert_close(monarch_dense_reference(w_left, w_right).double(), m, atol=1e-5, rtol=1e-5)
        if d_in == d_mid == d_out:
            torch.testing.assert_close(p_out, p_mid.T)


def _check(shape_lead, d_in, d_mid, d_out, nb, dtype, bias):
    w_left, w_right = _factors(d_in, d_mid, d_out, nb, dtype)
    x = torch.randn(*shape_lead, d_in, device=DEV, dtype=dtype, requires_grad=True)
    w_left.requires_grad_()
    w_right.requires_grad_()
    b = torch.randn(d_out, device=DEV, dtype=dtype, requires_grad=True) if bias else None
    inputs = [t for t in (x, w_left, w_right, b) if t is not None]
    with poisoned_outputs():
        y = wf.monarch_linear(x, w_left, w_right, bias=b, backend="triton")
    assert y.shape == (*shape_lead, d_out) and y.dtype == dtype
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    want = monarch_linear_reference(ref_in[0], ref_in[1], ref_in[2], ref_in[3] if bias else None)
    assert rel_l2(y, want) <= max(REL_L2[dtype], 1e-6 if dtype == torch.float32 else 0)
    g = torch.randn_like(y)  # no tokens: zero weight gradients
    with poisoned_outputs():
        got = torch.autograd.grad(y, inputs, g)
    exp = torch.autograd.grad(want, ref_in, g.double())
    for name, a, e in zip(("x", "w_left", "w_right", "bias"), got, exp):
        assert a.dtype == dtype, name
        assert rel_l2(a, e) <= (1e-5 if dtype == torch.float32 else 2e-2), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype):
    _check((37,), *shape, dtype, bias=True)


@pytest.mark.parametrize("shape", [(32, 64, 96, 2), (48, 48, 48, 4), (96, 40, 56, 4), (32, 256, 64, 8),
                                   (64, 64, 64, 16), (64, 128, 64, 4), (64, 128, 64, 2)])
@pytest.mark.parametrize("runs,tma_store", [("0", "0"), ("0", "1")])
def test_knobs_match_reference(shape, runs, tma_store, monkeypatch):
    """The interpreter's table has R's GEMMs run by run and descriptor stores on (test_matches_reference); here
    without runs (mode 3 needs the stores), with and without the stores: against the reference, fp16 with and
    without a bias. Runs of 16 (32, 64, 96, 2) and 32
    (64, 128, 64, 2) columns are one and two CPU tiles (mode 3); runs of 8 (64, 128, 64, 4) fall back to mode 2."""
    monkeypatch.setenv("WARPFORGE_MONARCH_RUNS", runs)
    monkeypatch.setenv("WARPFORGE_MONARCH_TMA_STORE", tma_store)
    for bias in (False, True):
        _check((37,), *shape, torch.float16, bias)


@pytest.mark.parametrize("shape", [(48, 48, 48, 4), (32, 64, 96, 2), (64, 64, 64, 16), (48, 24, 36, 3)])
@pytest.mark.parametrize("runs", ["0", "1"])
def test_wgrad_blas_matches_reference(shape, runs, monkeypatch):
    """The weight gradients by torch.bmm on views (the sm90 table's wgrad_blas) and the bias gradient as a sum of dy:
    fp16 and fp32, with a bias, without runs and with them (mode 3 at (32, 64, 96, 2): every nb-th row of w_right's
    gradient per batched GEMM)."""
    monkeypatch.setenv("WARPFORGE_MONARCH_WGRAD_BLAS", "1")
    monkeypatch.setenv("WARPFORGE_MONARCH_RUNS", runs)
    for dtype in (torch.float16, torch.float32):
        _check((37,), *shape, dtype, bias=True)


def test_runs_apply_where_runs_are_whole_tiles():
    """Mode 3 only where a run of the intermediate (d_mid / nb² columns) is whole tiles of both GEMM edges and the
    weight gradient's rows, with descriptors both ways: at the bar's d 4096 on sm90 nb 4 (runs of 256) takes it, nb 16
    (runs of 16) keeps mode 2 and the shuffle (its mode 3 paths were slower on an H100); and not without the table's
    descriptor stores or loads."""
    from warpforge.ops.monarch.monarch_kernel import runs_apply
    sm90 = configs.MONARCH.lookup("sm90")
    assert runs_apply(4, 4096 // 4, sm90) and not runs_apply(16, 4096 // 16, sm90)
    assert not runs_apply(4, 4096 // 4, sm90._replace(gemm=sm90.gemm._replace(tma_store=False)))
    assert not runs_apply(4, 4096 // 4, sm90._replace(wgrad=sm90.wgrad._replace(tma=False)))
    assert not runs_apply(4, 4096 // 4, sm90._replace(runs=False))
    cpu = configs.MONARCH.lookup("cpu")
    assert runs_apply(2, 32, cpu) and runs_apply(2, 64, cpu) and not runs_apply(4, 32, cpu)


@pytest.mark.parametrize("lead", [(1,), (2, 3), (0,), (2, 0, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_token_counts_and_bias(lead, bias):
    _check(lead, 48, 48, 48, 4, torch.float32, bias)


def test_many_tokens_split_weight_gradients(monkeypatch):
    """Enough tokens for the weight gradients to cut them into ranges (a forced count of 3, and the automatic one)."""
    _check((300,), 32, 32, 32, 2, torch.float32, True)
    monkeypatch.setattr(configs, "MONARCH", configs.MONARCH.map(lambda c: c._replace(wgrad=c.wgrad._replace(splits=3))))
    _check((131,), 32, 32, 32, 2, torch.float32, True)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if not ON_CPU else []))
def test_descriptor_and_pointer_paths_agree(dtype):
    """Blocks whose widths are whole 16-element tiles take the tensor-descriptor (TMA) loads where the table
    enables them; the pointer path computes the same tiles in the same order: identical outputs and gradients."""
    w_left, w_right = (w.to(dtype).requires_grad_() for w in _factors(64, 64, 64, 2))
    x = torch.randn(70, 64, device=DEV, dtype=dtype, requires_grad=True)
    dy = torch.randn(70, 64, device=DEV, dtype=dtype)
    table, runs = configs.MONARCH, []
    try:
        for tma in (True, False):
            # mode 2 both times (mode 3 needs the descriptors and sums R's K in another order)
            configs.MONARCH = table.map(lambda c: c._replace(runs=False, gemm=c.gemm._replace(tma=tma),
                                                             wgrad=c.wgrad._replace(tma=tma, splits=2)))
            y = wf.monarch_linear(x, w_left, w_right, backend="triton")
            runs.append((y, *torch.autograd.grad(y, (x, w_left, w_right), dy)))
    finally:
        configs.MONARCH = table
    for a, b in zip(*runs):  # the GPU's MMAs may order a tile's sums differently for the two operand sources
        assert torch.equal(a, b) if ON_CPU else rel_l2(a, b) <= 1e-3


def test_weight_gradients_are_deterministic():
    w_left, w_right = (w.requires_grad_() for w in _factors(48, 48, 48, 4))
    x = torch.randn(70, 48, device=DEV)
    grads = []
    for _ in range(2):
        y = wf.monarch_linear(x, w_left, w_right, backend="triton")
        grads.append(torch.autograd.grad(y.square().sum(), (w_left, w_right)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_backends_agree_on_defaults():
    w_left, w_right = _factors(32, 32, 32, 4)
    x = torch.randn(5, 32, device=DEV)
    torch.testing.assert_close(wf.monarch_linear(x, w_left, w_right),
                               wf.monarch_linear(x, w_left, w_right, backend="reference"), atol=1e-5, rtol=1e-5)


def test_first_order_only():
    w_left, w_right = _factors(32, 32, 32, 4)
    x = torch.randn(5, 32, device=DEV, requires_grad=True)
    (g,) = torch.autograd.grad(wf.monarch_linear(x, w_left, w_right, backend="triton").sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="first-order only"):
        g.square().sum().backward()


# ------------------------------------------------------------------------------------------- bad input
def _raises(name, fn):
    with pytest.raises(WarpforgeInputError, match=rf"^{name}"):
        fn()


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bad_input(backend):
    w_left, w_right = _factors(48, 48, 48, 4)
    x = torch.randn(5, 48, device=DEV)

    def call(x=x, w_left=w_left, w_right=w_right, **kw):
        return wf.monarch_linear(x, w_left, w_right, backend=backend, **kw)
    _raises("x", lambda: call(x=torch.randn(5, 50, device=DEV)))            # 50 not 4 x 12
    _raises("x", lambda: call(x=torch.tensor(1.0, device=DEV)))
    _raises("x", lambda: call(x=x.to(torch.int32)))
    _raises("x", lambda: call(x=[1.0]))
    _raises("w_right", lambda: call(w_right=w_right.to(torch.float64)))
    _raises("w_right", lambda: call(w_right=w_right[0]))
    _raises("w_right", lambda: call(w_right=w_right[:, :0]))
    _raises("w_left", lambda: call(w_left=w_left[:2]))                      # nblocks 2 against 4
    _raises("w_left", lambda: call(w_left=w_left[:, :, :6]))                # d_mid / nblocks 6 against 12
    _raises("w_left", lambda: call(w_left=w_left.half()))
    _raises("w_left", lambda: call(w_left=w_left.to("meta")))
    _raises("bias", lambda: call(bias=torch.zeros(47, device=DEV)))
    _raises("bias", lambda: call(bias=torch.zeros(1, 48, device=DEV)))
    _raises("bias", lambda: call(bias=torch.zeros(48, device=DEV, dtype=torch.float64)))
    _raises("bias", lambda: call(bias="zeros"))
    _raises("backend", lambda: wf.monarch_linear(x, w_left, w_right, backend="cuda"))


@pytest.mark.skipif(ON_GPU, reason="the interpreter's bf16 matmuls")
def test_interpreter_refuses_bf16():
    w_left, w_right = _factors(32, 32, 32, 4, torch.bfloat16)
    _raises("x", lambda: wf.monarch_linear(torch.randn(3, 32, dtype=torch.bfloat16), w_left, w_right,
                                           backend="triton"))


def test_bad_projection_input():
    w = torch.randn(48, 32)
    _raises("weight", lambda: monarch_project(w[0], 4))
    _raises("weight", lambda: monarch_project(w, 5))
    _raises("nblocks", lambda: monarch_project(w, 0))
    _raises("d_mid", lambda: monarch_project(w, 4, d_mid=30))
    _raises("linear", lambda: MonarchLinear.from_dense(torch.nn.Conv1d(2, 2, 1), 2))
    _raises("linear", lambda: MonarchLinear.from_dense(torch.nn.Linear(32, 30), 4))  # its out_features, not d_out
    _raises("nblocks", lambda: MonarchLinear.from_dense(torch.nn.Linear(32, 32), 0))
    _raises("d_in", lambda: MonarchLinear(30, 32, 4))
    _raises("backend", lambda: MonarchLinear(32, 32, 4, backend="cuda"))


# ------------------------------------------------------------------------------------------- projection
@pytest.mark.parametrize("d_in, d_out, nb", [(16, 16, 4), (64, 64, 4), (32, 64, 4), (48, 24, 2), (36, 36, 4)])
def test_projection_recovers_a_monarch_weight(d_in, d_out, nb):
    """A weight that is exactly Monarch comes back exactly (as a matrix: the factors are unique only up to
    scalings within each block pair)."""
    d_mid = min(d_in, d_out)
    w_left, w_right = (w.double().cpu() for w in _factors(d_in, d_mid, d_out, nb))
    m = monarch_dense_reference(w_left, w_right).double()
    pl, pr = monarch_project_reference(m, nb, d_mid)
    torch.testing.assert_close(monarch_dense_reference(pl, pr).double(), m, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d_in, d_out, nb", [(16, 16, 4), (64, 64, 4), (32, 64, 4), (36, 36, 4)])
def test_projection_is_idempotent_and_nearest(d_in, d_out, nb):
    """Projecting the projection changes nothing, and no nearby Monarch matrix (the projection's factors
    perturbed) is closer to the dense weight than the projection."""
    w = torch.randn(d_out, d_in, dtype=torch.float64)
    pl, pr = monarch_project(w, nb)
    m = monarch_dense_reference(pl, pr).double()
    m2 = monarch_dense_reference(*monarch_project(m, nb)).double()
    torch.testing.assert_close(m2, m, atol=1e-5, rtol=1e-5)
    err = (w - m).norm()
    assert err < w.norm()
    for _ in range(10):
        nl, nr = pl + 1e-2 * torch.randn_like(pl), pr + 1e-2 * torch.randn_like(pr)
        assert err <= (w - monarch_dense_reference(nl, nr).double()).norm() + 1e-6


def test_monarch_linear_module():
    lin = torch.nn.Linear(32, 64, device=DEV)
    mod = MonarchLinear.from_dense(lin, 4, backend="triton")
    assert mod.w_right.shape == (4, 8, 8) and mod.w_left.shape == (4, 16, 8)
    x = torch.randn(3, 5, 32, device=DEV, requires_grad=True)
    y = mod(x)
    want = x.detach() @ mod.dense_weight().T.to(DEV) + lin.bias.detach()
    torch.testing.assert_close(y.detach(), want, atol=1e-4, rtol=1e-4)
    y.sum().backward()
    assert x.grad is not None and mod.w_left.grad is not None and mod.bias.grad is not None
    # a dense weight that is exactly Monarch: from_dense reproduces the layer
    exact = MonarchLinear(32, 32, 4, bias=False, device=DEV)
    dense = torch.nn.Linear(32, 32, bias=False, device=DEV)
    with torch.no_grad():
        dense.weight.copy_(exact.dense_weight())
    again = MonarchLinear.from_dense(dense, 4)
    x = torch.randn(7, 32, device=DEV)
    torch.testing.assert_close(again(x), exact(x), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("nb", [4, 16])
@pytest.mark.parametrize("bias,knobs", [(True, None), (False, "000"), (False, "110"), (True, "110"), (False, "001"),
                                       (True, "111")])
def test_real_size_bf16(nb, bias, knobs, monkeypatch):
    if knobs is not None:  # WARPFORGE_MONARCH_RUNS, _TMA_STORE and _WGRAD_BLAS, else the table's
        for name, knob in zip(("RUNS", "TMA_STORE", "WGRAD_BLAS"), knobs):
            monkeypatch.setenv(f"WARPFORGE_MONARCH_{name}", knob)
    d, t = 4096, 4096
    w_left, w_right = _factors(d, d, d, nb, torch.bfloat16)
    w_left.requires_grad_()
    w_right.requires_grad_()
    x = torch.randn(t, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(d, device=DEV, dtype=torch.bfloat16, requires_grad=True) if bias else None
    inputs = [i for i in (x, w_left, w_right, b) if i is not None]
    with poisoned_outputs():
        y = wf.monarch_linear(x, w_left, w_right, bias=b, backend="triton")
    ref_in = [t_.detach().float().requires_grad_() for t_ in inputs]
    want = monarch_linear_reference(*ref_in, *([] if bias else [None]))
    assert rel_l2(y, want) <= 1e-2
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, inputs, g)
    exp = torch.autograd.grad(want, ref_in, g.float())
    for a, e in zip(got, exp):
        assert rel_l2(a, e) <= 2e-2


@pytest.mark.gpu
def test_real_size_odd_tokens_rectangular_bf16():
    """3003 tokens (a ragged last tile), d_in 2048 -> d_out 3072 through d_mid 1024 (runs of 16: mode 2), eagerly
    and replayed from a CUDA graph, gradients included."""
    w_left, w_right = (w.requires_grad_() for w in _factors(2048, 1024, 3072, 8, torch.bfloat16))
    x = torch.randn(3, 1001, 2048, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(3, 1001, 3072, device=DEV, dtype=torch.bfloat16)

    def step():
        y = wf.monarch_linear(x, w_left, w_right, backend="triton")
        return (y, *torch.autograd.grad(y, (x, w_left, w_right), dy))
    ref_in = [t.detach().float().requires_grad_() for t in (x, w_left, w_right)]
    want = monarch_linear_reference(*ref_in)
    exp = (want.detach(), *torch.autograd.grad(want, ref_in, dy.float()))
    eager = tuple(t.detach() for t in step())  # (detached: testing.graph_replayed says why)
    for a, e in zip(eager, exp):
        assert rel_l2(a, e) <= 2e-2
    for a, b in zip(graph_replayed(step), eager):
        assert rel_l2(a, b) <= 1e-3


def test_registered_ops_and_compile():
    """The ops' schema, fake and autograd registrations: fp32 (mode 2), fp16 where the renumbered weight is a third
    output (runs of 16, the interpreter's table), fp16 at one block (mode 3 would be mode 0 there: no output may be a
    view of the weight), then a compiled step."""
    from warpforge.ops.monarch import api
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    for d_in, d_mid, d_out, nb, dtype in ((48, 48, 48, 4, torch.float32), (32, 64, 96, 2, torch.float16),
                                          (32, 32, 32, 1, torch.float16)):
        w_left, w_right = _factors(d_in, d_mid, d_out, nb, dtype)
        x = torch.randn(7, d_in, device=DEV, dtype=dtype)
        for bias in (torch.randn(d_out, device=DEV, dtype=dtype), None):
            torch.library.opcheck(api._fwd.op, (x, w_left, w_right, bias), test_utils=utils)
    w_left, w_right = _factors(48, 48, 48, 4)
    x = torch.randn(7, 48, device=DEV)
    f = torch.compile(lambda x: wf.monarch_linear(x, w_left, w_right, backend="triton"), backend="aot_eager",
                      fullgraph=True)
    xg = x.clone().requires_grad_()
    f(xg).square().sum().backward()
    want = x.clone().requires_grad_()
    monarch_linear_reference(want, w_left, w_right).square().sum().backward()
    torch.testing.assert_close(xg.grad, want.grad, atol=1e-4, rtol=1e-4)


def test_knob_builds_compile_for_sm90():
    """With runs and descriptor stores forced on, every Monarch kernel compiles for sm_90 (no GPU: Triton's wheel
    carries ptxas) without spills, the bf16 GEMMs on wgmma and descriptors."""
    import os
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(root), WARPFORGE_MONARCH_RUNS="1", WARPFORGE_MONARCH_TMA_STORE="1")
    run = subprocess.run([sys.executable, str(root / "scripts" / "compile_sm90.py"), "--family", "monarch"],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("monarch: ")]
    assert run.returncode == 0 and lines and not any("FAILED" in line for line in lines), \
        run.stdout[-2000:] + run.stderr[-2000:]
    assert all("spills 0/0" in line for line in lines), "\n".join(lines)
    gemms = [line for line in lines if "blockdiag_gemm_kernel" in line and "wgmma" in line]
    assert len(gemms) >= 12 and all("tma" in line for line in gemms), "\n".join(lines)
