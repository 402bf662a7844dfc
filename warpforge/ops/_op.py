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
from torch._C import _len_torch_dispatch_stack  # what _get_current_dispatch_mode reads, without its frame

NAMESPACE = "warpforge"


def kernel_op(name: str, impl: Callable, fake: Callable, *, setup_context: Optional[Callable] = None,
              backward: Optional[Callable] = None, mutates_args: tuple[str, ...] = (),
              eager_impl: Optional[Callable] = None) -> Callable:
    """Define `warpforge::<name>` from impl, fake and an optional (setup_context, backward) pair. mutates_args names
    the arguments an in-place op writes (a cache append), as torch.library requires. eager_impl: what eager calls run
    instead of impl, where they can do less: it returns None for the outputs that impl returns as empty placeholders
    (a custom op's outputs must be tensors, each its own: an allocation apiece), and setup_context and backward then
    take those Nones."""
    if (setup_context is None) != (backward is None):
        raise TypeError(f"kernel_op {name}: setup_context and backward go together")
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=mutates_args)
    op.register_fake(fake)
    eager = eager_impl or impl
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
        eager = _autograd_function(name, eager, setup_context, backward).apply

    def call(*args, **kwargs):
        if torch.compiler.is_compiling() or _len_torch_dispatch_stack():
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
        # the outputs marked non-differentiable (statistics, indices) get None as their gradient, not zeros: the
        # engine would otherwise allocate and fill one tensor per such output on every backward, which no backward
        # here reads. Differentiable outputs without a gradient are still given zeros, as for the registered op.
        ctx._materialize_non_diff_grads = False
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

    With Triton 3.6's CUDA launcher (and no scratch memory) the direct call goes straight to its C `launch` with
    tensors passed as their addresses: the Python wrapper in front of it and, per pointer argument, the
    `data_ptr()` call and `cuPointerGetAttribute` check it would make (the ops have checked their devices) are
    skipped. Host TMA descriptors (the Gluon kernels') are keyed by their dtype, box and layout, as Triton keys them,
    and passed on whole: the C launch's wrapper encodes their tensor maps.

    args are the non-constexpr arguments, in the kernel's order, and the constexprs its last parameters (passed in
    meta). Under the Triton interpreter, with launch hooks set (a profiler), or with a driver that only compiles,
    every launch goes through `kernel[grid]`."""

    counts = None  # {(kernel name, path): launches} while a dict (`warpforge tune norm --eager-profile`); paths:
    # "c" (Triton 3.6's C launch, direct), "run" (the compiled kernel's launcher object), "triton" (kernel[grid])

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}
        self.device = None
        self.binders: dict = {}  # argument types -> a function made for them: (spec, args with tensors as addresses)

    def __call__(self, grid, *args, **meta):
        key = None
        device = self.device
        if device is not None:
            binder = self.binders.get(tuple(map(type, args)))
            if binder is None:
                binder = self._binder(args)
            spec, flat = binder(*args)
            key = (device(), tuple(meta.values()), spec)
            hit = self.compiled.get(key)
            if hit is not None:
                _, run, raw, function, packed, tail, runtime, stream = hit
                enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
                if (enter is None or not getattr(enter, "calls", True)) and \
                        (leave is None or not getattr(leave, "calls", True)):  # no launch hook to call
                    n = len(grid)
                    if raw is not None:  # Triton 3.6's C launch: (.., coop, pdl, scratch, profile scratch, ..)
                        run.launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream(key[0]),
                                   function, raw[0], raw[1], None, None, packed, None, None, None, *flat, *tail)
                    else:
                        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream(key[0]), function,
                            packed, None, None, None, *args, *tail)
                    if self.counts is not None:
                        self._count("c" if raw is not None else "run")
                    return
        compiled = self.kernel[grid](*args, **meta)
        if self.counts is not None:
            self._count("triton")
        entry = _cacheable(self.kernel, compiled, len(args), meta)
        if entry is not None:
            if key is None:
                self.device = _fast_device(entry[-1])
                key = (self.device(), tuple(meta.values()), _bind(args)[0])
            self.compiled[key] = entry[:-1]

    def _binder(self, args):
        """A function of these argument types returning _bind's (spec as a tuple, flat): straight-line code, made once
        per type pattern (an eager launch otherwise loops over ~10 arguments in Python on every call)."""
        names = [f"a{i}" for i in range(len(args))]
        spec, flat, pre = [], [], []
        for i, (name, a) in enumerate(zip(names, args)):
            t = type(a)
            if t is _Tensor or (t is not int and t is not float and isinstance(a, _Tensor)):
                pre.append(f"p{i} = {name}.data_ptr()")
                spec += [f"{name}.dtype", f"not p{i} & 15"]
                flat.append(f"p{i}")
                continue
            if _is_descriptor(t):
                spec += [f"_t{i}", f"{name}.base.dtype", f"tuple({name}.block_shape)",
                         f"getattr({name}, 'layout', None)", f"getattr({name}, 'padding', None)"]
                flat.append(name)
                continue
            if t is int:
                spec.append(f"(4 if {name} == 1 else ({name} % 16 == 0) + 2 * (not -2147483648 <= {name} < 2147483648))")
            elif t is float:
                spec.append("5")
            else:  # None, bools, dtypes: by value
                spec += [f"_t{i}", name]
            flat.append(name)
        glob = {f"_t{i}": type(a) for i, a in enumerate(args)}
        code = (f"def bind({', '.join(names)}):\n    " + "".join(f"{line}\n    " for line in pre)
                + f"return ({', '.join(spec)}{',' if len(spec) == 1 else ''}), "
                + f"({', '.join(flat)}{',' if len(flat) == 1 else ''})\n")
        exec(compile(code, f"<Launcher binder {len(self.binders)}>", "exec"), glob)
        binder = self.binders[tuple(map(type, args))] = glob["bind"]
        return binder

    def _count(self, path):
        key = (getattr(self.kernel, "__name__", None) or getattr(getattr(self.kernel, "fn", None), "__name__", "?"),
               path)
        self.counts[key] = self.counts.get(key, 0) + 1


def _is_descriptor(t) -> bool:
    """A host TMA descriptor's class (Triton's TensorDescriptor or Gluon's): an argument Triton specializes on its
    dtype, block shape and layout, and whose tensor map the C launch's wrapper encodes on every launch."""
    return t.__name__ == "TensorDescriptor" and t.__module__.startswith("triton.")


