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
        if not torch.is_grad_enabled():  # the usual backward (no create_graph): grad mode is off already
            return backward(ctx, *grads)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        message = (f"warpforge::{name}: its Triton backward is first-order only; use backend='reference' for "
                   "higher-order gradients").encode()
        marked = [None if g is None else g.detach().requires_grad_() for g in outputs]
        return autograd_functions.DelayedError(message, len(marked))(*marked)
    return first_order_backward


# ------------------------------------------------------------------------------------ cached launches
class Launcher:
    """`kernel[grid](*args, **meta)` for one Triton kernel, keeping each compiled form under the key of what Triton
    specializes on: the current device, the meta values (constexprs, launch options) and per argument its dtype and
    16-byte alignment (tensors) or whether it is 1, a multiple of 16 or 64-bit (ints). A later launch with the same
    key calls the compiled kernel directly. Triton's own `kernel[grid]` binds and specializes every argument again
    on each call (≈ 10 µs of host time a launch with Triton 3.6 on a 2-core CPU, against ≈ 4 µs for this key),
    which an eager call of a microsecond kernel pays on every op.

    args are the non-constexpr arguments, in the kernel's order, and the constexprs its last parameters (passed in
    meta). Under the Triton interpreter, with launch hooks set (a profiler), or with a driver that only compiles,
    every launch goes through `kernel[grid]`."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}
        self.device = None

    def __call__(self, grid, *args, **meta):
        key = None
        if self.device is not None:
            key = (self.device(), tuple(meta.values()), tuple(map(_spec, args)))
            hit = self.compiled.get(key)
            if hit is not None:
                compiled, tail, runtime, stream = hit
                if _idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook):
                    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                                 stream(key[0]), compiled.function, compiled.packed_metadata, None, None, None,
                                 *args, *tail)
                    return
        compiled = self.kernel[grid](*args, **meta)
        entry = _cacheable(self.kernel, compiled, len(args), meta)
        if entry is not None:
            if key is None:
                self.device = entry[-1]
                key = (self.device(), tuple(meta.values()), tuple(map(_spec, args)))
            self.compiled[key] = entry[:-1]


_LAUNCHERS: dict = {}


def cached_launch(kernel, grid, *args, **meta) -> None:
    """`kernel[grid](*args, **meta)` through the kernel's Launcher (made on first use): what api.py passes to its
    kernel files' launch helpers as their `launch` (kernel files import nothing of the toolkit)."""
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is None:
        launcher = _LAUNCHERS[id(kernel)] = Launcher(kernel)
    launcher(grid, *args, **meta)


def _spec(a):
    t = type(a)
    if t is int:
        return 4 if a == 1 else (a % 16 == 0) + 2 * (not -2**31 <= a < 2**31)
    if t is float:
        return 5
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    return t, a  # None, bools, dtypes: by value


def _cacheable(kernel, compiled, n_args, meta):
    """(compiled, constexpr values in order, Triton's runtime knobs, stream getter, device getter), or None where the
    direct call would not match what `kernel[grid]` did: the interpreter (no compiled kernel), constexprs not last
    or not all in meta, a driver that cannot launch."""
    if compiled is None or not hasattr(compiled, "packed_metadata"):
        return None
    names = list(getattr(kernel, "arg_names", ()))
    tail_names = names[n_args:]
    if any(name not in meta for name in tail_names) or \
            [p.num for p in kernel.params if p.is_constexpr] != list(range(n_args, len(names))):
        return None
    from triton import knobs
    from triton.runtime.driver import driver
    active = driver.active
    if getattr(active, "launcher_cls", None) is None:  # a driver that only compiles (scripts/compile_sm90.py)
        return None
    return (compiled, tuple(meta[name] for name in tail_names), knobs.runtime, active.get_current_stream,
            active.get_current_device)


def _idle(hook) -> bool:
    """No launch hook to call: None, or (Triton 3.6 on) an empty HookChain."""
    return hook is None or not getattr(hook, "calls", True)
