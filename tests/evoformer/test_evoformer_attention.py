"""evoformer_attention against its reference: forward (fp32 reference) and every gradient (q, k, v, gate, the pair
bias; float64 reference), broadcast bias shapes, masked and fully masked rows, column and triangle attention as the
same op, the pair bias's gradient bitwise reproducible, bad input naming the argument.

On a CPU the kernels run through the Triton interpreter at small shapes (fp32 and fp16; N_res crossing the 16-row
tiles); on a GPU the same tests run compiled, in bf16 too, plus the real sizes marked gpu.
"""
import math

import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.ops.evoformer import evoformer_attention_reference
from warpforge.testing import REL_L2, cosine, device_under_test, dtypes_under_test, poisoned_outputs, rel_l2

DEV = device_under_test()
DTYPES = [torch.float32] + dtypes_under_test()
NEG = float("-inf")


def _qkv(B, S, R, H, D, dtype, gate=True):
    q, k, v = (torch.randn(B, S, R, H, D, device=DEV, dtype=dtype).requires_grad_() for _ in range(3))
    g = torch.randn(B, S, R, H, D, device=DEV, dtype=dtype).requires_grad_() if gate else None
    return q, k, v, g


def _mask(B, S, R, drop=0.25):
    """The residue mask as a bias [B, S, 1, 1, R]: 0 or -inf, at least one key kept per row."""
    keep = torch.rand(B, S, R, device=DEV) > drop
    keep[..., 0] = True
    return torch.zeros(B, S, 1, 1, R, device=DEV).masked_fill(~keep[:, :, None, None, :], NEG)


def _pair(shape, dtype, grad=True):
    return torch.randn(shape, device=DEV, dtype=dtype).requires_grad_(grad)


def _reference_grads(q, k, v, biases, gate, d_out, scale=None):
    """out and the gradients of every input that requires one, in float64."""
    leaves = [t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v)]
    bias64 = [b.detach().double().requires_grad_(b.requires_grad) for b in biases]
    g64 = None if gate is None else gate.detach().double().requires_grad_()
    out = evoformer_attention_reference(*leaves, bias64, gate=g64, softmax_scale=scale, compute_dtype=torch.float64)
    wrt = [t for t in leaves + bias64 + ([g64] if g64 is not None else []) if t.requires_grad]
    return out, torch.autograd.grad(out, wrt, d_out.double())


def _check(q, k, v, biases, gate=None, scale=None, grad_tol=None):
    """Forward vs the fp32 reference within REL_L2, gradients vs float64 within grad_tol."""
    dtype = q.dtype
    with poisoned_outputs():
        out = wf.evoformer_attention(q, k, v, biases, gate=gate, softmax_scale=scale, backend="triton")
    assert out.dtype == dtype and out.shape == q.shape
    ref = evoformer_attention_reference(*(t.detach().float() for t in (q, k, v)), [b.float() for b in biases],
                                        gate=None if gate is None else gate.detach().float(), softmax_scale=scale)
    err = rel_l2(out, ref)
    assert err <= REL_L2[dtype], f"out: rel L2 {err}"
    d_out = torch.randn_like(out)
    inputs = [t for t in [q, k, v, *biases] + ([gate] if gate is not None else []) if t.requires_grad]
    names = ["dq", "dk", "dv"] + [f"dbias{i}" for i, b in enumerate(biases) if b.requires_grad] + \
        (["dgate"] if gate is not None else [])
    with poisoned_outputs():
        got = torch.autograd.grad(out, inputs, d_out)
    _, want = _reference_grads(q, k, v, biases, gate, d_out, scale)
    grad_tol = grad_tol or (1e-4 if dtype == torch.float32 else 2e-2)
    for name, g, w, t in zip(names, got, want, inputs):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        err = rel_l2(g, w)
        assert err <= grad_tol, f"{name}: rel L2 {err}"
    return out, got


