"""Runs registered cases: every impl on the same rotated inputs, in one process, beside the machine's
measured ceilings (copy bandwidth, bf16 GEMM rate)."""
from __future__ import annotations

import os
import platform
import subprocess
import time
import traceback

import torch

from ..runtime import measured_gemm_flops
from .cases import Case


def _git_commit() -> str:
    env = os.environ.get("WARPFORGE_GIT_COMMIT")
    if env:
        return env
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0]
    except Exception:
        return "unknown"


def _time_ms(fn, device) -> float:
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure_ceilings(device) -> tuple[float, float]:
    """(copy TB/s counting read + write, bf16 GEMM TFLOP/s as the fastest cuBLAS layout runs 8192³ random data)."""
    if device.type != "cuda":
        return float("nan"), float("nan")
    n = 2 * 2**30
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device)
    copy_tbps = 2 * n / (ms * 1e-3) / 1e12
    src = dst = None  # free the 4 GB before the GEMM
    return copy_tbps, measured_gemm_flops(device) / 1e12


def machine_info(device) -> dict:
    import triton
    info = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor()})",
        "driver": _driver() if device.type == "cuda" else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "git_commit": _git_commit(),
        "interpreter": device.type != "cuda",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    info["copy_tbps"], info["gemm_tflops"] = measure_ceilings(device)
    return info


def run_case(case: Case, device, machine: dict, log=print) -> list[dict]:
    tiny = device.type != "cuda"
    try:
        setup = case.build(device, tiny)
    except Exception as exc:  # a baseline missing on this machine must not stop the suite
        log(f"  {case.name}: setup failed: {exc!r}")
        return [dict(family=case.family, case=case.name, impl="warpforge", ms=None, error=repr(exc))]
    rows = []
    for impl, fn in setup.impls.items():
        row = dict(family=case.family, case=case.name, impl=impl, ran=setup.ran, err_kind=setup.err_kind,
                   tol=setup.tol)
        if getattr(fn, "timer", None):  # graphed() labels its callables: replayed, or eager and why
            row["timer"] = fn.timer
        try:
            err = None
            if setup.score is not None:
                setup.reset()
                err = setup.score(fn())
            ms = _time_ms(fn, device)
            row.update(ms=ms, err=err, ok=err is None or err <= setup.tol, tflops=setup.flops / (ms * 1e-3) / 1e12 if setup.flops else None,
                       gbps=setup.bytes / (ms * 1e-3) / 1e9 if setup.bytes else None)
            if setup.tokens:
                row["tokens_per_s"] = setup.tokens / (ms * 1e-3)
            if device.type == "cuda":
                floor_ms = max(setup.flops / (machine["gemm_tflops"] * 1e12),
                               setup.bytes / (machine["copy_tbps"] * 1e12)) * 1e3
                row["frac_limit"] = floor_ms / ms
                row["bound"] = ("compute" if setup.flops / (machine["gemm_tflops"] * 1e12)
                                >= setup.bytes / (machine["copy_tbps"] * 1e12) else "memory")
        except Exception as exc:
            row.update(ms=None, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            if os.environ.get("WARPFORGE_BENCH_DEBUG"):
                traceback.print_exc()
        rows.append(row)
    # "warpforge" and its variants ("warpforge (eager)") against every baseline
    base = [r for r in rows if not r["impl"].startswith("warpforge") and r.get("ms")]
    best = min(base, key=lambda r: r["ms"]) if base else None
    for ours in (r for r in rows if best and r["impl"].startswith("warpforge") and r.get("ms")):
        ours["best_baseline"] = best["impl"]
        ours["speedup"] = best["ms"] / ours["ms"]
        for r in base:
            ours[f"speedup_vs_{r['impl']}"] = r["ms"] / ours["ms"]
    del setup
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run(cases: list[Case], device, log=print, checkpoint=None) -> dict:
    """checkpoint(result) is called after every case, so a run cut short still leaves its rows."""
    machine = machine_info(device)
    result = {"machine": machine, "rows": []}
    for i, case in enumerate(cases):
        log(f"[{i + 1}/{len(cases)}] {case.family}: {case.name}")
        result["rows"].extend(run_case(case, device, machine, log))
        if checkpoint:
            checkpoint(result)
    return result
