"""Sampling from a trained GPT checkpoint: temperature, top-k, top-p, KV cache, a prompt."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from .config import GPTConfig
from .data import cache_dir
from .model import GPT


def load(preset_name: str = "tiny", ckpt: str | None = None, device=None) -> GPT:
    path = Path(ckpt) if ckpt else cache_dir().parent / "runs" / preset_name / "ckpt.pt"
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: train one first (`warpforge gpt train --preset "
                                f"{preset_name}`)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    model = GPT(GPTConfig(**state["model_cfg"]))
    model.load_state_dict(state["model"])
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval()


def sample(model: GPT, prompt: str = "\n", max_new_tokens: int = 300, temperature: float = 0.8,
           top_k: int | None = 50, top_p: float | None = None, num_samples: int = 1, seed: int = 0) -> list[str]:
    """Byte-level text continuation of `prompt`."""
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
