"""Dense attention forward on an H200: the Hopper Gluon kernel (ops/attention/flash_gluon_kernel.py), the portable
Triton kernel and cuDNN SDPA, in one process on the same data.

    PYTHONPATH=. python scripts/bench_attention_gluon.py [--sweep] [--sweep-only] [--json out.json]

Cases (bf16): b4 h16 s8192 d128 causal and non-causal, b32 h16 s1024 d128 causal, b8 h32 s4096 d64 causal.
Per case and path: ms (triton.testing.do_bench median; each call takes the next of a rotation of input sets that
together pass 2x the L2, so L2 does not serve them), TFLOP/s (4 · b · h · s² · d, halved when causal), the ratio
to cuDNN, and the max abs error against SDPA's output. cuDNN runs through
torch.nn.attention.sdpa_kernel(SDPBackend.CUDNN_ATTENTION) on [b, h, s, d] views of the same tensors.
--sweep: the Gluon kernel's knobs (BLOCK_N 64/128 x ring stages x ping-pong on/off x persistent) on the causal
cases, called directly. 128 query rows per work item (two 64-row consumer warpgroups) is fixed by the register
budget, and BLOCK_N 176 is not a TMA box Triton accepts (boxes are powers of two).
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

import warpforge as wf  # noqa: E402
from warpforge.ops.attention import api, configs  # noqa: E402
from warpforge.ops.attention import flash_gluon_kernel as fg  # noqa: E402

CASES = [  # b, h, s, d, causal
    (4, 16, 8192, 128, True),
    (4, 16, 8192, 128, False),
    (32, 16, 1024, 128, True),
    (8, 32, 4096, 64, True),
]
SWEEP = [(128, 2, True, False), (128, 2, False, False), (128, 3, True, False), (64, 4, True, False),
         (128, 2, True, True), (64, 4, True, True)]
SWEEP_D64 = [(128, 4, True, False), (128, 2, True, False), (128, 4, True, True)]


def flops(b, h, s, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def input_sets(b, h, s, d, l2_bytes):
    per_set = 3 * b * s * h * d * 2
    n = max(2, math.ceil(2 * l2_bytes / per_set))
    g = torch.Generator(device="cuda").manual_seed(0)
    return [[torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
            for _ in range(n)]


def timed(fn, sets):
    """Median ms of fn(q, k, v), each call on the next input set."""
    i = [0]

    def call():
        q, k, v = sets[i[0] % len(sets)]
        i[0] += 1
        return fn(q, k, v)
    return triton.testing.do_bench(call, warmup=10, rep=60, return_mode="median")


def sdpa_cudnn(causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                 v.transpose(1, 2), is_causal=causal)
        return o.transpose(1, 2)
    return run


def portable(causal):
    def run(q, k, v):
        return wf.flash_attention(q, k, v, causal=causal)
    return run


def gluon(causal, block_n=None, stages=None, pingpong=None, persistent=None):
    def run(q, k, v):
        knobs = api.gluon_knobs(q.shape[-1], causal) if block_n is None else (block_n, stages, pingpong, persistent)
        return fg.flash_fwd_gluon(q, k, v, q.shape[-1] ** -0.5, causal, *knobs)[0]
    return run


def run_case(b, h, s, d, causal, l2, sweep):
    sets = input_sets(b, h, s, d, l2)
    q, k, v = sets[0]
    fl = flops(b, h, s, d, causal)
    paths = {"gluon": gluon(causal), "portable": portable(causal), "cudnn": sdpa_cudnn(causal)}
    if sweep and causal:
        grid = SWEEP_D64 if d == 64 else SWEEP
        for block_n, stages, pp, pers in grid:
            if fg.smem_bytes(d, block_n, stages, pers) <= fg.SMEM_MAX:
                paths[f"gluon bn{block_n} st{stages} pp{int(pp)} pers{int(pers)}"] = gluon(causal, block_n, stages, pp,
                                                                                       pers)
    ref = None
    try:
        ref = paths["cudnn"](q, k, v)
    except Exception as e:  # noqa: BLE001 - a torch build without cuDNN attention: say so, time the rest
        print(f"  cudnn: unavailable ({type(e).__name__}: {str(e)[:120]})")
        paths.pop("cudnn")
    rows = {}
    for name, fn in paths.items():
        t0 = time.perf_counter()
        try:
            out = fn(q, k, v)
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item() if ref is not None else float("nan")
            ms = timed(fn, sets)
        except Exception as e:  # noqa: BLE001 - one failing knob must not stop the rest of the sweep
            print(f"  {name:32s} FAILED: {type(e).__name__}: {str(e)[:200]}")
            continue
        rows[name] = dict(ms=ms, tflops=fl / ms / 1e9, max_err=err, wall_s=time.perf_counter() - t0)
    base = rows.get("cudnn", {}).get("ms")
    label = f"b{b} h{h} s{s} d{d} {'causal' if causal else 'full'}"
    print(f"{label}  ({fl / 1e12:.3f} TFLOP)")
    for name, r in rows.items():
        ratio = f"{base / r['ms']:.3f}x cuDNN" if base else "-"
        r["vs_cudnn"] = base / r["ms"] if base else None
        print(f"  {name:32s} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s  {ratio:>14s}  max|err| vs SDPA "
              f"{r['max_err']:.2e}")
    del sets
    torch.cuda.empty_cache()
    return label, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time the Gluon kernel's knobs")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep's shapes (headline, b32 s1024, d64)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0), "needs an sm_90 GPU"
    assert fg.available(), f"the Gluon kernel needs Triton {fg.GLUON_TRITON_VERSIONS} (have {triton.__version__})"
    os.environ[configs.GLUON_ENV] = "0"  # "portable" is the portable kernel; the Gluon kernel is called directly
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2 ** 20) or 50 * 2 ** 20
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, L2 {l2 / 2 ** 20:.0f} MB; "
          f"default knobs (BLOCK_N, stages, ping-pong): {configs.GLUON_FWD}")
    t0 = time.perf_counter()
    results = {}
    cases = CASES if not args.sweep_only else [c for c in CASES if c[-1]]
    for case in cases:
        label, rows = run_case(*case, l2, args.sweep or args.sweep_only)
        results[label] = rows
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__, results=results), f,
                      indent=1)


if __name__ == "__main__":
    main()