# B, S, R, H, D, biases, gate: "mask" [B, S, 1, 1, R] (-inf), "pair" [B, 1, H, R, R], "pair1" [1, 1, H, R, R],
# "pair3" [H, R, R], "headless" [B, 1, 1, R, R], "full" [B, S, H, R, R] without a gradient; the list's order is the
# op's bias order
CASES = [
    (1, 2, 1, 2, 8, ("mask", "pair"), True),        # one residue
    (2, 3, 17, 2, 16, ("mask", "pair"), True),      # one past a tile
    (1, 2, 37, 2, 24, ("pair",), False),            # padded head dim, pair bias alone
    (2, 2, 37, 1, 32, ("pair1", "mask"), True),     # pair bias shared by the batch, in slot 0
    (1, 2, 20, 2, 64, ("pair3",), False),           # [H, R, R], the widest head
    (1, 3, 33, 2, 32, (), True),                    # no bias
    (2, 2, 17, 2, 8, ("mask",), False),             # mask only
    (2, 2, 19, 2, 16, ("headless", "pair"), True),  # two gradient-taking biases
    (1, 2, 17, 2, 16, ("full", "pair"), False),     # a per-row bias [B, S, H, R, R] (no gradient)
    (1, 2, 32, 2, 16, ("mask", "pair"), True),      # N_res a multiple of the tiles: the unmasked (EVEN) loads
]


def _biases(names, B, S, R, H, dtype):
    shapes = {"pair": (B, 1, H, R, R), "pair1": (1, 1, H, R, R), "pair3": (H, R, R), "headless": (B, 1, 1, R, R)}
    shapes["full"] = (B, S, H, R, R)
    return [_mask(B, S, R) if n == "mask" else _pair(shapes[n], dtype, grad=n != "full") for n in names]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_s{}_r{}_h{}_d{}_{}_gate{}".format(
    *c[:5], "+".join(c[5]) or "nobias", int(c[6])))
def test_matches_reference(case, dtype):
    B, S, R, H, D, names, gate = case
    q, k, v, g = _qkv(B, S, R, H, D, dtype, gate)
    _check(q, k, v, _biases(names, B, S, R, H, dtype), g)


def test_softmax_scale_and_mixed_bias_dtypes():
    q, k, v, g = _qkv(1, 2, 21, 2, 16, torch.float16)
    pair = _pair((1, 1, 2, 21, 21), torch.float32)  # an fp32 pair bias beside fp16 q, k, v
    _check(q, k, v, [_mask(1, 2, 21).half(), pair], g, scale=0.3)


def test_bf16_pair_bias_beside_fp16_qkv():
    """A bf16 tile bias (the kernels widen it through its bits, evoformer_kernel._widen) beside fp16 q, k, v, with
    its gradient; -inf entries stay -inf."""
    q, k, v, g = _qkv(1, 2, 21, 2, 16, torch.float16)
    pair = _pair((1, 1, 2, 21, 21), torch.bfloat16)
    with torch.no_grad():
        pair[0, 0, 1, 3, ::2] = NEG
    _check(q, k, v, [_mask(1, 2, 21).half(), pair], g)


