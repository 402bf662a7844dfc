"""Decode speed of the serving engine on a random-weight Llama of a given shape (no checkpoint needed):
tokens/s and MBU (bytes of weights and KV cache read per decode step over the measured copy bandwidth).

    python -m warpforge.serve.bench --shape llama3-8b --batch 1 --context 1024 --steps 64
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from .cuda_graphs import DecodeGraphs
from .engine import Engine
from .kv_cache import PagedKVCache
from .loader import ModelSpec
from .models import build
from .sampling import SamplingParams

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                      intermediate_size=14336, vocab_size=128256),
    "llama3-1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                      intermediate_size=8192, vocab_size=128256),
    "tiny": dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512,
                 vocab_size=1024),
}


def random_model(shape: str, dtype, device, max_len: int):
    s = ModelSpec(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                  tie_embeddings=False, sliding_windows=(None,) * SHAPES[shape]["num_layers"],
                  max_position_embeddings=max_len, **SHAPES[shape])
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape_):
        return (torch.randn(*shape_, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    w = {"embed": rand(s.vocab_size, s.hidden_size), "lm_head": rand(s.vocab_size, s.hidden_size),
         "norm": torch.ones(s.hidden_size, dtype=dtype, device=device)}
    for i in range(s.num_layers):
        w.update({f"{i}.attn_norm": torch.ones(s.hidden_size, dtype=dtype, device=device),
                  f"{i}.mlp_norm": torch.ones(s.hidden_size, dtype=dtype, device=device),
                  f"{i}.qkv": rand(qkv, s.hidden_size), f"{i}.o": rand(s.hidden_size, s.num_heads * s.head_dim),
                  f"{i}.gate_up": rand(2 * s.intermediate_size, s.hidden_size),
                  f"{i}.down": rand(s.hidden_size, s.intermediate_size)})
    # bytes a decode step reads: every weight but the embedding table, of which it gathers one row per token
    read = sum(t.numel() * t.element_size() for name, t in w.items() if name != "embed")
    return s, build(s, w, max_len, device), read


def report(out: dict, path=None) -> dict:
    """A bench's result: printed as one JSON line, and written to path when given."""
    print(json.dumps(out))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    return out


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t)


PROFILE_STEPS = 8


def _profile(eng) -> None:
    """Where a step's time goes: the top GPU kernels, and the GPU's busy time per step beside the step's wall time
    (the rest is host work the GPU waits for)."""
    from torch.profiler import ProfilerActivity, profile
    n = PROFILE_STEPS
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(n):
            eng.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / n
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / n / 1e3
    print(f"profile: {n} steps, wall {wall * 1e3:.3f} ms/step, GPU kernels {gpu:.3f} ms/step")
    print(events.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=70))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m warpforge.serve.bench")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed")
    p.add_argument("--kv-format", default="bf16")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--profile", action="store_true", help="also print the GPU kernels of a few steps (torch.profiler)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    page = 16
    extra = PROFILE_STEPS if a.profile else 0  # the profiled steps come after the timed ones: room for them
    max_len = a.context + a.steps + 16 + extra
    spec, model, weight_bytes = random_model(a.shape, torch.bfloat16, device, max_len)
    pages = a.batch * -(-max_len // page) + 2
    cache = PagedKVCache(spec.num_layers, pages, page, spec.num_kv_heads, spec.head_dim, a.kv_format,
                         torch.bfloat16, device)
    graphs = None if a.no_graphs else DecodeGraphs(model, cache, a.batch, -(-max_len // page))
    eng = Engine(model, cache, None, max_model_len=max_len, max_num_seqs=a.batch,
                 max_num_batched_tokens=max(a.context, 512) * a.batch, graphs=graphs)
    params = SamplingParams(max_tokens=a.steps + 8 + extra, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(a.batch):
        eng.add_request(None, params, prompt_token_ids=torch.randint(0, spec.vocab_size, (a.context,),
                                                                     generator=g).tolist())
    while not all(r.decoding for r in eng.running) or len(eng.running) < a.batch:  # prefill
        eng.step()
    for _ in range(4):  # warm-up (graph capture)
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t) / a.steps
    kv_bytes = (PagedKVCache.bytes_per_page(spec.num_layers, page, spec.num_kv_heads, spec.head_dim, a.kv_format)
                // page * a.batch * (a.context + a.steps // 2 + 4))
    if a.profile:
        _profile(eng)
    bw = copy_bandwidth(device)
    out = {"shape": a.shape, "batch": a.batch, "context": a.context, "kv_format": a.kv_format,
           "graphs": graphs is not None, "step_ms": step_s * 1e3, "tokens_per_s": a.batch / step_s,
           "weight_gb": weight_bytes / 1e9, "kv_gb": kv_bytes / 1e9, "copy_tb_s": bw / 1e12,
           "mbu": (weight_bytes + kv_bytes) / step_s / bw, "gpu": torch.cuda.get_device_name()}
    return report(out, a.json)


if __name__ == "__main__":
    main()
