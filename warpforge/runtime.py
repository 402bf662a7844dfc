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
from typing import NamedTuple, Optional

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


def check_interpreted_matmul_dtype(backend: str, name: str, t: torch.Tensor) -> None:
    """The Triton interpreter's tl.dot is wrong on bf16 operands (it returns values of ~1e9): an op whose kernels
    multiply matrices refuses bf16 there rather than return garbage."""
    if backend == "triton" and t.device.type == "cpu" and t.dtype == torch.bfloat16:
        raise WarpforgeInputError(
            f"{name}: expected float16 or float32 on the Triton interpreter (its bf16 matmuls are wrong: run bf16 "
            f"on a GPU, or with backend='reference'), got bfloat16")


def _tma_scratch(size, align, stream):
    return torch.empty(size, dtype=torch.int8, device=_tma_scratch.device)


def ensure_tma_allocator(device: torch.device) -> None:
    """Kernels that build TMA descriptors in their body (tl.make_tensor_descriptor) need a small global
    scratch per program. Triton keeps the allocator in a context variable, i.e. per thread, and autograd runs
    the backward on its own thread: so call this at every launch that needs it."""
    import triton
    _tma_scratch.device = device
    triton.set_allocator(_tma_scratch)


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Whether tensor descriptors can address these tensors: 16-byte aligned bases and row strides, unit inner
    strides, no zero strides (an expanded row: a tensor map's strides are byte offsets between distinct rows, so
    such a view takes the pointer path). Which shapes use TMA at all is each family's config table's decision."""
    return all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and
               all(st > 0 and st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) for t in tensors)


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


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code: Triton 3.6's triton.cdiv is a constexpr function (~2 µs a call on a 2-core CPU,
    ~16 a call in an Evoformer fwd+bwd), where an eager call's host time is what a user waits for."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host code (see cdiv)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 4 for the interpreter."""
    return _props(device).multi_processor_count if device.type == "cuda" else 4


def arch_key(device: torch.device) -> str:
    """A short key for per-architecture config tables: 'sm90', 'sm80', ..., or 'cpu'."""
    if device.type != "cuda":
        return "cpu"
    props = _props(device)
    return f"sm{props.major}{props.minor}"


# ----------------------------------------------------------------------------------------- device specs
class DeviceSpec(NamedTuple):
    """What a GPU can do at most, from its datasheet: dense (non-sparse) tensor-core rates and the size of the
    last-level cache a benchmark must rotate its inputs past."""
    name: str
    bf16_flops: float
    fp8_flops: Optional[float]
    cache_bytes: int


_MiB = 2**20
# matched against torch.cuda.get_device_name() in this order, so the more specific names come first
DEVICE_SPECS = (
    ("H200", DeviceSpec("H200", 989e12, 1979e12, 50 * _MiB)),
    ("GH200", DeviceSpec("GH200", 989e12, 1979e12, 50 * _MiB)),
    ("H100 PCIe", DeviceSpec("H100 PCIe", 756e12, 1513e12, 50 * _MiB)),
    ("H100 NVL", DeviceSpec("H100 NVL", 835e12, 1671e12, 50 * _MiB)),
    ("H100", DeviceSpec("H100 SXM", 989e12, 1979e12, 50 * _MiB)),
    ("H20", DeviceSpec("H20", 148e12, 296e12, 60 * _MiB)),
    ("A100", DeviceSpec("A100", 312e12, None, 40 * _MiB)),
    ("L40S", DeviceSpec("L40S", 362e12, 733e12, 96 * _MiB)),
    ("RTX 4090", DeviceSpec("RTX 4090", 165e12, 330e12, 72 * _MiB)),
    ("GB200", DeviceSpec("GB200", 2500e12, 5000e12, 126 * _MiB)),
    ("B200", DeviceSpec("B200", 2250e12, 4500e12, 126 * _MiB)),
    ("MI325X", DeviceSpec("MI325X", 1307e12, 2615e12, 256 * _MiB)),  # the 256 MB Infinity Cache, not the L2
    ("MI300X", DeviceSpec("MI300X", 1307e12, 2615e12, 256 * _MiB)),
)
_SPECS: dict = {}


def device_spec(device: torch.device) -> DeviceSpec:
    """The device's DeviceSpec: from DEVICE_SPECS by name, else measured once (the bf16 rate of a large GEMM,
    the cache size the driver reports). The cache size is the larger of the table's and the driver's."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SPECS:
        props = _props(torch.device("cuda", index))
        name = torch.cuda.get_device_name(index)
        spec = next((s for key, s in DEVICE_SPECS if key in name), None)
        if spec is None:
            spec = DeviceSpec(name, measured_gemm_flops(torch.device("cuda", index)), None, 0)
        _SPECS[index] = spec._replace(cache_bytes=max(spec.cache_bytes, getattr(props, "L2_cache_size", 0)))
    return _SPECS[index]


def measured_gemm_flops(device: torch.device, n: int = 8192) -> float:
    """The bf16 rate of torch.matmul (cuBLAS / hipBLASLt) at n³, the fastest of the NN and NT layouts: the
    ceiling a kernel is measured against is the one the best library reaches on this machine."""
    import triton.testing
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = min(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
               for fn in (lambda: a @ b, lambda: a @ b.T))
    return 2 * n**3 / (best * 1e-3)
