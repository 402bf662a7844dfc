"""The GPT's fused training ops: `rms_norm` (and `add_rms_norm`, with the residual add), `layer_norm`, `apply_rope`,
`swiglu`, `linear_cross_entropy`.

validate -> pick backend -> (reference | torch.library custom op with autograd over the Triton kernels; eager
calls take the same impls and backward through a plain autograd.Function: runtime.eager_or_op)
"""
from __future__ import annotations

from typing import Optional

import torch

from ...errors import (check_dim, check_dtype, check_last_dim_contiguous, check_rank, check_same_device,
                       check_same_dtype, check_tensor, check_tensors, fail)
from ...runtime import arch_key, eager_or_op, resolve_backend, sm_count
from .reference import (add_rms_norm_reference, layer_norm_reference, linear_cross_entropy_reference,
                        rms_norm_reference, rope_reference, rope_tables, swiglu_reference)

__all__ = ["rms_norm", "add_rms_norm", "layer_norm", "apply_rope", "rope_tables", "swiglu", "linear_cross_entropy",
           "rms_norm_reference", "add_rms_norm_reference", "layer_norm_reference", "rope_reference",
           "swiglu_reference", "linear_cross_entropy_reference"]

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# logits materialised per linear_cross_entropy chunk (rows x vocab), per arch: larger chunks make fewer, larger
# GEMMs (gpt2-124m on an H200: 13 chunks of 1334 rows; its 13 fp32 d_weight accumulations took 2.5 ms of a
# 39 ms step) for more memory; scripts/tune_lce.py sweeps it. 1 << 26 is 128 MB of bf16 logits. sm90: 16k x 50304
# fwd+bwd 8.50 ms at 1 << 26, 7.16 ms at 1 << 28 (peak +1.15 GB), 8.00 at 1 << 29 (two uneven chunks).
CE_CHUNK_ELEMENTS = {"default": 1 << 26, "sm90": 1 << 28}


