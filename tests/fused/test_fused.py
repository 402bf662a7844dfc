"""Fused training ops vs their references: values and gradients, awkward sizes, bad input."""
import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.ops.fused import (linear_cross_entropy_reference, rms_norm_reference, rope_reference, rope_tables,
                                 swiglu_reference)
from warpforge.testing import REL_L2, device_under_test, poisoned_outputs, rel_l2

DEV = device_under_test()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV.type == "cuda" else [])


def _grads_match(fn, ref, inputs, dtype):
    with poisoned_outputs():
        out = fn(*inputs)
    ref_in = [t.detach().float().requires_grad_(t.requires_grad) for t in inputs]
    want = ref(*ref_in)
    tol = max(REL_L2[dtype], 1e-5 if dtype == torch.float32 else 0)
    assert rel_l2(out, want) <= tol
    g = torch.randn_like(out) if out.dim() else torch.ones_like(out)
    got = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], g)
    exp = torch.autograd.grad(want, [t for t in ref_in if t.requires_grad], g.float())
    for a, b in zip(got, exp):
        assert rel_l2(a, b) <= (2e-2 if dtype != torch.float32 else 1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 96), (7, 1000), (1, 33)])
def test_rms_norm(shape, dtype):
    x = torch.randn(shape, device=DEV, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(shape[-1], device=DEV, dtype=dtype)).requires_grad_()
    _grads_match(lambda a, b: wf.rms_norm(a, b, backend="triton"), rms_norm_reference, [x, w], dtype)


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
        from warpforge.ops.fused import layer_norm_reference
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
@pytest.mark.parametrize("shape", [(2, 7, 3, 32), (1, 5, 20, 64), (2, 3, 5, 40)])  # d 40: half not a power of 2
def test_rope(shape, dtype):
    b, s, h, d = shape
    x = torch.randn(shape, device=DEV, dtype=dtype, requires_grad=True)
    angles = torch.rand(s, d // 2, device=DEV) * 6
    cos, sin = angles.cos(), angles.sin()
    _grads_match(lambda a: wf.apply_rope(a, cos, sin, backend="triton"), lambda a: rope_reference(a, cos, sin),
                 [x], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 6, 2 * 40), (3, 2 * 1500)])
def test_swiglu(shape, dtype):
    gu = torch.randn(shape, device=DEV, dtype=dtype, requires_grad=True)
    _grads_match(lambda a: wf.swiglu(a, backend="triton"), swiglu_reference, [gu], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width,vocab", [(37, 64, 300), (5, 32, 5000)])
def test_linear_cross_entropy(rows, width, vocab, dtype, monkeypatch):
    from warpforge.ops import fused
    monkeypatch.setattr(fused, "CE_CHUNK_ELEMENTS", {"default": 4 * vocab})  # several chunks even at these sizes
    hidden = torch.randn(rows, width, device=DEV, dtype=dtype, requires_grad=True)
    weight = (0.2 * torch.randn(vocab, width, device=DEV, dtype=dtype)).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device=DEV)
    targets[::4] = -100  # ignored rows
    _grads_match(lambda h, w: wf.linear_cross_entropy(h, w, targets, backend="triton"),
                 lambda h, w: linear_cross_entropy_reference(h, w, targets), [hidden, weight], dtype)


def test_ce_chunks_are_equal():
    from warpforge.ops.fused import ce_chunk_rows
    assert ce_chunk_rows(16384, 50304, 1 << 28) == 4096  # 4 chunks of 4096, not 3 of 5336 and one of 376
    assert ce_chunk_rows(16384, 50304, 1 << 40) == 16384
    assert ce_chunk_rows(10, 1000, 1) == 1
    for rows, vocab, elements in [(37, 300, 1200), (16383, 50304, 1 << 26), (5, 5000, 20000)]:
        chunk = ce_chunk_rows(rows, vocab, elements)
        assert chunk * vocab <= max(elements, vocab) and -(-rows // chunk) * chunk - rows < chunk


def test_bad_input():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(WarpforgeInputError, match="^weight"):
        wf.rms_norm(x, torch.ones(9, device=DEV), backend="triton")
    with pytest.raises(WarpforgeInputError, match="^gate_up"):
        wf.swiglu(torch.randn(2, 7, device=DEV), backend="triton")
    with pytest.raises(WarpforgeInputError, match="^cos"):
        wf.apply_rope(torch.randn(1, 4, 2, 8, device=DEV), torch.ones(5, 4, device=DEV), torch.ones(4, 4, device=DEV),
                      backend="triton")
    with pytest.raises(WarpforgeInputError, match="^x: expected an even head dim"):
        wf.apply_rope(torch.randn(1, 4, 2, 7, device=DEV), torch.ones(4, 3, device=DEV), torch.ones(4, 3, device=DEV),
                      backend="triton")
    with pytest.raises(WarpforgeInputError, match="^targets"):
        wf.linear_cross_entropy(x, torch.randn(10, 8, device=DEV), torch.zeros(3, dtype=torch.long, device=DEV),
                                backend="triton")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 96), (7, 1000), (2, 33)])
def test_layer_norm(shape, dtype):
    from warpforge.ops.fused import layer_norm_reference
    x = (torch.randn(shape, device=DEV, dtype=dtype) + 0.5).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], device=DEV, dtype=dtype)).requires_grad_()
    b = (0.1 * torch.randn(shape[-1], device=DEV, dtype=dtype)).requires_grad_()
    _grads_match(lambda a, c, d: wf.layer_norm(a, c, d, backend="triton"), layer_norm_reference, [x, w, b], dtype)


def test_compiled_matches_eager():
    """Under torch.compile the ops stay whole custom ops (no graph break, fake-tensor tracing of the registered
    backward); eagerly they run through a plain autograd.Function over the same impls. Same values and
    gradients either way."""
    torch.manual_seed(0)
    x = torch.randn(6, 40, device=DEV, requires_grad=True)
    w = (1 + 0.1 * torch.randn(40, device=DEV)).requires_grad_()
    gu = torch.randn(6, 2, 4, 64, device=DEV, requires_grad=True)
    head = (0.1 * torch.randn(50, 40, device=DEV)).requires_grad_()
    targets = torch.randint(0, 50, (6,), device=DEV)
    cos, sin = rope_tables(2, 32, device=DEV)

    def step(x, w, gu, head):
        h = wf.rms_norm(x, w, backend="triton") + wf.layer_norm(x, w, w, backend="triton")
        y, h = wf.add_rms_norm(h, x, w, backend="triton")
        h = h + y
        r = wf.apply_rope(wf.swiglu(gu, backend="triton").view(6, 2, 4, 32), cos, sin, backend="triton")
        h = h + r.sum((1, 2))[:, :1]
        return wf.linear_cross_entropy(h, head, targets, backend="triton")

    inputs = (x, w, gu, head)
    eager = step(*inputs)
    eager_grads = torch.autograd.grad(eager, inputs)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if DEV.type == "cpu" else "inductor")
    got = compiled(*inputs)
    got_grads = torch.autograd.grad(got, inputs)
    assert torch.allclose(got, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, eager_grads):
        assert rel_l2(a, b) <= 1e-5
