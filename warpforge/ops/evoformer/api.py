"""`evoformer_attention`: DS4Sci_EvoformerAttention's call on warpforge kernels. validate -> dispatch (the
reference, or the Triton kernels as an op with autograd)."""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import torch

from ...errors import check_dtype, check_last_dim_contiguous, check_positive_float, check_rank, check_same_device, \
    check_same_dtype, check_tensor, fail
from ...runtime import arch_key, check_interpreted_matmul_dtype, resolve_backend, sm_count
from .._op import cached_launch, kernel_op
from . import configs
from .reference import evoformer_attention_reference

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 64


def _full(bias: Optional[torch.Tensor], shape) -> Optional[torch.Tensor]:
    """bias as a [B, S, H, R, R] view, stride 0 where it broadcasts (never copied)."""
    if bias is None:
        return None
    return bias.reshape((1,) * (5 - bias.dim()) + tuple(bias.shape)).expand(shape)


def _tiles(q):
    from .evoformer_kernel import _block
    return configs.TILES.lookup(q.device, _block(q.shape[-1]))


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias1: Optional[torch.Tensor],
              bias2: Optional[torch.Tensor], gate: Optional[torch.Tensor],
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .evoformer_kernel import evoformer_fwd
    B, S, R, H, _ = q.shape
    full = (B, S, H, R, R)
    biases = (_full(bias1, full), _full(bias2, full))
    if _gluon_takes(q, biases, configs.gluon_fwd, _fwd_kernel):
        return _fwd_kernel().fwd_gluon(q, k, v, biases, gate, scale, sm_count(q.device), cached_launch)
    return evoformer_fwd(q, k, v, biases, gate, scale, _tiles(q).fwd, cached_launch)


def _fwd_fake(q, k, v, bias1, bias2, gate, scale):
    B, S, R, H, _ = q.shape
    return torch.empty_like(q), q.new_empty((2, B, S, H, R), dtype=torch.float32)


def _sum_dims(bias: torch.Tensor, grad_shape) -> tuple:
    """The dims of the [B, 1, H, R, R] score gradient that bias broadcasts over (summed down to its shape)."""
    shape = (1,) * (5 - bias.dim()) + tuple(bias.shape)
    return tuple(i for i in range(5) if shape[i] == 1 and grad_shape[i] != 1)


