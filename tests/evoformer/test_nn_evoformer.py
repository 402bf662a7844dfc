"""nn.MSARowAttentionWithPairBias, nn.MSAColumnAttention, nn.TriangleAttention: a state dict with OpenFold's key names
(and shapes) loads, and each module matches OpenFold's math written out below in plain PyTorch (float64), output
and the gradients of the inputs and of every weight, with backend="reference" and backend="triton" (the interpreter
on a CPU); bad input names the argument.
"""
import math

import pytest
import torch
import torch.nn.functional as TF

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.testing import cosine, device_under_test, rel_l2

DEV = device_under_test()
BACKENDS = ["reference", "triton", "torch"]


# ------------------------------------------------------------------------------------------ OpenFold's names
def _attention_keys(c_in, c, heads):
    """OpenFold's primitives.Attention (gating on): q/k/v without bias, o and g with one."""
    w = c * heads
    return {"linear_q.weight": (w, c_in), "linear_k.weight": (w, c_in), "linear_v.weight": (w, c_in),
            "linear_o.weight": (c_in, w), "linear_o.bias": (c_in,), "linear_g.weight": (w, c_in),
            "linear_g.bias": (w,)}


def _prefixed(prefix, keys):
    return {prefix + k: v for k, v in keys.items()}


def _row_keys(c_m, c_z, c, heads):  # openfold/model/msa.py MSAAttention(pair_bias=True)
    return {"layer_norm_m.weight": (c_m,), "layer_norm_m.bias": (c_m,), "layer_norm_z.weight": (c_z,),
            "layer_norm_z.bias": (c_z,), "linear_z.weight": (heads, c_z),
            **_prefixed("mha.", _attention_keys(c_m, c, heads))}


def _column_keys(c_m, c, heads):  # MSAColumnAttention wraps an MSAAttention(pair_bias=False) as _msa_att
    return _prefixed("_msa_att.", {"layer_norm_m.weight": (c_m,), "layer_norm_m.bias": (c_m,),
                                   **_prefixed("mha.", _attention_keys(c_m, c, heads))})


def _triangle_keys(c_z, c, heads):  # openfold/model/triangular_attention.py TriangleAttention
    return {"layer_norm.weight": (c_z,), "layer_norm.bias": (c_z,), "linear.weight": (heads, c_z),
            **_prefixed("mha.", _attention_keys(c_z, c, heads))}


def _random_state(keys, gen):
    """Weights of those names and shapes, scaled so that no term is negligible (LayerNorm weights near 1)."""
    out = {}
    for name, shape in keys.items():
        fan_in = shape[-1] if len(shape) == 2 else 1
        t = torch.randn(shape, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)
        if name.endswith("norm_m.weight") or name.endswith("norm_z.weight") or name.endswith("norm.weight"):
            t = 1.0 + 0.2 * t
        out[name] = t
    return out


# ------------------------------------------------------------------------------------------ OpenFold's math
def _of_layer_norm(x, sd, p):
    return TF.layer_norm(x, (x.shape[-1],), sd[p + "weight"], sd[p + "bias"], 1e-5)


def _of_attention(sd, p, x, biases, heads):
    """OpenFold's Attention(q_x=x, kv_x=x, biases): [*, Q, C] -> [*, Q, C], with gating."""
    def proj(name):  # [*, Q, H * c] -> [*, H, Q, c]
        t = x @ sd[p + name + ".weight"].T
        return t.view(t.shape[:-1] + (heads, -1)).transpose(-2, -3)
    q, k, v = proj("linear_q"), proj("linear_k"), proj("linear_v")
    q = q / math.sqrt(q.shape[-1])
    a = q @ k.transpose(-1, -2)
    for b in biases:
        a = a + b
    o = (torch.softmax(a, dim=-1) @ v).transpose(-2, -3)  # [*, Q, H, c]
    g = torch.sigmoid(x @ sd[p + "linear_g.weight"].T + sd[p + "linear_g.bias"])
    o = o * g.view(g.shape[:-1] + (heads, -1))
    return o.flatten(-2) @ sd[p + "linear_o.weight"].T + sd[p + "linear_o.bias"]


def _of_msa_attention(sd, p, m, z, mask, heads, inf=1e9):
    """OpenFold's MSAAttention: m [*, S, R, C], z [*, R, R, C_z] or None, mask [*, S, R] or None."""
    if mask is None:
        mask = m.new_ones(m.shape[:-1])
    biases = [(inf * (mask - 1))[..., :, None, None, :]]
    if z is not None:
        z = _of_layer_norm(z, sd, p + "layer_norm_z.") @ sd[p + "linear_z.weight"].T  # [*, R, R, H]
        biases.append(z.permute(*range(z.dim() - 3), -1, -3, -2).unsqueeze(-4))      # [*, 1, H, R, R]
    return _of_attention(sd, p + "mha.", _of_layer_norm(m, sd, p + "layer_norm_m."), biases, heads)


