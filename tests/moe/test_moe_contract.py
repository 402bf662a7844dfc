"""The MoE family's input contract: strided ids and weights, how routing breaks ties and takes non-finite
logits (both backends alike), the value checks (FP8 weights and scales, ids, align's arguments) and trusted ids
that are out of range. Tiny shapes: fast on the interpreter."""
import importlib

import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.ops.moe import align
from warpforge.testing import device_under_test, poisoned_outputs

DEV = device_under_test()
BACKENDS = ("triton", "reference")
# the interpreter's numpy warns on the inf / NaN arithmetic that some cases feed it on purpose
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def _inputs(t=5, e=4, h=16, i=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=gen).to(DEV)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(DEV)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(DEV)
    return hidden, w13, w2


def _routing(t=5, k=2, e=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(t, k, generator=gen).to(DEV)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(DEV, torch.int32)
    return weights, ids


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=tol, atol=tol, equal_nan=True)


# ------------------------------------------------------------------------------------ strided ids and weights
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_strided_ids_and_weights(dtype):
    """ids / weights as views with a stride of 2 (every other column of a wider tensor): the kernels read them as
    the values they are, not as a dense block of memory."""
    hidden, w13, w2 = _inputs()
    weights, ids = _routing()
    ids = ids.to(dtype)
    ids_view = torch.stack([ids, torch.full_like(ids, 3)], 2)[..., 0]
    weights_view = torch.stack([weights, torch.full_like(weights, 9.0)], 2)[..., 0]
    assert ids_view.stride() == (4, 2) and weights_view.stride() == (4, 2)
    ref = wf.moe.experts(hidden, w13, w2, weights, ids, backend="reference")
    for backend in BACKENDS:
        out = wf.moe.experts(hidden, w13, w2, weights_view, ids_view, backend=backend)
        _close(out, ref)
    for backend in BACKENDS:
        for a, b in zip(align(ids_view, 4, 16, backend=backend), align(ids.contiguous(), 4, 16, backend=backend)):
            assert torch.equal(a, b)


def test_strided_ids_training():
    """The backward runs on the same schedule: gradients from strided ids match the contiguous ones."""
    hidden, w13, w2 = _inputs()
    weights, ids = _routing()
    ids_view = torch.stack([ids, ids], 2)[..., 0]
    grads = []
    for i in (ids, ids_view):
        x = hidden.clone().requires_grad_()
        w = weights.clone().requires_grad_()
        out = wf.moe.experts(x, w13, w2, w, i, backend="triton")
        grads.append(torch.autograd.grad(out.square().sum(), (x, w)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ ties
TIES = {
    "zero_router": lambda: torch.zeros(3, 8),
    "pairs": lambda: torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 1.0, 0.0]]).repeat(3, 1),
    "saturated_softmax": lambda: torch.tensor([[0.0, 200.0, 0.0, 200.0, -50.0, 0.0, 200.0, 7.0]]),
    "huge_logits": lambda: torch.randn(5, 8, generator=torch.Generator().manual_seed(3)) * 1e30,
    "late_ties": lambda: torch.tensor([[-3.0, 2.0, 2.0, -3.0, -3.0, 2.0, -3.0, 2.0]]),
}


@pytest.mark.parametrize("name", sorted(TIES))
@pytest.mark.parametrize("kw", [{}, dict(scoring="sigmoid"), dict(scoring="sigmoid", renormalize=False),
                                dict(scoring="sigmoid", num_expert_group=4, topk_group=2),
                                dict(num_expert_group=2, topk_group=1)])
def test_ties_go_to_the_lower_expert_id(name, kw):
    logits = TIES[name]().to(DEV)
    k = 3
    (w_t, i_t), (w_r, i_r) = (wf.moe.route(logits, k, backend=b, **kw) for b in BACKENDS)
    assert torch.equal(i_t.cpu(), i_r.cpu())
    _close(w_t, w_r)
    assert all(len(set(row)) == k for row in i_t.tolist())


def test_choosing_ranks_shared():
    from warpforge.ops.moe import reference, route_kernel
    assert (route_kernel.NAN_RANK.value, route_kernel.LEFT_OUT_RANK.value) == \
        (reference.NAN_RANK, reference.LEFT_OUT_RANK)


