"""`apply_rope`: validate -> dispatch (the reference, or the Triton kernel as an op with autograd)."""
from __future__ import annotations

from typing import Optional

import torch

from ...errors import (check_dtype, check_last_dim_contiguous, check_rank, check_same_device, check_tensor,
                       dense_like, fail)
from ...runtime import resolve_backend
from .._op import kernel_op
from . import configs
from .reference import rope_reference

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _rope_impl(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    from .rope_kernel import rope
    return rope(x, cos, sin, backward, configs.ROPE.lookup(x.device))


def _rope_fake(x, cos, sin, backward):
    return torch.empty_like(x)


_rotate = kernel_op("rope_rotate", _rope_impl, _rope_fake)  # without autograd: the backward's inverse rotation


def _rope_setup(ctx, inputs, output):
    _, cos, sin, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward = backward


def _rope_backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return _rotate(dy.contiguous(), cos, sin, not ctx.backward), None, None, None


_rope = kernel_op("rope", _rope_impl, _rope_fake, setup_context=_rope_setup, backward=_rope_backward)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
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
        check_dtype(name, t, FLOATS)
        if tuple(t.shape) != (x.shape[1], d // 2):
            fail(name, f"shape ({x.shape[1]}, {d // 2}) (seq, head_dim / 2)", tuple(t.shape))
        check_same_device(name, t, "x", x)
        if t.requires_grad:
            fail(name, "a table that does not require grad (no backend differentiates the angles)",
                 "requires_grad=True")
    check_last_dim_contiguous("x", x)
    if backend == "reference":
        return rope_reference(x, cos, sin)
    # the output is allocated like x and written with a unit last stride
    return _rope(dense_like(x), cos.contiguous(), sin.contiguous(), False)
