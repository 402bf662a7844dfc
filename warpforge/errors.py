"""Input validation shared by every public op.

Each public op validates its arguments exactly once, at its public door, with these helpers; kernels
assume validated input. A failed check raises `WarpforgeInputError` naming the argument, what was
expected and what came.
"""
from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from typing import Callable, Iterable, Sequence, TypeVar

import torch

T = TypeVar("T")


class WarpforgeInputError(ValueError):
    """A public op was given an argument it cannot run on."""


def fail(name: str, expected: str, got: object) -> None:
    raise WarpforgeInputError(f"{name}: expected {expected}, got {got}")


def check_tensor(name: str, t: object) -> torch.Tensor:
    """A dense (strided) torch.Tensor: sparse, nested and other layouts have no strides the kernels could follow
    (and the references' ops fail on them with errors that name no argument)."""
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.layout != torch.strided or t.is_nested:
        fail(name, "a dense (strided) tensor", "a nested tensor" if t.is_nested else f"layout {t.layout}")
    return t


def check_rank(name: str, t: torch.Tensor, ranks: int | Sequence[int]) -> None:
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if t.dim() not in ranks:
        want = " or ".join(str(r) for r in ranks)
        fail(name, f"a {want}-d tensor", f"shape {tuple(t.shape)}")


def check_tensors(**specs: tuple) -> None:
    """check_tensors(name=(value, rank), ...): each is a tensor of that rank (rank None: any)."""
    for name, (t, rank) in specs.items():
        check_tensor(name, t)
        if rank is not None:
            check_rank(name, t, rank)


def check_dtype(name: str, t: torch.Tensor, dtypes: Iterable[torch.dtype]) -> None:
    dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        want = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        fail(name, f"dtype in ({want})", str(t.dtype).replace("torch.", ""))


def check_same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        fail(name, f"a tensor on {ref.device} (like {ref_name})", f"a tensor on {t.device}")


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        fail(name, f"dtype {ref.dtype} (like {ref_name})", str(t.dtype))


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.size(-1) > 1 and t.stride(-1) != 1:
        fail(name, "a contiguous last dimension (stride 1)", f"stride {t.stride()}")


def dense_like(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy of it where a tensor allocated like it (torch.empty_like, as kernels allocate
    outputs and gradients) would not have a unit last stride: a view whose last dim overlaps another dim of
    stride 1 (as_strided(..., (.., 1, 1))), for which empty_like orders the dims differently. The kernels write
    such buffers as if their last stride were 1. Contiguous tensors, the common case, cost one flag read."""
    if t.is_contiguous() or t.dim() < 2 or t.size(-1) <= 1:
        return t
    return t if torch.empty_like(t, device="meta").stride(-1) == 1 else t.contiguous()


def check_dim(name: str, t: torch.Tensor, dim: int, size: int, what: str = "") -> None:
    if t.size(dim) != size:
        label = f" ({what})" if what else ""
        fail(name, f"size {size} in dim {dim}{label}", f"shape {tuple(t.shape)}")


def check_choice(name: str, value: object, choices: Iterable[object]) -> None:
    choices = tuple(choices)
    if value not in choices:
        fail(name, f"one of {choices}", repr(value))


def check_cu_seqlens(name: str, cu: torch.Tensor, ref: torch.Tensor, read_values: bool = True):
    """cu_seqlens: int32, 1-d, on ref's device, starting at 0, non-decreasing, ending at ref.size(0).

    Checking the values reads the tensor on the host (a device sync); with read_values=False only its
    type, rank, device and size are checked, and None is returned.
    """
    check_tensor(name, cu)
    check_rank(name, cu, 1)
    check_dtype(name, cu, (torch.int32,))
    check_same_device(name, cu, "q", ref)
    if cu.numel() < 2:
        fail(name, "at least 2 entries (batch + 1)", f"{cu.numel()}")
    if not read_values:
        return None
    host = cu.detach().to("cpu", torch.int64)
    if int(host[0]) != 0:
        fail(name, "first entry 0", int(host[0]))
    if bool((host[1:] < host[:-1]).any()):
        fail(name, "non-decreasing offsets", host.tolist()[:16])
    if int(host[-1]) != ref.size(0):
        fail(name, f"last entry equal to total tokens {ref.size(0)}", int(host[-1]))
    return host


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        fail(name, "a bool", repr(value))


def check_no_grad(name: str, t: torch.Tensor, op: str) -> None:
    """t does not require grad while grad mode is on: for forward-only ops, whose Triton path has no backward while
    the reference's would differentiate, so one contract holds on both backends instead of a dropped gradient."""
    if torch.is_grad_enabled() and t.requires_grad:
        fail(name, f"a tensor that does not require grad ({op} is forward-only; call it under torch.no_grad() or "
             "detach)", "requires_grad=True")


def check_int(name: str, value: object, lo: int | None = None, hi: int | None = None, what: str = "") -> None:
    """An int (not a bool) within [lo, hi] where given."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = "" if lo is None and hi is None else (f" from {lo}" if lo is not None else "") + \
            (f" to {hi}" if hi is not None else "")
        fail(name, what or f"an int{bounds}", repr(value))


FP32_TINY, FP32_MAX = 1.1754943508222875e-38, 3.4028234663852886e+38  # the normal fp32 range
# the largest scale-like argument taken: kernels multiply it by small constants (log2(e), a score) in fp32, where
# 3e38 · log2(e) is already inf; no real softmax scale, softcap or eps comes near
SCALE_MAX = 1e30


def check_positive_float(name: str, value: object, allow_none: bool = True, allow_zero: bool = False) -> None:
    """A float (or int) > 0 (>= 0 with allow_zero) from fp32's smallest normal to SCALE_MAX, since the kernels
    compute in fp32 (1e-300 would be 0 there, 1e300 inf), or None where allowed."""
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        ((allow_zero and value == 0) or FP32_TINY <= value <= SCALE_MAX)
    if not ok:
        fail(name, f"a float {'>= 0' if allow_zero else '> 0'} from 1.2e-38 to {SCALE_MAX:g}" +
             (" or None" if allow_none else ""), repr(value))


def host_reads_allowed(t: torch.Tensor) -> bool:
    """Whether a check may read t's values on the host: not while torch.compile traces or a CUDA graph is being
    captured (a read would sync or break the capture; shapes and dtypes are still checked then)."""
    if torch.compiler.is_compiling() or t.device.type == "meta":
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


_READ: "OrderedDict[tuple, tuple]" = OrderedDict()


def read_once(tensors: tuple, context: tuple, read: Callable[[], T]) -> T:
    """read(), a check that reads these tensors' values on the host (a sync), once for as long as the same tensor
    objects come back with unchanged values (their version counters) in the same context: the offsets every layer
    of a step passes are read back once, not once per layer. A failed check is not remembered."""
    try:
        versions = tuple(t._version for t in tensors)
    except RuntimeError:  # inference-mode tensors keep no version counter
        return read()
    key = tuple(id(t) for t in tensors) + tuple(context)
    hit = _READ.get(key)
    if hit is not None and hit[1] == versions and all(ref() is t for ref, t in zip(hit[0], tensors)):
        _READ.move_to_end(key)
        return hit[2]
    result = read()
    _READ[key] = (tuple(weakref.ref(t) for t in tensors), versions, result)
    if len(_READ) > 64:
        _READ.popitem(last=False)
    return result
