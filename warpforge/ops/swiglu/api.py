"""`swiglu`: validate -> dispatch (the reference, or the Triton kernels as ops with autograd)."""
from __future__ import annotations

from typing import Optional

import torch

from ...errors import check_dtype, check_tensor, fail
from ...runtime import resolve_backend
from .._op import cached_launch, kernel_op
from . import configs
from .reference import swiglu_reference

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


_CFGS: dict = {}
_SK = None  # the kernel file, imported on first use (a function-level import statement costs ~1 µs a call)


def _kernels():
    global _SK
    from . import swiglu_kernel
    _SK = swiglu_kernel
    return swiglu_kernel


def _cfg(device: torch.device) -> configs.SwigluCfg:
    """The table's config for the device, looked up once per (table, device) rather than on every eager call."""
    hit = _CFGS.get(device)
    if hit is None or hit[0] is not configs.SWIGLU:
        hit = _CFGS[device] = (configs.SWIGLU, configs.SWIGLU.lookup(device))
    return hit[1]


def _swiglu_fwd_impl(gate_up: torch.Tensor) -> torch.Tensor:
    return (_SK or _kernels()).swiglu_fwd(gate_up, _cfg(gate_up.device), cached_launch)


def _swiglu_fwd_fake(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def _swiglu_bwd_impl(dout: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return (_SK or _kernels()).swiglu_bwd(dout.contiguous(), gate_up, _cfg(gate_up.device), cached_launch)


def _swiglu_bwd_fake(dout, gate_up):
    return torch.empty_like(gate_up)


_swiglu_bwd = kernel_op("swiglu_bwd", _swiglu_bwd_impl, _swiglu_bwd_fake)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_backward(ctx, dout):
    (gate_up,) = ctx.saved_tensors
    return _swiglu_bwd(dout, gate_up)


_swiglu_fwd = kernel_op("swiglu_fwd", _swiglu_fwd_impl, _swiglu_fwd_fake, setup_context=_swiglu_setup,
                        backward=_swiglu_backward)


def swiglu(gate_up: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    """gate_up [..., 2I] (gate first, then up) -> silu(gate) · up [..., I], without an intermediate."""
    check_tensor("gate_up", gate_up)
    backend = resolve_backend(backend, gate_up.device)
    check_dtype("gate_up", gate_up, FLOATS)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        fail("gate_up", "a tensor [..., 2I] with an even last dim (gate and up halves)", f"shape {tuple(gate_up.shape)}")
    if backend == "reference":
        return swiglu_reference(gate_up)
    return _swiglu_fwd(gate_up.contiguous())
