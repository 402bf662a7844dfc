"""Fused training ops at GPT-2 small's training shapes (16 x 1024 tokens, d 768, ffn 3072, vocab 50304),
forward + backward, against the same math in PyTorch, eager and torch.compile'd. The elementwise ops are
bound by memory (bytes = the tensors each pass must read and write); linear + cross-entropy by its matmuls.

Every path is replayed from CUDA graphs, so the rows compare kernels (inside a compiled, graphed training step
that is what counts); "warpforge (eager)" adds the host cost of calling our ops one by one."""
from __future__ import annotations

import torch

from ..ops.linear_ce import linear_cross_entropy, linear_cross_entropy_reference
from ..ops.norm import add_rms_norm, add_rms_norm_reference, layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from ..ops.rope import apply_rope, rope_reference, rope_tables
from ..ops.swiglu import swiglu, swiglu_reference
from ..testing import rel_l2
from . import baselines
from .cases import Rotation, Setup, graphed, register

TOKENS, D, FFN, VOCAB, HEADS = 16 * 1024, 768, 3072, 50304, 12


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def eager_call(step, rot, device):
    """One eager call (no compile, no graph) timed from an idle GPU: the sync first means the timer, which starts
    when the GPU reaches it after the bench's cache flush, cannot start while the host is already part-way into the
    call (do_bench's flush takes the GPU ~0.1 ms, during which the host would run ahead unseen). So the time is the
    host's cost of the call, or the kernels' when they take longer: what a user calling the op eagerly waits."""
    def call():
        torch.cuda.synchronize(device)
        return step(rot())
    return call


