"""Where an op runs.

backend=None  auto: CUDA tensors -> Triton kernels, CPU tensors -> the PyTorch reference.
"triton"      the Triton kernels; on CPU tensors this is the Triton interpreter, which must be switched
              on with TRITON_INTERPRET=1 before triton is first imported.
"reference"   the plain PyTorch reference (warpforge/ops/<family>/reference.py).

WARPFORGE_BACKEND sets the default for backend=None.
"""
from __future__ import annotations

import os
import sys

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .errors import WarpforgeInputError

BACKENDS = ("triton", "reference")


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Return "triton" or "reference" for an op whose inputs live on `device`."""
    if backend is None:
        backend = os.environ.get("WARPFORGE_BACKEND") or None
    if backend is None:
        return "triton" if device.type == "cuda" else "reference"
    if backend not in BACKENDS:
        raise WarpforgeInputError(f"backend: expected None or one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and device.type == "cpu" and not interpreter_enabled():
        raise WarpforgeInputError(
            "backend: 'triton' on CPU tensors runs the Triton interpreter; set TRITON_INTERPRET=1 "
            "before importing triton/warpforge, or use backend='reference'"
        )
    if backend == "triton" and device.type == "cpu" and _triton_compiled_mode():
        raise WarpforgeInputError(
            "backend: TRITON_INTERPRET=1 was set after triton was imported; set it before the first import")
    if backend == "triton" and device.type not in ("cpu", "cuda"):
        raise WarpforgeInputError(f"backend: 'triton' runs on cuda (or cpu via the interpreter), got {device}")
    return backend


def eager_or_op(op, impl, setup_context=None, backward=None):
    """A caller for `op`, a torch.library custom op over `impl`: under torch.compile the op itself (opaque and
    whole to Inductor), otherwise `impl` directly, through a torch.autograd.Function made of the op's own
    setup_context and backward when it has them. The custom-op machinery (dispatcher, dynamo guard, autograd
    shim) was ~70% of an eager call's host time (benchmarks/NOTES.md). A backward that calls other ops calls
    them through their own eager_or_op callers. "Under torch.compile" means dynamo tracing or any dispatch mode
    being active: AOTAutograd traces a registered backward under fake/proxy modes, and on torch 2.11 outside
    dynamo's is_compiling() (impls given fake tensors fail there); any other mode (a FLOP counter, a debug
    mode) sees the op as a whole too."""
    eager_fn = None
    if backward is not None:
        class _Eager(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                out = impl(*args)
                setup_context(ctx, args, out)
                return out

            @staticmethod
            def backward(ctx, *grads):
                return backward(ctx, *grads)
        eager_fn = _Eager.apply

    def call(*args, **kwargs):  # keywords only for ops without autograd (Function.apply takes none)
        if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
            return op(*args, **kwargs)
        return eager_fn(*args) if eager_fn is not None else impl(*args, **kwargs)
    return call


def _tma_scratch(size, align, stream):
    return torch.empty(size, dtype=torch.int8, device=_tma_scratch.device)


def ensure_tma_allocator(device: torch.device) -> None:
    """Kernels that build TMA descriptors in their body (tl.make_tensor_descriptor) need a small global
    scratch per program. Triton keeps the allocator in a context variable, i.e. per thread, and autograd runs
    the backward on its own thread: so call this at every launch that needs it."""
    import triton
    _tma_scratch.device = device
    triton.set_allocator(_tma_scratch)


def _triton_compiled_mode() -> bool:
    """True when triton was imported without the interpreter (its own jit helpers are then compiled-only)."""
    tl = sys.modules.get("triton.language")
    return tl is not None and type(tl.zeros).__name__ == "JITFunction"


_PROPS: dict = {}


def _props(device: torch.device):
    """A CUDA device's properties, read once: config lookups and launch planning ask on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROPS:
        _PROPS[index] = torch.cuda.get_device_properties(index)
    return _PROPS[index]


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 4 for the interpreter."""
    return _props(device).multi_processor_count if device.type == "cuda" else 4


def arch_key(device: torch.device) -> str:
    """A short key for per-architecture config tables: 'sm90', 'sm80', ..., or 'cpu'."""
    if device.type != "cuda":
        return "cpu"
    props = _props(device)
    return f"sm{props.major}{props.minor}"
