"""MLA decode on an H200: the seesaw Gluon kernel (decode_seesaw_kernel.py) checked against the fp32 reference on
small awkward shapes, then timed beside the first Gluon kernel and the portable kernel in one process (CUDA-graph
replay, b 128, s_q 1, page 64, cache_seqlens L + 2i, pages shuffled).

    python scripts/check_mla_seesaw.py --out seesaw.json [--lens 1024,...] [--hq 128,64] [--check-only]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import warpforge as wf  # noqa: E402
from warpforge.ops.mla import decode_gluon_kernel as dg  # noqa: E402
from warpforge.ops.mla import decode_seesaw_kernel as ds  # noqa: E402
from warpforge.ops.mla import mla_decode_reference  # noqa: E402
from warpforge.testing import cosine  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mla_gluon import FLASHMLA_HQ128_MS, graph_ms, one_minus_cos, problem, set_gluon  # noqa: E402


def check(h_q, s_q, lens, splits, causal, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = len(lens)
    max_pages = max(1, -(-max(lens) // 64))
    pages = b * max_pages + 3
    q = torch.randn(b, s_q, h_q, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    cache = torch.randn(pages, 64, 1, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    cache[-1].fill_(float("nan"))  # a page no request owns: must never be read into a result
    table = torch.randperm(pages - 1, device="cuda", generator=g)[: b * max_pages].view(b, max_pages).int()
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    # rows past each request's length on its last page: NaN (a kernel must not let them reach the output)
    for i, n in enumerate(lens):
        if n % 64:
            cache[table[i, n // 64].long(), n % 64:] = float("nan")
    scale = 576 ** -0.5
    out, lse = ds.mla_decode_seesaw(q, cache, table, seqlens, scale, causal, splits)
    torch.cuda.synchronize()
    clean = torch.nan_to_num(cache, nan=0.0)
    ref, ref_lse = mla_decode_reference(q.float(), clean.float(), table, seqlens, softmax_scale=scale, causal=causal)
    nonempty = seqlens > 0
    ok = bool(torch.isfinite(out).all())
    cos = 1 - cosine(out[nonempty], ref[nonempty]) if nonempty.any() else 0.0
    seen = torch.isfinite(ref_lse)  # rows that see no token (causal, s_q > length) have lse -inf in both
    lse_err = (lse[seen] - ref_lse[seen]).abs().max().item() if seen.any() else 0.0
    ok = ok and bool((lse[~seen] == float("-inf")).all())
    empty_ok = bool((out[~nonempty] == 0).all()) if (~nonempty).any() else True
    good = ok and cos < 1e-5 and lse_err < 1e-3 and empty_ok
    print(f"check h_q {h_q} s_q {s_q} causal {causal} splits {splits} lens {lens}: finite {ok} 1-cos {cos:.1e} "
          f"lse err {lse_err:.1e} empty ok {empty_ok} -> {'ok' if good else 'FAIL'}", flush=True)
    return good


def run_case(h_q, L, splits_list):
    q, cache, table, seqlens, total = problem(h_q, L)
    flops = 2 * h_q * total * 1088
    row = {"h_q": h_q, "L": L}
    set_gluon(True)
    plan = wf.mla.plan(q, cache, table)
    ms, out = graph_ms(lambda: plan.run(q, cache, table, seqlens)[0])
    row["gluon"] = {"ms": ms, "splits": plan.num_splits, "tflops": flops / ms / 1e9}
    set_gluon(False)
    plan_p = wf.mla.plan(q, cache, table)
    ms, out = graph_ms(lambda: plan_p.run(q, cache, table, seqlens)[0])
    row["portable"] = {"ms": ms, "splits": plan_p.num_splits, "tflops": flops / ms / 1e9}
    set_gluon(True)
    best = None
    for splits in splits_list:
        ms, out = graph_ms(lambda: ds.mla_decode_seesaw(q, cache, table, seqlens, 576 ** -0.5, False, splits)[0])
        err = one_minus_cos(out, q, cache, table, seqlens)
        row[f"seesaw_s{splits}"] = {"ms": ms, "tflops": flops / ms / 1e9, "one_minus_cos": err}
        if best is None or ms < best[0]:
            best = (ms, splits)
    fm = FLASHMLA_HQ128_MS.get(L) if h_q == 128 else None
    row["seesaw_best"] = {"ms": best[0], "splits": best[1]}
    print(f"h_q {h_q:3d} L {L:6d} | seesaw " + " ".join(f"s{s} {row[f'seesaw_s{s}']['ms']:.3f}" for s in splits_list)
          + f" (1-cos {row[f'seesaw_s{splits_list[0]}']['one_minus_cos']:.1e}) | gluon {row['gluon']['ms']:.3f}"
          f" s{row['gluon']['splits']} | portable {row['portable']['ms']:.3f} | best {best[0]:.3f} ms = "
          f"{flops / best[0] / 1e9:.0f} TF/s, {row['gluon']['ms'] / best[0]:.2f}x gluon"
          + (f", {fm / best[0]:.2f}x FlashMLA's table" if fm else ""), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--hq", default="128,64")
    ap.add_argument("--lens", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--splits", default="1,2,3")
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name(), "checks": [], "cases": []}
    cases = [
        (128, 1, [1, 64, 65, 128, 200, 1000], 1, False),   # one page, pages odd and even, partial pages
        (128, 1, [0, 63, 129, 4096 + 7], 3, False),        # an empty request, splits with odd page counts
        (64, 1, [300, 5000, 17], 2, False),
        (64, 2, [100, 2000, 64], 1, True),                  # MTP: two query tokens, causal
        (32, 4, [777, 90], 2, True),
        (128, 2, [3000, 1], 4, True),
    ]
    for h_q, s_q, lens, splits, causal in cases:
        result["checks"].append({"h_q": h_q, "s_q": s_q, "lens": lens, "splits": splits, "causal": causal,
                                 "ok": check(h_q, s_q, lens, splits, causal)})
    if not args.check_only and all(c["ok"] for c in result["checks"]):
        splits_list = [int(s) for s in args.splits.split(",")]
        for h_q in map(int, args.hq.split(",")):
            for L in map(int, args.lens.split(",")):
                result["cases"].append(run_case(h_q, L, splits_list))
    result["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