def _summed_to(dbias: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The [B, H, R, R] score gradient (already summed over N_seq) summed down to bias's own shape and dtype (a
    view, without a copy, where the backward already wrote it in bias's dtype and nothing is left to sum)."""
    grad = dbias[:, None]  # [B, 1, H, R, R]
    dims = _sum_dims(bias, grad.shape)
    return (grad.sum(dims, keepdim=True) if dims else grad).reshape(bias.shape).to(bias.dtype).contiguous()


def _dbias_dtype(q: torch.Tensor, wanted) -> torch.dtype:
    """The dtype the backward writes the summed score gradient in: the one wanted bias's own where nothing is left to
    sum (the pair bias [B, 1, H, R, R]: one cast in the kernel instead of a copy after it), else fp32."""
    B, S, R, H, _ = q.shape
    if len(wanted) == 1 and not _sum_dims(wanted[0], (B, 1, H, R, R)):
        return wanted[0].dtype
    return torch.float32


def _gluon_takes(q: torch.Tensor, biases, switch, kernel) -> bool:
    """Whether a Hopper Gluon kernel module (fwd_gluon_kernel, dkdv_gluon_kernel, dq_dbias_gluon_kernel: `kernel`)
    takes this call: an sm_90 device, its switch on (configs), a shape and biases it takes
    (gluon_shared_kernel.fits), a Triton its Gluon was written for (the module's available())."""
    if q.device.type != "cuda" or arch_key(q.device) != "sm90" or not switch():
        return False
    from .gluon_shared_kernel import fits
    return fits(q, biases) and kernel().available()


def _fwd_kernel():
    from . import fwd_gluon_kernel
    return fwd_gluon_kernel


def _dkdv_kernel():
    from . import dkdv_gluon_kernel
    return dkdv_gluon_kernel


def _dq_dbias_kernel():
    from . import dq_dbias_gluon_kernel
    return dq_dbias_gluon_kernel


def _dq_dbias_pass(q: torch.Tensor, biases, scale: float, dbias_dtype: torch.dtype = torch.float32):
    """The Hopper pass that computes dq and the pair bias's gradient in one walk (dq_dbias_gluon_kernel), as the
    callable evoformer_bwd takes, where it applies (_gluon_takes); else None (the portable passes)."""
    if not _gluon_takes(q, biases, configs.gluon_dq_dbias, _dq_dbias_kernel):
        return None
    return functools.partial(_dq_dbias_kernel().dq_dbias_gluon, biases=biases, scale=scale, n_sm=sm_count(q.device),
                             launch=cached_launch, out_dtype=dbias_dtype)


def _dkdv_pass(q: torch.Tensor, biases, scale: float):
    """The Hopper dk/dv pass (dkdv_gluon_kernel), as the callable evoformer_bwd takes, where it applies
    (_gluon_takes); else None (the portable pass)."""
    if not _gluon_takes(q, biases, configs.gluon_dkdv, _dkdv_kernel):
        return None
    return functools.partial(_dkdv_kernel().dkdv_gluon, biases=biases, scale=scale, n_sm=sm_count(q.device),
                             launch=cached_launch)


def _bwd_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, bias1: Optional[torch.Tensor], bias2: Optional[torch.Tensor],
              gate: Optional[torch.Tensor], scale: float, want1: bool, want2: bool,
              want_gate: bool) -> list[torch.Tensor]:
    """[dq, dk, dv, then the gradient of each bias whose want flag is set, in that bias's shape and dtype, then
    the gate's if want_gate]. out is the (gated) output."""
    from .evoformer_kernel import evoformer_bwd
    B, S, R, H, _ = q.shape
    full = (B, S, H, R, R)
    biases = (_full(bias1, full), _full(bias2, full))
    dtype = _dbias_dtype(q, [bias for bias, want in ((bias1, want1), (bias2, want2)) if want])
    dq, dk, dv, dgate, dbias = evoformer_bwd(do.contiguous(), q, k, v, out, lse, biases, gate, scale, want1 or want2,
                                             _tiles(q), want_gate, configs.bwd_fused(),
                                             _dq_dbias_pass(q, biases, scale, dtype), _dkdv_pass(q, biases, scale),
                                             cached_launch, dtype)
    return [dq, dk, dv] + [_summed_to(dbias, bias) for bias, want in ((bias1, want1), (bias2, want2)) if want] + \
        ([dgate] if dgate is not None else [])


def _bwd_fake(do, q, k, v, out, lse, bias1, bias2, gate, scale, want1, want2, want_gate):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)] + \
        [bias.new_empty(bias.shape) for bias, want in ((bias1, want1), (bias2, want2)) if want] + \
        ([torch.empty_like(gate)] if want_gate and gate is not None else [])


_evoformer_bwd = kernel_op("evoformer_attention_bwd", _bwd_impl, _bwd_fake)


def _setup(ctx, inputs, output):
    q, k, v, bias1, bias2, gate, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], bias1, bias2, gate)
    ctx.scale = scale
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, d_out, _d_lse):
    q, k, v, out, lse, bias1, bias2, gate = ctx.saved_tensors
    want = [bool(ctx.needs_input_grad[3]) and bias1 is not None, bool(ctx.needs_input_grad[4]) and bias2 is not None]
    want_gate = bool(ctx.needs_input_grad[5]) and gate is not None
    dq, dk, dv, *rest = _evoformer_bwd(d_out, q, k, v, out, lse, bias1, bias2, gate, ctx.scale, *want, want_gate)
    dbias1 = rest.pop(0) if want[0] else None
    dbias2 = rest.pop(0) if want[1] else None
    dgate = rest.pop(0) if want_gate else None
    return dq, dk, dv, dbias1, dbias2, dgate, None


_evoformer = kernel_op("evoformer_attention", _fwd_impl, _fwd_fake, setup_context=_setup, backward=_backward)


