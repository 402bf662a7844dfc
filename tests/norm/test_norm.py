"""rms_norm, add_rms_norm and layer_norm vs their references: values and gradients, awkward sizes, bad input."""
import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.testing import assert_grads_match, device_under_test, dtypes_under_test, rel_l2
from warpforge.ops.norm import layer_norm_reference, rms_norm_reference

DEV = device_under_test()
DTYPES = [torch.float32] + dtypes_under_test()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 96), (7, 1000), (1, 33)])
def test_rms_norm(shape, dtype):
    x = torch.randn(shape, device=DEV, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(shape[-1], device=DEV, dtype=dtype)).requires_grad_()
    assert_grads_match(lambda a, b: wf.rms_norm(a, b, backend="triton"), rms_norm_reference, [x, w], dtype)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_out_dtype(norm):
    """An fp32 input normalised straight into a half-precision output (what autocast's next matmul reads): the
    fp32 result rounded once; gradients flow back to the fp32 input and weights."""
    x = torch.randn(5, 3, 200, device=DEV, requires_grad=True)
    w = (1 + 0.1 * torch.randn(200, device=DEV)).requires_grad_()
    b = (0.1 * torch.randn(200, device=DEV)).requires_grad_()
    if norm == "rms":
        got = wf.rms_norm(x, w, backend="triton", out_dtype=torch.float16)
        want = rms_norm_reference(x, w, 1e-6)
    else:
        got = wf.layer_norm(x, w, b, backend="triton", out_dtype=torch.float16)
        want = layer_norm_reference(x, w, b, 1e-5)
    assert got.dtype == torch.float16 and x.dtype == torch.float32
    assert rel_l2(got.float(), want) <= 1e-3
    g = torch.randn_like(want)
    inputs = [x, w] if norm == "rms" else [x, w, b]
    for a, e in zip(torch.autograd.grad(got, inputs, g.half()), torch.autograd.grad(want, inputs, g)):
        assert a.dtype == torch.float32 and rel_l2(a, e) <= 1e-3
    with pytest.raises(WarpforgeInputError, match="^out_dtype"):
        wf.rms_norm(x, w, backend="triton", out_dtype=torch.int32)


@pytest.mark.parametrize("x_dtype,res_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float16),
                                               (torch.float32, torch.float32)])
def test_add_rms_norm(x_dtype, res_dtype):
    """rms_norm(x + residual) and the sum in one pass: the sum in the promoted dtype, normalised as stored; both
    outputs used downstream, so x's and the residual's gradients get the norm's and the sum's."""
    x = torch.randn(3, 7, 130, device=DEV, dtype=x_dtype, requires_grad=True)
    r = torch.randn(3, 7, 130, device=DEV, dtype=res_dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(130, device=DEV)).requires_grad_()
    y, total = wf.add_rms_norm(x, r, w, backend="triton", out_dtype=torch.float16)
    ref_total = x.double() + r.double()
    ref_y = rms_norm_reference(ref_total.to(total.dtype).double(), w.double(), 1e-6)
    assert total.dtype == torch.result_type(x, r) and y.dtype == torch.float16
    tol = 1e-5 if total.dtype == torch.float32 else 1e-3
    assert rel_l2(total.double(), ref_total) <= tol
    assert rel_l2(y.double(), ref_y) <= 1e-3
    gy, gt = torch.randn_like(y), torch.randn_like(total)
    got = torch.autograd.grad((y, total), (x, r, w), (gy, gt))
    want = torch.autograd.grad((ref_y, ref_total), (x, r, w), (gy.double(), gt.double()))
    for a, e in zip(got, want):
        assert a.dtype in (x_dtype, res_dtype, torch.float32)
        assert rel_l2(a.double(), e) <= (2e-3 if torch.float16 in (x_dtype, res_dtype) else 1e-4)
    ref_y2, ref_t2 = wf.add_rms_norm(x, r, w, backend="reference", out_dtype=torch.float16)
    assert rel_l2(ref_t2.double(), ref_total) <= tol and ref_y2.dtype == torch.float16
    with pytest.raises(WarpforgeInputError, match="^residual"):
        wf.add_rms_norm(x, r[:, :3], w, backend="triton")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 96), (7, 1000), (2, 33)])
