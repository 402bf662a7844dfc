"""`linear_cross_entropy`: validate -> plan (chunk size) -> dispatch (the reference, or cuBLAS GEMMs around the
Triton softmax kernel, chunk by chunk, as an op with autograd)."""
from __future__ import annotations

from typing import Optional

import torch

from ...errors import (check_choice, check_dim, check_dtype, check_int, check_positive_float, check_rank,
                       check_same_device, check_same_dtype, check_tensor, check_tensors, fail, host_reads_allowed)
from ...runtime import resolve_backend
from .._op import kernel_op
from . import configs
from .reference import linear_cross_entropy_reference

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def ce_chunk_rows(rows: int, vocab: int, elements: int) -> int:
    """Rows per linear_cross_entropy chunk: as many chunks as `elements` logits each allow, of equal size (a
    short last chunk is a GEMM that fills few SMs and still pays a full pass over the weight)."""
    n_chunks = -(-rows * max(vocab, 1) // max(elements, 1))
    return max(1, -(-rows // max(n_chunks, 1)))


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


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h @ weightᵀ, the chunk's logits (the kernel turns them into their gradient in place). fp16 logits are
    formed in fp32: fp16 tops out at 65504, and a logit past it would make the loss NaN."""
    if h.dtype != torch.float16:
        return h @ weight.T
    if h.is_cuda:
        try:
            return torch.mm(h, weight.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # a torch without the fp32-output GEMM
            pass
    return h.float() @ weight.float().T


def _chunks(hidden, weight, targets, bias, ignore_index, grad_scale, smoothing, z_scale, softcap, cfg,
            with_grads=True):
    """Walks the rows a chunk at a time (the full [rows, vocab] logits never exist): per-row losses, and, with_grads,
    the gradients of Σ_row grad_scale[row] · loss[row] (grad_scale one element or one per row, on the device):
    d_hidden in hidden's dtype, d_weight and d_bias in fp32."""
    from .linear_ce_kernel import ce_loss_and_grad_
    rows, vocab = hidden.shape[0], weight.shape[0]
    chunk = ce_chunk_rows(rows, vocab, cfg.chunk_elements)
    losses = torch.empty(rows, device=hidden.device, dtype=torch.float32)
    if with_grads:
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        d_bias = torch.zeros((vocab if bias is not None else 0,), device=weight.device, dtype=torch.float32)
    for start in range(0, rows, chunk):
        h = hidden[start:start + chunk]
        scale = grad_scale if grad_scale.numel() == 1 else grad_scale[start:start + chunk]
        logits = _chunk_logits(h, weight)  # becomes its own gradient in place
        losses[start:start + chunk] = ce_loss_and_grad_(logits, targets[start:start + chunk], ignore_index, scale,
                                                        cfg, bias, smoothing, z_scale, softcap, write_grad=with_grads)
        if not with_grads:
            continue
        grad = logits.to(h.dtype)
        d_hidden[start:start + chunk] = grad @ weight
        _add_product_fp32(d_weight, grad.T, h)
        if bias is not None:
            d_bias += grad.sum(0, dtype=torch.float32)
    return (losses, d_hidden, d_weight, d_bias) if with_grads else losses


def _linear_ce_impl(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: Optional[torch.Tensor],
                    ignore_index: int, mean: bool, smoothing: float, z_scale: float,
                    softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean or summed loss and its gradients at once (d_bias fp32, empty without a bias): the 1 / n scale of
    the mean is applied inside the softmax kernel, so no gradient takes another pass; backward only scales them.
    softcap 0: none."""
    cfg = configs.LINEAR_CE.lookup(hidden.device)
    n_valid = (targets != ignore_index).sum().clamp(min=1).float()  # stays on the device: no sync
    scale = 1.0 / n_valid if mean else torch.ones((), device=hidden.device)
    losses, d_hidden, d_weight, d_bias = _chunks(hidden, weight, targets, bias, ignore_index, scale.reshape(1),
                                                 smoothing, z_scale, softcap or None, cfg)
    loss = losses.sum() / n_valid if mean else losses.sum()
    return loss, d_hidden, d_weight.to(weight.dtype), d_bias


def _linear_ce_fake(hidden, weight, targets, bias, ignore_index, mean, smoothing, z_scale, softcap):
    return (hidden.new_empty((), dtype=torch.float32), torch.empty_like(hidden), torch.empty_like(weight),
            hidden.new_empty((weight.shape[0] if bias is not None else 0,), dtype=torch.float32))


def _ce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2], output[3])
    ctx.has_bias = inputs[3] is not None
    ctx.mark_non_differentiable(output[1], output[2], output[3])


def _ce_backward(ctx, d_loss, _dh, _dw, _db):
    d_hidden, d_weight, d_bias = ctx.saved_tensors
    db = d_bias * d_loss if ctx.has_bias else None
    return (d_hidden * d_loss.to(d_hidden.dtype), d_weight * d_loss.to(d_weight.dtype), None,
            db.to(d_hidden.dtype) if db is not None else None, None, None, None, None, None)


_linear_ce = kernel_op("linear_cross_entropy", _linear_ce_impl, _linear_ce_fake, setup_context=_ce_setup,
                       backward=_ce_backward)


def _rows_loss_impl(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: Optional[torch.Tensor],
                    ignore_index: int, smoothing: float, z_scale: float, softcap: float) -> torch.Tensor:
    """reduction="none": the per-row losses only (their gradients need each row's upstream gradient, which
    comes in the backward: _rows_grad recomputes the chunks' logits with it)."""
    cfg = configs.LINEAR_CE.lookup(hidden.device)
    one = torch.ones(1, device=hidden.device)
    return _chunks(hidden, weight, targets, bias, ignore_index, one, smoothing, z_scale, softcap or None, cfg,
                   with_grads=False)


def _rows_loss_fake(hidden, weight, targets, bias, ignore_index, smoothing, z_scale, softcap):
    return hidden.new_empty((hidden.shape[0],), dtype=torch.float32)


def _rows_grad_impl(d_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    bias: Optional[torch.Tensor], ignore_index: int, smoothing: float, z_scale: float,
                    softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = configs.LINEAR_CE.lookup(hidden.device)
    _, d_hidden, d_weight, d_bias = _chunks(hidden, weight, targets, bias, ignore_index, d_loss.float().contiguous(),
                                            smoothing, z_scale, softcap or None, cfg)
    return d_hidden, d_weight.to(weight.dtype), d_bias


def _rows_grad_fake(d_loss, hidden, weight, targets, bias, ignore_index, smoothing, z_scale, softcap):
    return (torch.empty_like(hidden), torch.empty_like(weight),
            hidden.new_empty((weight.shape[0] if bias is not None else 0,), dtype=torch.float32))


_rows_grad = kernel_op("linear_cross_entropy_rows_bwd", _rows_grad_impl, _rows_grad_fake)


def _rows_setup(ctx, inputs, output):
    hidden, weight, targets, bias = inputs[:4]
    ctx.save_for_backward(hidden, weight, targets, bias if bias is not None else torch.empty(0))
    ctx.has_bias, ctx.settings = bias is not None, inputs[4:]


def _rows_backward(ctx, d_loss):
    hidden, weight, targets, bias = ctx.saved_tensors
    d_hidden, d_weight, d_bias = _rows_grad(d_loss.contiguous(), hidden, weight, targets,
                                            bias if ctx.has_bias else None, *ctx.settings)
    return (d_hidden, d_weight, None, d_bias.to(hidden.dtype) if ctx.has_bias else None) + (None,) * 4


_rows_loss = kernel_op("linear_cross_entropy_rows", _rows_loss_impl, _rows_loss_fake, setup_context=_rows_setup,
                       backward=_rows_backward)


REDUCTIONS = ("mean", "sum", "none")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         backend: Optional[str] = None, *, bias: Optional[torch.Tensor] = None,
                         reduction: str = "mean", label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                         softcap: Optional[float] = None) -> torch.Tensor:
    """Cross-entropy of the logits z = hidden [N, H] @ weight [V, H]ᵀ (+ bias [V]) against targets [N] (int64 /
    int32), skipping ignore_index, without materialising the [N, V] logits. Liger-Kernel's options: softcap c > 0
    caps the logits as c · tanh(z / c) (Gemma-2); label_smoothing ε in [0, 1] as F.cross_entropy's; lse_square_scale
    λ >= 0 adds the z-loss λ · lse(z)² per row. reduction: "mean" over the rows counted (0, with zero gradients,
    when none counts, or N = 0), "sum", or "none" (fp32 per-row losses [N], 0 on ignored rows; its backward
    computes the logits a second time, since every row's gradient waits for its own upstream gradient).

    Targets must lie in [0, V) or equal ignore_index: checked on the host (one sync) except under CUDA-graph
    capture or torch.compile, where a row with a target out of range gets a NaN loss (and NaN gradients) instead:
    no read outside the logits."""
    check_tensors(hidden=(hidden, 2), weight=(weight, 2), targets=(targets, 1))
    backend = resolve_backend(backend, hidden.device)
    check_dtype("hidden", hidden, FLOATS)
    check_same_dtype("weight", weight, "hidden", hidden)
    check_dtype("targets", targets, (torch.int64, torch.int32))
    check_dim("weight", weight, 1, hidden.shape[1], "hidden's width")
    check_dim("targets", targets, 0, hidden.shape[0], "hidden's rows")
    for name, t in (("weight", weight), ("targets", targets)):
        check_same_device(name, t, "hidden", hidden)
    if bias is not None:
        check_tensor("bias", bias)
        check_rank("bias", bias, 1)
        check_same_dtype("bias", bias, "hidden", hidden)
        check_same_device("bias", bias, "hidden", hidden)
        check_dim("bias", bias, 0, weight.shape[0], "weight's rows (the vocabulary)")
    check_int("ignore_index", ignore_index, lo=-2**63, hi=2**63 - 1)
    check_choice("reduction", reduction, REDUCTIONS)
    check_positive_float("label_smoothing", label_smoothing, allow_none=False, allow_zero=True)
    if label_smoothing > 1:
        fail("label_smoothing", "a float in [0, 1]", repr(label_smoothing))
    check_positive_float("lse_square_scale", lse_square_scale, allow_none=False, allow_zero=True)
    check_positive_float("softcap", softcap)
    targets = targets.long()  # int32 targets would compare against ignore_index wrapped to 32 bits
    if host_reads_allowed(targets) and targets.numel():
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= weight.shape[0]))
        if bool(bad.any()):
            fail("targets", f"values in [0, {weight.shape[0]}) or ignore_index ({ignore_index})",
                 f"{int(targets[bad][0])} at row {int(bad.nonzero()[0])}")
    settings = dict(bias=bias, reduction=reduction, label_smoothing=float(label_smoothing),
                    lse_square_scale=float(lse_square_scale), softcap=softcap)
    if backend == "reference":
        return linear_cross_entropy_reference(hidden, weight, targets, ignore_index, **settings)
    args = (hidden.contiguous(), weight.contiguous(), targets.contiguous(),
            None if bias is None else bias.contiguous(), int(ignore_index))
    tail = (float(label_smoothing), float(lse_square_scale), float(softcap or 0.0))
    if reduction == "none":
        return _rows_loss(*args, *tail)
    return _linear_ce(*args, reduction == "mean", *tail)[0]