def _fast_device(getter):
    """The current-device getter for launch keys: torch.cuda.current_device (Triton's) checks initialisation in three
    Python frames per call; once a kernel has been compiled and launched here CUDA is initialised, and its C getter
    answers alone."""
    if getter is getattr(torch.cuda, "current_device", None) and torch.cuda.is_initialized():
        fast = getattr(torch._C, "_cuda_getDevice", None)
        if fast is not None:
            return fast
    return getter


_LAUNCHERS: dict = {}


def cached_launch(kernel, grid, *args, **meta) -> None:
    """`kernel[grid](*args, **meta)` through the kernel's Launcher (made on first use): what api.py passes to its
    kernel files' launch helpers as their `launch` (kernel files import nothing of the toolkit)."""
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is None:
        launcher = _LAUNCHERS[id(kernel)] = Launcher(kernel)
    launcher(grid, *args, **meta)


_Tensor = torch.Tensor


def _bind(args):
    """(what Triton specializes args on, flattened: a tensor's dtype and whether its address is a multiple of 16, an
    int's class (1, a multiple of 16, 64-bit), a float, anything else by value; args with tensors as addresses)."""
    spec, flat = [], []
    for a in args:  # the binders (Launcher._binder) do the same in straight-line code
        t = type(a)
        if t is _Tensor or (t is not int and t is not float and isinstance(a, _Tensor)):
            p = a.data_ptr()
            spec += (a.dtype, not p & 15)
            flat.append(p)
            continue
        if _is_descriptor(t):  # a host TMA descriptor: Triton specializes on its dtype, box and layout
            spec += (t, a.base.dtype, tuple(a.block_shape), getattr(a, "layout", None),
                     getattr(a, "padding", None))
            flat.append(a)  # the C launch's wrapper encodes its tensor map
            continue
        if t is int:
            spec.append(4 if a == 1 else (a % 16 == 0) + 2 * (not -2**31 <= a < 2**31))
        elif t is float:
            spec.append(5)
        else:  # None, bools, dtypes: by value
            spec += (t, a)
        flat.append(a)
    return tuple(spec), flat


def _cacheable(kernel, compiled, n_args, meta):
    """(the compiled kernel, its runner, (cooperative grid, PDL) where its C launch can be called directly, else None,
    its function handle and packed metadata, the constexpr values in order, Triton's runtime knobs, the stream getter,
    the device getter), or None where the direct call would not match what `kernel[grid]` did: the interpreter (no
    compiled kernel), constexprs not last or not all in meta, a driver that cannot launch."""
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
    run = compiled.run
    return (compiled, run, _raw_launch(run), compiled.function, compiled.packed_metadata,
            tuple(meta[name] for name in tail_names), knobs.runtime, active.get_current_stream,
            active.get_current_device)


def _raw_launch(run):
    """(cooperative grid, PDL) when `run` is Triton 3.6's CudaLauncher without scratch memory: its __call__(gridX,
    gridY, gridZ, stream, function, *args) then only forwards to the C `launch`, whose pointer arguments may be ints.
    None for anything else (other Triton versions or backends: called through `run` as Triton does)."""
    call = getattr(type(run), "__call__", None)
    code = getattr(call, "__code__", None)
    if type(run).__name__ != "CudaLauncher" or not type(run).__module__.endswith("nvidia.driver") or code is None \
            or code.co_varnames[:6] != ("self", "gridX", "gridY", "gridZ", "stream", "function") \
            or code.co_argcount != 6 or not code.co_flags & 0x04 or not hasattr(run, "launch") \
            or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    return run.launch_cooperative_grid, run.launch_pdl