def test_layer_norm(shape, dtype):
    x = (torch.randn(shape, device=DEV, dtype=dtype) + 0.5).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], device=DEV, dtype=dtype)).requires_grad_()
    b = (0.1 * torch.randn(shape[-1], device=DEV, dtype=dtype)).requires_grad_()
    assert_grads_match(lambda a, c, d: wf.layer_norm(a, c, d, backend="triton"), layer_norm_reference, [x, w, b], dtype)


def test_bad_input():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(WarpforgeInputError, match="^weight"):
        wf.rms_norm(x, torch.ones(9, device=DEV), backend="triton")


@pytest.mark.parametrize("block_rows,prefetch", [(2, True), (4, True), (2, False)])
def test_row_tiles(block_rows, prefetch, monkeypatch):
    """Several rows per forward program and per backward step (the tile table's block_rows), row counts that are not
    multiples of the tile, the backward with and without its prefetch of the next tile, forced on whatever runs the
    tests; the residual add too."""
    from warpforge.ops.norm import configs
    monkeypatch.setattr(configs, "NORM", configs.NORM.map(lambda c: c._replace(block_rows=block_rows,
                                                                                prefetch=prefetch)))
    x = torch.randn(7, 5, 96, device=DEV, requires_grad=True)
    w = (1 + 0.1 * torch.randn(96, device=DEV)).requires_grad_()
    b = (0.1 * torch.randn(96, device=DEV)).requires_grad_()
    assert_grads_match(lambda a, c: wf.rms_norm(a, c, backend="triton"), rms_norm_reference, [x, w], torch.float32)
    assert_grads_match(lambda a, c, d: wf.layer_norm(a, c, d, backend="triton"), layer_norm_reference, [x, w, b],
                       torch.float32)
    r = torch.randn_like(x)
    y, total = wf.add_rms_norm(x, r, w, backend="triton")
    assert rel_l2(total, x + r) <= 1e-6 and rel_l2(y, rms_norm_reference(x + r, w, 1e-6)) <= 1e-5


def test_no_rows():
    """Zero rows: empty outputs, and weight gradients that are sums of nothing (zeros), not garbage."""
    x = torch.randn(0, 5, 64, device=DEV, requires_grad=True)
    w = torch.randn(64, device=DEV, requires_grad=True)
    b = torch.randn(64, device=DEV, requires_grad=True)
    y = wf.layer_norm(x, w, b, backend="triton")
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), torch.randn_like(y))
    assert y.shape == x.shape and gx.shape == x.shape
    assert torch.equal(gw, torch.zeros_like(w)) and torch.equal(gb, torch.zeros_like(b))


def test_repeated_calls_new_alignment():
    """The ops keep compiled kernels between calls (ops/_op.py's Launcher): later calls with other row counts and an
    input that is not 16-byte aligned (a view one element in) must still match the reference."""
    base = torch.randn(40 * 96 + 1, device=DEV)
    w = 1 + 0.1 * torch.randn(96, device=DEV)
    for rows, offset in ((16, 0), (16, 0), (7, 1), (33, 1), (16, 0)):
        x = base[offset:offset + rows * 96].view(rows, 96)
        assert rel_l2(wf.rms_norm(x, w, backend="triton"), rms_norm_reference(x, w, 1e-6)) <= 1e-5


class _StubParam:
    def __init__(self, num, is_constexpr):
        self.num, self.is_constexpr = num, is_constexpr


class _StubKernelSignature:
    """What ops/_op.py's Launcher reads of a JITFunction: (X, n, eps, BLOCK), BLOCK a constexpr."""
    arg_names = ["X", "n", "eps", "BLOCK"]
    params = [_StubParam(0, False), _StubParam(1, False), _StubParam(2, False), _StubParam(3, True)]