def ce_chunk_rows(rows: int, vocab: int, elements: int) -> int:
    """Rows per linear_cross_entropy chunk: as many chunks as `elements` logits each allow, of equal size (a
    short last chunk is a GEMM that fills few SMs and still pays a full pass over the weight)."""
    n_chunks = -(-rows * max(vocab, 1) // max(elements, 1))
    return max(1, -(-rows // max(n_chunks, 1)))


def _kernels():
    from . import fused_kernel
    return fused_kernel


def _programs(device) -> int:
    return 4 * sm_count(device)  # persistent norm-backward programs: 4 per multiprocessor


# ----------------------------------------------------------------------------- RMSNorm / LayerNorm
def _norm_fwd_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                   layer: bool, out_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd); mean is empty for RMSNorm."""
    y, mean, rstd, _ = _kernels().norm_fwd(x, weight, bias, eps, layer, out_dtype)
    return y, mean if mean is not None else rstd.new_empty(0), rstd


_norm_fwd_op = torch.library.custom_op("warpforge::norm_fwd", _norm_fwd_impl, mutates_args=())


@_norm_fwd_op.register_fake
def _(x, weight, bias, eps, layer, out_dtype):
    rows = x.numel() // max(x.shape[-1], 1)
    return torch.empty_like(x, dtype=out_dtype), x.new_empty(rows if layer else 0, dtype=torch.float32), \
        x.new_empty(rows, dtype=torch.float32)


def _norm_bwd_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                   layer: bool,
                   d_sum: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db); d_sum: x's gradient from its other uses when x is a residual sum, added into dx."""
    dx, dw, db = _kernels().norm_bwd(dy.contiguous(), x, weight, mean, rstd, _programs(x.device), layer,
                                     d_sum.contiguous() if d_sum is not None else None)
    return dx, dw, db if db is not None else weight.new_empty(0)


_norm_bwd_op = torch.library.custom_op("warpforge::norm_bwd", _norm_bwd_impl, mutates_args=())


@_norm_bwd_op.register_fake
def _(dy, x, weight, mean, rstd, layer, d_sum=None):
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty(weight.shape[0] if layer else 0)


_norm_bwd = eager_or_op(_norm_bwd_op, _norm_bwd_impl)


def _norm_setup(ctx, inputs, output):
    x, weight, bias, _, layer, _ = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.layer = layer
    ctx.mark_non_differentiable(output[1], output[2])


def _norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _norm_bwd(dy, x, weight, mean, rstd, ctx.layer)
    return dx, dw, db if ctx.layer else None, None, None, None


_norm_fwd_op.register_autograd(_norm_backward, setup_context=_norm_setup)
_norm_fwd = eager_or_op(_norm_fwd_op, _norm_fwd_impl, _norm_setup, _norm_backward)


def _add_norm_fwd_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y = rms_norm(x + residual), x + residual, rstd)."""
    y, _, rstd, total = _kernels().norm_fwd(x, weight, None, eps, False, out_dtype, residual)
    return y, total, rstd


_add_norm_fwd_op = torch.library.custom_op("warpforge::add_rms_norm_fwd", _add_norm_fwd_impl, mutates_args=())


@_add_norm_fwd_op.register_fake
def _(x, residual, weight, eps, out_dtype):
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
    d_sum, dw, _ = _norm_bwd(dy, total, weight, rstd, rstd, False, d_total)  # rstd stands in for the unused mean
    return d_sum.to(ctx.dtypes[0]), d_sum.to(ctx.dtypes[1]), dw, None, None


_add_norm_fwd_op.register_autograd(_add_norm_backward, setup_context=_add_norm_setup)
_add_norm_fwd = eager_or_op(_add_norm_fwd_op, _add_norm_fwd_impl, _add_norm_setup, _add_norm_backward)


def _check_norm(x, weight, bias, out_dtype):
    check_tensor("x", x)
    if out_dtype is not None and out_dtype not in FLOATS:
        fail("out_dtype", f"None or one of {FLOATS}", out_dtype)
    check_tensor("weight", weight)
    check_dtype("x", x, FLOATS)
    for name, t in (("weight", weight),) + ((("bias", bias),) if bias is not None else ()):
        check_tensor(name, t)
        check_rank(name, t, 1)
        check_dim(name, t, 0, x.shape[-1], "x's last dim")
        check_same_device(name, t, "x", x)


def rms_norm(x, weight, eps: float = 1e-6, backend=None, *, out_dtype=None):
    """x / sqrt(mean(x², -1) + eps) · weight over the last dim; x [..., n], weight [n]. out_dtype: the output's
    dtype if not x's (e.g. bf16 from an fp32 residual stream under autocast: the cast the next matmul would
    make, without another pass over memory)."""
    _check_norm(x, weight, None, out_dtype)
    if resolve_backend(backend, x.device) == "reference":
        y = rms_norm_reference(x, weight, eps)
        return y if out_dtype is None else y.to(out_dtype)
    return _norm_fwd(x.contiguous(), weight.contiguous(), None, float(eps), False, out_dtype)[0]


def add_rms_norm(x, residual, weight, eps: float = 1e-6, backend=None, *, out_dtype=None):
    """(rms_norm(x + residual), x + residual) in one pass over memory: a pre-norm block's residual add fused with
    the next norm. The sum has x's and residual's promoted dtype (an fp32 stream plus a bf16 branch stays fp32);
    out_dtype is the normalised output's, as in rms_norm."""
    _check_norm(x, weight, None, out_dtype)
    check_tensor("residual", residual)
    check_dtype("residual", residual, FLOATS)
    check_same_device("residual", residual, "x", x)
    if residual.shape != x.shape:
        fail("residual", f"x's shape {tuple(x.shape)}", tuple(residual.shape))
    if resolve_backend(backend, x.device) == "reference":
        y, total = add_rms_norm_reference(x, residual, weight, eps)
        return (y if out_dtype is None else y.to(out_dtype)), total
    y, total, _ = _add_norm_fwd(x.contiguous(), residual.contiguous(), weight.contiguous(), float(eps), out_dtype)
    return y, total


