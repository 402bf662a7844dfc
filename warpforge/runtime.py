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


def _triton_compiled_mode() -> bool:
    """True when triton was imported without the interpreter (its own jit helpers are then compiled-only)."""
    tl = sys.modules.get("triton.language")
    return tl is not None and type(tl.zeros).__name__ == "JITFunction"


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached: launch planning asks on every call); 4 for the interpreter."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def arch_key(device: torch.device) -> str:
    """A short key for per-architecture config tables: 'sm90', 'sm80', ..., or 'cpu'."""
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"