def test_launcher_reuses_only_what_triton_would(monkeypatch):
    """ops/_op.py's Launcher with a stand-in kernel and driver: the first launch of each specialization goes through
    kernel[grid]; a repeat calls the compiled kernel directly with the same arguments, the constexprs after them;
    a new specialization (an int no longer a multiple of 16, a misaligned tensor, another dtype) or a launch hook
    goes back through kernel[grid]."""
    import importlib

    import triton
    from warpforge.ops import _op

    calls = []

    class Compiled:
        packed_metadata, function = "packed", "function"

        def run(self, *args):
            calls.append(("direct",) + args)

    class Kernel(_StubKernelSignature):
        def __getitem__(self, grid):
            def launch(*args, **meta):
                calls.append(("triton", grid, args, meta))
                return Compiled()
            return launch

    class Driver:
        launcher_cls = object

        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 7

    class Hooks:
        def __init__(self, calls=()):
            self.calls = list(calls)

    class Runtime:
        launch_enter_hook, launch_exit_hook = Hooks(), None

    driver = importlib.import_module("triton.runtime.driver").driver
    monkeypatch.setattr(type(driver), "active", property(lambda self: Driver()))
    monkeypatch.setattr(triton.knobs, "runtime", Runtime())
    launch = _op.Launcher(Kernel())
    x = torch.zeros(64)
    launch((3,), x, 768, 1e-6, BLOCK=1024)
    launch((5, 2), x, 768, 1e-6, BLOCK=1024)
    assert calls[0][0] == "triton" and calls[1] == ("direct", 5, 2, 1, 7, "function", "packed", None, None, None, x,
                                                     768, 1e-6, 1024)
    for args in ((x, 770, 1e-6), (x[1:], 768, 1e-6), (x.double(), 768, 1e-6)):
        calls.clear()
        launch((3,), *args, BLOCK=1024)
        assert calls[0][0] == "triton"
    calls.clear()
    launch((3,), x, 768, 1e-6, BLOCK=2048)
    launch((3,), x, 768, 1e-6, BLOCK=1024)
    assert [c[0] for c in calls] == ["triton", "direct"]
    Runtime.launch_enter_hook = Hooks([print])
    calls.clear()
    launch((3,), x, 768, 1e-6, BLOCK=1024)
    assert calls[0][0] == "triton"


def test_launcher_calls_triton36_c_launch_directly(monkeypatch):
    """With Triton 3.6's CUDA launcher (a CudaLauncher whose __call__ only forwards to its C `launch`) and no scratch
    memory, a repeat launch calls `launch` itself, tensors as their addresses (the order of that C function's
    arguments); with scratch memory, through the launcher object, tensors as they are."""
    import importlib

    import triton
    from warpforge.ops import _op

    calls = []

    class CudaLauncher:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            calls.append(("wrapper", gridX, gridY, gridZ, stream, function) + args)

        def launch(self, *args):
            calls.append(("raw",) + args)

    CudaLauncher.__module__ = "triton.backends.nvidia.driver"

    class Compiled:
        packed_metadata, function = "packed", "function"

        def __init__(self, scratch):
            self.run = CudaLauncher()
            self.run.global_scratch_size = scratch

    class Kernel(_StubKernelSignature):
        scratch = 0

        def __getitem__(self, grid):
            return lambda *args, **meta: Compiled(self.scratch)

    class Driver:
        launcher_cls = object
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 7)

    class Runtime:
        launch_enter_hook = launch_exit_hook = None

    driver = importlib.import_module("triton.runtime.driver").driver
    monkeypatch.setattr(type(driver), "active", property(lambda self: Driver()))
    monkeypatch.setattr(triton.knobs, "runtime", Runtime())
    x = torch.zeros(64)
    for scratch, want in ((0, ("raw", 5, 2, 1, 7, "function", False, True, None, None, "packed", None, None, None,
                               x.data_ptr(), 768, 1e-6, 1024)),
                          (256, ("wrapper", 5, 2, 1, 7, "function", "packed", None, None, None, x, 768, 1e-6, 1024))):
        Kernel.scratch = scratch
        launch = _op.Launcher(Kernel())
        launch((3,), x, 768, 1e-6, BLOCK=1024)
        calls.clear()
        launch((5, 2), x, 768, 1e-6, BLOCK=1024)
        assert calls == [want]


def test_launcher_binders_match_bind():
    """ops/_op.py's Launcher keys a launch by straight-line binders made per argument-type pattern: each must give
    _bind's specialization key and flat arguments exactly (tensors, a Parameter, ints 1 / 16k / 64-bit / odd, a float,
    None, bools, a dtype), and the launch counts (a debug aid) record the path taken."""
    from warpforge.ops import _op

    x = torch.zeros(64)
    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.float16))
    for args in ((x, 768, 1e-6), (x[1:], 1, 2.0), (p, x, 2**40, 17, None, True, torch.float32),
                 (x, False, 0, -3), (7,)):
        launcher = _op.Launcher(object())
        spec, flat = launcher._binder(args)(*args)
        want = _op._bind(args)
        assert (spec, list(flat)) == (want[0], list(want[1])) and type(spec) is tuple
        assert launcher.binders[tuple(map(type, args))] is not None

    calls = []

    class Kernel:
        __name__ = "k"
        arg_names = ["X", "n", "BLOCK"]

        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append(args)

    try:
        _op.Launcher.counts = {}
        _op.Launcher(Kernel())((1,), x, 3, BLOCK=4)
        assert _op.Launcher.counts == {("k", "triton"): 1}
    finally:
        _op.Launcher.counts = None


