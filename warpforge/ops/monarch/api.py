"""`monarch_linear` and `monarch_project`: validate -> dispatch (the reference, or the Triton block-diagonal GEMMs
as ops with autograd). The convention, M = P_out · L · P_mid · R, is reference.py's."""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ...errors import (check_dtype, check_int, check_rank, check_same_device, check_same_dtype, check_tensor,
                       check_tensors, fail, host_reads_allowed)
from ...runtime import check_interpreted_matmul_dtype, resolve_backend
from .._op import kernel_op
from . import configs
from .reference import monarch_linear_reference, monarch_project_reference

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _config(x: torch.Tensor) -> configs.MonarchCfg:
    """The tile table's entry; WARPFORGE_MONARCH_RUNS and WARPFORGE_MONARCH_TMA_STORE (1 / 0) override its `runs`
    and `gemm.tma_store`, WARPFORGE_MONARCH_WGRAD_BLAS its `wgrad_blas` (for A/B timing)."""
    cfg = configs.MONARCH.lookup(x.device, "fp32" if x.dtype == torch.float32 else "any")
    runs, store = os.environ.get("WARPFORGE_MONARCH_RUNS"), os.environ.get("WARPFORGE_MONARCH_TMA_STORE")
    if runs is not None:
        cfg = cfg._replace(runs=runs != "0")
    if store is not None:
        cfg = cfg._replace(gemm=cfg.gemm._replace(tma_store=store != "0"))
    blas = os.environ.get("WARPFORGE_MONARCH_WGRAD_BLAS")
    if blas is not None:
        cfg = cfg._replace(wgrad_blas=blas != "0")
    return cfg


def _fwd_impl(x: torch.Tensor, w_left: torch.Tensor, w_right: torch.Tensor,
              bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [T, d_out], the intermediate [T, d_mid] in L's block order, w_right's rows run by run where the kernels
    take them (else empty): the last two kept for the backward)."""
    from .monarch_kernel import monarch_fwd
    return monarch_fwd(x, w_left, w_right, bias, _config(x))


def _fwd_fake(x, w_left, w_right, bias):
    # the third output's shape follows the table and the WARPFORGE_MONARCH_* knobs as they are when traced: set the
    # knobs before the first compile
    from .monarch_kernel import runs_apply
    t = x.shape[0]
    nb, q = w_right.shape[:2]
    return (x.new_empty(t, w_left.shape[0] * w_left.shape[1]), x.new_empty(t, nb * q),
            w_right.new_empty(w_right.shape if runs_apply(nb, q, _config(x)) else (0,)))


def _bwd_impl(dy: torch.Tensor, x: torch.Tensor, w_left: torch.Tensor, w_right: torch.Tensor, g: torch.Tensor,
              w_runs: torch.Tensor, has_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d w_left, d w_right, d bias fp32 [d_out], empty without a bias)."""
    from .monarch_kernel import monarch_bwd
    return monarch_bwd(dy, x, w_left, w_right, g, has_bias, _config(x), w_runs)


def _bwd_fake(dy, x, w_left, w_right, g, w_runs, has_bias):
    d_out = w_left.shape[0] * w_left.shape[1] if has_bias else 0
    return (torch.empty_like(x), torch.empty_like(w_left), torch.empty_like(w_right),
            x.new_empty(d_out, dtype=torch.float32))


_bwd = kernel_op("monarch_linear_bwd", _bwd_impl, _bwd_fake)


def _setup(ctx, inputs, output):
    x, w_left, w_right, bias = inputs
    ctx.save_for_backward(x, w_left, w_right, output[1], output[2])
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, dy, _dg, _dw_runs):
    x, w_left, w_right, g, w_runs = ctx.saved_tensors
    dx, dwl, dwr, dbias = _bwd(dy.contiguous(), x, w_left, w_right, g, w_runs, ctx.has_bias)
    return dx, dwl, dwr, dbias.to(x.dtype) if ctx.has_bias else None


_fwd = kernel_op("monarch_linear_fwd", _fwd_impl, _fwd_fake, setup_context=_setup, backward=_backward)