def test_fully_masked_rows_give_zero_and_no_nan_gradient():
    B, S, R, H, D = 2, 3, 19, 2, 16
    q, k, v, g = _qkv(B, S, R, H, D, torch.float32)
    mask = _mask(B, S, R)
    mask[0, 1] = NEG        # MSA row (0, 1): every key masked, every query dead
    pair = torch.randn(B, 1, H, R, R, device=DEV)
    pair[1, 0, 1, 5] = NEG  # query 5 of head 1, batch 1: dead in every row
    pair.requires_grad_()
    out, (dq, dk, dv, dpair, dg) = _check(q, k, v, [mask, pair], g)
    assert torch.all(out[0, 1] == 0) and torch.all(out[1, :, 5, 1] == 0)
    assert torch.all(dq[0, 1] == 0) and torch.all(dk[0, 1] == 0) and torch.all(dv[0, 1] == 0)
    assert torch.all(dg[0, 1] == 0) and torch.all(dq[1, :, 5, 1] == 0)
    assert torch.all(dpair[1, 0, 1, 5] == 0)
    for t in (dq, dk, dv, dpair, dg):
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("gate", [True, False])
def test_fully_masked_rows_with_a_finite_mask_bias_match_the_fp32_reference_gradient(gate):
    """OpenFold's mask bias is finite (inf · (mask - 1), inf = 1e9): a fully masked row is then attended, near
    uniformly (the scores round to the bias in fp32), where -inf gives zeros. The gradient should be that of the
    function the forward computed (the fp32 reference's, whose forward matches): fp32 cannot hold such a row's lse
    to better than ~64 in the exponent, so the forward keeps the row's maximum and 1 / l instead (row_stats)."""
    B, S, R, H, D = 1, 2, 16, 2, 16
    q, k, v, g = _qkv(B, S, R, H, D, torch.float32, gate=gate)
    mask = torch.zeros(B, S, 1, 1, R, device=DEV)
    mask[0, 1] = -1e9
    pair = _pair((B, 1, H, R, R), torch.float32)
    out = wf.evoformer_attention(q, k, v, [mask, pair], gate=g, backend="triton")
    ref = evoformer_attention_reference(q, k, v, [mask, pair], gate=g)
    assert rel_l2(out, ref) <= REL_L2[torch.float32]
    d_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, pair), d_out)
    want = torch.autograd.grad(ref, (q, k, v, pair), d_out)
    for name, a, b in zip(("dq", "dk", "dv", "dpair"), got, want):
        assert rel_l2(a, b) <= 1e-3, name


def test_everything_masked():
    q, k, v, _ = _qkv(1, 2, 17, 1, 8, torch.float32, gate=False)
    pair = _pair((1, 1, 1, 17, 17), torch.float32)
    mask = torch.full((1, 2, 1, 1, 17), NEG, device=DEV)
    out = wf.evoformer_attention(q, k, v, [mask, pair], backend="triton")
    assert torch.all(out == 0)
    grads = torch.autograd.grad(out, (q, k, v, pair), torch.randn_like(out))
    assert all(torch.all(t == 0) for t in grads)


def test_pair_bias_gradient_is_bitwise_reproducible():
    B, S, R, H, D = 1, 4, 33, 2, 16
    q, k, v, g = _qkv(B, S, R, H, D, torch.float16)
    mask, pair = _mask(B, S, R), _pair((B, 1, H, R, R), torch.float16)
    d_out = torch.randn(B, S, R, H, D, device=DEV, dtype=torch.float16)
    runs = []
    for _ in range(3):
        out = wf.evoformer_attention(q, k, v, [mask, pair], gate=g, backend="triton")
        runs.append(torch.autograd.grad(out, (pair, q), d_out))
    for dpair, dq in runs[1:]:
        assert torch.equal(dpair, runs[0][0]) and torch.equal(dq, runs[0][1])


def test_column_attention_is_the_op_on_the_transposed_msa():
    """Column attention (each residue's column attends over the MSA rows) = the op on m transposed, here fed as
    non-contiguous views."""
    B, S, R, H, D = 1, 13, 6, 2, 16
    q, k, v, g = _qkv(B, S, R, H, D, torch.float32)
    keep = torch.rand(B, S, R, device=DEV) > 0.2
    keep[:, 0] = True
    col_mask = torch.zeros(B, R, 1, 1, S, device=DEV).masked_fill(~keep.transpose(1, 2)[:, :, None, None], NEG)
    out = wf.evoformer_attention(*(t.transpose(1, 2) for t in (q, k, v)), [col_mask], gate=g.transpose(1, 2),
                                 backend="triton").transpose(1, 2)
    # directly: scores over the rows s, t of each column r
    scores = torch.einsum("bsrhd,btrhd->brhst", q, k) / math.sqrt(D) + col_mask
    want = torch.einsum("brhst,btrhd->bsrhd", scores.softmax(-1), v) * torch.sigmoid(g)
    assert rel_l2(out, want) <= 1e-5
    assert rel_l2(torch.autograd.grad(out.sum(), q)[0], torch.autograd.grad(want.sum(), q)[0]) <= 1e-4


