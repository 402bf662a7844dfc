"""Checkpoint directories -> a `ModelSpec` (the shapes a serving model is built from) and its weights under the
serving models' names.

Two formats are read:
- Hugging Face: config.json (`architectures` / `model_type`) and *.safetensors (one file or shards with
  model.safetensors.index.json) with the transformers weight names, for the dense Llama-style families: Llama,
  Mistral, Qwen2, Qwen3 (q/k norm).
- warpforge GPT exports (`warpforge gpt train` writes model.safetensors and config.json with "model_cfg"; see
  models/gpt/checkpoint.py): the same pre-norm block with a fused qkv and a fused gate_up.

Weights come back fused the way the forward multiplies them: one qkv matrix [(h_q + 2 h_kv) · d, hidden] and one
gate_up matrix [2 · ffn, hidden] (gate rows first), so a layer is three matmuls and a down projection.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..errors import WarpforgeInputError

# model_type -> the serving family whose forward runs it (serve/models/<family>.py). The MoE and MLA families
# (mixtral, qwen3_moe, deepseek_v3) are the next ones: a spec field for their extra shapes and a file each.
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "warpforge_gpt": "llama"}


@dataclass(frozen=True)
class ModelSpec:
    """What a decoder's forward needs to know of a checkpoint. Layer-varying settings are tuples per layer."""
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]            # HF's rope parameters beyond theta ({"rope_type": "llama3", ...}) or None
    tie_embeddings: bool
    qkv_bias: bool = False                  # Qwen2
    qk_norm: bool = False                   # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_windows: tuple = ()             # per layer: None (full attention) or the tokens a query sees, itself included
    max_position_embeddings: int = 4096
    eos_token_ids: tuple = ()
    bos_token_id: Optional[int] = None
    rope_tables: str = "hf"                 # "hf" (transformers' inv_freq) or "warpforge" (ops.rope.rope_tables)
    tokenizer: str = "tokenizer.json"       # "tokenizer.json", or a warpforge GPT vocabulary ("bytes", "gpt2")
    extra: dict = field(default_factory=dict)

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise WarpforgeInputError(f"path: expected a checkpoint directory holding {path.name}, got {path.parent}") \
            from None
    except json.JSONDecodeError as exc:
        raise WarpforgeInputError(f"path: {path} is not valid JSON ({exc})") from None


def read_spec(path) -> ModelSpec:
    """The ModelSpec of the checkpoint directory at path (HF or warpforge GPT), or a WarpforgeInputError saying what
    is missing or not supported."""
    path = Path(path)
    if not path.is_dir():
        raise WarpforgeInputError(f"path: expected a checkpoint directory, got {str(path)!r}")
    cfg = _read_json(path / "config.json")
    if "model_cfg" in cfg:
        return _gpt_spec(cfg["model_cfg"])
    return _hf_spec(cfg, path)


