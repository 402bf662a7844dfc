"""MLA decode on an H200: the Gluon kernel (decode_gluon_kernel.py) called directly on small awkward shapes (empty
and one-token requests, odd page counts per split, NaN past every request's end, causal MTP rows) against the fp32
reference, each line printed as it finishes (a hang shows where). Timing: scripts/bench_mla_gluon.py.

    python scripts/check_mla_gluon.py --out check.json
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from warpforge.ops.mla import decode_gluon_kernel as dg  # noqa: E402
from warpforge.ops.mla import mla_decode_reference  # noqa: E402
from warpforge.testing import cosine  # noqa: E402


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
    out, lse = dg.mla_decode_gluon(q, cache, table, seqlens, scale, causal, splits)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name(), "checks": []}
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
    result["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} ({result['seconds']:.0f} s): {sum(c['ok'] for c in result['checks'])} of "
          f"{len(result['checks'])} checks ok")
    sys.exit(0 if all(c["ok"] for c in result["checks"]) else 1)


if __name__ == "__main__":
    main()