def test_tie_order_is_documented_one():
    """Equal scores: lowest expert id first, in order (a zero-initialised router routes every token to 0..k-1);
    groups likewise."""
    for backend in BACKENDS:
        _, ids = wf.moe.route(torch.zeros(4, 8, device=DEV), 3, backend=backend)
        assert ids.tolist() == [[0, 1, 2]] * 4
        logits = torch.tensor([[0.0, 0.0, 5.0, 5.0, 0.0, 0.0, 5.0, 5.0]], device=DEV)
        _, ids = wf.moe.route(logits, 2, scoring="sigmoid", num_expert_group=4, topk_group=1, backend=backend)
        assert ids.tolist() == [[2, 3]]  # groups 1 and 3 tie: group 1 is kept


@pytest.mark.parametrize("logits,k", [(torch.zeros(5, 4), 2), (torch.tensor([[1.0, 1.0, 0.0, 0.0]]).repeat(5, 1), 1)])
def test_fused_moe_with_tied_router_agrees(logits, k):
    hidden, w13, w2 = _inputs()
    outs = [wf.fused_moe(hidden, w13, w2, logits.to(DEV), k, backend=b) for b in BACKENDS]
    _close(*outs)


# ------------------------------------------------------------------------------------ non-finite logits
def _nonfinite(kind):
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    if kind == "nan":
        logits[1, 3] = float("nan")
    elif kind == "nan_row":
        logits[1] = float("nan")
    elif kind == "pos_inf":
        logits[1, 2] = float("inf")
    elif kind == "neg_inf_row":
        logits[1] = float("-inf")
    elif kind == "neg_inf_some":
        logits[1, :5] = float("-inf")
    return logits.to(DEV)


@pytest.mark.parametrize("kind", ["nan", "nan_row", "pos_inf", "neg_inf_row", "neg_inf_some"])
@pytest.mark.parametrize("kw", [{}, dict(scoring="sigmoid"), dict(scoring="sigmoid", num_expert_group=4, topk_group=2),
                                dict(renormalize=False, routed_scaling_factor=2.5)])
def test_nonfinite_logits_route_alike(kind, kw):
    """The documented result on both backends: k distinct ids in [0, E), weights NaN where the scores are."""
    logits = _nonfinite(kind)
    with poisoned_outputs():
        w_t, i_t = wf.moe.route(logits, 3, backend="triton", **kw)
    w_r, i_r = wf.moe.route(logits, 3, backend="reference", **kw)
    assert torch.equal(i_t.cpu(), i_r.cpu())
    _close(w_t, w_r)
    assert all(len(set(row)) == 3 and 0 <= min(row) and max(row) < 8 for row in i_t.tolist())
    assert torch.isfinite(w_t[[0, 2, 3]]).all()  # other tokens untouched
    if kw.get("scoring", "softmax") == "softmax" and kind in ("nan", "nan_row", "pos_inf", "neg_inf_row"):
        assert i_t[1].tolist() == [0, 1, 2] and torch.isnan(w_t[1]).all()


def test_nonfinite_logits_sigmoid_avoid_nan_experts():
    logits = torch.zeros(2, 8, device=DEV)
    logits[0, :6] = float("nan")
    logits[1] = float("-inf")
    for backend in BACKENDS:
        weights, ids = wf.moe.route(logits, 3, scoring="sigmoid", backend=backend)
        assert ids.tolist() == [[6, 7, 0], [0, 1, 2]]  # NaN ranks below every number; all-zero scores tie
        assert torch.isnan(weights[0]).all() and torch.equal(weights[1].cpu(), torch.zeros(3))


def test_fused_moe_nonfinite_logits_confined_to_their_token():
    hidden, w13, w2 = _inputs()
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(2)).to(DEV)
    logits[2, 1] = float("nan")
    outs = [wf.fused_moe(hidden, w13, w2, logits, 2, backend=b) for b in BACKENDS]
    _close(*outs)
    assert torch.isnan(outs[0][2]).all() and torch.isfinite(outs[0][[0, 1, 3, 4]]).all()


def test_routed_scaling_factor_bounded():
    logits = torch.randn(3, 8, device=DEV)
    for backend in BACKENDS:
        with pytest.raises(WarpforgeInputError, match="^routed_scaling_factor"):
            wf.moe.route(logits, 2, routed_scaling_factor=1e300, backend=backend)
        weights, _ = wf.moe.route(logits, 2, renormalize=False, routed_scaling_factor=1e30, backend=backend)
        assert torch.isfinite(weights).all()


# ------------------------------------------------------------------------------------ FP8 weights and scales
@pytest.mark.parametrize("w", [torch.ones(2, 4, 4, dtype=torch.int32), torch.ones(2, 4, 4, dtype=torch.bool),
                               torch.ones(2, 4, 4, dtype=torch.float64)])
