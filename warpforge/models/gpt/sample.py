"""Sampling from a trained GPT checkpoint: temperature, top-k, top-p, KV cache, a prompt."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ...errors import check_int, fail
from .checkpoint import WEIGHTS, CheckpointError, load_weights, read_checkpoint, read_exported
from .config import GPTConfig, from_dict
from .data import cache_dir
from .model import GPT, check_sampling
from .tokenizer import get as get_tokenizer

SEEDS = (-2 ** 63, 2 ** 64 - 1)  # what torch.Generator.manual_seed takes


def load(preset_name: str = "tiny", ckpt: str | None = None, device=None, backend=None) -> GPT:
    """The model of a training checkpoint (`ckpt`: a ckpt.pt, or a run folder / its model.safetensors, read with
    config.json beside it; default: the preset's run), in eval mode. A missing file is a FileNotFoundError, an
    unreadable one a CheckpointError (both one line)."""
    path = Path(ckpt) if ckpt else cache_dir().parent / "runs" / preset_name / "ckpt.pt"
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: train one first (`warpforge gpt train --preset "
                                f"{preset_name}`)")
    if path.is_dir() or path.name == WEIGHTS:
        model_cfg, weights = read_exported(path if path.is_dir() else path.parent)
    else:
        state = read_checkpoint(path, keys=("model", "model_cfg"))
        model_cfg, weights = state["model_cfg"], state["model"]
    try:
        cfg = from_dict(GPTConfig, model_cfg)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: its model config does not read here ({exc})") from None
    model = GPT(cfg, backend=backend)
    load_weights(model, weights, path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval()


def sample(model: GPT, prompt: str = "\n", max_new_tokens: int = 300, temperature: float = 0.8,
           top_k: int | None = 50, top_p: float | None = None, num_samples: int = 1, seed: int = 0) -> list[str]:
    """Text continuation of `prompt` in the model's tokenizer (bytes, or GPT-2's): num_samples continuations of
    max_new_tokens tokens each.
    temperature 0 is greedy; top_k keeps the k most likely bytes, top_p the smallest set holding that much
    probability (None: no limit). WarpforgeInputErrors (one line) for settings that cannot sample."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    check_int("num_samples", num_samples, lo=1)
    check_int("seed", seed, lo=SEEDS[0], hi=SEEDS[1])
    if not isinstance(prompt, str):
        fail("prompt", "a str", type(prompt).__name__)
    device = model.embed.weight.device
    tok = get_tokenizer(model.cfg.tokenizer)
    ids = tok.encode(prompt) or tok.encode("\n")
    if max(ids) >= model.cfg.vocab_size:
        fail("prompt", f"tokens below this model's vocab_size ({model.cfg.vocab_size})", f"token {max(ids)}")
    idx = torch.tensor([ids] * num_samples, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    # on GPU in bf16 as the model trained (the attention kernels take fp16/bf16); the model itself is untouched
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    with amp:
        out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
    return [tok.decode(row.tolist()) for row in out]
