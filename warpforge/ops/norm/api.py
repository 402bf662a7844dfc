"""`rms_norm`, `add_rms_norm` (a residual add fused with the next norm) and `layer_norm`: validate -> dispatch
(the reference, or the Triton kernels as ops with autograd)."""
from __future__ import annotations

from typing import Optional

import torch

from ...errors import (FP32_TINY, SCALE_MAX, check_dim, check_dtype, check_positive_float, check_rank,
                       check_same_device, check_tensor, fail)
from ...runtime import resolve_backend, sm_count
from .._op import cached_launch, kernel_op
from . import configs
from .reference import add_rms_norm_reference, layer_norm_reference, rms_norm_reference

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


_CFGS: dict = {}
_NK = None  # the kernel file, imported on first use (keeps `import warpforge` off Triton; a function-level import
# statement costs ~1 µs a call)


def _kernels():
    global _NK
    from . import norm_kernel
    _NK = norm_kernel
    return norm_kernel
_FWD_KIND, _BWD_KIND = ("rms_fwd", "layer_fwd"), ("rms_bwd", "layer_bwd")  # by layer (a bool)


def _cfg(x: torch.Tensor, kind: str) -> tuple[configs.NormCfg, int]:
    """(the table's config for x's device, the kind and x's width; the backward's program count), looked up once per
    (table, device, kind, width): an eager call would otherwise pay the lookup and the SM count on every call. The
    table is part of the key so that a swapped table (tests force tiles that way) is seen."""
    key = (x.device, kind, x.shape[-1])
    hit = _CFGS.get(key)
    if hit is None or hit[0] is not configs.NORM:
        cfg = configs.NORM.lookup(x.device, kind, size=x.shape[-1])
        hit = _CFGS[key] = (configs.NORM, cfg, cfg.programs_per_sm * sm_count(x.device))
    return hit[1], hit[2]


# ------------------------------------------------------------------------------------------- ops
# Each op has an eager form (`*_eager`: absent outputs as None) and the registered op's (`*_impl`: absent outputs as
# empty tensors, one each, since a custom op's outputs are tensors and may not alias one another). An eager call
# makes only the tensors it uses: on a GPU host each allocation costs microseconds.
def _norm_fwd_eager(x, weight, bias, eps, layer, out_dtype):
    """(y, mean or None, rstd)."""
    y, mean, rstd, _ = (_NK or _kernels()).norm_fwd(x, weight, bias, eps, layer, out_dtype, None, _cfg(x, _FWD_KIND[layer])[0],
                                cached_launch)
    return y, mean, rstd


def _norm_fwd_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                   layer: bool, out_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd); mean is empty for RMSNorm."""
    y, mean, rstd = _norm_fwd_eager(x, weight, bias, eps, layer, out_dtype)
    return y, mean if mean is not None else rstd.new_empty(0), rstd


def _norm_fwd_fake(x, weight, bias, eps, layer, out_dtype):
    rows = x.numel() // max(x.shape[-1], 1)
    return torch.empty_like(x, dtype=out_dtype), x.new_empty(rows if layer else 0, dtype=torch.float32), \
        x.new_empty(rows, dtype=torch.float32)


def _norm_bwd_eager(dy, x, weight, mean, rstd, layer, d_sum=None, dx_dtype=None, dx2_dtype=None):
    """(dx, dx2 or None, dw, db or None)."""
    cfg, programs = _cfg(x, _BWD_KIND[layer] if d_sum is None else "add_bwd")
    return (_NK or _kernels()).norm_bwd(dy.contiguous(), x, weight, mean, rstd, programs, layer,
                    d_sum.contiguous() if d_sum is not None else None, cfg, dx_dtype, dx2_dtype, cached_launch)


def _norm_bwd_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                   layer: bool, d_sum: Optional[torch.Tensor] = None, dx_dtype: Optional[torch.dtype] = None,
                   dx2_dtype: Optional[torch.dtype] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dx2, dw, db); d_sum: x's gradient from its other uses when x is a residual sum, added into dx. dx in
    dx_dtype (default x's); dx2: the same gradient in dx2_dtype when given (else empty), for a residual sum's two
    inputs of different dtypes."""
    dx, dx2, dw, db = _norm_bwd_eager(dy, x, weight, mean, rstd, layer, d_sum, dx_dtype, dx2_dtype)
    return dx, dx2 if dx2 is not None else weight.new_empty(0), dw, db if db is not None else weight.new_empty(0)