def layer_norm(x, weight, bias, eps: float = 1e-5, backend=None, *, out_dtype=None):
    """(x − mean) / sqrt(var + eps) · weight + bias over the last dim; x [..., n], weight and bias [n].
    out_dtype: as rms_norm's."""
    _check_norm(x, weight, bias, out_dtype)
    if bias is None:
        fail("bias", "a tensor [n] (use rms_norm for a norm without bias or centring)", None)
    if resolve_backend(backend, x.device) == "reference":
        y = layer_norm_reference(x, weight, bias, eps)
        return y if out_dtype is None else y.to(out_dtype)
    return _norm_fwd(x.contiguous(), weight.contiguous(), bias.contiguous(), float(eps), True, out_dtype)[0]


# ------------------------------------------------------------------------------------------- RoPE
def _rope_impl(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    return _kernels().rope(x, cos, sin, backward)


_rope_op = torch.library.custom_op("warpforge::rope", _rope_impl, mutates_args=())


@_rope_op.register_fake
def _(x, cos, sin, backward):
    return torch.empty_like(x)


def _rope_setup(ctx, inputs, output):
    _, cos, sin, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward = backward


_rotate = eager_or_op(_rope_op, _rope_impl)  # without autograd: the backward's inverse rotation


def _rope_backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return _rotate(dy.contiguous(), cos, sin, not ctx.backward), None, None, None


_rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)
_rope = eager_or_op(_rope_op, _rope_impl, _rope_setup, _rope_backward)


def apply_rope(x, cos, sin, backend=None):
    """Rotary embedding: pairs (x_i, x_{i + d/2}) of x [b, s, h, d] rotated by cos/sin [s, d/2]."""
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        check_tensor(name, t)
    backend = resolve_backend(backend, x.device)
    check_rank("x", x, 4)
    check_dtype("x", x, FLOATS)
    d = x.shape[-1]
    if d % 2:
        fail("x", "an even head dim (rotated in pairs i, i + d/2)", d)
    for name, t in (("cos", cos), ("sin", sin)):
        check_rank(name, t, 2)
        if tuple(t.shape) != (x.shape[1], d // 2):
            fail(name, f"shape ({x.shape[1]}, {d // 2}) (seq, head_dim / 2)", tuple(t.shape))
        check_same_device(name, t, "x", x)
    check_last_dim_contiguous("x", x)
    if backend == "reference":
        return rope_reference(x, cos, sin)
    return _rope(x, cos.contiguous(), sin.contiguous(), False)


# ----------------------------------------------------------------------------------------- SwiGLU
def _swiglu_fwd_impl(gate_up: torch.Tensor) -> torch.Tensor:
    return _kernels().swiglu_fwd(gate_up)


_swiglu_fwd_op = torch.library.custom_op("warpforge::swiglu_fwd", _swiglu_fwd_impl, mutates_args=())


@_swiglu_fwd_op.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def _swiglu_bwd_impl(dout: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return _kernels().swiglu_bwd(dout.contiguous(), gate_up)


_swiglu_bwd_op = torch.library.custom_op("warpforge::swiglu_bwd", _swiglu_bwd_impl, mutates_args=())


@_swiglu_bwd_op.register_fake
def _(dout, gate_up):
    return torch.empty_like(gate_up)


_swiglu_bwd = eager_or_op(_swiglu_bwd_op, _swiglu_bwd_impl)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_backward(ctx, dout):
    (gate_up,) = ctx.saved_tensors
    return _swiglu_bwd(dout, gate_up)


_swiglu_fwd_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)
_swiglu_fwd = eager_or_op(_swiglu_fwd_op, _swiglu_fwd_impl, _swiglu_setup, _swiglu_backward)


def swiglu(gate_up, backend=None):
    """gate_up [..., 2I] (gate first, then up) -> silu(gate) · up [..., I], without an intermediate."""
    check_tensor("gate_up", gate_up)
    backend = resolve_backend(backend, gate_up.device)
    check_dtype("gate_up", gate_up, FLOATS)
    if gate_up.shape[-1] % 2:
        fail("gate_up", "an even last dim (gate and up halves)", gate_up.shape[-1])
    if backend == "reference":
        return swiglu_reference(gate_up)
    return _swiglu_fwd(gate_up.contiguous())


# ------------------------------------------------------------------------------ linear + cross-entropy
def _add_product_fp32(acc, a, b):
    """acc (fp32) += a @ b for bf16/fp16 a, b: on CUDA one cuBLAS GEMM with fp32 output accumulating into acc
    (torch's addmm out_dtype), not a rounded half-precision product, a conversion and an add (three passes
    over [vocab, H] per chunk)."""
    if acc.is_cuda and a.dtype != torch.float32:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError):  # a torch without the fp32-output GEMM
            pass
    acc += (a @ b).float()


