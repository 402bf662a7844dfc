"""Sweep the MoE weight-gradient kernel's tiles on this GPU (training sizes), for MoECfg.wgrad.

    warpforge tune moe-wgrad [--models mixtral,qwen3-30b-a3b] [--tokens 8192]

Times d_w13 = Σ d_preᵀ hidden and d_w2 = Σ d_outᵀ (w · act) per expert, as the backward runs them (each
alone, then both), with the table's block_m for that token count; prints TFLOP/s per tile and the best, for
configs.py's sm90 entries.
"""
import argparse

import torch
import triton.testing

from warpforge.bench.moe_cases import MODELS, _logits
from warpforge.bench.report import write_json
from warpforge.ops.moe import align, route_reference
from warpforge.ops.moe.configs import GEMMS
from warpforge.ops.moe.moe_kernel import _weight_grad, expert_blocks

TILES = [(128, 64, 8, 4), (128, 128, 8, 3), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 4, 4),
         (64, 256, 8, 3), (256, 64, 8, 4), (128, 128, 8, 4), (128, 256, 8, 2), (128, 256, 8, 4), (128, 512, 8, 2),
         (64, 512, 8, 3), (256, 256, 8, 2)]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune moe-wgrad")
    ap.add_argument("--models", default="mixtral,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--out", default=None, help="also write the results as JSON (gpu_check.sh's TUNE passes it)")
    args = ap.parse_args(argv)
    results = []
    dev = torch.device("cuda")
    for model in args.models.split(","):
        e, k, h, i, route_kw = MODELS[model]
        for t in map(int, args.tokens.split(",")):
            torch.manual_seed(0)
            hidden = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
            d_out = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
            d_pre = torch.randn(t * k, 2 * i, device=dev, dtype=torch.bfloat16)
            act = torch.randn(t * k, i, device=dev, dtype=torch.bfloat16)
            weights, ids = route_reference(_logits(t, e, False, dev, torch.Generator().manual_seed(t)), k, **route_kw)
            base = GEMMS.lookup(dev, (e, 2 * i, h), t)
            sorted_ids, expert_ids, _ = align(ids, e, base.block_m)
            blocks = expert_blocks(expert_ids, e)
            dw13 = torch.empty(e, 2 * i, h, device=dev, dtype=torch.bfloat16)
            dw2 = torch.empty(e, h, i, device=dev, dtype=torch.bfloat16)
            flops = 2 * t * k * 3 * h * i
            best = None
            for tile in TILES:
                cfg = base._replace(wgrad=tile)

                def w13():
                    _weight_grad(d_pre, hidden, dw13, sorted_ids, blocks, k, cfg, g_by_token=False)

                def w2():
                    _weight_grad(d_out, act, dw2, sorted_ids, blocks, k, cfg, g_by_token=True)

                def run():
                    w13()
                    w2()
                try:
                    run()
                    ms, ms13, ms2 = (triton.testing.do_bench(f, rep=50, return_mode="median") for f in (run, w13, w2))
                except Exception as exc:  # out of shared memory and the like
                    print(f"{model} T{t} {tile}: {type(exc).__name__} {str(exc)[:100]}", flush=True)
                    continue
                print(f"{model} T{t} bm{base.block_m} wgrad {tile}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s "
                      f"(d_w13 {ms13:.3f} ms {flops * 2 / 3 / ms13 / 1e9:.0f}, d_w2 {ms2:.3f} ms "
                      f"{flops / 3 / ms2 / 1e9:.0f})", flush=True)
                results.append(dict(model=model, tokens=t, wgrad=list(tile), ms=ms, ms_d_w13=ms13, ms_d_w2=ms2))
                if best is None or ms < best[0]:
                    best = (ms, tile)
            print(f"BEST {model} T{t}: wgrad {best[1]} {best[0]:.3f} ms", flush=True)
    if args.out:
        write_json(results, args.out)


if __name__ == "__main__":
    main()
