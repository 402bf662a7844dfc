"""The fourth adversarial sweep's findings (Monarch hardest, then every op): each test failed before its fix. One
contract on both backends: refuse with a WarpforgeInputError naming the argument, or answer what the reference
answers; never read or write outside a tensor."""
import math

import pytest
import torch

import warpforge as wf
from warpforge.nn import MonarchLinear
from warpforge.ops.monarch import monarch_project
from warpforge.testing import rel_l2

from .contract import BACKENDS, DEV, ON_CPU, raises as _raises



def _rn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEV, dtype=dtype)


def _tied(shape, strides, requires_grad=False):
    """A view whose last dim overlaps another dim of stride 1: torch.empty_like of it has no unit last stride."""
    n = 1 + sum((s - 1) * st for s, st in zip(shape, strides))
    t = _rn(n).as_strided(shape, strides).detach()
    return t.requires_grad_(requires_grad)


# ------------------------------------------------------------------------------------------- every op
@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_and_nested_tensors_refused(backend):
    """Used to be torch errors naming no argument ("unsupported memory format option", "Could not run
    'aten::mean.dim' with arguments from the 'SparseCPU' backend"), and the reference CE accepted a sparse hidden."""
    sparse = _rn(3, 16).to_sparse()
    _raises("x", lambda: wf.rms_norm(sparse, torch.ones(16, device=DEV), backend=backend))
    _raises("weight", lambda: wf.rms_norm(_rn(3, 16), torch.ones(16, device=DEV).to_sparse(), backend=backend))
    _raises("gate_up", lambda: wf.swiglu(sparse, backend=backend))
    targets = torch.zeros(3, dtype=torch.long, device=DEV)
    _raises("hidden", lambda: wf.linear_cross_entropy(sparse, _rn(11, 16), targets, backend=backend))
    w_left, w_right = _rn(2, 4, 4), _rn(2, 4, 8)
    _raises("x", lambda: wf.monarch_linear(sparse, w_left, w_right, backend=backend))
    nested = torch.nested.nested_tensor([_rn(2, 16), _rn(3, 16)])
    _raises("gate_up", lambda: wf.swiglu(nested, backend=backend))


def _grads(fn, inputs, backend):
    out = fn(*inputs, backend=backend)
    g = torch.arange(out.numel(), device=DEV, dtype=out.dtype).reshape(out.shape).sin()
    return [out] + list(torch.autograd.grad((out * g).sum(), [t for t in inputs if t.requires_grad]))


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_gradients_of_overlapping_views(backend, which):
    """q, k or v a view whose last dim overlaps its heads (strides (.., 8, 1, 1)): the Triton backward allocated
    dq / dk / dv with torch.empty_like, which then had a last stride of 2, and wrote them as if it were 1 (wrong
    gradients). They match the same inputs made contiguous."""
    inputs = [_rn(2, 5, 2, 8).requires_grad_() for _ in range(3)]
    inputs[which] = _tied((2, 5, 2, 8), (8, 8, 1, 1), requires_grad=True)
    plain = [t.detach().contiguous().requires_grad_() for t in inputs]
    got = _grads(wf.flash_attention, inputs, backend)
    want = _grads(wf.flash_attention, plain, "reference")
    for a, e in zip(got, want):
        assert rel_l2(a, e) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_attention_gradients_of_overlapping_views(backend):
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEV)
    q = _tied((7, 2, 8), (8, 1, 1), requires_grad=True)
    k, v = _rn(7, 2, 8).requires_grad_(), _rn(7, 2, 8).requires_grad_()

    def attend(q, k, v, backend):
        return wf.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, backend=backend)
    got = _grads(attend, [q, k, v], backend)
    want = _grads(attend, [t.detach().contiguous().requires_grad_() for t in (q, k, v)], "reference")
    for a, e in zip(got, want):
        assert rel_l2(a, e) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_of_an_overlapping_view(backend):
    """The Triton rope wrote its output (empty_like(x): last stride 2) as if contiguous: wrong values."""
    x = _tied((1, 8, 2, 8), (8, 8, 1, 1), requires_grad=True)
    cos, sin = torch.rand(8, 4, device=DEV), torch.rand(8, 4, device=DEV)
    got = _grads(wf.apply_rope, [x, cos, sin], backend)
    want = _grads(wf.apply_rope, [x.detach().contiguous().requires_grad_(), cos, sin], "reference")
    for a, e in zip(got, want):
        assert rel_l2(a, e) < 1e-6


