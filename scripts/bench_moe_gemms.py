"""Each GEMM of the MoE training path (ops/moe/sorted_kernel.py) timed alone on this GPU, at a bench model's shape:
the forward's gate/up (SwiGLU epilogue) and down, the backward's d act (SwiGLU-gradient epilogue) and d hidden, and
the two weight gradients, with the configs.SORTED tiles and with the candidate tiles given, beside cuBLAS on one
expert's share of the same GEMM (torch.mm on [rows / E, K] x [K, N]: the rate a plain GEMM of that size reaches).

    PYTHONPATH=. python scripts/bench_moe_gemms.py [--model mixtral] [--tokens 8192] [--tiles up=128x64x8x4,...]

--tiles: extra candidates, GEMM=BLOCK_NxBLOCK_KxWARPSxSTAGES[xws] separated by commas (GEMM one of up, down, dact,
dhidden, wgrad). Times are triton.testing.do_bench medians; TFLOP/s count the scheduled rows (num_post, padding
included: what the kernel computes).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from warpforge.bench.moe_cases import MODELS, _expert_weights, _logits  # noqa: E402
from warpforge.ops.moe import configs, route_reference  # noqa: E402
from warpforge.ops.moe import sorted_kernel as sk  # noqa: E402
from warpforge.ops.moe.align import align_unchecked  # noqa: E402
from warpforge.ops.moe.moe_kernel import expert_blocks  # noqa: E402


def _tile(text):
    parts = text.split("x")
    return configs.SortedTile(*map(int, parts[:4]), ws=len(parts) > 4 and parts[4] == "ws")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mixtral")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--tiles", default="")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a tiny interpreter smoke run
    args = ap.parse_args()
    dev = torch.device(args.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float16
    e, k, h, i, route_kw = MODELS[args.model] if dev.type == "cuda" else (4, 2, 32, 48, {})
    t = args.tokens
    w13, w2 = _expert_weights(args.model, e, h, i, dev, dt)  # the bench's own weights
    weights, ids = route_reference(_logits(t, e, False, dev, torch.Generator().manual_seed(t)), k, **route_kw)
    cfg = configs.SORTED.lookup(dev, tuple(w13.shape), t)
    schedule = align_unchecked(ids, e, cfg.block_m, backend="triton")
    sorted_ids, expert_ids, num_post = schedule
    cap, n_slots, rows = sorted_ids.numel(), t * k, int(num_post.item())
    wflat = weights.reshape(-1).float().contiguous()
    xs = torch.randn(cap, h, device=dev, dtype=dt)
    act = torch.randn(cap, i, device=dev, dtype=dt)
    pre = torch.randn(cap, 2 * i, device=dev, dtype=dt)
    dos = torch.randn(cap, h, device=dev, dtype=dt)
    d_pre = torch.randn(cap, 2 * i, device=dev, dtype=dt)
    out_i, out_h = (torch.empty(cap, n, device=dev, dtype=dt) for n in (i, h))
    act_w = torch.empty_like(act)
    blocks = expert_blocks(expert_ids, e)

    def gemm(name, tile):
        c = cfg._replace(up=tile, down=tile, dact=tile, wgrad=tile)
        if name == "up":
            return lambda: sk._gemm(xs, w13, out_i, schedule, i, h, tile, c, b_kmajor=True, swiglu=True, pre=pre,
                                    n_slots=n_slots)
        if name == "down":
            return lambda: sk._gemm(act, w2, out_h, schedule, h, i, tile, c, b_kmajor=True, row_w=wflat,
                                    n_slots=n_slots)
        if name == "dact":  # the GEMM, then the SwiGLU-gradient pass (sorted_kernel.swiglu_grad), as the backward
            d_w = torch.zeros(n_slots, device=dev, dtype=torch.float32)
            return lambda: (sk._gemm(dos, w2, out_i, schedule, i, h, tile, c, b_kmajor=False, n_slots=n_slots),
                            sk.swiglu_grad(out_i, act, pre, wflat, schedule, d_w))
        if name == "dhidden":
            return lambda: sk._gemm(d_pre, w13, out_h, schedule, h, 2 * i, tile, c, b_kmajor=False, n_slots=n_slots)
        dw13, dw2 = torch.empty_like(w13), torch.empty_like(w2)
        return lambda: (sk._weight_grad(d_pre, xs, dw13, blocks, c), sk._weight_grad(dos, act_w, dw2, blocks, c))

    # (name, flops, table tile, cuBLAS stand-in: one expert's rows)
    m = rows // e
    mats = {"up": (2 * h * 2 * i, cfg.up, (m, h, 2 * i)), "down": (2 * i * h, cfg.down, (m, i, h)),
            "dact": (2 * h * i, cfg.dact or cfg.up, (m, h, i)), "dhidden": (2 * 2 * i * h, cfg.down, (m, 2 * i, h)),
            "wgrad": (2 * (2 * i * h + h * i), cfg.wgrad, None)}
    extra = {}
    for spec in filter(None, args.tiles.split(",")):
        name, tile = spec.split("=")
        extra.setdefault(name, []).append(_tile(tile))
    print(f"{args.model} T{t}: {rows} scheduled rows of {cap}, block_m {cfg.block_m}")
    for name, (per_row, table, mm) in mats.items():
        flops = per_row * rows
        for label, tile in [("table", table)] + [("cand", x) for x in extra.get(name, [])]:
            try:
                fn = gemm(name, tile)
                ms = triton.testing.do_bench(fn, warmup=5, rep=60) if dev.type == "cuda" else (fn(), 1.0)[1]
                print(f"{name:8s} {label:5s} {tuple(tile)}  {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
            except Exception as exc:  # noqa: BLE001 - a candidate that does not compile or fit: report, go on
                print(f"{name:8s} {label:5s} {tuple(tile)}  failed: {str(exc)[:120]}", flush=True)
        if mm is not None and dev.type == "cuda":
            a = torch.randn(mm[0], mm[1], device=dev, dtype=dt)
            b = torch.randn(mm[1], mm[2], device=dev, dtype=dt)
            ms = triton.testing.do_bench(lambda: torch.mm(a, b), warmup=5, rep=60)
            tflops = 2 * mm[0] * mm[1] * mm[2] / ms / 1e9
            print(f"{name:8s} cuBLAS one expert {mm}  {ms:7.3f} ms  {tflops:6.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