def _norm_bwd_fake(dy, x, weight, mean, rstd, layer, d_sum=None, dx_dtype=None, dx2_dtype=None):
    return (torch.empty_like(x, dtype=dx_dtype),
            torch.empty_like(x, dtype=dx2_dtype) if dx2_dtype is not None else weight.new_empty(0),
            torch.empty_like(weight), weight.new_empty(weight.shape[0] if layer else 0))


_norm_bwd = kernel_op("norm_bwd", _norm_bwd_impl, _norm_bwd_fake, eager_impl=_norm_bwd_eager)


def _norm_setup(ctx, inputs, output):
    x, weight, bias, _, layer, _ = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.layer = layer
    if layer:
        ctx.mark_non_differentiable(output[1], output[2])
    else:  # RMSNorm's mean: None (eager) or an empty tensor (the registered op)
        ctx.mark_non_differentiable(*(t for t in output[1:] if t is not None))


def _norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, _, dw, db = _norm_bwd(dy, x, weight, mean, rstd, ctx.layer)
    return dx, dw, db if ctx.layer else None, None, None, None


_norm_fwd = kernel_op("norm_fwd", _norm_fwd_impl, _norm_fwd_fake, setup_context=_norm_setup,
                      backward=_norm_backward, eager_impl=_norm_fwd_eager)