# ------------------------------------------------------------------------------------------- monarch_linear
def _shuffle(d, nb):
    idx = torch.arange(d).reshape(d // nb, nb).T.reshape(-1)
    return torch.eye(d, dtype=torch.float64)[idx]


def _dense64(w_left, w_right):
    """M = P_out · blockdiag(L) · P_mid · blockdiag(R) in float64, written with dense matrices."""
    nb, q, _ = w_right.shape
    s = w_left.shape[1]
    return _shuffle(nb * s, s) @ torch.block_diag(*w_left) @ _shuffle(nb * q, nb) @ torch.block_diag(*w_right)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nb, p, q, s, t", [(3, 5, 7, 3, 5), (1, 3, 5, 7, 2), (5, 1, 1, 1, 3), (2, 17, 3, 9, 19)])
def test_monarch_gradients_against_float64_autograd(backend, nb, p, q, s, t):
    """x, both factors and bias at small odd shapes, against torch.autograd through the dense M in float64."""
    w_left, w_right = _rn(nb, s, q) / q ** 0.5, _rn(nb, q, p) / p ** 0.5
    inputs = [_rn(2, t, nb * p), w_left, w_right, _rn(nb * s)]
    inputs = [x.requires_grad_() for x in inputs]
    ref = [x.detach().double().cpu().requires_grad_() for x in inputs]
    want = ref[0] @ _dense64(ref[1], ref[2]).T + ref[3]
    g = _rn(2, t, nb * s)
    y = wf.monarch_linear(inputs[0], inputs[1], inputs[2], bias=inputs[3], backend=backend)
    assert rel_l2(y.cpu(), want) < 1e-5
    for a, e in zip(torch.autograd.grad(y, inputs, g), torch.autograd.grad(want, ref, g.double().cpu())):
        assert a.dtype == torch.float32 and rel_l2(a.cpu(), e) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_monarch_fp16_intermediate_past_fp16_range(backend):
    """The kernels keep the intermediate in x's dtype: an fp16 intermediate past 65504 is inf there, where the
    reference (fp32 throughout) used to answer finite values. The reference now rounds it as the kernels do, so
    the backends agree (bit for bit here)."""
    w_right = torch.full((2, 4, 4), 300.0, device=DEV, dtype=torch.float16)
    w_left = torch.full((2, 4, 4), 1e-3, device=DEV, dtype=torch.float16)
    x = torch.full((3, 8), 100.0, device=DEV, dtype=torch.float16)
    assert torch.isinf(wf.monarch_linear(x, w_left, w_right, backend=backend)).all()
    torch.manual_seed(0)
    w_left, w_right, x = _rn(4, 16, 16).half(), _rn(4, 16, 16).half(), _rn(64, 64).half()
    got = wf.monarch_linear(x, w_left, w_right, backend=backend)
    other = wf.monarch_linear(x, w_left, w_right, backend="reference" if backend == "triton" else "triton")
    assert rel_l2(got, other) < 1e-3


MODULE_SETTINGS = [
    ("d_in", lambda: MonarchLinear(2**70, 2**70, 2)),          # an overflow in torch.empty
    ("d_in", lambda: MonarchLinear(2**40, 2**40, 2**20)),      # an allocator error
    ("nblocks", lambda: MonarchLinear(8, 8, 2**70)),           # was named d_in
    ("dtype", lambda: MonarchLinear(8, 8, 2, dtype=torch.int32)),   # "Only Tensors of floating point ... grad"
    ("dtype", lambda: MonarchLinear(8, 8, 2, dtype=torch.float64)),  # built, then every forward refused
    ("dtype", lambda: MonarchLinear(8, 8, 2, dtype="float32")),
    ("device", lambda: MonarchLinear(8, 8, 2, device="nope")),
    ("linear", lambda: MonarchLinear.from_dense(torch.nn.Linear(8, 12, dtype=torch.float64), 2)),
    ("linear", lambda: MonarchLinear.from_dense(torch.nn.LazyLinear(12), 2)),  # was named d_in
]


@pytest.mark.parametrize("name, make", MODULE_SETTINGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(MODULE_SETTINGS)])
def test_monarch_module_settings(name, make):
    _raises(name, make)


@pytest.mark.parametrize("backend", BACKENDS)
def test_monarch_module_names_its_input(backend):
    """x in another dtype or on another device than the module's weights used to be refused naming w_right."""
    mod = MonarchLinear(8, 12, 2, backend=backend, device=DEV)
    _raises("x", lambda: mod(_rn(3, 8).half()))
    _raises("x", lambda: mod(torch.randn(3, 8, device="meta")))
    _raises("x", lambda: mod(_rn(3, 7)))
    if backend == "reference":  # (the Triton backend refuses meta tensors, naming backend)
        assert mod.to("meta")(torch.randn(3, 8, device="meta")).shape == (3, 12)


@pytest.mark.skipif(not ON_CPU, reason="CPU autocast")
def test_monarch_module_under_autocast_as_nn_linear():
    """nn.Linear under autocast takes any float input and answers in autocast's dtype; MonarchLinear refused a bf16
    input (naming w_right) and answered fp32 for an fp32 one."""
    mod = MonarchLinear(8, 12, 2, backend="reference")
    x = torch.randn(3, 8)
    want = mod(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for inp in (x, x.bfloat16()):
            y = mod(inp)
            assert y.dtype == torch.bfloat16 and rel_l2(y, want) < 2e-2
        y.float().sum().backward()
    assert mod.w_left.grad.dtype == torch.float32


def test_monarch_project_arguments():
    w = torch.randn(12, 8)
    nan = w.clone()
    nan[0, 0] = math.nan
    _raises("weight", lambda: monarch_project(nan, 2))                              # torch's LinAlgError
    _raises("weight", lambda: monarch_project(torch.full((12, 8), math.inf), 2))
    _raises("weight", lambda: monarch_project(w[:0], 2))                            # was named d_mid
    _raises("d_mid", lambda: monarch_project(w, 2, d_mid=2**40))                   # an allocator error
    _raises("d_mid", lambda: monarch_project(w, 2, d_mid=2**70))                   # an overflow in torch.zeros
    _raises("d_mid", lambda: monarch_project(w, 2, d_mid=18))                      # past nblocks · min(d_in, d_out)
    w_left, w_right = monarch_project(w, 2, d_mid=16)                              # the most: full rank
    assert w_left.shape == (2, 6, 8) and w_right.shape == (2, 8, 4)
    lin = torch.nn.Linear(8, 12)
    with torch.no_grad():
        lin.weight[0, 0] = math.nan
    _raises("weight", lambda: MonarchLinear.from_dense(lin, 2))
