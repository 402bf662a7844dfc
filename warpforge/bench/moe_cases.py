"""MoE forward at the issue's model shapes (Mixtral-8x7B, DeepSeek-V3, Qwen3-30B-A3B) and token counts,
uniform and Zipf(1.2)-skewed routing. Bytes are the weights of the experts actually touched (what decode
must read); FLOPs are 2 · T · k · 3 · H · I. Baselines: the `torch._grouped_mm` path (sort rows by expert,
two grouped GEMMs, scatter-add back) and a per-expert loop, both eager (the loop reads expert lists on the
host; the `_grouped_mm` path gave wrong outputs when graph-captured). Every path includes routing. Up to T 512
ours is timed both as a replayed CUDA graph (how serving runs decode; align is graph-safe) and eagerly."""
from __future__ import annotations

import torch

from ..ops.moe import experts_reference, fused_moe, quantize_weights, route_reference
from ..testing import rel_l2
from . import baselines
from .cases import Rotation, Setup, graphed, register

MODELS = {  # E, topk, H, I, router extras
    "mixtral": (8, 2, 4096, 14336, {}),
    "deepseek-v3": (256, 8, 7168, 2048, dict(scoring="sigmoid", num_expert_group=8, topk_group=4,
                                             routed_scaling_factor=2.5)),
    "qwen3-30b-a3b": (128, 8, 2048, 768, {}),
}


def _logits(t, e, skew, device, gen):
    if not skew:
        return torch.randn(t, e, generator=gen).to(device)
    # Zipf(1.2) popularity: expert r gets a prior ∝ r^-1.2, added in log space
    prior = torch.arange(1, e + 1, dtype=torch.float32).pow(-1.2).log()
    return (torch.randn(t, e, generator=gen) + 3 * prior).to(device)


_WEIGHTS = {}


def _expert_weights(model, e, h, i, device, dtype):
    """Made on the device (DeepSeek-V3's are 22.5 GB in bf16) and shared by all of a model's cases."""
    key = (model, e, h, i, str(device), dtype)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        torch.manual_seed(0)
        w13 = torch.randn(e, 2 * i, h, device=device, dtype=dtype).mul_(h ** -0.5)
        w2 = torch.randn(e, h, i, device=device, dtype=dtype).mul_(i ** -0.5)
        _WEIGHTS[key] = (w13, w2)
    return _WEIGHTS[key]


def moe_setup(device, tiny, *, model, t, skew, fp8=False):
    e, k, h, i, route_kw = MODELS[model]
    if tiny:
        e, k, h, i, t = 8, 2, 64, 96, min(t, 9)
        route_kw = {}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(t)
    w13, w2 = _expert_weights(model, e, h, i, device, dtype)
    logits = _logits(t, e, skew, device, gen)
    weights, ids = route_reference(logits, k, **route_kw)
    touched = torch.unique(ids).numel()
    nbytes = touched * 3 * h * i * (1 if fp8 else 2) + 2 * t * h * 2
    fp8_kw = {}
    if fp8:
        (q13, s13), (q2, s2) = quantize_weights(w13), quantize_weights(w2)
        fp8_kw = dict(w_format="fp8", w_scales=(s13, s2))
    flops = 2.0 * t * k * 3 * h * i
    rot = Rotation(lambda: torch.randn(t, h, device=device, dtype=dtype), 2 * t * h, device)
    # The same weights serve every set (they are what is being read); only activations rotate. Every path
    # routes; up to T 512 (decode, small prefill) the capturable paths replay CUDA graphs, as serving does.
    def ours(x):
        return fused_moe(x, q13 if fp8 else w13, q2 if fp8 else w2, logits, k, backend="triton", **fp8_kw,
                         **route_kw)

    def grouped(x):
        return baselines.grouped_mm_experts(x, w13, w2, *route_reference(logits, k, **route_kw))

    impls = {"warpforge": graphed(ours, rot, device) if t <= 512 else (lambda: ours(rot()))}
    if device.type == "cuda":
        if t <= 512:
            impls["warpforge (eager)"] = lambda: ours(rot())
        if hasattr(torch, "_grouped_mm"):
            # eager: captured in a graph this path returned wrong outputs on the H200 (rel L2 ~1, torch 2.11)
            impls["torch._grouped_mm"] = lambda: grouped(rot())
        impls["per-expert loop"] = lambda: baselines.per_expert_loop(rot(), w13, w2, weights, ids)
    cache = {}

    def score(out):
        if "ref" not in cache:
            cache["ref"] = experts_reference(rot.sets[0].float(), w13.float(), w2.float(), weights, ids)
        return rel_l2(out, cache["ref"])

    # FP8: against the bf16 weights, so the error includes e4m3's own rounding of them (~5e-2 at the output; the
    # kernel against its dequantised weights is checked tightly by the tests)
    return Setup(flops=flops, bytes=nbytes, impls=impls, score=score, reset=rot.reset, tokens=t,
                 tol=6e-2 if fp8 else 1e-2,
                 ran=f"E{e} top{k} H{h} I{i} T{t}{' fp8' if fp8 else ''}")