@pytest.mark.parametrize("starting", [True, False])
def test_triangle_attention_is_the_op_on_the_pair_rows(starting):
    """Triangle attention around the starting node: out[i, j] = Σ_k softmax_k(q_ij · k_ik + b_jk + mask_ik) v_ik,
    the op with the pair rows i as N_seq and the triangle bias b [1, H, R, R]; the ending node on the transpose."""
    B, R, H, D = 1, 17, 2, 8
    q, k, v, g = _qkv(B, R, R, H, D, torch.float32)
    tri = _pair((B, 1, H, R, R), torch.float32)
    mask = _mask(B, R, R, drop=0.1)
    if starting:
        out = wf.evoformer_attention(q, k, v, [mask, tri], gate=g, backend="triton")
        scores = torch.einsum("bijhd,bikhd->bihjk", q, k) / math.sqrt(D) + tri + mask
        want = torch.einsum("bihjk,bikhd->bijhd", scores.softmax(-1), v) * torch.sigmoid(g)
    else:  # around the ending node: out[i, j] = Σ_k softmax_k(q_ij · k_kj + b_ik + mask_kj) v_kj
        t = [x.transpose(1, 2) for x in (q, k, v, g)]
        out = wf.evoformer_attention(*t[:3], [mask, tri], gate=t[3], backend="triton").transpose(1, 2)
        scores = torch.einsum("bijhd,bkjhd->bjhik", q, k) / math.sqrt(D) + tri + mask
        want = torch.einsum("bjhik,bkjhd->bijhd", scores.softmax(-1), v) * torch.sigmoid(g)
    assert rel_l2(out, want) <= 1e-5
    d_out = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, tri), d_out), torch.autograd.grad(want, (q, tri), d_out)):
        assert rel_l2(a, b) <= 1e-4


def test_reference_backend_auto_dispatch_and_empty():
    q, k, v, g = _qkv(1, 2, 9, 2, 8, torch.float32)
    pair = _pair((1, 1, 2, 9, 9), torch.float32)
    want = evoformer_attention_reference(q, k, v, [pair], gate=g)
    assert rel_l2(wf.evoformer_attention(q, k, v, [pair], gate=g, backend="reference"), want) <= 1e-6
    if DEV.type == "cpu":  # auto on CPU tensors is the reference
        assert rel_l2(wf.evoformer_attention(q, k, v, [pair], gate=g), want) <= 1e-6
    for shape in ((0, 2, 9, 2, 8), (1, 0, 9, 2, 8), (1, 2, 0, 2, 8)):
        e = torch.randn(shape, device=DEV)
        assert wf.evoformer_attention(e, e, e, [], backend="triton").shape == shape


def _compiled(fn):
    return torch.compile(fn, fullgraph=True, backend="aot_eager" if DEV.type == "cpu" else "inductor")


def test_torch_compile_forward_no_graph_break():
    q, k, v, g = (t.detach() for t in _qkv(1, 2, 17, 2, 16, torch.float16))
    pair = _pair((1, 1, 2, 17, 17), torch.float16, grad=False)

    def step(q, k, v, g, pair):
        return wf.evoformer_attention(q, k, v, [pair], gate=g, backend="triton")

    assert rel_l2(_compiled(step)(q, k, v, g, pair), step(q, k, v, g, pair)) <= 1e-3


def test_torch_compile_backward():
    q, k, v, g = _qkv(1, 2, 17, 2, 16, torch.float16)
    pair = _pair((1, 1, 2, 17, 17), torch.float16)

    def step(q, k, v, g, pair):
        return wf.evoformer_attention(q, k, v, [pair], gate=g, backend="triton").float().square().sum()

    loss = _compiled(step)(q, k, v, g, pair)
    loss.backward()
    ref = step(*[t.detach().clone() for t in (q, k, v, g, pair)])
    assert torch.allclose(loss.detach(), ref, rtol=1e-3)
    assert pair.grad is not None and torch.isfinite(pair.grad).all()


