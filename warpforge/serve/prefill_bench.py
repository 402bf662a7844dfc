"""Prefill speed of the serving engine beside transformers (sdpa) in the same process, on random-weight Llama
models of the same shape: the time from an N-token prompt to its first token (the engine: one request, one prefill
chunk, the KV pages written; transformers: one forward with its KV cache, the last position's logits only).

    python -m warpforge.serve.prefill_bench --shape llama3-8b --tokens 8192 [--json OUT]

FLOPs counted as 2 · parameters (embedding excluded) · tokens plus causal attention (2 · 2 · layers · heads ·
head_dim · tokens² / 2), as the issue's anchor does.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from .bench import SHAPES, random_model, report
from .engine import Engine
from .kv_cache import PagedKVCache
from .sampling import SamplingParams


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, device, reps: int) -> float:
    fn()  # warm-up: compiles the kernels, fills the allocator
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _transformers_model(spec, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                      num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                      head_dim=spec.head_dim, intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size,
                      max_position_embeddings=spec.max_position_embeddings, rope_theta=spec.rope_theta,
                      rms_norm_eps=spec.rms_norm_eps, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # random weights made where they run (an 8B model's CPU init takes minutes)
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m warpforge.serve.prefill_bench")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    page, max_len = 16, a.tokens + 16
    spec, model, weight_bytes = random_model(a.shape, dtype, device, max_len)
    cache = PagedKVCache(spec.num_layers, -(-max_len // page) + 2, page, spec.num_kv_heads, spec.head_dim, "bf16"
                         if dtype == torch.bfloat16 else "fp32", dtype, device)
    eng = Engine(model, cache, None, max_model_len=max_len, max_num_seqs=1, max_num_batched_tokens=a.tokens,
                 graphs=None)
    ids = torch.randint(0, spec.vocab_size, (a.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def ours():
        eng.add_request(None, params, prompt_token_ids=ids)
        while eng.has_unfinished():
            eng.step()
    ours_ms = _median_ms(ours, device, a.reps)
    del eng, cache, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf = _transformers_model(spec, device, dtype)
    x = torch.tensor([ids], device=device)

    def theirs():
        with torch.no_grad():
            hf(input_ids=x, use_cache=True, logits_to_keep=1)
    hf_ms = _median_ms(theirs, device, a.reps)
    flops = 2.0 * (weight_bytes / 2 if dtype == torch.bfloat16 else weight_bytes / 4) * a.tokens + \
        2.0 * 2 * spec.num_layers * spec.num_heads * spec.head_dim * a.tokens ** 2 / 2
    out = {"shape": a.shape, "tokens": a.tokens, "warpforge_ms": ours_ms, "transformers_ms": hf_ms,
           "speedup": hf_ms / ours_ms, "warpforge_tflops": flops / ours_ms / 1e9,
           "transformers_tflops": flops / hf_ms / 1e9, "device": str(device),
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}
    return report(out, a.json)


if __name__ == "__main__":
    main()