def test_launcher_keys_tma_descriptors_like_triton():
    """A host TMA descriptor argument (the Gluon kernels take a dozen): the binders key it by what Triton specializes
    it on (its class, dtype, box, layout, padding), not by its tensor's address or shape, and pass the descriptor
    itself on (Triton 3.6's C launch wrapper encodes its tensor map on every launch)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from warpforge.ops import _op

    a, b = torch.zeros(256, 64), torch.zeros(512, 64)
    da, db = TensorDescriptor.from_tensor(a, [64, 64]), TensorDescriptor.from_tensor(b, [64, 64])
    box = TensorDescriptor.from_tensor(a, [32, 64])
    half = TensorDescriptor.from_tensor(a.half(), [64, 64])
    launcher = _op.Launcher(object())
    keys = []
    for args in ((da, a, 3), (db, b, 3), (box, a, 3), (half, a, 3)):
        spec, flat = launcher._binder(args)(*args)
        assert (spec, list(flat)) == (_op._bind(args)[0], list(_op._bind(args)[1])) and flat[0] is args[0]
        keys.append(spec)
    assert keys[0] == keys[1] and len({keys[0], keys[2], keys[3]}) == 3


def test_eager_backward_gets_no_zeros_for_statistics():
    """ops/_op.py's eager autograd.Function: outputs marked non-differentiable (a norm's mean and rstd) reach the
    backward as None, not as zeros the engine would allocate and fill on every call; a differentiable output without
    a gradient still gets zeros, as the registered op's backward does."""
    from warpforge.ops._op import kernel_op

    seen = []

    def impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x * 2, x.sum(-1), x * 3

    def fake(x):
        return torch.empty_like(x), x.new_empty(x.shape[:-1]), torch.empty_like(x)

    def setup(ctx, inputs, out):
        ctx.mark_non_differentiable(out[1])

    def backward(ctx, dy, d_stat, dz):
        seen.append((d_stat, dz))
        return dy * 2 + dz * 3

    op = kernel_op("test_eager_nondiff_grads", impl, fake, setup_context=setup, backward=backward)
    x = torch.randn(4, 5, requires_grad=True)
    y, _, _ = op(x)
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert seen[0][0] is None and torch.equal(seen[0][1], torch.zeros(4, 5)) and torch.equal(gx, torch.full_like(x, 2))


def test_eager_norms_make_no_placeholders(monkeypatch):
    """Eager calls pass None where the registered op returns empty placeholder tensors (RMSNorm's mean, the backward's
    second dx and db): no allocation an eager call does not use."""
    import sys

    new_empty = torch.Tensor.new_empty

    def refuse(*args, **kwargs):  # placeholders are made in api.py (the interpreter makes its own tensors)
        assert not sys._getframe(1).f_code.co_filename.endswith(("norm/api.py", "norm_kernel.py")), \
            "a placeholder tensor in an eager call"
        return new_empty(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "new_empty", refuse)
    x = torch.randn(6, 40, device=DEV, requires_grad=True)
    w = (1 + 0.1 * torch.randn(40, device=DEV)).requires_grad_()
    b = torch.zeros(40, device=DEV, requires_grad=True)
    y = wf.rms_norm(x, w, backend="triton")
    gx, gw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    want = torch.autograd.grad(rms_norm_reference(x, w, 1e-6), (x, w), torch.ones_like(y))
    assert rel_l2(gx, want[0]) <= 1e-4 and rel_l2(gw, want[1]) <= 1e-4
    y = wf.layer_norm(x, w, b, backend="triton")
    torch.autograd.grad(y, (x, w, b), torch.ones_like(y))
    r = torch.randn(6, 40, device=DEV, dtype=torch.float16, requires_grad=True)
    y, total = wf.add_rms_norm(x, r, w, backend="triton")
    torch.autograd.grad((y, total), (x, r, w), (torch.ones_like(y), torch.ones_like(total)))