def test_torch_compile_backward_matches_eager_with_broadcast_biases():
    """The backward op's fake gives each bias's gradient in the bias's own (broadcast) shape and dtype: a [H, R, R]
    fp32 triangle bias and a [B, 1, 1, R, R] bias beside fp16 q, k, v, with a mask that takes no gradient."""
    B, S, R, H, D = 2, 2, 17, 2, 16
    q, k, v, g = _qkv(B, S, R, H, D, torch.float16)
    tri, headless = _pair((H, R, R), torch.float32), _pair((B, 1, 1, R, R), torch.float16)
    mask = _mask(B, S, R).half()
    inputs = (q, k, v, g, tri, headless)

    def step(q, k, v, g, tri, headless):
        return wf.evoformer_attention(q, k, v, [mask, tri], gate=g, backend="triton") + \
            wf.evoformer_attention(q, k, v, [headless], gate=g, backend="triton")

    d_out = torch.randn(B, S, R, H, D, device=DEV, dtype=torch.float16)
    got = torch.autograd.grad(_compiled(step)(*inputs), inputs, d_out)
    want = torch.autograd.grad(step(*inputs), inputs, d_out)
    for t, a, b in zip(inputs, got, want):
        assert a.shape == t.shape and a.dtype == t.dtype
        assert rel_l2(a, b) <= 1e-3


def test_triton_backward_is_first_order_only():
    q, k, v, g = _qkv(1, 2, 9, 1, 8, torch.float32)
    pair = _pair((1, 1, 1, 9, 9), torch.float32)
    out = wf.evoformer_attention(q, k, v, [pair], gate=g, backend="triton")
    dq, dpair = torch.autograd.grad(out.square().sum(), (q, pair), create_graph=True)
    assert dpair.shape == pair.shape
    with pytest.raises(RuntimeError, match="first-order only"):
        (dq.square().sum() + dpair.sum()).backward()


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_gate_dtype_must_be_q_dtype_and_output_is_q_dtype(backend):
    """A gate in another dtype would promote the gated output past q's dtype: it is refused at the door, naming
    gate, on both backends; a gate in q's dtype gives q's dtype."""
    q, k, v, _ = _qkv(1, 2, 5, 1, 8, torch.float16, gate=False)
    with pytest.raises(WarpforgeInputError, match="^gate"):
        wf.evoformer_attention(q, k, v, [], gate=torch.randn(1, 2, 5, 1, 8, device=DEV), backend=backend)
    out = wf.evoformer_attention(q, k, v, [], gate=torch.randn(1, 2, 5, 1, 8, device=DEV, dtype=torch.float16),
                                 backend=backend)
    assert out.dtype == torch.float16


# ------------------------------------------------------------------------------------------ bad input
def _bad(**over):
    B, S, R, H, D = 1, 2, 8, 2, 16
    args = dict(q=torch.randn(B, S, R, H, D, device=DEV, dtype=torch.float16),
                k=torch.randn(B, S, R, H, D, device=DEV, dtype=torch.float16),
                v=torch.randn(B, S, R, H, D, device=DEV, dtype=torch.float16), biases=[], gate=None)
    args.update(over)
    return args


def _t(*shape, dtype=torch.float16, grad=False):
    return torch.randn(shape, device=DEV, dtype=dtype).requires_grad_(grad)