def test_quantize_weights_dtype(w):
    with pytest.raises(WarpforgeInputError, match="^w"):
        wf.moe.quantize_weights(w.to(DEV))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_quantize_weights_finite(bad):
    w = torch.randn(2, 4, 4, device=DEV)
    w[1, 2, 3] = bad
    with pytest.raises(WarpforgeInputError, match="^w"):
        wf.moe.quantize_weights(w)
    q, s = wf.moe.quantize_weights(torch.randn(2, 4, 4, device=DEV).half())
    assert q.dtype == torch.float8_e4m3fn and torch.isfinite(s).all()


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("bad", ["nan", "inf", "negative"])
def test_fp8_scales_values(which, bad):
    hidden, w13, w2 = _inputs()
    logits = torch.randn(5, 4, device=DEV)
    (q13, s13), (q2, s2) = wf.moe.quantize_weights(w13), wf.moe.quantize_weights(w2)
    scales = [s13.clone(), s2.clone()]
    if bad == "negative":
        scales[which] = -scales[which]
    else:
        scales[which][0, 0, 0] = float(bad)
    for backend in BACKENDS:
        with pytest.raises(WarpforgeInputError, match=rf"^w_scales\[{which}\]"):
            wf.fused_moe(hidden, q13, q2, logits, 2, w_format="fp8", w_scales=tuple(scales), backend=backend)


def test_fp8_is_inference_only_on_both_backends():
    hidden, w13, w2 = _inputs()
    logits = torch.randn(5, 4, device=DEV)
    (q13, s13), (q2, s2) = wf.moe.quantize_weights(w13), wf.moe.quantize_weights(w2)
    for backend in BACKENDS:
        for x, lg in ((hidden.clone().requires_grad_(), logits), (hidden, logits.clone().requires_grad_())):
            with pytest.raises(WarpforgeInputError, match="^w_format"):
                wf.fused_moe(x, q13, q2, lg, 2, w_format="fp8", w_scales=(s13, s2), backend=backend)
        with torch.no_grad():  # inference of a model whose activations would otherwise require grad
            out = wf.fused_moe(hidden.clone().requires_grad_(), q13, q2, logits, 2, w_format="fp8",
                               w_scales=(s13, s2), backend="reference")
        assert out.shape == hidden.shape


# ------------------------------------------------------------------------------------ experts' weights and ids
@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.int64, torch.int32])
def test_experts_weights_dtype(dtype):
    hidden, w13, w2 = _inputs()
    weights, ids = _routing()
    for backend in BACKENDS:
        with pytest.raises(WarpforgeInputError, match="^topk_weights"):
            wf.moe.experts(hidden, w13, w2, weights.to(dtype), ids, backend=backend)


@pytest.mark.parametrize("bad", [4, -1, 3000, -3])
def test_experts_ids_checked(bad):
    hidden, w13, w2 = _inputs()
    weights, ids = _routing()
    ids[0, 0] = bad
    for backend in BACKENDS:
        with pytest.raises(WarpforgeInputError, match="^topk_ids"):
            wf.moe.experts(hidden, w13, w2, weights, ids, backend=backend)


@pytest.mark.parametrize("bad", [4, 3000, -3, 2**31 - 1])
def test_trusted_ids_out_of_range_add_nothing(bad):
    """check_ids=False: an id out of range is left out of the one-launch schedule (never read or written
    through), as the reference leaves it out; its weight's gradient is 0."""
    hidden, w13, w2 = _inputs()
    weights, ids = _routing()
    ids[0, 0], ids[3, 1] = bad, bad
    weights.requires_grad_()
    outs = []
    for backend in BACKENDS:
        with poisoned_outputs():
            out = wf.moe.experts(hidden, w13, w2, weights, ids, check_ids=False, backend=backend)
        outs.append((out, *torch.autograd.grad(out.square().sum(), weights)))
    _close(outs[0][0], outs[1][0])
    _close(outs[0][1], outs[1][1], tol=1e-4)
    assert outs[0][1][0, 0] == 0 and outs[0][1][3, 1] == 0
    kept = torch.ones_like(weights, dtype=torch.bool)
    kept[0, 0] = kept[3, 1] = False
    ref = wf.moe.experts(hidden, w13, w2, (weights * kept).detach(), torch.where(kept, ids, 0), backend="reference")
    _close(outs[0][0], ref)


def test_unreadable_ids_are_clamped(monkeypatch):
    """Where a check may not read values (CUDA-graph capture, torch.compile), check_ids clamps on the device
    instead, on both backends alike."""
    align_module = importlib.import_module("warpforge.ops.moe.align")  # the package's `align` is the function
    monkeypatch.setattr(align_module, "host_reads_allowed", lambda t: False)
    hidden, w13, w2 = _inputs()
    weights, ids = _routing()
    bad = ids.clone()
    bad[0, 0], bad[1, 1] = 9, -2
    outs = [wf.moe.experts(hidden, w13, w2, weights, bad, backend=b) for b in BACKENDS]
    _close(*outs)
    _close(outs[0], wf.moe.experts(hidden, w13, w2, weights, bad.clamp(0, 3), backend="reference"))


