"""Fused Mixture-of-Experts: `fused_moe` (vLLM/SGLang's call) and its public pieces `route`, `experts`.

validate -> route -> align (graph safe) -> two Triton grouped GEMMs, as ops with autograd. Inference routes and
aligns in one Triton launch each where configs.ROUTING says so (torch ops on the device otherwise). The
backward (gradients for hidden, w13, w2 and, through the routing, router_logits) runs the same gather/scatter
GEMMs plus a per-expert weight-gradient kernel.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ...errors import (check_bool, check_choice, check_dtype, check_int, check_positive_float, check_rank,
                       check_same_device, check_same_dtype, check_tensor, check_tensors, fail, host_reads_allowed,
                       read_once)
from ...runtime import check_interpreted_matmul_dtype, resolve_backend
from .._op import kernel_op
from . import configs
from .align import align_unchecked, capacity, checked_ids
from .reference import dequantize_weights_reference, experts_reference, quantize_weights_reference, route_reference



def quantize_weights(w: torch.Tensor):
    """Expert weights [E, rows, cols] -> (FP8 e4m3 weights, fp32 scales [E, ceil(rows/128), ceil(cols/128)]), for
    fused_moe(..., w_format="fp8", w_scales=(scales13, scales2)). w: fp16 / bf16 / fp32, finite (a NaN or inf
    would poison its whole block's scale; checked on the host except under CUDA-graph capture or torch.compile)."""
    check_tensor("w", w)
    check_rank("w", w, 3)
    check_dtype("w", w, (torch.float16, torch.bfloat16, torch.float32))
    if _host_readable(w) and w.numel() and not bool(torch.isfinite(w).all()):
        fail("w", "finite weights (a NaN or inf poisons its 128 x 128 block's scale)", "NaN or inf")
    return quantize_weights_reference(w)


def _host_readable(t: torch.Tensor) -> bool:
    """Whether a check may read t's values (errors.host_reads_allowed; a meta tensor has none)."""
    return t.device.type != "meta" and host_reads_allowed(t)


def _experts_fp8_impl(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, s13: torch.Tensor,
                      s2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Inference with FP8 expert weights (dequantised tile by tile inside the GEMMs); no backward."""
    from .moe_kernel import fused_experts
    cfg = _config(hidden.device, hidden.shape[0], w13)
    cfg = cfg.fp8 or cfg
    sorted_ids, expert_ids, num_post = align_unchecked(ids, w13.shape[0], cfg.block_m, backend="triton")
    return fused_experts(hidden, w13.view(torch.uint8), w2.view(torch.uint8), weights, sorted_ids, expert_ids,
                         num_post, ids.shape[1], cfg, scales=(s13, s2))[0]


def _experts_fp8_fake(hidden, w13, w2, s13, s2, weights, ids):
    return torch.empty_like(hidden)


_experts_fp8 = kernel_op("moe_experts_fp8", _experts_fp8_impl, _experts_fp8_fake)


def _decode_tile(device: torch.device, tokens: int, w13: torch.Tensor,
                 fp8: bool = False) -> Optional[configs.DecodeTile]:
    """The one-launch decode kernel's tile where inference takes it (configs.DECODE; FP8 weights only where the tile
    says fp8), else None. WARPFORGE_MOE_DECODE=1 takes it at every T <= 16 (the table's tile, or DECODE_TRY), =0
    never."""
    switch = os.environ.get("WARPFORGE_MOE_DECODE", "")
    if switch == "0" or tokens == 0:
        return None
    tile = configs.DECODE.lookup(device, tuple(w13.shape), tokens)
    if switch == "1":
        return tile if tile is not None or tokens > 16 else configs.DECODE_TRY
    return tile if tile is not None and (tile.fp8 or not fp8) else None


def _experts_decode_impl(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                         ids: torch.Tensor, s13: Optional[torch.Tensor], s2: Optional[torch.Tensor]) -> torch.Tensor:
    """Inference at decode sizes in one launch after the router (decode_kernel.py); FP8 when s13 / s2 are given."""
    from .decode_kernel import fused_experts_decode
    fp8 = s13 is not None
    if fp8:
        w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
    return fused_experts_decode(hidden, w13, w2, weights.float().contiguous(), ids.contiguous(),
                                _decode_tile(hidden.device, hidden.shape[0], w13, fp8),
                                scales=(s13, s2) if fp8 else None)


def _experts_decode_fake(hidden, w13, w2, weights, ids, s13, s2):
    return torch.empty_like(hidden)


_experts_decode = kernel_op("moe_experts_decode", _experts_decode_impl, _experts_decode_fake)


def _experts_fwd_impl(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor,
                      train: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor]:
    """(out, act, pre, sorted_ids, expert_ids, num_post); act/pre are what the backward needs (pre is empty
    when not training)."""
    from .moe_kernel import fused_experts
    scfg = _sorted_config(hidden.device, hidden.shape[0], w13, train)
    if scfg is not None:
        from .sorted_kernel import fused_experts_sorted
        sorted_ids, expert_ids, num_post = align_unchecked(ids, w13.shape[0], scfg.block_m, backend="triton")
        out, act, pre = fused_experts_sorted(hidden, w13, w2, weights, sorted_ids, expert_ids, num_post,
                                             ids.shape[1], scfg, save_pre=train)
    else:
        cfg = _config(hidden.device, hidden.shape[0], w13)
        sorted_ids, expert_ids, num_post = align_unchecked(ids, w13.shape[0], cfg.block_m, backend="triton")
        out, act, pre = fused_experts(hidden, w13, w2, weights, sorted_ids, expert_ids, num_post, ids.shape[1], cfg,
                                      save_pre=train)
    if pre is None:
        pre = hidden.new_empty(0, w13.shape[1])
    return out, act, pre, sorted_ids, expert_ids, num_post


def _experts_fwd_fake(hidden, w13, w2, weights, ids, train):
    t, k = ids.shape
    n = t * k
    e, two_i, _ = w13.shape
    scfg = _sorted_config(hidden.device, t, w13, train)
    bm = (scfg or _config(hidden.device, t, w13)).block_m
    cap = capacity(n, e, bm)
    rows = cap if scfg is not None else n  # the sorted path keeps act and pre in align's sorted order
    return (torch.empty_like(hidden), hidden.new_empty(rows, two_i // 2), hidden.new_empty(rows if train else 0, two_i),
            ids.new_empty(cap), ids.new_empty(cap // bm), ids.new_empty(1))


def _experts_bwd_impl(d_out: torch.Tensor, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      weights: torch.Tensor, act: torch.Tensor, pre: torch.Tensor, sorted_ids: torch.Tensor,
                      expert_ids: torch.Tensor, num_post: torch.Tensor,
                      topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .moe_kernel import fused_experts_backward
    scfg = _sorted_config(hidden.device, hidden.shape[0], w13, True)  # a backward: its forward trained
    if scfg is not None:
        from .sorted_kernel import fused_experts_sorted_backward
        return fused_experts_sorted_backward(d_out, hidden, w13, w2, weights, act, pre, sorted_ids, expert_ids,
                                             num_post, topk, scfg)
    cfg = _config(hidden.device, hidden.shape[0], w13)
    return fused_experts_backward(d_out, hidden, w13, w2, weights, act, pre, sorted_ids, expert_ids, num_post,
                                  topk, cfg)


def _experts_bwd_fake(d_out, hidden, w13, w2, weights, act, pre, sorted_ids, expert_ids, num_post, topk):
    return torch.empty_like(hidden), torch.empty_like(w13), torch.empty_like(w2), weights.new_empty(weights.shape)


_experts_bwd = kernel_op("moe_experts_bwd", _experts_bwd_impl, _experts_bwd_fake)


def _experts_setup(ctx, inputs, output):
    hidden, w13, w2, weights, ids, train = inputs
    out, act, pre, sorted_ids, expert_ids, num_post = output
    ctx.save_for_backward(hidden, w13, w2, weights, act, pre, sorted_ids, expert_ids, num_post)
    ctx.topk = ids.shape[1]
    ctx.mark_non_differentiable(act, pre, sorted_ids, expert_ids, num_post)


def _experts_backward(ctx, d_out, *_):
    hidden, w13, w2, weights, act, pre, sorted_ids, expert_ids, num_post = ctx.saved_tensors
    if pre.shape[0] != act.shape[0]:
        raise RuntimeError("fused_moe ran without saving activations (train=False): cannot backprop")
    d_hidden, d_w13, d_w2, d_weights = _experts_bwd(d_out, hidden, w13, w2, weights, act, pre, sorted_ids,
                                                    expert_ids, num_post, ctx.topk)
    return d_hidden, d_w13, d_w2, d_weights.to(weights.dtype), None, None


_experts_fwd = kernel_op("moe_experts_fwd", _experts_fwd_impl, _experts_fwd_fake, setup_context=_experts_setup,
                         backward=_experts_backward)


# Tiles from outside the table: None, or a function (device, tokens, w13) -> MoECfg or None asked first (compat.vllm
# sets one that reads the tuned files in WARPFORGE_MOE_CONFIG_DIR). Forward, fake and backward all look up here, so
# they agree on block_m, which sizes the schedule.
config_source = None


def _config(device: torch.device, tokens: int, w13: torch.Tensor) -> configs.MoECfg:
    """The tiles for this model shape and token count (fp32 activations: the fp32 tiles)."""
    if config_source is not None:
        cfg = config_source(device, tokens, w13)
        if cfg is not None:
            return cfg
    return configs.GEMMS.lookup(device, "fp32" if w13.dtype == torch.float32 else tuple(w13.shape), tokens)


def _sorted_config(device: torch.device, tokens: int, w13: torch.Tensor,
                   train: bool) -> Optional[configs.SortedCfg]:
    """The training-size path's tiles (sorted_kernel.py) where it runs, else None. configs.SORTED's entry for
    this arch, shape and token count decides (None below its token threshold), `on` whether it is the default
    for training (a forward that saves for the backward: without one, the gathered path was faster on the H200,
    session 14); WARPFORGE_MOE_SORTED=1 runs it wherever an entry exists, =0 never. A function of shapes, train
    and the environment only: forward, fake and backward must agree (the path sets act's and pre's row count and
    align's block_m). Rows must be 16-byte multiples for the tensor descriptors."""
    switch = os.environ.get("WARPFORGE_MOE_SORTED", "")
    if switch == "0" or w13.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    from .sorted_kernel import dims_fit
    scfg = configs.SORTED.lookup(device, "fp32" if w13.dtype == torch.float32 else tuple(w13.shape), tokens)
    if scfg is None or not ((scfg.on and train) or switch == "1"):
        return None
    if not dims_fit(w13.shape[2], w13.shape[1] // 2, w13.dtype):
        return None
    return scfg


def route(router_logits, topk, *, renormalize=True, scoring="softmax", num_expert_group=None, topk_group=None,
          routed_scaling_factor=1.0, backend=None):
    """router_logits [T, E] -> (topk_weights fp32 [T, k], topk_ids int32 [T, k]); see reference.py. The
    weights are differentiable in router_logits; without autograd the Triton backend routes in one launch
    (where configs.ROUTING says so).

    Both backends choose alike (reference.py): equal scores go to the lower expert id, a NaN score ranks below
    every number, so a row's ids are k distinct experts in [0, E) whatever the logits; a softmax row with a NaN
    or +inf logit (or every logit -inf) gets experts 0..k-1 with NaN weights. routed_scaling_factor is at most
    fp32's largest finite value (the weights are fp32, at most 1 before the scaling)."""
    check_routing(router_logits, topk, scoring, num_expert_group, topk_group, renormalize, routed_scaling_factor)
    return _route(router_logits, topk, resolve_backend(backend, router_logits.device), renormalize=renormalize,
                  scoring=scoring, num_expert_group=num_expert_group, topk_group=topk_group,
                  routed_scaling_factor=routed_scaling_factor)


def _route_impl(router_logits: torch.Tensor, topk: int, renormalize: bool, scoring: str, num_expert_group: int,
                topk_group: int, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference routing in one launch (no autograd: training routes through the torch version)."""
    from .route_kernel import route_triton
    return route_triton(router_logits, topk, renormalize, scoring, num_expert_group, topk_group,
                        routed_scaling_factor)


def _route_fake(router_logits, topk, renormalize, scoring, num_expert_group, topk_group, routed_scaling_factor):
    t = router_logits.shape[0]
    return (router_logits.new_empty((t, topk), dtype=torch.float32),
            router_logits.new_empty((t, topk), dtype=torch.int32))


_route_one_launch = kernel_op("moe_route", _route_impl, _route_fake)


def _route(router_logits, topk, backend, **kw):
    from .route_kernel import fits
    needs_grad = torch.is_grad_enabled() and router_logits.requires_grad
    if backend == "triton" and not needs_grad and configs.ROUTING.lookup(router_logits.device).one_launch and \
            fits(router_logits.shape[1], kw["num_expert_group"]):
        return _route_one_launch(router_logits, topk, bool(kw["renormalize"]), kw["scoring"],
                                 kw["num_expert_group"] or 0, kw["topk_group"] or 0,
                                 float(kw["routed_scaling_factor"]))
    return route_reference(router_logits, topk, **kw)


def check_routing(router_logits, topk, scoring, num_expert_group, topk_group, renormalize, routed_scaling_factor):
    check_tensor("router_logits", router_logits)
    check_rank("router_logits", router_logits, 2)
    check_dtype("router_logits", router_logits, (torch.float16, torch.bfloat16, torch.float32))
    e = router_logits.shape[1]
    check_int("topk", topk, 1, e, f"an int from 1 to the number of experts ({e})")
    check_choice("scoring", scoring, ("softmax", "sigmoid"))
    check_bool("renormalize", renormalize)
    check_positive_float("routed_scaling_factor", routed_scaling_factor, allow_none=False)
    if (num_expert_group is None) != (topk_group is None):
        fail("topk_group", "given together with num_expert_group (or neither)",
             f"topk_group={topk_group}, num_expert_group={num_expert_group}")
    if num_expert_group is not None:
        check_int("num_expert_group", num_expert_group, 1, e)
        if e % num_expert_group:
            fail("num_expert_group", f"a divisor of the number of experts ({e})", num_expert_group)
        check_int("topk_group", topk_group, 1, num_expert_group)
        if topk > topk_group * (e // num_expert_group):
            fail("topk", f"at most the experts in topk_group groups ({topk_group * (e // num_expert_group)})",
                 topk)


def _check_scales(w_scales, w13, w2, hidden):
    if not isinstance(w_scales, (tuple, list)) or len(w_scales) != 2:
        fail("w_scales", "(scales for w13, scales for w2) from moe.quantize_weights", type(w_scales).__name__)
    for name, sc, w in (("w_scales[0]", w_scales[0], w13), ("w_scales[1]", w_scales[1], w2)):
        check_tensor(name, sc)
        check_dtype(name, sc, (torch.float32,))
        check_same_device(name, sc, "hidden", hidden)
        want = (w.shape[0], -(-w.shape[1] // 128), -(-w.shape[2] // 128))
        if tuple(sc.shape) != want:
            fail(name, f"shape {want} (one scale per 128 x 128 block)", tuple(sc.shape))
    if _host_readable(w_scales[0]):  # model weights: read once for as long as the same tensors come back unchanged
        read_once(tuple(w_scales), ("moe.w_scales",), lambda: _check_scale_values(w_scales))


def _check_scale_values(w_scales):
    for name, sc in (("w_scales[0]", w_scales[0]), ("w_scales[1]", w_scales[1])):
        if sc.numel() and not bool((torch.isfinite(sc) & (sc >= 0)).all()):
            fail(name, "finite scales >= 0", "NaN, inf or a negative scale")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor, topk: int, *,
              renormalize: bool = True, scoring: str = "softmax", num_expert_group: Optional[int] = None,
              topk_group: Optional[int] = None, routed_scaling_factor: float = 1.0, w_format: str = "bf16",
              w_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
              backend: Optional[str] = None) -> torch.Tensor:
    """out [T, H] = Σ_k weight_k · W2_e (SiLU(gate) ⊙ up) with [gate; up] = W13_e · hidden.

    hidden [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; router_logits [T, E].
    The kernels keep SiLU(gate) ⊙ up between the two GEMMs in hidden's dtype (as vLLM does; the reference keeps
    fp32): with fp16 activations a product past 65504 becomes inf where the reference stays finite. bf16 has the
    range. w_format="fp8": w13 / w2 from quantize_weights, w_scales their scales; inference only. Where a tuned
    entry says so (configs.py, `fp8_fp16_math`) the GEMMs run in fp16: hidden and SiLU(gate) ⊙ up must then stay
    within fp16's range (|x| < 65504), as they do after a norm.
    """
    backend = _check_experts(hidden, w13, w2, w_format, w_scales, backend)
    check_routing(router_logits, topk, scoring, num_expert_group, topk_group, renormalize, routed_scaling_factor)
    check_same_device("router_logits", router_logits, "hidden", hidden)
    if tuple(router_logits.shape) != (hidden.shape[0], w13.shape[0]):
        fail("router_logits", f"[{hidden.shape[0]}, {w13.shape[0]}] ([T, E])", tuple(router_logits.shape))
    weights, ids = _route(router_logits, topk, backend, renormalize=renormalize, scoring=scoring,
                          num_expert_group=num_expert_group, topk_group=topk_group,
                          routed_scaling_factor=routed_scaling_factor)
    return _run_experts(hidden, w13, w2, weights, ids, w_format, w_scales, backend)


def experts(hidden, w13, w2, topk_weights, topk_ids, *, w_format="bf16", w_scales=None, check_ids=True,
            backend=None):
    """The expert half of `fused_moe` for a routing already made (e.g. by `route`, whose weights carry the router's
    gradient): out [T, H] = Σ_k topk_weights[t, k] · expert topk_ids[t, k] (hidden[t]). topk_weights [T, k]
    float (fp16 / bf16 / fp32 / fp64), topk_ids [T, k] int32/int64 in [0, E).

    check_ids: the ids' values are checked on the host (one sync); under CUDA-graph capture or torch.compile
    they are clamped into [0, E) on the device instead. Pass False for ids that `route` made (always in range):
    they are trusted then, unchecked. An id out of range still never makes a kernel read or write outside its
    tensors: it adds nothing (as on the reference backend) where align runs as one launch (decode sizes), and
    the torch align (larger T·k) raises torch's index error.
    """
    backend = _check_experts(hidden, w13, w2, w_format, w_scales, backend)
    check_tensors(topk_weights=(topk_weights, 2), topk_ids=(topk_ids, 2))
    check_dtype("topk_weights", topk_weights, (torch.float16, torch.bfloat16, torch.float32, torch.float64))
    check_dtype("topk_ids", topk_ids, (torch.int32, torch.int64))
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        check_same_device(name, t, "hidden", hidden)
        if t.shape[0] != hidden.shape[0]:
            fail(name, f"[{hidden.shape[0]}, k] (a row per token)", tuple(t.shape))
    if topk_weights.shape != topk_ids.shape:
        fail("topk_weights", f"the shape of topk_ids {tuple(topk_ids.shape)}", tuple(topk_weights.shape))
    check_bool("check_ids", check_ids)
    if check_ids:
        topk_ids = checked_ids(topk_ids, w13.shape[0])
    return _run_experts(hidden, w13, w2, topk_weights.float(), topk_ids.to(torch.int32), w_format, w_scales, backend)


def _check_experts(hidden, w13, w2, w_format, w_scales, backend) -> str:
    """Checks of the expert inputs shared by fused_moe and experts; returns the resolved backend."""
    check_tensors(hidden=(hidden, 2), w13=(w13, 3), w2=(w2, 3))
    backend = resolve_backend(backend, hidden.device)
    check_dtype("hidden", hidden, (torch.float16, torch.bfloat16, torch.float32))
    check_interpreted_matmul_dtype(backend, "hidden", hidden)
    for name, t in (("w13", w13), ("w2", w2)):
        check_same_device(name, t, "hidden", hidden)
    if w_format not in ("bf16", "fp8"):
        fail("w_format", "'bf16' (weights in hidden's dtype) or 'fp8'", repr(w_format))
    if w_format == "fp8":
        check_dtype("w13", w13, (torch.float8_e4m3fn,))
        check_dtype("w2", w2, (torch.float8_e4m3fn,))
    else:
        check_same_dtype("w13", w13, "hidden", hidden)
        check_same_dtype("w2", w2, "hidden", hidden)
    h = hidden.shape[1]
    if h == 0:  # the decode pass's last-block offset goes negative, the sorted pass's block size to 0
        fail("hidden", "a nonzero hidden size (dim 1)", tuple(hidden.shape))
    e, two_i, h13 = w13.shape
    if h13 != h:
        fail("w13", f"[E, 2I, {h}] (H of hidden)", tuple(w13.shape))
    if two_i % 2 or two_i == 0:  # I = 0 would launch no program, leaving the outputs as allocated
        fail("w13", "an even, nonzero middle dim (gate rows, then up rows)", two_i)
    if tuple(w2.shape) != (e, h, two_i // 2):
        fail("w2", f"[{e}, {h}, {two_i // 2}] ([E, H, I])", tuple(w2.shape))
    if w_format == "fp8":
        _check_scales(w_scales, w13, w2, hidden)
    elif w_scales is not None:
        fail("w_scales", "None unless w_format='fp8'", "scales")
    return backend


def _run_experts(hidden, w13, w2, weights, ids, w_format, w_scales, backend):
    if w_format == "fp8":
        # inference only, on both backends (the Triton kernels have no backward through FP8 weights)
        if torch.is_grad_enabled() and any(x.requires_grad for x in (hidden, w13, w2, weights)):
            fail("w_format", "'bf16' for training (FP8 expert weights are for inference)", "'fp8' with autograd")
        if backend == "reference":
            return experts_reference(hidden, *(dequantize_weights_reference(w, sc).to(hidden.dtype)
                                               for w, sc in ((w13, w_scales[0]), (w2, w_scales[1]))), weights, ids)
        args = (hidden.contiguous(), w13.contiguous(), w2.contiguous())
        scales = (w_scales[0].contiguous(), w_scales[1].contiguous())
        if _decode_tile(hidden.device, hidden.shape[0], w13, fp8=True):
            return _experts_decode(*args, weights, ids, *scales)
        return _experts_fp8(*args, *scales, weights, ids)
    if backend == "reference":
        return experts_reference(hidden, w13, w2, weights, ids)
    train = torch.is_grad_enabled() and any(x.requires_grad for x in (hidden, w13, w2, weights))
    if not train and _decode_tile(hidden.device, hidden.shape[0], w13):
        return _experts_decode(hidden.contiguous(), w13.contiguous(), w2.contiguous(), weights, ids, None, None)
    return _experts_fwd(hidden.contiguous(), w13.contiguous(), w2.contiguous(), weights, ids, train)[0]