def _check(x, w_left, w_right, bias):
    """Every argument of monarch_linear; returns (nblocks, d_in, d_mid, d_out)."""
    check_tensors(x=(x, None), w_left=(w_left, 3), w_right=(w_right, 3))
    if x.dim() == 0:
        fail("x", "a tensor [..., d_in]", "a 0-d tensor")
    check_dtype("x", x, FLOATS)
    for name, w in (("w_right", w_right), ("w_left", w_left)):
        check_same_dtype(name, w, "x", x)
        check_same_device(name, w, "x", x)
    nb, q, p = w_right.shape
    if min(nb, q, p) == 0:
        fail("w_right", "[nblocks, d_mid / nblocks, d_in / nblocks] with no empty dim", tuple(w_right.shape))
    if x.shape[-1] != nb * p:
        fail("x", f"a last dim d_in = {nb * p} (nblocks {nb} x {p}, from w_right {tuple(w_right.shape)})",
             f"shape {tuple(x.shape)}")
    if w_left.shape[0] != nb or w_left.shape[2] != q or w_left.shape[1] == 0:
        fail("w_left", f"[{nb}, d_out / {nb}, {q}] (nblocks and d_mid / nblocks of w_right {tuple(w_right.shape)})",
             tuple(w_left.shape))
    d_out = nb * w_left.shape[1]
    if bias is not None:
        check_tensor("bias", bias)
        check_rank("bias", bias, 1)
        check_same_dtype("bias", bias, "x", x)
        check_same_device("bias", bias, "x", x)
        if bias.shape[0] != d_out:
            fail("bias", f"[{d_out}] (d_out of w_left)", tuple(bias.shape))
    return nb, nb * p, nb * q, d_out


def monarch_linear(x: torch.Tensor, w_left: torch.Tensor, w_right: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
                   backend: Optional[str] = None) -> torch.Tensor:
    """y = x Mᵀ (+ bias) for the Monarch matrix M = P_out · blockdiag(w_left) · P_mid · blockdiag(w_right)
    (reference.py spells the permutations out; HazyResearch fly's blockdiag_butterfly_multiply with
    w1_bfly = w_right, w2_bfly = w_left).

    x [..., d_in]; w_right [nblocks, d_mid / nblocks, d_in / nblocks] (applied first); w_left
    [nblocks, d_out / nblocks, d_mid / nblocks]; bias [d_out] or None; all one dtype (fp16 / bf16 / fp32) and
    device. Returns [..., d_out]. Differentiable in x, both factors and bias; the Triton backward is first-order.
    """
    check_tensor("x", x)
    backend = resolve_backend(backend, x.device)
    _, d_in, _, d_out = _check(x, w_left, w_right, bias)
    check_interpreted_matmul_dtype(backend, "x", x)
    if backend == "reference":
        return monarch_linear_reference(x, w_left, w_right, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), d_in).contiguous()
    y = _fwd(x2, w_left.contiguous(), w_right.contiguous(), None if bias is None else bias.contiguous())[0]
    return y.view(*lead, d_out)


def monarch_project(weight: torch.Tensor, nblocks: int,
                    d_mid: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Monarch factors (w_left, w_right) nearest to a dense weight [d_out, d_in] in Frobenius norm (y = x Wᵀ
    as nn.Linear): per pair of blocks a truncated SVD (reference.py), the projection of Dao et al. Section 3.4
    (rank 1 per block pair at nblocks = √d; d_mid / nblocks² in general). d_mid defaults to min(d_in, d_out).
    Plain PyTorch (SVDs), for converting a model's weights, not for a step."""
    check_tensor("weight", weight)
    check_rank("weight", weight, 2)
    check_dtype("weight", weight, FLOATS + (torch.float64,))
    d_out, d_in = weight.shape
    if d_out == 0 or d_in == 0:
        fail("weight", "a [d_out, d_in] weight with no empty dim", tuple(weight.shape))
    check_int("nblocks", nblocks, lo=1)
    d_mid = min(d_in, d_out) if d_mid is None else d_mid
    check_int("d_mid", d_mid, lo=1)
    for name, d in (("weight", d_out), ("weight", d_in), ("d_mid", d_mid)):
        if d % nblocks or d == 0:
            fail(name, f"dims divisible by nblocks ({nblocks})", tuple(weight.shape) if name == "weight" else d)
    # past nblocks · min(d_in, d_out) every pair of blocks is already at full rank: more columns are zeros (and an
    # absurd d_mid would be an allocator error)
    most = nblocks * min(d_in, d_out)
    if d_mid > most:
        fail("d_mid", f"at most nblocks · min(d_in, d_out) = {most} (every block pair at full rank)", d_mid)
    if host_reads_allowed(weight) and not bool(torch.isfinite(weight).all()):
        fail("weight", "finite values (the projection's SVDs do not converge on NaN or inf)", "NaN or inf")
    return monarch_project_reference(weight, nblocks, d_mid)
