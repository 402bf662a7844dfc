"""Decode-size experts on this GPU: the token-major GEMV kernels (ops/moe/decode_kernel.py) over a few tiles,
against the grouped path (align + two grouped GEMMs), per model and token count, for configs.DECODE_GEMV.

    PYTHONPATH=. python scripts/tune_moe_decode.py [--models mixtral,deepseek-v3,qwen3-30b-a3b] [--tokens 1,2,4]

Each call routes its tokens to experts no other call in the rotation touches, so the weights come from DRAM
(L2 holds ~60 MB, Qwen3's eight experts 75 MB). Every path is replayed from CUDA graphs, routing excluded
(it is the same kernel for both). Prints µs per call and the fraction of the weight-read floor at 4.3 TB/s.
"""
import argparse

import torch
import triton.testing

from warpforge.bench.moe_cases import MODELS
from warpforge.bench.report import write_json
from warpforge.ops.moe import DECODE_GEMV, experts
from warpforge.ops.moe.decode_kernel import decode_experts
from warpforge.runtime import arch_key

TILES = [(16, 16, 256, 4), (32, 16, 256, 4), (16, 32, 512, 4), (32, 32, 256, 8), (8, 8, 512, 4), (16, 16, 128, 4)]


def graphs_of(step, routings):
    """One CUDA graph per routing of step(weights, ids); returns a callable replaying them all in turn."""
    graphs = []
    for w, ids in routings:
        step(w, ids)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(w, ids)
        graphs.append(g)

    def replay():
        for g in graphs:
            g.replay()
    return replay


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--out", default=None, help="also write the results as JSON (gpu_check.sh's TUNE passes it)")
    args = ap.parse_args()
    results = []
    dev = torch.device("cuda")
    DECODE_GEMV.pop(arch_key(dev), None)  # "grouped" below must be the grouped path whatever the table says
    for model in args.models.split(","):
        e, k, h, i, _ = MODELS[model]
        torch.manual_seed(0)
        w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) * h ** -0.5
        w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) * i ** -0.5
        for t in map(int, args.tokens.split(",")):
            hidden = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
            per_call = min(t * k, e)
            rounds = max(1, min(8, e // per_call))
            perm = torch.randperm(e)
            routings = []
            for r in range(rounds):  # disjoint expert sets (round-robin within a call when T·k > E)
                pool = perm[(r * per_call) % e:][:per_call] if rounds > 1 else perm
                ids = pool[torch.arange(t * k) % pool.numel()].view(t, k).to(torch.int32).to(dev)
                w = torch.softmax(torch.randn(t, k, device=dev), 1)
                routings.append((w, ids))
            floor_us = per_call * 3 * h * i * 2 / 4.3e12 * 1e6

            def report(label, step):
                with torch.no_grad():
                    try:
                        ms = triton.testing.do_bench(graphs_of(step, routings), rep=50, return_mode="median")
                    except Exception as exc:  # a tile too big for this GPU, and the like
                        print(f"{model} T{t} {label}: {type(exc).__name__} {str(exc)[:100]}", flush=True)
                        return
                us = ms * 1e3 / rounds
                results.append(dict(model=model, tokens=t, path=label, us=us, floor_us=floor_us))
                print(f"{model} T{t} {label}: {us:.1f} us ({100 * floor_us / us:.0f}% of the {floor_us:.1f} us "
                      f"floor)", flush=True)

            report("grouped", lambda w, ids: experts(hidden, w13, w2, w, ids, backend="triton"))
            for tiles in TILES:
                report(f"gemv {tiles}", lambda w, ids, tiles=tiles: decode_experts(hidden, w13, w2, w, ids, tiles))
        w13 = w2 = None
        torch.cuda.empty_cache()
    if args.out:
        write_json(results, args.out)


if __name__ == "__main__":
    main()