def _of_column(sd, m, mask, heads):
    m = m.transpose(-2, -3)
    mask = None if mask is None else mask.transpose(-1, -2)
    return _of_msa_attention(sd, "_msa_att.", m, None, mask, heads).transpose(-2, -3)


def _of_triangle(sd, x, mask, heads, starting, inf=1e9):
    if mask is None:
        mask = x.new_ones(x.shape[:-1])
    if not starting:
        x, mask = x.transpose(-2, -3), mask.transpose(-1, -2)
    x = _of_layer_norm(x, sd, "layer_norm.")
    mask_bias = (inf * (mask - 1))[..., :, None, None, :]
    tri = x @ sd["linear.weight"].T                                  # [*, I, J, H]
    tri = tri.permute(*range(tri.dim() - 3), -1, -3, -2).unsqueeze(-4)  # [*, 1, H, I, J]
    out = _of_attention(sd, "mha.", x, [mask_bias, tri], heads)
    return out if starting else out.transpose(-2, -3)


# ------------------------------------------------------------------------------------------ tests
def _mask(shape, gen):
    """1 keep / 0 drop, at least one residue kept in every row (a fully masked row is OpenFold's near-uniform
    average of -1e9 scores: fp32 and float64 differ there, tested apart)."""
    keep = (torch.rand(shape, generator=gen) > 0.25).double()
    keep[..., 0] = 1.0
    return keep.to(DEV)


def _compare(module, keys, of_fn, inputs, backend, grad_inputs):
    """Load an OpenFold-named state dict, then output and gradients (inputs and weights) vs OpenFold's math."""
    gen = torch.Generator().manual_seed(1)
    sd = _random_state(keys, gen)
    assert set(module.state_dict()) == set(keys)
    module.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    module.to(DEV).backend = backend
    if hasattr(module, "_msa_att"):
        module._msa_att.backend = backend
    ins = [None if t is None else t.float().to(DEV).requires_grad_(i in grad_inputs) for i, t in enumerate(inputs)]
    out = module(*ins)
    sd64 = {k: v.to(DEV).requires_grad_() for k, v in sd.items()}
    ref_ins = [None if t is None else t.to(DEV).requires_grad_(i in grad_inputs) for i, t in enumerate(inputs)]
    want = of_fn(sd64, *ref_ins)
    assert out.shape == want.shape and out.dtype == torch.float32
    assert rel_l2(out, want) <= 1e-5, f"out: rel L2 {rel_l2(out, want)}"
    d_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(DEV)
    params = dict(module.named_parameters())
    names = [f"input {i}" for i in grad_inputs] + list(params)
    got = torch.autograd.grad(out, [ins[i] for i in grad_inputs] + list(params.values()), d_out.float())
    exp = torch.autograd.grad(want, [ref_ins[i] for i in grad_inputs] + [sd64[n] for n in params], d_out)
    for name, a, b in zip(names, got, exp):
        # a per-head constant (linear_z · layer_norm_z.bias) shifts every score of a row alike: the softmax
        # ignores it and that gradient is 0 up to rounding, so the error is relative to at least 0.1
        err = (a.double() - b).norm().item() / max(b.norm().item(), 0.1)
        assert err <= 1e-4, f"d {name}: rel L2 {err}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lead,S,R", [((2,), 3, 17), ((), 2, 5)])
