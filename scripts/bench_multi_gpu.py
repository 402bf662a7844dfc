"""Issue 23's multi-GPU bars, run under torchrun on one host:

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/bench_multi_gpu.py --out OUT.json
    (--cpu: a dry run of the logic on CPU processes over gloo, with small --ring-tokens / --ep-tokens / --sparse-tokens)

- ring: ring attention forward+backward over the ranks (b 1, 16 heads, d 128, causal, bf16, zigzag) at --ring-tokens
  total tokens, against flash_attention on one GPU over the same sequence (rank 0 alone, before the ring runs):
  throughput ratio = one GPU's time / the ring's time (bar >= 1.7x at 256k on 2 GPUs).
- ep: one Mixtral-shaped MoE layer's experts (H 4096, I 14336, 8 experts, top-2) forward+backward at --ep-tokens
  tokens per GPU, expert-parallel over the ranks, against one GPU running all 8 experts on its own --ep-tokens:
  throughput ratio = W · one GPU's time / the expert-parallel time (bar >= 1.6x on 2 GPUs).
- sparse-cp: context-parallel top-k sparse attention (16 heads, 2 kv heads, d 128, blocks of 128, top 16, the index
  branch selecting) forward+backward over --sparse-tokens tokens split across the ranks (bar: 2M tokens run).
Each time is the median of --iters timed iterations after a warm-up, every rank between barriers; the single-GPU
baselines run in the same processes first. Writes one JSON with the machine, every time and the ratios."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

DEV = "cuda"  # --cpu: a dry run of the script's logic on CPU processes (gloo, tiny shapes, the reference ops)


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _time(fn, iters: int, sync=True) -> float:
    """Median ms of fn() over iters runs after two warm-ups; every rank starts each run together."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if sync:
            dist.barrier()
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_ring(tokens: int, iters: int, rank: int, world: int) -> dict:
    import warpforge as wf
    from warpforge.distributed import ring_attention, shard_sequence
    g = torch.Generator(device=DEV).manual_seed(0)
    shape = (1, tokens, 16, 128 if DEV == "cuda" else 16)
    q, k, v, do = (torch.randn(shape, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(4))
    res = {"tokens": tokens, "heads": 16, "head_dim": shape[-1]}
    if rank == 0:
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))

        def one():
            wf.flash_attention(qf, kf, vf, causal=True).backward(do)
        res["one_gpu_ms"] = _time(one, iters, sync=False)
    dist.barrier()
    ql, kl, vl, dol = (shard_sequence(t, rank, world).contiguous() for t in (q, k, v, do))
    ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
    del q, k, v  # the full sequence: only the shards stay

    def ring():
        ring_attention(ql, kl, vl, causal=True).backward(dol)
    res["ring_ms"] = _time(ring, iters)
    return res


def bench_ep(tokens: int, iters: int, rank: int, world: int) -> dict:
    from warpforge.distributed import expert_parallel_experts, local_expert_range
    from warpforge.ops.moe import experts, route
    h, i, e, k = (4096, 14336, 8, 2) if DEV == "cuda" else (64, 64, 8, 2)
    g = torch.Generator(device=DEV).manual_seed(1)
    w13 = (torch.randn(e, 2 * i, h, device=DEV, generator=g) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device=DEV, generator=g) * i ** -0.5).bfloat16()
    g.manual_seed(2 + rank)
    x = torch.randn(tokens, h, device=DEV, dtype=torch.bfloat16, generator=g)
    logits = torch.randn(tokens, e, device=DEV, generator=g)
    dy = torch.randn(tokens, h, device=DEV, dtype=torch.bfloat16, generator=g)
    weights, ids = route(logits, k)
    res = {"tokens_per_gpu": tokens, "H": h, "I": i, "experts": e, "topk": k}
    if rank == 0:
        xf, w13f, w2f, wf_ = (t.clone().requires_grad_() for t in (x, w13, w2, weights))

        def one():
            experts(xf, w13f, w2f, wf_, ids, check_ids=False).backward(dy)
        res["one_gpu_ms"] = _time(one, iters, sync=False)
        del xf, w13f, w2f
    dist.barrier()
    own = local_expert_range(e)
    w13l = w13[own.start:own.stop].clone().requires_grad_()
    w2l = w2[own.start:own.stop].clone().requires_grad_()
    del w13, w2
    xl, wl = x.clone().requires_grad_(), weights.clone().requires_grad_()

    def ep():
        expert_parallel_experts(xl, w13l, w2l, wl, ids, num_experts=e).backward(dy)
    res["ep_ms"] = _time(ep, iters)
    return res


