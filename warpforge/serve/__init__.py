"""Serving: Hugging Face (Llama, Mistral, Qwen2, Qwen3) and warpforge GPT checkpoints on warpforge's kernels, with a
paged KV cache, continuous batching, chunked prefill, lossless speculative decoding and CUDA-graph decode.

    from warpforge.serve import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""
from .engine import Engine
from .kv_cache import PageAllocator, PagedKVCache
from .llm import LLM
from .loader import ModelSpec, read_spec
from .request import RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "Engine", "PagedKVCache", "PageAllocator", "ModelSpec",
           "read_spec"]