def moe_train_setup(device, tiny, *, model, t):
    """Forward + backward (gradients for hidden, w13, w2 and the router logits) of one MoE layer."""
    e, k, h, i, route_kw = MODELS[model]
    if tiny:
        e, k, h, i, t = 8, 2, 64, 96, 9
        route_kw = {}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    # views of the shared weights (autograd.grad leaves them untouched): DeepSeek-V3's are 22.5 GB
    w13, w2 = (w.detach().requires_grad_() for w in _expert_weights(model, e, h, i, device, dtype))
    gen = torch.Generator().manual_seed(t)
    logits = _logits(t, e, False, device, gen).requires_grad_()
    flops = 3 * 2.0 * t * k * 3 * h * i  # forward + two backward matmuls per forward matmul
    rot = Rotation(lambda: torch.randn(t, h, device=device, dtype=dtype, requires_grad=True), 2 * t * h, device)
    grad = torch.randn(t, h, device=device, dtype=dtype)

    def step(path):
        def run():
            x = rot()
            out = path(x)
            return torch.autograd.grad(out, (x, w13, w2, logits), grad)
        return run

    def ours(x):
        return fused_moe(x, w13, w2, logits, k, backend="triton", **route_kw)

    def grouped(x):
        weights, ids = route_reference(logits, k, **route_kw)
        return baselines.grouped_mm_experts(x, w13, w2, weights, ids)

    impls = {"warpforge": step(ours)}
    if device.type == "cuda" and hasattr(torch, "_grouped_mm"):
        impls["torch._grouped_mm"] = step(grouped)

    def score(grads):
        return streamed_grads_error(grads, rot.sets[0], w13, w2, logits, k, route_kw, grad)

    return Setup(flops=flops, bytes=0, impls=impls, score=score, reset=rot.reset, tokens=t,
                 ran=f"E{e} top{k} H{h} I{i} T{t} fwd+bwd")


def streamed_grads_error(grads, hidden, w13, w2, logits, k, route_kw, grad) -> float:
    """The largest relative L2 error of (d hidden, d w13, d w2, d logits) against the fp32 reference, computed one
    expert at a time: the whole-layer fp32 reference of DeepSeek-V3 (its weights and their gradients in fp32,
    90 GB) does not fit beside the bf16 run. The same numbers as rel_l2 over whole tensors."""
    x = hidden.detach().float()
    g = grad.float()
    lg = logits.detach().float().requires_grad_()
    weights, ids = route_reference(lg, k, **route_kw)
    inter = w2.shape[2]
    dx = torch.zeros_like(x)
    dweights = torch.zeros_like(weights)
    # [error², reference²] summed over experts on the device: read back once, not once per expert
    sq = {name: torch.zeros(2, dtype=torch.float64, device=x.device) for name in ("w13", "w2")}
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13e, w2e = w13[e].detach().float().requires_grad_(), w2[e].detach().float().requires_grad_()
        if tok.numel():
            xe = x[tok].requires_grad_()
            gate_up = xe @ w13e.T
            ye = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2e.T
            ge = g[tok]
            dweights[tok, slot] = (ge * ye).sum(-1).detach()
            gx, ref13, ref2 = torch.autograd.grad(ye, (xe, w13e, w2e), ge * weights[tok, slot, None].detach())
            dx.index_add_(0, tok, gx)
        else:  # no token: the reference gradients are zero
            ref13, ref2 = torch.zeros_like(w13e), torch.zeros_like(w2e)
        for name, ref, got in (("w13", ref13, grads[1][e]), ("w2", ref2, grads[2][e])):
            sq[name] += torch.stack(((got.double() - ref.double()).square().sum(), ref.double().square().sum()))
    dlogits, = torch.autograd.grad(weights, lg, dweights)

    def streamed(err2, ref2):
        return err2 ** 0.5 / ref2 ** 0.5 if ref2 > 0 else err2 ** 0.5
    if not all(torch.isfinite(t).all() for t in grads[1:3]):
        return float("inf")
    return max(rel_l2(grads[0], dx), streamed(*sq["w13"].tolist()), streamed(*sq["w2"].tolist()),
               rel_l2(grads[3], dlogits))


def _register_fp8():
    for model in ("mixtral", "deepseek-v3"):
        for t in (1, 16, 128):
            register("moe", f"{model} T{t} uniform fp8", quick=model == "mixtral" and t == 16)(
                lambda dev, tiny, model=model, t=t: moe_setup(dev, tiny, model=model, t=t, skew=False, fp8=True))


def _register():
    for model in ("mixtral", "qwen3-30b-a3b", "deepseek-v3"):
        register("moe", f"{model} T8192 fwd+bwd", quick=model == "mixtral")(
            lambda dev, tiny, model=model: moe_train_setup(dev, tiny, model=model, t=8192))
    for model in MODELS:
        for t in (1, 4, 16, 64, 128, 512, 2048, 8192):
            for skew in (False, True):
                quick = model == "mixtral" and t == 16 and not skew
                register("moe", f"{model} T{t} {'zipf' if skew else 'uniform'}", quick=quick)(
                    lambda dev, tiny, model=model, t=t, skew=skew: moe_setup(dev, tiny, model=model, t=t, skew=skew))


_register()
_register_fp8()