def test_msa_row_attention_with_pair_bias(backend, lead, S, R):
    c_m, c_z, c, heads = 12, 6, 8, 2
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(*lead, S, R, c_m, generator=gen, dtype=torch.float64)
    z = torch.randn(*lead, R, R, c_z, generator=gen, dtype=torch.float64)
    mask = _mask((*lead, S, R), gen)
    module = wf.nn.MSARowAttentionWithPairBias(c_m, c_z, c, heads)
    _compare(module, _row_keys(c_m, c_z, c, heads), lambda sd, m, z, mask: _of_msa_attention(sd, "", m, z, mask, heads),
             [m, z, mask], backend, grad_inputs=(0, 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_msa_column_attention(backend):
    c_m, c, heads, S, R = 10, 16, 2, 19, 4
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(2, S, R, c_m, generator=gen, dtype=torch.float64)
    mask = _mask((2, R, S), gen).transpose(-1, -2)  # every column keeps a row
    module = wf.nn.MSAColumnAttention(c_m, c, heads)
    _compare(module, _column_keys(c_m, c, heads), lambda sd, m, mask: _of_column(sd, m, mask, heads), [m, mask],
             backend, grad_inputs=(0,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("starting", [True, False])
def test_triangle_attention(backend, starting):
    c_z, c, heads, R = 8, 8, 2, 17
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, R, R, c_z, generator=gen, dtype=torch.float64)
    mask = _mask((1, R, R), gen)
    if not starting:
        mask = mask.transpose(-1, -2)  # around the ending node the columns attend: keep one row of each
    module = wf.nn.TriangleAttention(c_z, c, heads, starting=starting)
    _compare(module, _triangle_keys(c_z, c, heads), lambda sd, x, mask: _of_triangle(sd, x, mask, heads, starting),
             [x, mask], backend, grad_inputs=(0,))


def test_no_mask_and_fully_masked_rows():
    c_m, c_z, c, heads, S, R = 8, 4, 8, 2, 3, 9
    module = wf.nn.MSARowAttentionWithPairBias(c_m, c_z, c, heads, backend="triton").to(DEV)
    for p in module.parameters():  # the initial output projection is zero
        torch.nn.init.normal_(p, std=0.3)
    m = torch.randn(1, S, R, c_m, device=DEV, requires_grad=True)
    z = torch.randn(1, R, R, c_z, device=DEV, requires_grad=True)
    ones = torch.ones(1, S, R, device=DEV)
    out = module(m, z)
    assert rel_l2(out, module(m, z, ones)) <= 1e-6
    mask = ones.clone()
    mask[0, 1] = 0  # MSA row 1 all padding: OpenFold's -1e9 bias gives a finite (near-uniform) average
    out = module(m, z, mask)
    grads = torch.autograd.grad(out.square().sum(), (m, z, *module.parameters()))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_inputs_give_empty_outputs(backend):
    row = wf.nn.MSARowAttentionWithPairBias(8, 4, 8, 2, backend=backend).to(DEV)
    col = wf.nn.MSAColumnAttention(8, 8, 2, backend=backend).to(DEV)
    tri = wf.nn.TriangleAttention(4, 8, 2, starting=False, backend=backend).to(DEV)
    for b, s, r in ((0, 2, 5), (1, 0, 5), (1, 2, 0)):
        m, z = torch.randn(b, s, r, 8, device=DEV), torch.randn(b, r, r, 4, device=DEV)
        assert row(m, z, torch.ones(b, s, r, dtype=torch.bool, device=DEV)).shape == m.shape
        assert col(m).shape == m.shape and tri(z).shape == z.shape


def test_fresh_modules_start_as_openfold_does():
    """AlphaFold's initialisation: the output projection zero (a zero update), the gate's bias 1."""
    row = wf.nn.MSARowAttentionWithPairBias(8, 4, 8, 2)
    assert torch.all(row.mha.linear_o.weight == 0) and torch.all(row.mha.linear_g.bias == 1)
    out = row(torch.randn(1, 2, 5, 8), torch.randn(1, 5, 5, 4))
    assert torch.all(out == 0)
    assert "_msa_att.mha.linear_q.weight" in wf.nn.MSAColumnAttention(8, 8, 2).state_dict()


def test_bad_input_names_the_argument():
    row = wf.nn.MSARowAttentionWithPairBias(8, 4, 8, 2, backend="reference")
    m, z = torch.randn(1, 2, 5, 8), torch.randn(1, 5, 5, 4)
    for args, name in [((torch.randn(1, 2, 5, 7), z), "m"),
                       ((torch.randn(5, 8), z), "m"),
                       ((m, torch.randn(1, 5, 6, 4)), "z"),
                       ((m, torch.randn(1, 5, 5, 3)), "z"),
                       ((m, None), "z"),
                       ((m.double(), z), "m"),
                       ((m, z, torch.ones(1, 2, 4)), "mask")]:
        with pytest.raises(WarpforgeInputError, match=f"^{name}"):
            row(*args)
    col = wf.nn.MSAColumnAttention(8, 8, 2)
    with pytest.raises(WarpforgeInputError, match="^mask"):
        col(m, torch.ones(1, 5, 2))
    tri = wf.nn.TriangleAttention(4, 8, 2)
    with pytest.raises(WarpforgeInputError, match="^x"):
        tri(torch.randn(1, 5, 6, 4))
    for ctor, name in [(lambda: wf.nn.TriangleAttention(4, 72, 2), "c_hidden"),
                       (lambda: wf.nn.MSARowAttentionWithPairBias(0, 4, 8, 2), "c_m"),
                       (lambda: wf.nn.MSARowAttentionWithPairBias(8, None, 8, 2), "c_z"),
                       (lambda: wf.nn.MSAColumnAttention(8, 8, 0), "no_heads"),
                       (lambda: wf.nn.TriangleAttention(4, 8, 2, starting="yes"), "starting"),
                       (lambda: wf.nn.TriangleAttention(4, 8, 2, backend="cuda"), "backend"),
                       # absurd sizes: a TypeError (overflow in nn.LayerNorm) or an allocator error before
                       (lambda: wf.nn.MSAColumnAttention(2**70, 4, 2), "c_m"),
                       (lambda: wf.nn.MSAColumnAttention(8, 4, 2**40), "no_heads"),
                       (lambda: wf.nn.MSARowAttentionWithPairBias(8, 2**40, 8, 2), "c_z"),
                       (lambda: wf.nn.TriangleAttention(2**70, 8, 2), "c_in")]:
        with pytest.raises(WarpforgeInputError, match=f"^{name}"):
            ctor()
    # a meta input asked autocast about meta ("unknown device type for autocast"): refused as another device than
    # the module's; a module on meta runs on it
    with pytest.raises(WarpforgeInputError, match="^m: .*on cpu"):
        row(m.to("meta"), z.to("meta"))
    assert row.to("meta")(m.to("meta"), z.to("meta")).shape == m.shape


@pytest.mark.parametrize("which", ["row", "column", "triangle"])
def test_fp16_fully_masked_row_torch_backend_matches(which):
    """In fp16 the mask bias -1e9 · (1 - mask) was cast to q's dtype by the torch backend, -inf there: a fully
    masked row got zeros where the reference and triton (scores in fp32) average it near-uniformly. The torch
    backend keeps the bias in fp32 and matches."""
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(2, 3, 5, 8, generator=gen).to(DEV, torch.float16)
    z = torch.randn(2, 5, 5, 8, generator=gen).to(DEV, torch.float16)
    outs = {}
    for backend in BACKENDS:
        torch.manual_seed(0)  # the same initial weights for every backend
        if which == "row":
            mod, args = wf.nn.MSARowAttentionWithPairBias(8, 8, 4, 2, backend=backend), (m, z)
            mask = torch.ones(2, 3, 5)
            mask[0, 1] = 0  # MSA row 1 of batch 0: every residue dropped
        elif which == "column":
            mod, args, mask = wf.nn.MSAColumnAttention(8, 4, 2, backend=backend), (m,), torch.ones(2, 3, 5)
            mask[0, :, 0] = 0  # column 0 of batch 0: every row dropped
        else:
            mod, args, mask = wf.nn.TriangleAttention(8, 4, 2, backend=backend), (z,), torch.ones(2, 5, 5)
            mask[1, 2] = 0
        weights = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in mod.parameters():  # the initial output projection is zero
                p.add_(torch.randn(p.shape, generator=weights) * 0.3)
            outs[backend] = mod.to(DEV, torch.float16)(*args, mask.to(DEV)).float()
    assert torch.isfinite(outs["reference"]).all()
    for backend in ("triton", "torch"):
        torch.testing.assert_close(outs[backend], outs["reference"], atol=4e-3, rtol=4e-3)


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("which", ["row", "column", "triangle"])
def test_gpu_bf16_autocast_matches_fp32(which):
    """The modules under bf16 autocast at an Evoformer block's sizes vs themselves in fp32 (the reference)."""
    S, R, c_m, c_z = 64, 256, 256, 128
    if which == "row":
        module, args = wf.nn.MSARowAttentionWithPairBias(c_m, c_z, 32, 8), (torch.randn(1, S, R, c_m),
                                                                           torch.randn(1, R, R, c_z))
    elif which == "column":
        module, args = wf.nn.MSAColumnAttention(c_m, 32, 8), (torch.randn(1, S, R, c_m),)
    else:
        module, args = wf.nn.TriangleAttention(c_z, 32, 4), (torch.randn(1, R, R, c_z),)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    module = module.to(DEV)
    args = [a.to(DEV) for a in args]
    want = module(*args)  # fp32, compiled Triton
    module.backend = "reference"
    if hasattr(module, "_msa_att"):
        module._msa_att.backend = "reference"
    assert rel_l2(module(*args), want) <= 1e-5
    module.backend = "triton"
    if hasattr(module, "_msa_att"):
        module._msa_att.backend = "triton"
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = module(*args)
    assert cosine(got.float(), want) >= 0.999
