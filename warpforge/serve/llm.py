"""`LLM`: a checkpoint directory loaded for serving (weights, tokenizer, paged KV cache, engine), and offline
generation over it (vLLM's `LLM(...).generate(prompts, SamplingParams(...))`)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Union

import torch

from ..errors import WarpforgeInputError, check_int
from ..ops import paged
from . import models
from .cuda_graphs import DecodeGraphs
from .draft_chain import DraftChain
from .engine import Engine
from .kv_cache import PagedKVCache, check_kv_format
from .loader import load_weights, read_spec
from .request import RequestOutput
from .sampling import SamplingParams
from .speculative import DraftModelDrafter, NgramDrafter
from .tokenizer import load_tokenizer

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_KV_OF_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:  # bf16 where it is fast, fp32 on a CPU (where bf16 matmuls are slow and inexact)
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise WarpforgeInputError(f"dtype: expected one of {sorted(_DTYPES)} or a torch dtype, got {dtype!r}")
        return _DTYPES[dtype]
    if dtype not in _KV_OF_DTYPE:
        raise WarpforgeInputError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
    return dtype


def _load(path, dtype, device, max_model_len):
    spec = read_spec(path)
    weights = load_weights(path, spec, dtype, device)
    max_len = spec.max_position_embeddings if max_model_len is None else max_model_len
    check_int("max_model_len", max_len, lo=2)
    return spec, models.build(spec, weights, max_len, device), max_len


def _num_pages(num_pages, spec, kv_format, page_size, device, max_len, max_num_seqs, memory_fraction) -> int:
    if num_pages is not None:
        check_int("num_pages", num_pages, lo=1)
        return num_pages
    per_page = PagedKVCache.bytes_per_page(spec.num_layers, page_size, spec.num_kv_heads, spec.head_dim, kv_format)
    want = max_num_seqs * -(-max_len // page_size) + 1
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(2, min(want, int(free * memory_fraction) // per_page))
    return max(2, min(want, (1 << 30) // per_page))  # a CPU: at most 1 GiB of cache


class LLM:
    """A served model. path: a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) of a
    Llama, Mistral, Qwen2 or Qwen3 model, or a `warpforge gpt train` run directory.

    dtype: the weights' and activations' dtype (None: bf16 on CUDA, fp32 on a CPU). kv_format: the paged cache's
    format ("bf16", "fp16", "fp32", "fp8", "nvfp4", "mxfp4"; None: the dtype's). speculative: None, "ngram"
    (prompt lookup) or a draft model's directory (same vocabulary), proposing num_speculative_tokens a step.
    cuda_graphs: replay decode steps (plain, speculative verification, a draft model's) from CUDA graphs (None: on
    CUDA)."""

    def __init__(self, path, *, dtype=None, kv_format: Optional[str] = None, device=None, page_size: int = 16,
                 num_pages: Optional[int] = None, max_model_len: Optional[int] = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 1024, speculative: Optional[str] = None,
                 num_speculative_tokens: int = 4, cuda_graphs: Optional[bool] = None,
                 gpu_memory_fraction: float = 0.8):
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = _dtype(dtype, device)
        check_kv_format(kv_format)
        kv_format = kv_format or _KV_OF_DTYPE[dtype]
        if page_size not in paged.PAGE_SIZES:
            raise WarpforgeInputError(f"page_size: expected one of {paged.PAGE_SIZES}, got {page_size!r}")
        self.path = Path(path)
        self.spec, self.model, self.max_model_len = _load(path, dtype, device, max_model_len)
        self.tokenizer = load_tokenizer(path, self.spec.tokenizer)
        self.device, self.dtype = device, dtype
        pages = _num_pages(num_pages, self.spec, kv_format, page_size, device, self.max_model_len, max_num_seqs,
                           gpu_memory_fraction)
        self.cache = PagedKVCache(self.spec.num_layers, pages, page_size, self.spec.num_kv_heads, self.spec.head_dim,
                                  kv_format, dtype, device)
        if cuda_graphs is None:
            cuda_graphs = DecodeGraphs.supported(device)
        if cuda_graphs and not DecodeGraphs.supported(device):
            raise WarpforgeInputError(f"cuda_graphs: True needs a CUDA device, got {device}")
        max_pages = -(-self.max_model_len // page_size)
        drafter = self._drafter(speculative, dtype, kv_format, page_size, pages, device,
                                (max_num_seqs, max_pages, num_speculative_tokens + 1) if cuda_graphs else None)
        graphs = DecodeGraphs(self.model, self.cache, max_num_seqs, max_pages) if cuda_graphs else None
        self.engine = Engine(self.model, self.cache, self.tokenizer, eos_token_ids=self.spec.eos_token_ids,
                             max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, drafter=drafter,
                             num_speculative_tokens=num_speculative_tokens, graphs=graphs)

    def _drafter(self, speculative, dtype, kv_format, page_size, pages, device, graphs):
        """graphs: None, or (max batch, max pages per sequence, tokens a step feeds) for the draft model's graphs."""
        if speculative is None:
            return None
        if speculative == "ngram":
            return NgramDrafter()
        if not isinstance(speculative, (str, Path)) or not Path(speculative).is_dir():
            raise WarpforgeInputError(f"speculative: expected None, 'ngram' or a draft model's checkpoint directory, "
                                      f"got {speculative!r}")
        spec, model, _ = _load(speculative, dtype, device, self.max_model_len)
        fmt = kv_format if spec.head_dim in paged.head_dims(kv_format) else _KV_OF_DTYPE[dtype]
        cache = PagedKVCache(spec.num_layers, pages, page_size, spec.num_kv_heads, spec.head_dim, fmt, dtype, device)
        if graphs is None:
            return DraftModelDrafter(model, cache, self.spec.vocab_size)
        max_batch, max_pages, max_feed = graphs
        draft_graphs = DecodeGraphs(model, cache, max_batch, max_pages)
        chain = DraftChain(model, cache, draft_graphs, max_feed - 1, self.spec.vocab_size)
        return DraftModelDrafter(model, cache, self.spec.vocab_size, draft_graphs, max_feed, chain)

    @property
    def metrics(self):
        return self.engine.metrics

    def _requests(self, prompts, sampling_params):
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise WarpforgeInputError(f"prompts: expected a string, a list of token ids, or a non-empty list of "
                                      f"them, got {type(prompts).__name__}")
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise WarpforgeInputError(f"sampling_params: expected one, or one per prompt ({len(prompts)}), got "
                                      f"{len(params)}")
        return prompts, params

    def _add(self, prompt, params, on_output=None) -> str:
        if isinstance(prompt, str):
            return self.engine.add_request(prompt, params, on_output=on_output)
        if isinstance(prompt, (list, tuple)):
            return self.engine.add_request(None, params, prompt_token_ids=list(prompt), on_output=on_output)
        raise WarpforgeInputError(f"prompts: expected strings or lists of token ids, got {type(prompt).__name__}")

    def generate(self, prompts: Union[str, list], sampling_params: Union[None, SamplingParams, list] = None
                 ) -> list[RequestOutput]:
        """Every prompt (a string or a list of token ids) run to its end in one continuous batch; the final
        RequestOutput of each, in the prompts' order."""
        prompts, params = self._requests(prompts, sampling_params)
        final = {}
        ids = [self._add(p, sp, on_output=lambda o: final.__setitem__(o.request_id, o) if o.finished else None)
               for p, sp in zip(prompts, params)]
        try:
            while any(i not in final for i in ids):
                self.engine.step()
        finally:
            for i in ids:
                if i not in final:
                    self.engine.abort(i)
        return [final[i] for i in ids]

    def stream(self, prompt, sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """One prompt's outputs step by step (new_text / new_token_ids: what each step added)."""
        if isinstance(prompt, str):
            return self.engine.stream(prompt, sampling_params)
        return self.engine.stream(None, sampling_params, prompt_token_ids=list(prompt))
