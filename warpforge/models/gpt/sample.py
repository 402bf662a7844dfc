"""Sampling from a trained GPT checkpoint: temperature, top-k, top-p, KV cache, a prompt."""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from .checkpoint import CheckpointError, load_weights, read_checkpoint
from .config import GPTConfig, from_dict
from .data import cache_dir
from .model import GPT


def load(preset_name: str = "tiny", ckpt: str | None = None, device=None, backend=None) -> GPT:
    """The model of a training checkpoint (`ckpt`, or the preset's default run), in eval mode. A missing file is
    a FileNotFoundError, an unreadable one a CheckpointError (both one line)."""
    path = Path(ckpt) if ckpt else cache_dir().parent / "runs" / preset_name / "ckpt.pt"
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: train one first (`warpforge gpt train --preset "
                                f"{preset_name}`)")
    state = read_checkpoint(path, keys=("model", "model_cfg"))
    try:
        cfg = from_dict(GPTConfig, state["model_cfg"])
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: its model config does not read here ({exc})") from None
    model = GPT(cfg, backend=backend)
    load_weights(model, state["model"], path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval()


def sample(model: GPT, prompt: str = "\n", max_new_tokens: int = 300, temperature: float = 0.8,
           top_k: int | None = 50, top_p: float | None = None, num_samples: int = 1, seed: int = 0) -> list[str]:
    """Byte-level text continuation of `prompt`: num_samples continuations of max_new_tokens bytes each.
    temperature 0 is greedy; top_k keeps the k most likely bytes, top_p the smallest set holding that much
    probability (None: no limit)."""
    _check_sampling(max_new_tokens, temperature, top_k, top_p, num_samples)
    device = model.embed.weight.device
    ids = list(prompt.encode("utf-8")) or [10]
    if max(ids) >= model.cfg.vocab_size:
        raise ValueError("the prompt has bytes outside this model's vocabulary")
    idx = torch.tensor([ids] * num_samples, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    # on GPU in bf16 as the model trained (the attention kernels take fp16/bf16); the model itself is untouched
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    with amp:
        out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
    return [bytes(row.tolist()).decode("utf-8", errors="replace") for row in out]


def _check_sampling(max_new_tokens, temperature, top_k, top_p, num_samples) -> None:
    """One-line ValueErrors for settings that cannot sample."""
    def bad(name, expected, got):
        raise ValueError(f"{name}: expected {expected}, got {got!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        bad("max_new_tokens", "a positive integer", max_new_tokens)
    if not isinstance(num_samples, int) or num_samples < 1:
        bad("num_samples", "a positive integer", num_samples)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        bad("temperature", "a finite number >= 0 (0: greedy)", temperature)
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        bad("top_k", "a positive integer or None", top_k)
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        bad("top_p", "a probability in (0, 1] or None", top_p)
