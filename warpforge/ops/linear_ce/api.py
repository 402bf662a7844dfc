"""`linear_cross_entropy`: validate -> plan (chunk size) -> dispatch (the reference, or cuBLAS GEMMs around the
Triton softmax kernel, chunk by chunk, as an op with autograd)."""
from __future__ import annotations

import torch

from ...errors import (check_dim, check_dtype, check_int, check_same_device, check_same_dtype, check_tensors, fail,
                       host_reads_allowed)
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


def _linear_ce_impl(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward and both gradients at once, a chunk of rows at a time: the full [rows, vocab] logits never
    exist. The gradients are those of the mean loss (the 1 / n scale is applied inside the softmax kernel, so
    neither gradient takes another pass); backward only scales them."""
    from .linear_ce_kernel import ce_loss_and_grad_
    cfg = configs.LINEAR_CE.lookup(hidden.device)
    rows, vocab = hidden.shape[0], weight.shape[0]
    chunk = ce_chunk_rows(rows, vocab, cfg.chunk_elements)
    n_valid = (targets != ignore_index).sum().clamp(min=1).float()  # stays on the device: no sync
    inv_n = 1.0 / n_valid
    d_hidden = torch.empty_like(hidden)
    d_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
    loss_sum = torch.zeros((), device=hidden.device, dtype=torch.float32)
    for start in range(0, rows, chunk):
        h = hidden[start:start + chunk]
        logits = _chunk_logits(h, weight)  # becomes its own gradient in place
        loss_sum += ce_loss_and_grad_(logits, targets[start:start + chunk], ignore_index, inv_n, cfg).sum()
        grad = logits.to(h.dtype)
        d_hidden[start:start + chunk] = grad @ weight
        _add_product_fp32(d_weight, grad.T, h)
    return loss_sum / n_valid, d_hidden, d_weight.to(weight.dtype)


def _linear_ce_fake(hidden, weight, targets, ignore_index):
    return hidden.new_empty((), dtype=torch.float32), torch.empty_like(hidden), torch.empty_like(weight)


def _ce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _ce_backward(ctx, d_loss, _dh, _dw):
    d_hidden, d_weight = ctx.saved_tensors
    return d_hidden * d_loss.to(d_hidden.dtype), d_weight * d_loss.to(d_weight.dtype), None, None


_linear_ce = kernel_op("linear_cross_entropy", _linear_ce_impl, _linear_ce_fake, setup_context=_ce_setup,
                       backward=_ce_backward)


def linear_cross_entropy(hidden, weight, targets, ignore_index: int = -100, backend=None):
    """Mean cross-entropy of hidden [N, H] @ weight [V, H]ᵀ against targets [N] (int64 / int32), skipping
    ignore_index, without materialising the [N, V] logits. When no target counts (every one ignored, or N = 0)
    the loss is 0 and the gradients are zero.

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
    check_int("ignore_index", ignore_index, lo=-2**63, hi=2**63 - 1)
    targets = targets.long()  # int32 targets would compare against ignore_index wrapped to 32 bits
    if host_reads_allowed(targets) and targets.numel():
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= weight.shape[0]))
        if bool(bad.any()):
            fail("targets", f"values in [0, {weight.shape[0]}) or ignore_index ({ignore_index})",
                 f"{int(targets[bad][0])} at row {int(bad.nonzero()[0])}")
    if backend == "reference":
        return linear_cross_entropy_reference(hidden, weight, targets, ignore_index)
    return _linear_ce(hidden.contiguous(), weight.contiguous(), targets.contiguous(), int(ignore_index))[0]