def _check(q, k, v, biases, gate, softmax_scale, backend):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        check_rank(name, t, 5)
        check_same_device(name, t, "q", q)
        if t.shape != q.shape or t.dtype != q.dtype:
            fail(name, f"q's shape and dtype {tuple(q.shape)} {q.dtype}", f"{tuple(t.shape)} {t.dtype}")
    check_dtype("q", q, FLOATS)
    check_interpreted_matmul_dtype(backend, "q", q)
    B, S, R, H, D = q.shape
    if not 1 <= D <= MAX_HEAD_DIM:
        fail("q", f"a head dim from 1 to {MAX_HEAD_DIM}", D)
    if not isinstance(biases, (list, tuple)) or len(biases) > 2:
        fail("biases", "a list of at most two tensors", type(biases).__name__ if not isinstance(biases, (list, tuple))
             else f"{len(biases)} tensors")
    full = (B, S, H, R, R)
    for i, bias in enumerate(biases):
        name = f"biases[{i}]"
        check_tensor(name, bias)
        check_same_device(name, bias, "q", q)
        check_dtype(name, bias, FLOATS)
        if bias.dim() > 5 or any(n not in (1, m) for n, m in zip(reversed(bias.shape), reversed(full))):
            fail(name, f"a shape broadcastable to [B, N_seq, H, N_res, N_res] = {list(full)}", tuple(bias.shape))
        st = _full(bias, full).stride()
        if (R - 1) * (abs(st[3]) + abs(st[4])) >= 2 ** 31:  # the kernels' offsets inside one (b, s, h) are int32
            fail(name, "strides over the residues that keep one (b, s, h) slice under 2^31 elements", st[3:])
        if bias.requires_grad and torch.is_grad_enabled() and bias.dim() >= 4 and bias.shape[-4] != 1 and S != 1:
            fail(name, "no gradient unless it is shared by the MSA rows (N_seq dim 1, as the pair bias "
                 "[B, 1, H, N_res, N_res]): a per-row bias's gradient is as large as the scores", "requires_grad=True")
    if gate is not None:
        check_tensor("gate", gate)
        check_same_device("gate", gate, "q", q)
        check_same_dtype("gate", gate, "q", q)
        if gate.shape != q.shape:
            fail("gate", f"q's shape {tuple(q.shape)}", tuple(gate.shape))
    if R * H * D >= 2 ** 31:  # the kernels' offsets inside one (b, s, h) slice are int32
        fail("q", "N_res · H · D under 2^31 elements", R * H * D)
    check_positive_float("softmax_scale", softmax_scale)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_last_dim_contiguous(name, t)


def evoformer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, biases: Sequence[torch.Tensor] = (), *,
                        gate: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                        backend: Optional[str] = None) -> torch.Tensor:
    """Attention over the residues of each (batch, MSA row, head), AlphaFold's MSA row / column and triangle
    attention: q, k, v [B, N_seq, N_res, H, D] (D up to 64; fp16, bf16, fp32), `biases` up to two tensors
    broadcastable to [B, N_seq, H, N_res, N_res] added to the scaled scores (the residue mask bias [B, N_seq, 1, 1,
    N_res] and the pair bias [B, 1, H, N_res, N_res]), `gate` [B, N_seq, N_res, H, D] multiplying the output by
    sigmoid(gate). Gradients for q, k, v, the gate and any bias shared by the MSA rows (the pair bias's is a sum
    over N_seq, computed deterministically without materialising the scores). A query whose keys are all masked
    (-inf) gets output 0. Returns [B, N_seq, N_res, H, D] in q's dtype."""
    if isinstance(q, torch.Tensor):
        backend = resolve_backend(backend, q.device)
    _check(q, k, v, biases, gate, softmax_scale, backend)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if backend == "reference":
        return evoformer_attention_reference(q, k, v, biases, gate=gate, softmax_scale=scale)
    padded = list(biases) + [None] * (2 - len(biases))
    out, _ = _evoformer(q.contiguous(), k.contiguous(), v.contiguous(), padded[0], padded[1],
                        None if gate is None else gate.contiguous(), scale)
    return out
