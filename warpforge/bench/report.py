"""The bench report: a table on stdout, JSON, and an optional PNG."""
from __future__ import annotations

import json
import math
import os


def _fmt(x, spec):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


_MACHINE_KEYS = ("gpu", "torch", "triton", "git_commit")
_GPU_MACHINE_KEYS = ("copy_tbps", "gemm_tflops")  # the measured ceilings, absent from interpreter runs
_ROW_KEYS = ("family", "case", "impl")


def check_result(result) -> None:
    """A ValueError (one line) unless result has the shape write_json writes, which table reads: {"machine":
    {gpu, torch, triton, git_commit, (on a GPU) copy_tbps, gemm_tflops, ...}, "rows": [{family, case, impl, ...},
    ...]}."""
    def wrong(what):
        raise ValueError(f"not a `warpforge bench --json` result: {what}")
    if not isinstance(result, dict):
        wrong(f"a JSON {type(result).__name__}, not an object")
    for key, kind in (("machine", dict), ("rows", list)):
        if not isinstance(result.get(key), kind):
            wrong(f"no {key!r} {'object' if kind is dict else 'list'}")
    machine = result["machine"]
    missing = [k for k in _MACHINE_KEYS + (() if machine.get("interpreter") else _GPU_MACHINE_KEYS)
               if k not in machine]
    if missing:
        wrong(f"'machine' lacks {', '.join(missing)}")
    for i, row in enumerate(result["rows"]):
        if not isinstance(row, dict) or any(k not in row for k in _ROW_KEYS):
            wrong(f"row {i} is not an object with {', '.join(_ROW_KEYS)}")


def table(result: dict) -> str:
    m = result["machine"]
    interpreted = bool(m.get("interpreter"))
    head = (f"{m['gpu']} | torch {m['torch']} | triton {m['triton']} | commit {m['git_commit'][:10]}")
    if not interpreted:
        head += f" | copy {_fmt(m['copy_tbps'], '.2f')} TB/s | bf16 GEMM {_fmt(m['gemm_tflops'], '.0f')} TFLOP/s"
    lines = [head]
    if interpreted:
        lines.append("No GPU: the kernels ran through the Triton interpreter at the small shapes in 'ran' (not the "
                     "case's own), to check them against their references. Times are interpreter times, not GPU "
                     "times, so no rates are shown.")
        cols = ["family", "case", "ran", "impl", "ms", "error", "verdict"]
    else:
        cols = ["family", "case", "impl", "ms", "TFLOP/s", "GB/s", "%limit", "speedup", "error", "verdict"]
    body = [_row(r, interpreted) for r in result["rows"]]
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *body)]
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in body]
    wrong = [r for r in result["rows"] if r.get("ok") is False]
    lines.append(f"{len(wrong)} output(s) outside tolerance" if wrong else "every output within tolerance")
    uncaptured = [r for r in result["rows"] if str(r.get("timer", "")).startswith("eager (capture failed")]
    if uncaptured:  # the others of their case replayed graphs: these rows carry launch costs the others do not
        lines.append(f"{len(uncaptured)} row(s) timed eagerly, their capture failed: "
                     + "; ".join(f"{r['case']} / {r['impl']}" for r in uncaptured))
    return "\n".join(lines)


def _row(r: dict, interpreted: bool) -> list:
    lead = [r["family"], r["case"]] + ([r.get("ran") or "-"] if interpreted else []) + [r["impl"]]
    if r.get("ms") is None:
        return lead + ["FAILED"] + [""] * (1 if interpreted else 5) + [r.get("error", "")[:60]]
    err = f"{_fmt(r.get('err'), '.1e')} ({r.get('err_kind', 'err')})" if r.get("err") is not None else "-"
    verdict = "-" if r.get("err") is None else ("ok" if r.get("ok") else f"WRONG (tol {r.get('tol'):.0e})")
    if interpreted:
        return lead + [_fmt(r["ms"], ".1f"), err, verdict]
    sp = r.get("speedup")
    return lead + [_fmt(r["ms"], ".3f"), _fmt(r.get("tflops"), ".1f"), _fmt(r.get("gbps"), ".0f"),
                   _fmt(100 * r["frac_limit"], ".0f") + "%" if r.get("frac_limit") else "-",
                   f"{sp:.2f}x vs {r['best_baseline']}" if sp else "", err, verdict]


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=float)


def plot(result: dict, path: str) -> None:
    """TFLOP/s per case, one bar per impl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("tflops")]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, len(cases) * 0.9), 5))
    width = 0.8 / max(len(impls), 1)
    for j, impl in enumerate(impls):
        vals = [next((r["tflops"] for r in rows if r["case"] == c and r["impl"] == impl), 0) for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], vals, width, label=impl)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels(cases, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"warpforge bench on {result['machine']['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