def fwd_bwd_setup(device, tiny, *, make, ours, plain, reference, flops=0.0, nbytes=0.0, input_bytes=None):
    """make(tiny, device, dtype) -> list of inputs (grad-requiring where they should); ours/plain/reference
    take those inputs and return a tensor or a tuple of them. input_bytes sizes the L2 rotation (default:
    nbytes)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16

    def make_set():
        inputs = make(tiny, device, dtype)
        outs = _outputs(plain(*[t.detach() for t in inputs]))
        grads = tuple(torch.randn(o.shape, device=device, dtype=o.dtype) for o in outs if o.dim())
        return inputs, grads or None  # a scalar loss: no upstream gradient

    rot = Rotation(make_set, input_bytes or nbytes, device)

    def on_set(fn):
        def run(one_set):
            inputs, g = one_set
            out = _outputs(fn(*inputs))
            grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], g)
            return (*out, *grads)
        return run

    impls = {"warpforge": graphed(on_set(ours), rot, device)}
    if device.type == "cuda":
        impls["warpforge (eager)"] = eager_call(on_set(ours), rot, device)
        impls["torch.compile"] = graphed(on_set(torch.compile(plain)), rot, device)
        impls["torch eager"] = graphed(on_set(plain), rot, device)
    cache = {}

    def score(result):
        if "ref" not in cache:
            inputs, g = rot.sets[0]
            ref_in = [t.detach().float().requires_grad_(t.requires_grad) if t.is_floating_point() else t
                      for t in inputs]
            out = _outputs(reference(*ref_in))
            grads = torch.autograd.grad(out, [t for t in ref_in if t.requires_grad],
                                        None if g is None else tuple(t.float() for t in g))
            cache["ref"] = (*out, *grads)
        return max(rel_l2(a, b) for a, b in zip(result, cache["ref"]))

    ran = " ".join("x".join(map(str, t.shape)) for t in rot.sets[0][0] if t.is_floating_point() and t.dim() > 1)
    return Setup(flops=flops, bytes=nbytes, impls=impls, score=score, reset=rot.reset,
                 ran=f"{ran} {str(dtype).replace('torch.', '')}")


def _rows(tiny, d=D):
    return (64, 96) if tiny else (TOKENS, d)


def _register_norms(d: int, quick: bool):
    """rms_norm, add_rms_norm and layer_norm fwd+bwd at 16k rows of d (issue 20's bar: 768 and 4096)."""
    n = TOKENS
    register("fused", f"rms_norm fwd+bwd 16k x {d}", quick=quick)(lambda dev, tiny: fwd_bwd_setup(
        dev, tiny,
        make=lambda t, dv, dt: [torch.randn(_rows(t, d), device=dv, dtype=dt, requires_grad=True),
                                torch.ones(_rows(t, d)[1], device=dv, dtype=dt, requires_grad=True)],
        ours=lambda x, w: rms_norm(x, w, backend="triton"),
        plain=lambda x, w: baselines.rms_norm(x, w, 1e-6, x.dtype),
        reference=rms_norm_reference, nbytes=2.0 * n * d * 5))  # fwd: x, y; bwd: x, dy, dx
    register("fused", f"add_rms_norm fwd+bwd 16k x {d} (fp32 stream + bf16 branch)")(
        lambda dev, tiny: fwd_bwd_setup(
            dev, tiny,
            make=lambda t, dv, dt: [torch.randn(_rows(t, d), device=dv, dtype=torch.float32, requires_grad=True),
                                    torch.randn(_rows(t, d), device=dv, dtype=dt, requires_grad=True),
                                    torch.ones(_rows(t, d)[1], device=dv, dtype=torch.float32, requires_grad=True)],
            ours=lambda x, r, w: add_rms_norm(x, r, w, backend="triton", out_dtype=r.dtype),
            plain=lambda x, r, w: baselines.add_rms_norm(x, r, w, 1e-6, r.dtype),
            reference=add_rms_norm_reference,
            # fwd: x, r, sum, y; bwd: sum, dy, d_sum, dx (fp32 stream, bf16 branch)
            nbytes=2.0 * n * d * 13))
    register("fused", f"layer_norm fwd+bwd 16k x {d}")(lambda dev, tiny: fwd_bwd_setup(
        dev, tiny,
        make=lambda t, dv, dt: [torch.randn(_rows(t, d), device=dv, dtype=dt, requires_grad=True),
                                torch.ones(_rows(t, d)[1], device=dv, dtype=dt, requires_grad=True),
                                torch.zeros(_rows(t, d)[1], device=dv, dtype=dt, requires_grad=True)],
        ours=lambda x, w, b: layer_norm(x, w, b, backend="triton"),
        plain=baselines.layer_norm,
        reference=layer_norm_reference, nbytes=2.0 * n * d * 5))


def _register():
    n, d = TOKENS, D
    _register_norms(D, quick=True)
    register("fused", "swiglu fwd+bwd 16k x 2x3072", quick=True)(lambda dev, tiny: fwd_bwd_setup(
        dev, tiny,
        make=lambda t, dv, dt: [torch.randn((64, 2 * 96) if t else (TOKENS, 2 * FFN), device=dv, dtype=dt,
                                            requires_grad=True)],
        ours=lambda gu: swiglu(gu, backend="triton"),
        plain=baselines.swiglu,
        reference=swiglu_reference, nbytes=2.0 * n * FFN * 7))  # fwd: gu, out; bwd: gu, dout, dgu
    register("fused", "rope fwd+bwd b16 s1024 h12 d64")(lambda dev, tiny: fwd_bwd_setup(
        dev, tiny,
        make=lambda t, dv, dt: [torch.randn((1, 16, 2, 32) if t else (16, 1024, HEADS, 64), device=dv, dtype=dt,
                                            requires_grad=True)],
        ours=lambda x: apply_rope(x, *_angles(x), backend="triton"),
        plain=lambda x: baselines.rope(x, *_angles(x)),
        reference=lambda x: rope_reference(x, *_angles(x)), nbytes=2.0 * n * d * 4))
    register("fused", "linear+cross-entropy fwd+bwd 16k x 768 -> 50304", quick=True)(
        lambda dev, tiny: fwd_bwd_setup(
            dev, tiny,
            make=lambda t, dv, dt: [torch.randn((64, 32) if t else (TOKENS, D), device=dv, dtype=dt,
                                                requires_grad=True),
                                    (0.05 * torch.randn((500, 32) if t else (VOCAB, D), device=dv,
                                                        dtype=dt)).requires_grad_(),
                                    torch.randint(0, 500 if t else VOCAB, (64 if t else TOKENS,), device=dv)],
            ours=lambda h, w, y: linear_cross_entropy(h, w, y, backend="triton"),
            plain=baselines.linear_cross_entropy,
            reference=lambda h, w, y: linear_cross_entropy_reference(h, w, y),
            flops=3 * 2.0 * TOKENS * D * VOCAB, input_bytes=2.0 * (TOKENS + VOCAB) * D))
    _register_norms(4096, quick=False)  # last: the GPT's cases keep their order


def _angles(x):
    return rope_tables(x.shape[1], x.shape[-1], device=x.device)


_register()
