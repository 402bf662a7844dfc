"""The benchmark registry: per family, the shapes, their FLOP and byte counts, and the baselines.

A `Case` knows how to build a `Setup` on a device: inputs rotated past the last-level cache, one callable per
implementation (ours is "warpforge"), and how to score each output against the fp32 reference. Every module
`warpforge/bench/<name>_cases.py` is found and imported by `families()`; it registers its cases with
`@register`, and `warpforge bench --family NAME` picks them by family.
"""
from __future__ import annotations

import importlib
import logging
import math
import os
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..runtime import device_spec

log = logging.getLogger(__name__)


@dataclass
class Setup:
    flops: float
    bytes: float
    impls: dict[str, Callable[[], Any]]  # each call runs one step on the next rotated input set
    score: Callable[[Any], float] | None = None  # an impl's output on set 0 -> error vs the reference
    reset: Callable[[], None] = lambda: None  # the next impl call runs on set 0
    err_kind: str = "rel_l2"
    tol: float = 1e-2  # the error at which an impl's output counts as wrong
    tokens: int | None = None  # tokens processed per call, for tokens/s
    ran: str | None = None  # the shape actually run (the interpreter runs small ones)


@dataclass
class Case:
    family: str
    name: str
    build: Callable[[torch.device, bool], Setup]  # (device, tiny) -> Setup; tiny = interpreter sizes
    quick: bool = False
    tags: dict = field(default_factory=dict)


REGISTRY: list[Case] = []


def register(family: str, name: str, quick: bool = False, **tags):
    def wrap(build):
        REGISTRY.append(Case(family, name, build, quick, tags))
        return build
    return wrap


class Rotation:
    """Several input sets, handed out round-robin, enough that L2 cannot hold them. `reset()` makes the
    next call get set 0, the one the reference is computed on."""

    def __init__(self, make_set: Callable[[], Any], bytes_per_set: float, device: torch.device):
        n = 1
        if device.type == "cuda":  # 3x the cache in flight, so no impl is served from it
            n = max(2, min(16, math.ceil(3 * device_spec(device).cache_bytes / max(bytes_per_set, 1))))
        self.sets = [make_set() for _ in range(n)]
        self.i = 0

    def __call__(self):
        s = self.sets[self.i % len(self.sets)]
        self.i += 1
        return s

    def reset(self):
        self.i = 0


def timed_as(fn: Callable[[], Any], timer: str) -> Callable[[], Any]:
    """fn, labelled with how it runs ("cuda graph replay", or eager and why): the runner writes the label into the
    row, so that a row whose capture failed is not read as graph-timed beside rows that were."""
    fn.timer = timer
    return fn


def graphed(step: Callable[[Any], Any], rot: Rotation, device: torch.device) -> Callable[[], Any]:
    """A callable that replays `step(set)` for the next rotated set from a CUDA graph captured per set: how
    serving runs decode (launch costs gone, host-side value checks skipped inside the capture). Off CUDA,
    or for steps that cannot be captured, it calls step directly (its `timer` label says so)."""
    if device.type != "cuda":
        return timed_as(lambda: step(rot()), "eager (no CUDA)")
    graphs = []
    for s in rot.sets:
        # compile and validate once, outside the capture, on a side stream as PyTorch's graph docs warm up (so that
        # libraries' per-stream state, cuBLAS's workspace, is made before the capture, not inside it)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(s)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                out = step(s)
        except RuntimeError as exc:  # not capturable (a host sync, say): time it as it is, and say so
            torch.cuda.synchronize()
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            log.warning(f"bench: a step could not be captured, timed eagerly ({why})")
            return timed_as(lambda: step(rot()), f"eager (capture failed: {why})")
        graphs.append((g, out))

    def replay():
        g, out = graphs[rot.i % len(graphs)]
        rot.i += 1  # the same round-robin as rot(): reset() still means "set 0 next"
        g.replay()
        return out
    return timed_as(replay, "cuda graph replay")


def peak_memory(impls, rot, device) -> str:
    """Each impl's peak allocation above the memory in use before its call (after one warm-up call)."""
    parts = []
    for name, fn in impls.items():
        try:
            fn()
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            result = fn()
            torch.cuda.synchronize(device)
            parts.append(f"{name} {(torch.cuda.max_memory_allocated(device) - base) / 2**20:.0f}")
            del result
        except Exception as exc:  # the timing run reports the error itself
            parts.append(f"{name} failed ({type(exc).__name__})")
        torch.cuda.empty_cache()
    rot.reset()
    return "; peak MiB " + ", ".join(parts)


def families() -> list[str]:
    """Imports every *_cases module of this package once (each registers its cases); the families found."""
    for mod in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if mod.name.endswith("_cases"):
            importlib.import_module(f"{__package__}.{mod.name}")
    return sorted({c.family for c in REGISTRY})


def select(family: str | None = None, quick: bool = False) -> list[Case]:
    families()
    cases = [c for c in REGISTRY if family in (None, "all", c.family)]
    if quick:
        cases = [c for c in cases if c.quick]
    return cases