@pytest.mark.parametrize("over,name", [
    (dict(biases=[_t(1, 2, 2, 8, 7)]), "biases"),                     # keys 7 vs N_res 8
    (dict(biases=[_t(1, 1, 3, 8, 8)]), "biases"),                     # 3 heads vs 2
    (dict(biases=[_t(2, 1, 2, 8, 8)]), "biases"),                     # batch 2 vs 1
    (dict(biases=[_t(1, 1, 1, 2, 8, 8)]), "biases"),                  # 6-d
    (dict(biases=[_t(1, 2, 8, 8), _t(1, 1, 2, 9, 8)]), r"biases\[1\]"),
    (dict(biases=[_t(1, 1, 1, 1, 8)] * 3), "biases"),                 # three biases
    (dict(biases=_t(1, 1, 2, 8, 8)), "biases"),                       # a tensor, not a list
    (dict(biases=[_t(1, 2, 1, 1, 8, grad=True)]), "biases"),          # a per-row bias's gradient
    (dict(biases=[_t(2, 2, 8, 8, grad=True)]), "biases"),             # [S, H, R, R]: per row too
    (dict(biases=[_t(1, 1, 2, 8, 8, dtype=torch.float64)]), "biases"),
    (dict(biases=[None]), "biases"),
    (dict(q=_t(1, 2, 8, 2, 72), k=_t(1, 2, 8, 2, 72), v=_t(1, 2, 8, 2, 72)), "q"),  # D > 64
    (dict(k=_t(1, 2, 9, 2, 16)), "k"),                                # N_res mismatch
    (dict(v=_t(1, 2, 8, 2, 8)), "v"),                                 # head dim mismatch
    (dict(k=_t(1, 2, 8, 2, 16, dtype=torch.float32)), "k"),           # dtype mismatch
    (dict(q=_t(1, 2, 8, 2, 16, dtype=torch.float64), k=_t(1, 2, 8, 2, 16, dtype=torch.float64),
          v=_t(1, 2, 8, 2, 16, dtype=torch.float64)), "q"),
    (dict(q=_t(2, 8, 2, 16), k=_t(2, 8, 2, 16), v=_t(2, 8, 2, 16)), "q"),   # rank 4
    (dict(q=_t(1, 2, 8, 16, 2).transpose(-1, -2)), "q"),              # last dim strided
    (dict(gate=_t(1, 2, 8, 2, 8)), "gate"),                            # head dim 8 vs 16
    (dict(gate=_t(1, 2, 8, 2, 16, dtype=torch.float32)), "gate"),     # fp32 beside fp16 q
    (dict(gate=torch.zeros(1, 2, 8, 2, 16, dtype=torch.float16, device="meta")), "gate"),  # another device
    (dict(gate=[0.0]), "gate"),                                       # not a tensor
    (dict(softmax_scale=-1.0), "softmax_scale"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_input_names_the_argument(over, name):
    args = _bad(**over)
    with pytest.raises(WarpforgeInputError, match=rf"^{name}"):
        wf.evoformer_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("biases"),
                               backend=args.pop("backend", "triton"), **args)


def test_per_row_bias_requiring_grad_is_fine_without_grad_mode():
    """A per-row bias [B, S, H, R, R] that requires a gradient is refused only where one would be computed: under
    torch.no_grad the forward runs and matches the reference."""
    args = _bad(biases=[_t(1, 2, 2, 8, 8, grad=True)])
    with torch.no_grad():
        got = wf.evoformer_attention(args["q"], args["k"], args["v"], args["biases"], backend="triton")
        want = wf.evoformer_attention(args["q"], args["k"], args["v"], args["biases"], backend="reference")
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def test_bf16_refused_on_the_interpreter():
    if DEV.type != "cpu":
        pytest.skip("the interpreter only")
    q = torch.randn(1, 1, 4, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(WarpforgeInputError, match="^q"):
        wf.evoformer_attention(q, q, q, [], backend="triton")
    assert wf.evoformer_attention(q, q, q, [], backend="reference").dtype == torch.bfloat16


# ------------------------------------------------------------------------------- GPU, real sizes
def _chunked_reference(q, k, v, mask, pair, gate, d_out, rows=256):
    """fp32 reference out, dq, dk, dv, dgate, dpair over chunks of MSA rows (the pair bias's gradient summed over
    them), so that the scores of 5120 rows never exist at once."""
    outs, grads = [], [[], [], [], []]
    p32 = pair.detach().float().requires_grad_()
    dpair = torch.zeros_like(p32)
    for s0 in range(0, q.shape[1], rows):
        part = [t[:, s0:s0 + rows].detach().float().requires_grad_() for t in (q, k, v, gate)]
        out = evoformer_attention_reference(*part[:3], [mask[:, s0:s0 + rows], p32], gate=part[3])
        g = torch.autograd.grad(out, part + [p32], d_out[:, s0:s0 + rows].float())
        outs.append(out.detach())
        for acc, t in zip(grads, g[:4]):
            acc.append(t)
        dpair += g[4]
    return torch.cat(outs, 1), *(torch.cat(t, 1) for t in grads), dpair


GPU_CASES = [  # B, S, R, H, D: the bar's row attention, the extra-MSA stack, triangle attention (pair rows as S)
    (1, 512, 384, 8, 32),
    (1, 5120, 384, 8, 8),
    (1, 384, 384, 4, 32),
    (2, 64, 257, 8, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "b{}_s{}_r{}_h{}_d{}".format(*c))
def test_gpu_bf16_real_sizes(case):
    B, S, R, H, D = case
    q, k, v, g = _qkv(B, S, R, H, D, torch.bfloat16)
    mask = torch.zeros(B, S, 1, 1, R, device=DEV)
    mask[..., R - R // 10:] = -1e9  # padded residues, as OpenFold's inf · (mask - 1)
    pair = _pair((B, 1, H, R, R), torch.bfloat16)
    d_out = torch.randn_like(q)
    out = wf.evoformer_attention(q, k, v, [mask, pair], gate=g, backend="triton")
    got = (out, *torch.autograd.grad(out, (q, k, v, g, pair), d_out))
    want = _chunked_reference(q, k, v, mask, pair, g, d_out)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dgate", "dpair"), got, want):
        assert cosine(a, b) >= 0.9998, name
        assert rel_l2(a, b) <= (1e-2 if name == "out" else 2e-2), f"{name}: rel L2 {rel_l2(a, b)}"


@pytest.mark.gpu
@pytest.mark.parametrize("pair_std", [1.0, 100.0])
def test_gpu_fully_masked_rows_under_a_finite_mask_and_large_pair_biases(pair_std):
    """Whole MSA rows padded (OpenFold's -1e9 mask bias) beside pair biases large enough (|pair| · log2 e past 64,
    half fp32's spacing at 1e9 · log2 e) that the forward's and the backward's score arithmetic round a padded
    row's scores apart: the gradients must stay finite, and match the fp32 reference on the live rows. Without the
    backward's clamped exponent, std 100 gave non-finite gradients on an H100 (session 36; std 40 did not)."""
    B, S, R, H, D = 1, 64, 256, 4, 32
    q, k, v, g = _qkv(B, S, R, H, D, torch.bfloat16)
    mask = torch.zeros(B, S, 1, 1, R, device=DEV)
    mask[:, S // 2:] = -1e9  # the second half of the MSA rows: every key masked
    pair = (torch.randn(B, 1, H, R, R, device=DEV) * pair_std).to(torch.bfloat16).requires_grad_()
    d_out = torch.randn_like(q)
    out = wf.evoformer_attention(q, k, v, [mask, pair], gate=g, backend="triton")
    got = (out, *torch.autograd.grad(out, (q, k, v, g, pair), d_out))
    for name, a in zip(("out", "dq", "dk", "dv", "dgate", "dpair"), got):
        assert torch.isfinite(a).all(), name
    live = slice(0, S // 2)
    want = _chunked_reference(q[:, live], k[:, live], v[:, live], mask[:, live], pair, g[:, live], d_out[:, live])
    for name, a, b in zip(("out", "dq", "dk", "dv", "dgate"), got[:5], want[:5]):
        assert cosine(a[:, live], b) >= 0.9998, name


@pytest.mark.gpu
def test_gpu_pair_bias_gradient_deterministic_over_10_runs():
    B, S, R, H, D = 1, 512, 384, 8, 32
    q, k, v, g = _qkv(B, S, R, H, D, torch.bfloat16)
    pair = _pair((B, 1, H, R, R), torch.bfloat16)
    mask = torch.zeros(B, S, 1, 1, R, device=DEV)
    d_out = torch.randn_like(q)
    first = None
    for _ in range(10):
        out = wf.evoformer_attention(q, k, v, [mask, pair], gate=g, backend="triton")
        grads = torch.autograd.grad(out, (pair, q, k, v), d_out)
        if first is None:
            first = grads
        for a, b in zip(grads, first):
            assert torch.equal(a, b)


def test_gate_without_gradient():
    """A gate that does not require grad: the other gradients as with one that does, and no gate gradient."""
    dtype = torch.float32 if DEV.type == "cpu" else torch.bfloat16
    q, k, v, g = _qkv(1, 2, 20, 2, 16, dtype)
    pair = _pair((1, 1, 2, 20, 20), dtype)
    d_out = torch.randn(1, 2, 20, 2, 16, device=DEV, dtype=dtype)
    out = wf.evoformer_attention(q, k, v, [pair], gate=g, backend="triton")
    want = torch.autograd.grad(out, [q, k, v, pair], d_out)
    out = wf.evoformer_attention(q, k, v, [pair], gate=g.detach(), backend="triton")
    got = torch.autograd.grad(out, [q, k, v, pair], d_out)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("R", [17, 32])
def test_fused_backward_matches_the_two_passes(R, monkeypatch):
    """WARPFORGE_EVO_BWD_FUSED=1 (dk, dv and dq from one walk over the scores, dq summed in an fp32 buffer the
    program owns): the same gradients as the dk/dv and dq passes, and bitwise the same from run to run."""
    from warpforge.ops.evoformer import configs
    dtype = torch.float32 if DEV.type == "cpu" else torch.bfloat16
    q, k, v, g = _qkv(1, 3, R, 2, 16, dtype)
    biases = [_mask(1, 3, R), _pair((1, 1, 2, R, R), dtype)]
    d_out = torch.randn(1, 3, R, 2, 16, device=DEV, dtype=dtype)
    leaves = [q, k, v, biases[1], g]

    def grads(fused):
        monkeypatch.setenv(configs.BWD_FUSED_ENV, "1" if fused else "0")
        out = wf.evoformer_attention(q, k, v, biases, gate=g, backend="triton")
        return torch.autograd.grad(out, leaves, d_out)
    want, got, again = grads(False), grads(True), grads(True)
    for name, a, b, c in zip(["dq", "dk", "dv", "dpair", "dgate"], got, want, again):
        assert rel_l2(a, b) <= (1e-5 if dtype == torch.float32 else 1e-2), name
        assert torch.equal(a, c), name


@pytest.mark.parametrize("names", [("mask", "pair"), ("pair1", "mask"), ("headless", "pair"), ("full", "pair"), ()],
                         ids=lambda n: "+".join(n) or "nobias")
def test_key_rows_dkdv_matches_the_query_rows_step(names):
    """The dk/dv pass with its step transposed (EvoCfg.key_rows: keys as rows, the biases read transposed, the pair
    bias through a transposed copy) gives the gradients of the untransposed step."""
    from warpforge.ops.evoformer import api, configs, evoformer_kernel as ek
    B, S, R, H, D = 2, 2, 37, 2, 16
    dtype = torch.float32 if DEV.type == "cpu" else torch.bfloat16
    q, k, v, g, d_out = (torch.randn(B, S, R, H, D, device=DEV, dtype=dtype) for _ in range(5))
    full = (B, S, H, R, R)
    biases = [api._full(b.detach(), full) for b in _biases(names, B, S, R, H, dtype)]
    tiles = configs.TILES.lookup(DEV, ek._block(D))
    out, lse = ek.evoformer_fwd(q, k, v, biases, g, 0.25, tiles.fwd)

    def grads(key_rows):
        t = tiles._replace(dkdv=tiles.dkdv._replace(key_rows=key_rows))
        return ek.evoformer_bwd(d_out, q, k, v, out, lse, biases, g, 0.25, bool(biases), t)
    for name, a, b in zip(["dq", "dk", "dv", "dgate", "dbias"], grads(True), grads(False)):
        if b is not None:
            assert rel_l2(a, b) <= (1e-5 if dtype == torch.float32 else 1e-2), name