def _add_norm_fwd_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y = rms_norm(x + residual), x + residual, rstd)."""
    y, _, rstd, total = (_NK or _kernels()).norm_fwd(x, weight, None, eps, False, out_dtype, residual, _cfg(x, "add_fwd")[0],
                                   cached_launch)
    return y, total, rstd


def _add_norm_fwd_fake(x, residual, weight, eps, out_dtype):
    rows = x.numel() // max(x.shape[-1], 1)
    return torch.empty_like(x, dtype=out_dtype), torch.empty_like(x, dtype=torch.result_type(x, residual)), \
        x.new_empty(rows, dtype=torch.float32)


def _add_norm_setup(ctx, inputs, output):
    x, residual, weight, _, _ = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.dtypes = x.dtype, residual.dtype
    ctx.mark_non_differentiable(output[2])


def _add_norm_backward(ctx, dy, d_total, _drstd):
    total, weight, rstd = ctx.saved_tensors
    x_dtype, res_dtype = ctx.dtypes
    two = res_dtype != x_dtype  # each input's gradient in its dtype, from the one kernel (no cast pass after it)
    # rstd stands in for the unused mean
    dx, dres, dw, _ = _norm_bwd(dy, total, weight, rstd, rstd, False, d_total, x_dtype, res_dtype if two else None)
    return dx, dres if two else dx, dw, None, None


_add_norm_fwd = kernel_op("add_rms_norm_fwd", _add_norm_fwd_impl, _add_norm_fwd_fake, setup_context=_add_norm_setup,
                          backward=_add_norm_backward)


# ------------------------------------------------------------------------------------ public door
_STRIDED = torch.strided


def _check_norm(x, weight, bias, eps, out_dtype):
    """The common case in one expression (an eager call's host time counts), the checks one by one, with their
    messages, otherwise."""
    try:
        n = x.shape[-1]
        if isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.layout is _STRIDED \
                and weight.layout is _STRIDED and not x.is_nested and not weight.is_nested and n \
                and x.dtype in FLOATS and weight.dtype in FLOATS and weight.dim() == 1 and weight.shape[0] == n \
                and weight.device == x.device and (out_dtype is None or out_dtype in FLOATS) \
                and type(eps) is float and FP32_TINY <= eps <= SCALE_MAX \
                and (bias is None or (isinstance(bias, torch.Tensor) and bias.layout is _STRIDED
                                      and not bias.is_nested and bias.dtype in FLOATS and bias.dim() == 1
                                      and bias.shape[0] == n and bias.device == x.device)):
            return
    except (AttributeError, IndexError, TypeError):
        pass
    _check_norm_each(x, weight, bias, eps, out_dtype)


def _check_norm_each(x, weight, bias, eps, out_dtype):
    check_tensor("x", x)
    if out_dtype is not None and out_dtype not in FLOATS:
        fail("out_dtype", f"None or one of {FLOATS}", out_dtype)
    check_tensor("weight", weight)
    check_dtype("x", x, FLOATS)
    if x.dim() == 0 or x.shape[-1] == 0:
        fail("x", "a tensor [..., n] with n >= 1 (normalised over its last dim)", f"shape {tuple(x.shape)}")
    for name, t in (("weight", weight),) + ((("bias", bias),) if bias is not None else ()):
        check_tensor(name, t)
        check_rank(name, t, 1)
        check_dtype(name, t, FLOATS)
        check_dim(name, t, 0, x.shape[-1], "x's last dim")
        check_same_device(name, t, "x", x)
    check_positive_float("eps", eps, allow_none=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, backend: Optional[str] = None, *,
             out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x / sqrt(mean(x², -1) + eps) · weight over the last dim; x [..., n], weight [n]. out_dtype: the output's
    dtype if not x's (e.g. bf16 from an fp32 residual stream under autocast: the cast the next matmul would
    make, without another pass over memory)."""
    _check_norm(x, weight, None, eps, out_dtype)
    if resolve_backend(backend, x.device) == "reference":
        y = rms_norm_reference(x, weight, eps)
        return y if out_dtype is None else y.to(out_dtype)
    return _norm_fwd(x.contiguous(), weight.contiguous(), None, float(eps), False, out_dtype)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 backend: Optional[str] = None, *,
                 out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over memory: a pre-norm block's residual add fused with
    the next norm. The sum has x's and residual's promoted dtype (an fp32 stream plus a bf16 branch stays fp32);
    out_dtype is the normalised output's, as in rms_norm."""
    _check_norm(x, weight, None, eps, out_dtype)
    if not (isinstance(residual, torch.Tensor) and residual.layout is _STRIDED and not residual.is_nested
            and residual.dtype in FLOATS and residual.device == x.device and residual.shape == x.shape):
        check_tensor("residual", residual)
        check_dtype("residual", residual, FLOATS)
        check_same_device("residual", residual, "x", x)
        fail("residual", f"x's shape {tuple(x.shape)}", tuple(residual.shape))
    if resolve_backend(backend, x.device) == "reference":
        y, total = add_rms_norm_reference(x, residual, weight, eps)
        return (y if out_dtype is None else y.to(out_dtype)), total
    y_dtype = out_dtype or torch.promote_types(x.dtype, residual.dtype)  # rms_norm(total)'s dtype, as documented
    y, total, _ = _add_norm_fwd(x.contiguous(), residual.contiguous(), weight.contiguous(), float(eps), y_dtype)
    return y, total


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
               backend: Optional[str] = None, *, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """(x − mean) / sqrt(var + eps) · weight + bias over the last dim; x [..., n], weight and bias [n].
    out_dtype: as rms_norm's."""
    _check_norm(x, weight, bias, eps, out_dtype)
    if bias is None:
        fail("bias", "a tensor [n] (use rms_norm for a norm without bias or centring)", None)
    if resolve_backend(backend, x.device) == "reference":
        y = layer_norm_reference(x, weight, bias, eps)
        return y if out_dtype is None else y.to(out_dtype)
    return _norm_fwd(x.contiguous(), weight.contiguous(), bias.contiguous(), float(eps), True, out_dtype)[0]