def bench_sparse_cp(tokens: int, iters: int, rank: int, world: int) -> dict:
    """Context-parallel top-k sparse attention over one sequence of `tokens` split in contiguous chunks (the bar:
    2M tokens run), fwd + bwd with the index branch selecting: time and peak memory per rank."""
    from warpforge.distributed import sparse_attention_cp
    s_local, h_q, h_kv, d, di = tokens // world, 16, 2, 128 if DEV == "cuda" else 16, 32
    g = torch.Generator(device=DEV).manual_seed(3 + rank)

    def rnd(h, dd, scale=1.0):
        return (torch.randn(1, s_local, h, dd, device=DEV, generator=g) * scale).bfloat16()
    q, k, v, do = rnd(h_q, d), rnd(h_kv, d), rnd(h_kv, d), rnd(h_q, d)
    iq, ik = rnd(h_kv, di), rnd(1, di)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step():
        sparse_attention_cp(q, k, v, index_q=iq, index_k=ik, block_size=128, topk=16).backward(do)
    ms = _time(step, iters)
    return {"tokens": tokens, "tokens_per_gpu": s_local, "heads": h_q, "kv_heads": h_kv, "head_dim": d,
            "block": 128, "topk": 16, "sparse_cp_ms": ms,
            "peak_gb": torch.cuda.max_memory_allocated() / 2 ** 30 if DEV == "cuda" else 0.0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="ring,ep,sparse-cp")
    ap.add_argument("--ring-tokens", type=int, default=262144)
    ap.add_argument("--ep-tokens", type=int, default=8192)
    ap.add_argument("--sparse-tokens", type=int, default=2 * 2 ** 20)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="dry run: gloo, CPU, tiny shapes (pass small --*-tokens)")
    args = ap.parse_args()
    global DEV
    if args.cpu:
        DEV = "cpu"
        os.environ.setdefault("WARPFORGE_BACKEND", "reference")
    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not args.cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if not args.cpu else []
    report = {"machine": {"gpus": gpus,
                          "world": world, "torch": torch.__version__,
                          "git_commit": os.environ.get("WARPFORGE_GIT_COMMIT"),
                          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, "cases": {}}
    for case in args.cases.split(","):
        if case == "ring":
            r = bench_ring(args.ring_tokens, args.iters, rank, world)
        elif case == "ep":
            r = bench_ep(args.ep_tokens, args.iters, rank, world)
        elif case == "sparse-cp":
            r = bench_sparse_cp(args.sparse_tokens, max(1, args.iters // 2), rank, world)
        else:
            raise SystemExit(f"unknown case {case!r}")
        times = [None] * world
        dist.all_gather_object(times, r)  # every rank's own time; rank 0 also has the one-GPU baseline
        if rank == 0 and case == "sparse-cp":
            r["sparse_cp_ms_per_rank"] = [t["sparse_cp_ms"] for t in times]
            r["peak_gb_per_rank"] = [t["peak_gb"] for t in times]
            report["cases"][case] = r
            print(f"sparse-cp: {args.sparse_tokens} tokens over {world} GPUs ran: "
                  f"{max(r['sparse_cp_ms_per_rank']):.1f} ms fwd+bwd, peak {max(r['peak_gb_per_rank']):.1f} GB",
                  flush=True)
        elif rank == 0:
            key = "ring_ms" if case == "ring" else "ep_ms"
            slowest = max(t[key] for t in times)
            r[key + "_per_rank"] = [t[key] for t in times]
            r[key] = slowest
            r["throughput_ratio"] = (r["one_gpu_ms"] / slowest) if case == "ring" else \
                (world * r["one_gpu_ms"] / slowest)
            report["cases"][case] = r
            print(f"{case}: one GPU {r['one_gpu_ms']:.2f} ms, {world} GPUs {slowest:.2f} ms "
                  f"= {r['throughput_ratio']:.2f}x the throughput", flush=True)
        if not args.cpu:
            torch.cuda.empty_cache()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
