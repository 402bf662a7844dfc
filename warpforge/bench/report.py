"""The bench report: a table on stdout, JSON, and an optional PNG."""
from __future__ import annotations

import json
import math
import os


def _fmt(x, spec):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def table(result: dict) -> str:
    m = result["machine"]
    head = (f"{m['gpu']} | torch {m['torch']} | triton {m['triton']} | commit {m['git_commit'][:10]} | "
            f"copy {_fmt(m['copy_tbps'], '.2f')} TB/s | bf16 GEMM {_fmt(m['gemm_tflops'], '.0f')} TFLOP/s")
    lines = [head]
    if m.get("interpreter"):
        lines.append("NOTE: no GPU here. Kernels ran through the Triton interpreter at tiny sizes to check them "
                     "against the reference; the times below are interpreter times, not GPU times.")
    cols = ["family", "case", "impl", "ms", "TFLOP/s", "GB/s", "%limit", "speedup", "err"]
    body = []
    for r in result["rows"]:
        if r.get("ms") is None:
            body.append([r["family"], r["case"], r["impl"], "FAILED", "", "", "", "", r.get("error", "")[:60]])
            continue
        sp = r.get("speedup")
        body.append([r["family"], r["case"], r["impl"], _fmt(r["ms"], ".3f"), _fmt(r.get("tflops"), ".1f"),
                     _fmt(r.get("gbps"), ".0f"),
                     _fmt(100 * r["frac_limit"], ".0f") + "%" if r.get("frac_limit") else "-",
                     f"{sp:.2f}x vs {r['best_baseline']}" if sp else "",
                     _fmt(r.get("err"), ".1e")])
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *body)]
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


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