# ------------------------------------------------------------------------------------ align's arguments
IDS = "torch.tensor([[0, 3], [3, 1], [2, 0]], dtype=torch.int32)"


@pytest.mark.parametrize("call,name", [
    ("align(torch.rand(3, 2), 4, 16)", "topk_ids"),
    ("align(None, 4, 16)", "topk_ids"),
    ("align([[0, 1]], 4, 16)", "topk_ids"),
    (f"align({IDS}[:, 0], 4, 16)", "topk_ids"),
    (f"align({IDS}.short(), 4, 16)", "topk_ids"),
    ("align(torch.tensor([[0, 7]], dtype=torch.int32, device=DEV), 4, 16)", "topk_ids"),
    ("align(torch.tensor([[0, -1]], dtype=torch.int32, device=DEV), 4, 16)", "topk_ids"),
    ("align(torch.tensor([[0, 4]], device=DEV), 4, 16)", "topk_ids"),
    (f"align({IDS}, 0, 16)", "num_experts"),
    (f"align({IDS}, -4, 16)", "num_experts"),
    (f"align({IDS}, 4.0, 16)", "num_experts"),
    (f"align({IDS}, True, 16)", "num_experts"),
    (f"align({IDS}, 4, 0)", "block_m"),
    (f"align({IDS}, 4, -16)", "block_m"),
    (f"align({IDS}, 4, 16.0)", "block_m"),
    (f"align({IDS}, 4, None)", "block_m"),
    (f"align({IDS}, 4, 16, check_ids='yes')", "check_ids"),
    (f"align({IDS}, 4, 16, backend='bogus')", "backend"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_align_arguments(call, name, backend):
    if "backend=" not in call:
        call = call[:-1] + f", backend='{backend}')"
    with pytest.raises(WarpforgeInputError, match=f"^{name}"):
        eval(call, {"align": align, "torch": torch, "DEV": DEV})


@pytest.mark.parametrize("backend", BACKENDS)
def test_align_valid_edges(backend):
    ids = torch.tensor([[0, 3], [3, 1], [2, 0]], dtype=torch.int32, device=DEV)
    sorted_ids, expert_ids, num_post = align(ids, 4, 3, backend=backend)  # block_m not a power of two
    assert int(num_post) == 12 and expert_ids.tolist()[:4] == [0, 1, 2, 3]
    sorted_ids, expert_ids, num_post = align(ids.new_zeros(0, 2), 4, 16, backend=backend)
    assert int(num_post) == 0 and (expert_ids == -1).all() and (sorted_ids == 0).all()
    a, b = align(ids.long(), 1 + 3, 4, backend=backend), align(ids, 4, 4, backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_align_trusted_ids_out_of_range():
    """check_ids=False: the one-launch kernel leaves ids out of range out of the schedule (no stray reads or
    writes): the schedule of the ids in range, slot numbers unchanged."""
    ids = torch.tensor([[0, 7], [3, -1], [2, 0], [2**31 - 1, 3]], dtype=torch.int32, device=DEV)
    got = align(ids, 4, 4, check_ids=False, backend="triton")
    sorted_ids, expert_ids, num_post = got
    assert int(num_post) == 12 and expert_ids.tolist() == [0, 2, 3, -1, -1]
    assert sorted_ids.tolist()[:12] == [0, 5, 8, 8, 4, 8, 8, 8, 2, 7, 8, 8]
    assert (sorted_ids[12:] == 8).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens_keep_the_graph(backend):
    """0 tokens: the output stays in the autograd graph (zero gradients), on every backend (the reference's used to
    be a plain zeros buffer, so backward raised)."""
    w13 = torch.randn(2, 8, 16, device=DEV, requires_grad=True)
    w2 = torch.randn(2, 16, 4, device=DEV, requires_grad=True)
    hidden = torch.zeros(0, 16, device=DEV, requires_grad=True)
    weights = torch.zeros(0, 1, device=DEV, requires_grad=True)
    out = wf.moe.experts(hidden, w13, w2, weights, torch.zeros(0, 1, dtype=torch.int64, device=DEV), backend=backend)
    out.sum().backward()
    assert out.shape == (0, 16) and not w13.grad.any() and not w2.grad.any()