def _ids(value) -> tuple:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _hf_spec(cfg: dict, path: Path) -> ModelSpec:
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES or model_type == "warpforge_gpt":
        arch = (cfg.get("architectures") or ["?"])[0]
        raise WarpforgeInputError(
            f"path: expected a checkpoint of a supported family (model_type in "
            f"{sorted(k for k in FAMILIES if k != 'warpforge_gpt')}), got model_type {model_type!r} ({arch})")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise WarpforgeInputError(f"config.json: expected hidden_act 'silu' (SwiGLU), got {cfg['hidden_act']!r}")
    if cfg.get("mlp_bias"):
        raise WarpforgeInputError("config.json: mlp_bias=true is not supported (no MLP biases in these families)")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    # Qwen3's config class defaults head_dim to 128, not hidden / heads
    head_dim = cfg.get("head_dim") or (128 if model_type == "qwen3" else cfg["hidden_size"] // heads)
    # transformers 5 writes rope_parameters {"rope_type", "rope_theta", ...}; 4.x rope_theta and rope_scaling
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = rope or cfg.get("rope_scaling") or None
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise WarpforgeInputError(f"config.json: rope scaling {kind!r} is not supported (default, linear, llama3)")
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    layers = cfg["num_hidden_layers"]
    windows = _sliding_windows(cfg, model_type, layers)
    gen = path / "generation_config.json"
    eos = _ids(cfg.get("eos_token_id"))
    if gen.exists():
        eos = tuple(dict.fromkeys(eos + _ids(_read_json(gen).get("eos_token_id"))))
    return ModelSpec(
        model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # transformers' Mistral has no attention biases whatever attention_bias says; Llama and Qwen3 follow it
        qkv_bias=model_type == "qwen2" or (model_type != "mistral" and bool(cfg.get("attention_bias", False))),
        qk_norm=model_type == "qwen3", sliding_windows=windows,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"))


def _sliding_windows(cfg: dict, model_type: str, layers: int) -> tuple:
    """Per layer, the tokens a query sees (itself included) or None, as transformers reads the config: Llama none
    (its attention ignores sliding_window); with layer_types, the layers it marks "sliding_attention" (a Mistral
    config with layer_types is what transformers loads as Ministral); else Mistral every layer (sliding_window
    4096 when the key is absent, none when it is null), Qwen2/3 the layers from max_window_layers (default 28) on
    when use_sliding_window is set."""
    window = cfg["sliding_window"] if "sliding_window" in cfg else (4096 if model_type == "mistral" else None)
    if not window or model_type == "llama":
        return (None,) * layers
    types = cfg.get("layer_types")
    if types:
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if model_type == "mistral":
        return (int(window),) * layers
    if not cfg.get("use_sliding_window", False):
        return (None,) * layers
    first = cfg.get("max_window_layers", 28)
    return tuple(int(window) if i >= first else None for i in range(layers))


def _gpt_spec(m: dict) -> ModelSpec:
    if m.get("attention", "mha") != "mha" or m.get("moe_experts", 0) or m.get("mlp", "swiglu") != "swiglu":
        raise WarpforgeInputError("path: a warpforge GPT with MLA, MoE or Monarch layers is not served yet (dense "
                                  "GQA + SwiGLU only)")
    d, heads = m["d_model"], m["n_head"]
    ffn = -(-int(m.get("ffn_mult", 8 / 3) * d) // 64) * 64  # GPTConfig.ffn_dim
    return ModelSpec(
        model_type="warpforge_gpt", vocab_size=m["vocab_size"], hidden_size=d, num_layers=m["n_layer"],
        num_heads=heads, num_kv_heads=m.get("n_kv_head", heads), head_dim=d // heads, intermediate_size=ffn,
        rms_norm_eps=1e-6, rope_theta=float(m.get("rope_base", 10000.0)), rope_scaling=None,
        tie_embeddings=bool(m.get("tie_embeddings", True)), sliding_windows=(None,) * m["n_layer"],
        max_position_embeddings=m.get("seq_len", 256), rope_tables="warpforge",
        tokenizer=m.get("tokenizer", "bytes"))


# ------------------------------------------------------------------------------------------ weights
def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(_read_json(index)["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WarpforgeInputError(f"path: expected *.safetensors weights in {path}, found none")
    return files


def read_tensors(path) -> dict:
    """Every tensor of the checkpoint's safetensors files, on the CPU, by name."""
    from safetensors.torch import load_file
    tensors = {}
    for f in _safetensors_files(Path(path)):
        tensors.update(load_file(str(f)))
    return tensors


def load_weights(path, spec: ModelSpec, dtype: torch.dtype, device) -> dict:
    """The checkpoint's weights under the serving names (see module docstring), in dtype on device."""
    raw = read_tensors(path)
    if spec.model_type == "warpforge_gpt":
        meta = _read_json(Path(path) / "config.json")
        for name, source in meta.get("tied", {}).items():
            raw[name] = raw[source]
        out = _gpt_weights(raw, spec)
    else:
        out = _hf_weights(raw, spec)
    return {k: v.to(device=device, dtype=dtype).contiguous() for k, v in out.items()}


def _take(raw: dict, name: str) -> torch.Tensor:
    try:
        return raw.pop(name)
    except KeyError:
        raise WarpforgeInputError(f"weights: expected a tensor named {name!r} in the checkpoint, found none") \
            from None


def _hf_weights(raw: dict, spec: ModelSpec) -> dict:
    # some exports prefix the decoder ("model.") and some do not (a bare LlamaModel): accept both
    prefix = "model." if any(k.startswith("model.") for k in raw) else ""
    out = {"embed": _take(raw, f"{prefix}embed_tokens.weight"), "norm": _take(raw, f"{prefix}norm.weight")}
    head = raw.pop("lm_head.weight", None)
    if head is None and not spec.tie_embeddings:
        raise WarpforgeInputError("weights: expected lm_head.weight (config.json says the embeddings are not tied)")
    out["lm_head"] = out["embed"] if head is None else head
    for i in range(spec.num_layers):
        p = f"{prefix}layers.{i}."
        a = p + "self_attn."
        out[f"{i}.attn_norm"] = _take(raw, p + "input_layernorm.weight")
        out[f"{i}.mlp_norm"] = _take(raw, p + "post_attention_layernorm.weight")
        out[f"{i}.qkv"] = torch.cat([_take(raw, a + f"{n}_proj.weight") for n in "qkv"])
        if spec.qkv_bias:
            out[f"{i}.qkv_bias"] = torch.cat([_take(raw, a + f"{n}_proj.bias") for n in "qkv"])
        out[f"{i}.o"] = _take(raw, a + "o_proj.weight")
        if a + "o_proj.bias" in raw:  # Llama / Qwen3 with attention_bias: o_proj has one too (Qwen2's has not)
            out[f"{i}.o_bias"] = _take(raw, a + "o_proj.bias")
        if spec.qk_norm:
            out[f"{i}.q_norm"] = _take(raw, a + "q_norm.weight")
            out[f"{i}.k_norm"] = _take(raw, a + "k_norm.weight")
        m = p + "mlp."
        out[f"{i}.gate_up"] = torch.cat([_take(raw, m + "gate_proj.weight"), _take(raw, m + "up_proj.weight")])
        out[f"{i}.down"] = _take(raw, m + "down_proj.weight")
    _check_unused(raw)
    _check_shapes(out, spec)
    return out


def _check_unused(raw: dict) -> None:
    """Every checkpoint tensor was taken (one the forward does not apply would silently change the model)."""
    left = sorted(k for k in raw if not k.endswith("rotary_emb.inv_freq"))  # a buffer older exports save
    if left:
        raise WarpforgeInputError(f"weights: expected every checkpoint tensor to be used, got {len(left)} this "
                                  f"model does not apply: {left[:8]}{' ...' if len(left) > 8 else ''}")


def _gpt_weights(raw: dict, spec: ModelSpec) -> dict:
    out = {"embed": _take(raw, "embed.weight"), "norm": _take(raw, "norm.weight"), "lm_head": _take(raw, "head.weight")}
    for i in range(spec.num_layers):
        p = f"blocks.{i}."
        out[f"{i}.attn_norm"] = _take(raw, p + "norm1.weight")
        out[f"{i}.mlp_norm"] = _take(raw, p + "norm2.weight")
        out[f"{i}.qkv"] = _take(raw, p + "attn.qkv.weight")  # q heads, then k heads, then v heads (nn.Attention)
        out[f"{i}.o"] = _take(raw, p + "attn.proj.weight")
        out[f"{i}.gate_up"] = _take(raw, p + "mlp.gate_up.weight")  # gate first, then up (nn.SwiGLU)
        out[f"{i}.down"] = _take(raw, p + "mlp.down.weight")
    _check_unused(raw)
    _check_shapes(out, spec)
    return out


def _check_shapes(w: dict, s: ModelSpec) -> None:
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    want = {"embed": (s.vocab_size, s.hidden_size), "lm_head": (s.vocab_size, s.hidden_size),
            "norm": (s.hidden_size,)}
    for i in range(s.num_layers):
        want.update({f"{i}.qkv": (qkv, s.hidden_size), f"{i}.o": (s.hidden_size, s.num_heads * s.head_dim),
                     f"{i}.gate_up": (2 * s.intermediate_size, s.hidden_size),
                     f"{i}.down": (s.hidden_size, s.intermediate_size)})
        if f"{i}.o_bias" in w:
            want[f"{i}.o_bias"] = (s.hidden_size,)
    for name, shape in want.items():
        if tuple(w[name].shape) != shape:
            raise WarpforgeInputError(f"weights: expected {name} of shape {shape} (from config.json), got "
                                      f"{tuple(w[name].shape)}")
