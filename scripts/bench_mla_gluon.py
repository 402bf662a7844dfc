"""MLA decode on an H200: the Hopper Gluon kernel (decode_gluon_kernel.py) against the portable Triton kernel, in
one process, timed from CUDA-graph replay.

    python scripts/bench_mla_gluon.py --out mla_gluon.json [--hq 128,64] [--lens 1024,...] [--sweep]

Cases: b 128, s_q 1, page 64, cache_seqlens L + 2i (request i), pages shuffled, for h_q 128 and 64 and L
1k..32k. Per case: ms of each path (its planned split count), TFLOP/s (2 · h_q · s_q · Σ s_k · 1088) and
1 − cos against the fp32 reference (over the first REF_REQUESTS requests, which see the same inputs).
--sweep: at L 8k, the Gluon kernel's split counts 1-6, called directly. --sweep-only skips the cases.
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import warpforge as wf  # noqa: E402
from warpforge.ops.mla import configs, mla_decode_reference  # noqa: E402
from warpforge.ops.mla import decode_gluon_kernel as dg  # noqa: E402
from warpforge.testing import cosine  # noqa: E402

B, S_Q, PAGE = 128, 1, 64
REF_REQUESTS = 4
FLASHMLA_HQ128_MS = {1024: 0.092, 2048: 0.142, 4096: 0.240, 8192: 0.458, 16384: 1.017, 32768: 2.028}


def problem(h_q, L, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = [L + 2 * i for i in range(B)]
    max_pages = -(-max(lens) // PAGE)
    pages = B * max_pages
    q = torch.randn(B, S_Q, h_q, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    cache = torch.randn(pages, PAGE, 1, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randperm(pages, device="cuda", generator=g)[: B * max_pages].view(B, max_pages).int()
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, cache, table, seqlens, sum(lens)


def graph_ms(fn, reps=None):
    """ms per call of fn replayed from a CUDA graph (fn already ran once outside, so it is compiled)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    reps = reps or max(5, min(200, int(0.25 / max(once, 1e-5))))
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps, out


def one_minus_cos(out, q, cache, table, seqlens):
    n = REF_REQUESTS
    sub = cache[table[:n].long()].flatten(0, 1).float()  # the first n requests' pages, in table order
    sub_table = torch.arange(sub.shape[0], device=q.device, dtype=torch.int32).view(n, -1)
    ref, _ = mla_decode_reference(q[:n].float(), sub, sub_table, seqlens[:n])
    return 1 - cosine(out[:n], ref)


def set_gluon(on):
    os.environ[configs.GLUON_ENV] = "1" if on else "0"


def run_case(h_q, L):
    t0 = time.time()
    q, cache, table, seqlens, total = problem(h_q, L)
    flops = 2 * h_q * S_Q * total * 1088
    row = {"h_q": h_q, "L": L, "b": B}
    for name, on in (("gluon", True), ("portable", False)):
        set_gluon(on)
        plan = wf.mla.plan(q, cache, table)
        if on and not plan.gluon:
            row[name] = {"error": "gate closed (not sm_90 / Triton not in GLUON_TRITON_VERSIONS)"}
            continue
        try:
            ms, out = graph_ms(lambda: plan.run(q, cache, table, seqlens)[0])
            row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "splits": plan.num_splits,
                         "one_minus_cos": one_minus_cos(out, q, cache, table, seqlens)}
        except Exception as e:  # noqa: BLE001 - report and go on with the other path / cases
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    set_gluon(True)
    g, p = row.get("gluon", {}), row.get("portable", {})
    fm = FLASHMLA_HQ128_MS.get(L) if h_q == 128 else None
    if "ms" in g:
        row["speedup_vs_portable"] = p["ms"] / g["ms"] if "ms" in p else None
        row["vs_flashmla"] = fm / g["ms"] if fm else None
    fmt = lambda d: (f"{d['ms']:7.3f} ms {d['tflops']:6.1f} TF/s s{d['splits']} 1-cos {d['one_minus_cos']:.1e}"
                     if "ms" in d else d.get("error", "-"))
    print(f"h_q {h_q:3d} L {L:6d} | gluon {fmt(g)} | portable {fmt(p)}"
          + (f" | {row['speedup_vs_portable']:.2f}x portable" if row.get("speedup_vs_portable") else "")
          + (f", {row['vs_flashmla']:.2f}x FlashMLA" if row.get("vs_flashmla") else "")
          + f" [{time.time() - t0:.0f} s]", flush=True)
    del q, cache, table, seqlens
    torch.cuda.empty_cache()
    return row


def sweep(h_q, L=8192):
    q, cache, table, seqlens, total = problem(h_q, L)
    flops = 2 * h_q * S_Q * total * 1088
    rows = []
    for splits in (1, 2, 3, 4, 6):
        try:
            ms, out = graph_ms(lambda: dg.mla_decode_gluon(q, cache, table, seqlens, 576 ** -0.5, False, splits)[0])
            r = {"h_q": h_q, "L": L, "splits": splits, "ms": ms, "tflops": flops / ms / 1e9,
                 "one_minus_cos": one_minus_cos(out, q, cache, table, seqlens)}
            print(f"sweep h_q {h_q} L {L} splits {splits}: {ms:.3f} ms {r['tflops']:.1f} TF/s "
                  f"1-cos {r['one_minus_cos']:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001
            r = {"h_q": h_q, "L": L, "splits": splits, "error": f"{type(e).__name__}: {e}"[:300]}
            print(f"sweep h_q {h_q} splits {splits}: {r['error']}", flush=True)
        rows.append(r)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--hq", default="128,64")
    ap.add_argument("--lens", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--sweep", action="store_true", help="also try the Gluon kernel's split counts at L 8k")
    ap.add_argument("--sweep-only", action="store_true")
    args = ap.parse_args()
    import triton
    dev = torch.cuda.get_device_name()
    print(f"{dev} sm_{''.join(map(str, torch.cuda.get_device_capability()))} torch {torch.__version__} "
          f"triton {triton.__version__}; Gluon available: {dg.available()}", flush=True)
    t0 = time.time()
    result = {"device": dev, "triton": triton.__version__, "torch": torch.__version__, "cases": [], "sweep": []}
    if not args.sweep_only:
        for h_q in map(int, args.hq.split(",")):
            for L in map(int, args.lens.split(",")):
                result["cases"].append(run_case(h_q, L))
    if args.sweep or args.sweep_only:
        for h_q in map(int, args.hq.split(",")):
            result["sweep"] += sweep(h_q)
    result["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
