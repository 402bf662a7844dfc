"""The op toolkit: one call turns a kernel launcher into a public op.

    call = kernel_op("flash_attn_fwd", impl, fake, setup_context=..., backward=...)

registers `warpforge::flash_attn_fwd` with torch.library (custom op, fake for shape propagation, autograd
when a backward is given) and returns the caller that api.py uses:
- under torch.compile, or while any dispatch mode is active, the registered op: opaque and whole to
  Inductor, to AOTAutograd (which traces registered backwards under fake/proxy modes, on torch 2.11 outside
  dynamo's is_compiling(), where an impl given fake tensors would fail) and to a user's FLOP counter;
- otherwise `impl` directly, through a torch.autograd.Function built from the same setup_context and
  backward when there is one. The custom-op dispatcher, dynamo guard and autograd shim would otherwise be
  most of an eager call's host time (benchmarks/NOTES.md, "eager calls").

impl takes and returns tensors and plain Python values, annotated as torch.library requires; eager calls
pass arguments positionally when the op has a backward (autograd.Function.apply takes no keywords). A
backward that calls other ops calls them through their own callers. `call.op` is the registered op.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch._C import _functions as autograd_functions  # DelayedError: what once_differentiable uses
from torch.utils._python_dispatch import _get_current_dispatch_mode

NAMESPACE = "warpforge"


def kernel_op(name: str, impl: Callable, fake: Callable, *, setup_context: Optional[Callable] = None,
              backward: Optional[Callable] = None, mutates_args: tuple[str, ...] = ()) -> Callable:
    """Define `warpforge::<name>` from impl, fake and an optional (setup_context, backward) pair. mutates_args names
    the arguments an in-place op writes (a cache append), as torch.library requires."""
    if (setup_context is None) != (backward is None):
        raise TypeError(f"kernel_op {name}: setup_context and backward go together")
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=mutates_args)
    op.register_fake(fake)
    eager = impl
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
        eager = _autograd_function(name, impl, setup_context, backward).apply

    def call(*args, **kwargs):
        if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
            return op(*args, **kwargs)
        return eager(*args, **kwargs)

    call.op = op
    call.__name__ = call.__qualname__ = name
    call.__doc__ = impl.__doc__
    return call


def _autograd_function(name, impl, setup_context, backward):
    def forward(ctx, *args):
        out = impl(*args)
        setup_context(ctx, args, out)
        return out

    return type(f"{name}_eager", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(_first_order(name, backward))})


def _first_order(name, backward):
    """The kernels' backwards are not themselves differentiable. Under create_graph (a double backward) their
    gradients come back marked so that differentiating them raises a clear error naming the op, where they
    would otherwise be constants and the second derivative silently wrong or 'does not require grad'."""
    def first_order_backward(ctx, *grads):
        create_graph = torch.is_grad_enabled()
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not create_graph:
            return outputs
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        message = (f"warpforge::{name}: its Triton backward is first-order only; use backend='reference' for "
                   "higher-order gradients").encode()
        marked = [None if g is None else g.detach().requires_grad_() for g in outputs]
        return autograd_functions.DelayedError(message, len(marked))(*marked)
    return first_order_backward
