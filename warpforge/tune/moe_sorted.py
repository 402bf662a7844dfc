"""Sweep the MoE training path's tiles (ops/moe/sorted_kernel.py, configs.SORTED) on this GPU: one MoE layer's
forward + backward at a training token count, each candidate SortedCfg against the gathered-row path and
`torch._grouped_mm` in the same process, and print the table entries.

    warpforge tune moe-sorted [--models mixtral,qwen3-30b-a3b,deepseek-v3] [--tokens 8192] [--out tune.json]

Candidates: the table's entry, each GEMM but gate/up warp-specialized at 4 warps alone (the weight gradient at 2
stages: its 3 would not fit) and together (gate/up cannot be: sorted_kernel._gemm), the d act GEMM 64 columns wide or
at 4 stages, 4 stages for gate/up, block_m 64. Every candidate's gradients are checked against the gathered path's
first: a wrong one is reported and not timed (session 14's all-specialized tiles were 10-14% faster and returned inf). The winner goes into configs.SORTED,
numbers into NOTES.md.
"""
import argparse
import time

import torch

from warpforge.bench import baselines
from warpforge.bench.moe_cases import MODELS, _expert_weights, _logits
from warpforge.bench.report import write_json
from warpforge.ops.moe import api, configs, fused_moe, route_reference
from warpforge.testing import rel_l2
from warpforge.tune.timing import time_candidate


def _specialized(tile: configs.SortedTile, stages=None) -> configs.SortedTile:
    """tile warp-specialized: 4 warps, the only count at which Triton 3.6 specializes (HOPPER-PIPELINE.md)."""
    return tile._replace(warps=4, ws=True, stages=stages or tile.stages)


def candidates(base: configs.SortedCfg) -> dict:
    """name -> a SortedCfg."""
    ws = _specialized
    return {
        "table": base,
        "dact_n64": base._replace(dact=(base.dact or base.up)._replace(block_n=64)),  # half the accumulator
        "up4": base._replace(up=base.up._replace(stages=4)),
        "bm64": base._replace(block_m=64),
        "dact4": base._replace(dact=(base.dact or base.up)._replace(stages=4)),
        # one GEMM specialized at a time, then all that can be (gate/up cannot: sorted_kernel._gemm)
        "ws_down": base._replace(down=ws(base.down)),
        "ws_wgrad": base._replace(wgrad=ws(base.wgrad, 2)),
        "ws_dact": base._replace(dact=ws(base.dact or base.up)),
        "ws_not_up": base._replace(down=ws(base.down), wgrad=ws(base.wgrad, 2), dact=ws(base.dact or base.up)),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune moe-sorted")
    ap.add_argument("--models", default="mixtral,qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # the CPU smoke test's interpreter run
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("warpforge tune moe-sorted: needs a CUDA GPU")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    results = []
    t0 = time.time()
    for model in args.models.split(","):
        e, k, h, i, route_kw = MODELS[model]
        w13, w2 = (w.detach().requires_grad_() for w in _expert_weights(model, e, h, i, dev, dtype))
        for t in map(int, args.tokens.split(",")):
            logits = _logits(t, e, False, dev, torch.Generator().manual_seed(t)).requires_grad_()
            x = torch.randn(t, h, device=dev, dtype=dtype, requires_grad=True)
            grad = torch.randn(t, h, device=dev, dtype=dtype)
            flops = 3 * 2.0 * t * k * 3 * h * i

            def step(path):
                return lambda: torch.autograd.grad(path(), (x, w13, w2, logits), grad)
            base = configs.SORTED.lookup(dev, tuple(w13.shape), t)
            if base is None:
                print(f"{model} T{t}: no configs.SORTED entry on this GPU", flush=True)
                continue
            real = api._sorted_config
            rows, errors = {}, {}
            layer = step(lambda: fused_moe(x, w13, w2, logits, k, backend="triton", **route_kw))
            try:
                api._sorted_config = lambda *a: None  # the gathered-row kernels: the reference and the first row
                reference = layer()
                rows["gathered"] = time_candidate(layer, rep=40)
                for name, cfg in candidates(base).items():
                    api._sorted_config = lambda *a, cfg=cfg: cfg
                    # timed only once its gradients are within 2e-2 of the gathered path's (and not held meanwhile)
                    errors[name] = max(rel_l2(g, r) for g, r in zip(layer(), reference))
                    rows[name] = time_candidate(layer, rep=40) if errors[name] <= 2e-2 else None
            finally:
                api._sorted_config = real
            del reference

            def grouped():
                weights, ids = route_reference(logits, k, **route_kw)
                return baselines.grouped_mm_experts(x, w13, w2, weights, ids)
            rows["torch._grouped_mm"] = time_candidate(step(grouped), rep=40)
            ref = rows["torch._grouped_mm"]
            for name, ms in rows.items():
                err = errors.get(name)
                if err is not None and not err <= 2e-2:  # NaN included
                    print(f"{model} T{t} {name:18s} WRONG: gradients {err:.1e} from the gathered path's", flush=True)
                if ms is not None:
                    print(f"{model} T{t} {name:18s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s"
                          + (f"  {ref / ms:.3f}x grouped_mm" if ref else "")
                          + (f"  err {err:.1e}" if err is not None else ""), flush=True)
                results.append(dict(model=model, tokens=t, candidate=name, ms=ms, grad_error=err))
            del x, grad, logits
    print(f"[{time.time() - t0:.0f} s]")
    if args.out:
        write_json({"sweep": "moe-sorted", "rows": results}, args.out)


if __name__ == "__main__":
    main()
