"""Where GPU time goes: the kernels of a profiled stretch by total GPU time, beside its wall time. When the
wall time is much larger than the kernels' sum the work is bound by the host (launches, Python, waits), not
by the kernels. Used by scripts/profile_case.py (bench cases) and by `gpt train` (WARPFORGE_PROFILE_STEPS).
"""
from __future__ import annotations

import logging
import os
import time
from collections import defaultdict

import torch

log = logging.getLogger(__name__)


def kernel_table(prof, iters: int, top: int = 15) -> tuple[float, float, list[str]]:
    """From a finished torch.profiler run over `iters` repetitions: (kernel ms per repetition, launches per
    repetition, lines of the top kernels with their ms and count per repetition)."""
    kernels = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name[:90]]
            k[0] += ev.device_time_total / 1000 / iters
            k[1] += 1
    busy = sum(v[0] for v in kernels.values())
    launches = sum(v[1] for v in kernels.values()) / iters
    lines = [f"  {ms:8.3f} ms  {n / iters:5.0f}x  {name}"
             for name, (ms, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]]
    return busy, launches, lines


def idle_gaps(prof, iters: int, top: int = 8, min_us: float = 5.0) -> tuple[float, list[str]]:
    """Where the GPU ran nothing at all (no kernel, copy or memset on any stream) inside a finished profile:
    (idle ms per repetition, lines of the longest gaps with the work on either side). A gap after the last
    kernel of one phase and before the first of the next points at the host code between them."""
    spans = sorted((ev.time_range.start, ev.time_range.end, ev.name[:60]) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA)
    gaps, end, before = [], None, None
    for start, stop, name in spans:
        if end is not None and start - end > min_us:
            gaps.append((start - end, before, name))
        if end is None or stop > end:
            end, before = stop, name
    idle = sum(g for g, _, _ in gaps) / 1000 / iters
    lines = [f"  {us:8.1f} us idle  after {a}  before {b}" for us, a, b in sorted(gaps, reverse=True)[:top]]
    return idle, lines


class StepProfiler:
    """WARPFORGE_PROFILE_STEPS=A:B profiles training steps A+1..B (after warm-up and graph capture) on one
    process and logs (to the "warpforge" logger), per step, the wall time beside the kernels' GPU time, the top
    kernels and the GPU's longest idle gaps (the profiler's own host cost makes host-bound stretches look longer
    than they are)."""

    def __init__(self, enabled: bool):
        spec = os.environ.get("WARPFORGE_PROFILE_STEPS", "") if enabled and torch.cuda.is_available() else ""
        self.first, self.last = map(int, spec.split(":")) if spec else (None, None)
        self.prof = None

    def after_step(self, step: int) -> None:
        if self.first is None:
            return
        if step == self.first:
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()
        elif step == self.last and self.prof is not None:
            torch.cuda.synchronize()
            n = self.last - self.first
            wall = (time.perf_counter() - self.t0) * 1000 / n
            self.prof.__exit__(None, None, None)
            busy, launches, lines = kernel_table(self.prof, n)
            idle, gap_lines = idle_gaps(self.prof, n, top=12)
            log.info(f"profile of steps {self.first + 1}-{self.last}: {wall:.2f} ms a step, kernels {busy:.2f} ms "
                f"({launches:.0f} launches a step)\n" + "\n".join(lines) +
                f"\nGPU idle {idle:.2f} ms a step; longest gaps:\n" + "\n".join(gap_lines))
            self.prof = None
