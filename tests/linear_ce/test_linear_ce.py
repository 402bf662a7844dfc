"""linear_cross_entropy vs its reference: values and gradients over several chunks, ignored rows, bad input."""
import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.testing import assert_grads_match, device_under_test, dtypes_under_test
from warpforge.ops.linear_ce import ce_chunk_rows, linear_cross_entropy_reference

DEV = device_under_test()
DTYPES = [torch.float32] + dtypes_under_test()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width,vocab", [(37, 64, 300), (5, 32, 5000)])
def test_linear_cross_entropy(rows, width, vocab, dtype, monkeypatch):
    from warpforge.ops.linear_ce import configs
    # several chunks even at these sizes
    monkeypatch.setattr(configs, "LINEAR_CE", configs.LINEAR_CE.map(lambda c: c._replace(chunk_elements=4 * vocab)))
    hidden = torch.randn(rows, width, device=DEV, dtype=dtype, requires_grad=True)
    weight = (0.2 * torch.randn(vocab, width, device=DEV, dtype=dtype)).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device=DEV)
    targets[::4] = -100  # ignored rows
    assert_grads_match(lambda h, w: wf.linear_cross_entropy(h, w, targets, backend="triton"),
                 lambda h, w: linear_cross_entropy_reference(h, w, targets), [hidden, weight], dtype)


def test_ce_chunks_are_equal():
    assert ce_chunk_rows(16384, 50304, 1 << 28) == 4096  # 4 chunks of 4096, not 3 of 5336 and one of 376
    assert ce_chunk_rows(16384, 50304, 1 << 40) == 16384
    assert ce_chunk_rows(10, 1000, 1) == 1
    for rows, vocab, elements in [(37, 300, 1200), (16383, 50304, 1 << 26), (5, 5000, 20000)]:
        chunk = ce_chunk_rows(rows, vocab, elements)
        assert chunk * vocab <= max(elements, vocab) and -(-rows // chunk) * chunk - rows < chunk


def test_bad_input():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(WarpforgeInputError, match="^targets"):
        wf.linear_cross_entropy(x, torch.randn(10, 8, device=DEV), torch.zeros(3, dtype=torch.long, device=DEV),
                                backend="triton")


OPTIONS = [dict(reduction="sum"), dict(label_smoothing=0.1), dict(lse_square_scale=1e-2), dict(softcap=3.0),
           dict(bias=True), dict(reduction="none"),
           dict(reduction="none", label_smoothing=0.2, lse_square_scale=1e-3, softcap=5.0, bias=True),
           dict(reduction="sum", label_smoothing=0.05, softcap=2.0, bias=True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_liger_options(options, dtype, monkeypatch):
    """reduction / label_smoothing / z-loss / softcap / bias, alone and together, over several chunks, against
    the reference: loss and the gradients of hidden, weight and bias (reduction "none": a random upstream)."""
    from warpforge.ops.linear_ce import configs
    monkeypatch.setattr(configs, "LINEAR_CE", configs.LINEAR_CE.map(lambda c: c._replace(chunk_elements=4 * 300)))
    rows, width, vocab = 37, 64, 300
    hidden = torch.randn(rows, width, device=DEV, dtype=dtype, requires_grad=True)
    weight = (0.2 * torch.randn(vocab, width, device=DEV, dtype=dtype)).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device=DEV)
    targets[::4] = -100
    opts = dict(options)
    inputs = [hidden, weight]
    if opts.pop("bias", False):
        inputs.append(torch.randn(vocab, device=DEV, dtype=dtype, requires_grad=True))
    upstream = torch.randn(rows, device=DEV) if opts.get("reduction") == "none" else None

    def run(fn):
        def call(h, w, b=None):
            loss = fn(h, w, targets, bias=b, **opts)
            return (loss * upstream).sum() if upstream is not None else loss
        return call
    assert_grads_match(run(lambda *a, **k: wf.linear_cross_entropy(*a, backend="triton", **k)),
                       run(linear_cross_entropy_reference), inputs, dtype)


def test_reduction_none_shape_and_ignored_rows():
    x, w = torch.randn(6, 8, device=DEV), torch.randn(10, 8, device=DEV)
    t = torch.tensor([1, -100, 3, 4, -100, 9], device=DEV)
    for backend in ("triton", "reference"):
        out = wf.linear_cross_entropy(x, w, t, backend=backend, reduction="none")
        assert out.shape == (6,) and out.dtype == torch.float32
        assert out[1] == 0 and out[4] == 0 and bool((out[[0, 2, 3, 5]] > 0).all())


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("kw,name", [(dict(reduction="avg"), "reduction"), (dict(label_smoothing=1.5), "label_smoothing"),
                                     (dict(label_smoothing=float("nan")), "label_smoothing"),
                                     (dict(lse_square_scale=-1.0), "lse_square_scale"), (dict(softcap=0.0), "softcap"),
                                     (dict(softcap=-2.0), "softcap"), (dict(bias="b"), "bias"),
                                     (dict(bias=torch.zeros(9)), "bias"), (dict(bias=torch.zeros(10, 1)), "bias")])
def test_bad_options(kw, name, backend):
    x, w = torch.randn(2, 8, device=DEV), torch.randn(10, 8, device=DEV)
    if isinstance(kw.get("bias"), torch.Tensor):
        kw = dict(bias=kw["bias"].to(DEV))
    with pytest.raises(WarpforgeInputError, match=f"^{name}"):
        wf.linear_cross_entropy(x, w, torch.zeros(2, dtype=torch.long, device=DEV), backend=backend, **kw)


def _check_masked_vocabulary(rows, vocab, masked, targets, backend):
    """linear_cross_entropy with a -inf bias on the vocabulary ids `masked` (no smoothing): the loss matches plain
    cross-entropy and its gradient is finite."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(rows, 8, generator=g), torch.randn(vocab, 8, generator=g)
    bias = torch.zeros(vocab)
    bias[masked] = float("-inf")
    h, w, bias, targets = (t.to(DEV) for t in (h, w, bias, torch.tensor(targets)))
    h.requires_grad_()
    loss = wf.linear_cross_entropy(h, w, targets, bias=bias, backend=backend)
    want = torch.nn.functional.cross_entropy(h.detach() @ w.T + bias, targets)
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(loss, h)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_masked_vocabulary_entries_keep_the_loss_finite(backend):
    """A -inf bias on part of the vocabulary (padding) without label smoothing: the loss and its gradients are
    finite and match plain cross-entropy (the smoothing term's 0 · sum of logits was NaN there)."""
    _check_masked_vocabulary(4, 10, slice(5, None), [1, 2, 3, 4], backend)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_masked_first_vocabulary_block_keeps_the_loss_finite(backend, monkeypatch):
    """The whole first block of the kernel's walk over a row masked (-inf bias on the vocabulary's first 16 ids, the
    block forced to 16): its running max is -inf there, which must not make the row's sum NaN (-inf - -inf)."""
    from warpforge.ops.linear_ce import configs
    monkeypatch.setattr(configs, "LINEAR_CE", configs.LINEAR_CE.map(lambda c: c._replace(block=16)))
    _check_masked_vocabulary(3, 40, slice(None, 16), [20, 30, 39], backend)