def _linear_ce_impl(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward and both gradients at once, a chunk of rows at a time: the full [rows, vocab] logits never
    exist. The gradients are those of the mean loss (the 1 / n scale is applied inside the softmax kernel, so
    neither gradient takes another pass); backward only scales them."""
    k = _kernels()
    rows, vocab = hidden.shape[0], weight.shape[0]
    elements = CE_CHUNK_ELEMENTS.get(arch_key(hidden.device), CE_CHUNK_ELEMENTS["default"])
    chunk = ce_chunk_rows(rows, vocab, elements)
    n_valid = (targets != ignore_index).sum().clamp(min=1).float()  # stays on the device: no sync
    inv_n = 1.0 / n_valid
    d_hidden = torch.empty_like(hidden)
    d_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
    loss_sum = torch.zeros((), device=hidden.device, dtype=torch.float32)
    for start in range(0, rows, chunk):
        h = hidden[start:start + chunk]
        logits = h @ weight.T  # becomes its own gradient in place
        loss_sum += k.ce_loss_and_grad_(logits, targets[start:start + chunk], ignore_index, inv_n).sum()
        d_hidden[start:start + chunk] = logits @ weight
        _add_product_fp32(d_weight, logits.T, h)
    return loss_sum / n_valid, d_hidden, d_weight.to(weight.dtype)


_linear_ce_op = torch.library.custom_op("warpforge::linear_cross_entropy", _linear_ce_impl, mutates_args=())


@_linear_ce_op.register_fake
def _(hidden, weight, targets, ignore_index):
    return hidden.new_empty((), dtype=torch.float32), torch.empty_like(hidden), torch.empty_like(weight)


def _ce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _ce_backward(ctx, d_loss, _dh, _dw):
    d_hidden, d_weight = ctx.saved_tensors
    return d_hidden * d_loss.to(d_hidden.dtype), d_weight * d_loss.to(d_weight.dtype), None, None


_linear_ce_op.register_autograd(_ce_backward, setup_context=_ce_setup)
_linear_ce = eager_or_op(_linear_ce_op, _linear_ce_impl, _ce_setup, _ce_backward)


def linear_cross_entropy(hidden, weight, targets, ignore_index: int = -100, backend=None):
    """Mean cross-entropy of hidden [N, H] @ weight [V, H]ᵀ against targets [N] (int64), skipping
    ignore_index, without materialising the [N, V] logits."""
    check_tensors(hidden=(hidden, 2), weight=(weight, 2), targets=(targets, 1))
    backend = resolve_backend(backend, hidden.device)
    check_dtype("hidden", hidden, FLOATS)
    check_same_dtype("weight", weight, "hidden", hidden)
    check_dtype("targets", targets, (torch.int64, torch.int32))
    check_dim("weight", weight, 1, hidden.shape[1], "hidden's width")
    check_dim("targets", targets, 0, hidden.shape[0], "hidden's rows")
    for name, t in (("weight", weight), ("targets", targets)):
        check_same_device(name, t, "hidden", hidden)
    if backend == "reference":
        return linear_cross_entropy_reference(hidden, weight, targets.long(), ignore_index)
    return _linear_ce(hidden.contiguous(), weight.contiguous(), targets.contiguous(), int(ignore_index))[0]
