"""Helpers every family's tests use: error metrics, poisoned outputs, awkward shapes, the gpu marker."""
from __future__ import annotations

import contextlib
import random
from typing import Iterator

import torch

# Thresholds by dtype (DESIGN.md): relative L2 for fp32/fp16/bf16, cosine similarity for fp8/fp4.
REL_L2 = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
COSINE = {"fp8": 0.999, "fp4": 0.99}


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere in out gives inf."""
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return float("inf")
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().flatten(), ref.detach().double().flatten()
    if not torch.isfinite(out).all():
        return float("-inf")
    return torch.nn.functional.cosine_similarity(out, ref, dim=0).item()


def max_abs(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return float("inf")
    return (out - ref).abs().max().item() if out.numel() else 0.0


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Inside the block, torch.empty / torch.empty_like hand out NaN-filled float tensors (and -1 for
    ints), so an element a kernel forgets to write shows up as NaN instead of lucky zeros."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype not in (torch.bool,) and not t.is_complex():
            t.fill_(-1)
        return t

    torch.empty = lambda *a, **kw: poison(real_empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(real_empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def awkward_lengths(block: int = 16, rng: random.Random | None = None) -> list[int]:
    """Sequence lengths that stress block edges: 1, a block minus one, a block plus one, and a random
    non-multiple."""
    rng = rng or random.Random(0)
    return [1, block - 1, block + 1, rng.randrange(2, 4 * block) | 1]


def ragged_cu_seqlens(lengths: list[int], device="cpu") -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def device_under_test() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def dtypes_under_test() -> list[torch.dtype]:
    """bf16 is only trusted on a GPU: the interpreter's tl.dot on bf16 operands is wrong."""
    return [torch.float16, torch.bfloat16] if torch.cuda.is_available() else [torch.float16]
