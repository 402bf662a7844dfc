"""warpforge.flash_attention as a transformers attention implementation: `attn_implementation="warpforge"`.

    import warpforge.hf  # registers "warpforge" with transformers' AttentionInterface and AttentionMaskInterface
    model = AutoModelForCausalLM.from_config(config, attn_implementation="warpforge")

What runs on warpforge and what falls back (to transformers' SDPA implementation, logged once per reason):

- causal attention with no padding (training, prefill, KV-cache decode with transformers' DynamicCache): one
  `flash_attention(causal=True)` call on the [b, s, h, d] views; bottom-right alignment is what a cache needs (query
  i of s_q sits at key s_k - s_q + i). GQA/MQA run natively (no repeat of K/V).
- a 2D padding mask (left padding in batched generation, right padding in training) and StaticCache: the
  "warpforge" mask function hands the attention a bool key-validity mask [b, end] (the convention of transformers'
  FlashAttention masks: `end` = the last query's cache slot + 1, so static-cache slots past it are dropped); the
  valid queries and keys are packed and run as varlen `flash_attention` (cu_seqlens). Queries at padded positions
  get zeros (transformers' eager/SDPA give them values no valid token reads).
- packed sequences given as FlashAttention kwargs (`cu_seq_lens_q` / `cu_seq_lens_k`, e.g. from
  DataCollatorWithFlattening): varlen directly.
- Falls back: any mask transformers builds from a mask function other than the plain causal one (sliding-window
  layers, packed sequences detected from position_ids, bidirectional or image-token overlays, or_mask/and_mask
  functions), a 4D mask passed in by the caller, attention dropout in training, attention sinks (`s_aux`),
  position biases, and whatever warpforge's op refuses (head dims that are not multiples of 8 up to 256, bf16 on
  the CPU Triton interpreter, ...). `output_attentions` returns no weights (as SDPA).

The backend (None: by device; "triton"; "reference") is read from the module's `_warpforge_backend` attribute,
which `apply_warpforge(model, backend=...)` sets; else WARPFORGE_BACKEND / the device decides (runtime.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("warpforge.hf needs transformers: pip install 'warpforge[hf]'") from e

from ..errors import WarpforgeInputError
from ..ops.attention import flash_attention
from ._common import compute_dtype, fall_back

NAME = "warpforge"


def warpforge_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, cache_position=None, **kwargs):
    """transformers' mask hook for "warpforge": None for plain bottom-right causal attention over all kv_length keys;
    a bool [b, end] key-validity mask when there is padding or a StaticCache (end < kv_length); for any other mask
    function, SDPA's 4D bool mask (which the attention then hands to SDPA). transformers 4.x passes the query
    positions as cache_position instead of q_length / q_offset."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    given = dict(batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset, mask_function=mask_function,
                 attention_mask=attention_mask, **kwargs)
    given.update(dict(cache_position=cache_position) if q_length is None else
                 dict(q_length=q_length, q_offset=q_offset))
    if q_length is None:
        q_length = cache_position.shape[0]
        q_offset = cache_position[0] if q_length else 0
    end = q_offset - kv_offset + q_length
    end = int(end) if isinstance(end, torch.Tensor) else end  # a StaticCache's offset is a tensor
    if mask_function is not None and mask_function is not causal_mask_function:
        mask = sdpa_mask(**given)
        # None is SDPA's is_causal over the first keys (a window that hides nothing); with a StaticCache's slots
        # past end that is the key-validity mask below, not causal attention over all kv_length keys
        if mask is not None or end == kv_length:
            return mask
    if attention_mask is None:
        if end == kv_length:
            return None
        device = kwargs.get("device") or (cache_position.device if cache_position is not None else None)
        return torch.ones(batch_size, end, dtype=torch.bool, device=device)
    mask = attention_mask.to(torch.bool)
    if mask.shape[-1] < kv_offset + end:  # a mask shorter than the positions: the rest is padding (as transformers)
        mask = F.pad(mask, (0, kv_offset + end - mask.shape[-1]))
    mask = mask[:, kv_offset:kv_offset + end]
    if end == kv_length and bool(mask.all()):
        return None
    return mask


def _refusal(attention_mask, dropout, kwargs) -> str | None:
    if dropout:
        return "attention dropout (flash_attention has none)"
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.dtype != torch.bool):
        return ("a 4D mask (sliding-window layers, packed sequences found from position_ids, a custom mask function "
                "or a caller's 4D mask): not expressible as causal + varlen")
    if kwargs.get("s_aux") is not None:
        return "attention sinks (s_aux)"
    if kwargs.get("position_bias") is not None:
        return "a position bias"
    return None


def warpforge_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """transformers' attention call: query [b, h_q, s_q, d], key/value [b, h_kv, s_k, d] -> ([b, s_q, h_q, d_v],
    None)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    reason = _refusal(attention_mask, dropout, kwargs)
    if reason is None:
        try:
            return _run(module, query, key, value, attention_mask, scaling, causal, sliding_window, softcap,
                        kwargs), None
        except WarpforgeInputError as e:
            reason = str(e)
    fall_back("attention", reason)
    return _sdpa(module, query, key, value, attention_mask, dropout, scaling, causal, sliding_window, softcap,
                 kwargs)


def _run(module, query, key, value, mask, scaling, causal, sliding_window, softcap, kwargs):
    dtype = compute_dtype(query)  # autocast's (SDPA is on autocast's list; custom ops are not)
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (query, key, value))  # [b, s, h, d] views
    op = dict(causal=bool(causal), softmax_scale=scaling, softcap=softcap or None,
              window=(-1, -1) if sliding_window is None else (int(sliding_window) - 1, -1),
              backend=getattr(module, "_warpforge_backend", None))
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if mask is None and cu_q is not None and cu_k is not None and q.shape[0] == 1:  # packed by the data collator
        return flash_attention(q[0], k[0], v[0], cu_seqlens_q=cu_q.int(), cu_seqlens_k=cu_k.int(),
                               max_seqlen_q=_int(kwargs.get("max_length_q")),
                               max_seqlen_k=_int(kwargs.get("max_length_k")), **op)[None]
    if mask is None:
        return flash_attention(q, k, v, **op)
    b, s_q, h_q, _ = q.shape
    end = mask.shape[1]
    if mask.shape[0] != b or not s_q <= end <= k.shape[1]:
        raise WarpforgeInputError(f"attention_mask: a [{b}, s] key mask with {s_q} <= s <= {k.shape[1]}, got "
                                  f"{tuple(mask.shape)}")
    plan = _plan(mask, s_q)
    qp = q.reshape(b * s_q, h_q, q.shape[-1]).index_select(0, plan["q_rows"])
    kp, vp = (t[:, :end].reshape(b * end, *t.shape[2:]).index_select(0, plan["k_rows"]) for t in (k, v))
    out = flash_attention(qp, kp, vp, cu_seqlens_q=plan["cu_q"], cu_seqlens_k=plan["cu_k"],
                          max_seqlen_q=plan["max_q"], max_seqlen_k=plan["max_k"], **op)
    full = out.new_zeros(b * s_q, h_q, out.shape[-1]).index_copy(0, plan["q_rows"], out)
    return full.view(b, s_q, h_q, out.shape[-1])


def _int(x):
    return int(x) if x is not None else None


def _plan(mask: torch.Tensor, s_q: int) -> dict:
    """Rows of the valid queries (the last s_q key slots) and keys, and their cu_seqlens: read once per mask (kept
    on the mask tensor, which every layer of a forward shares)."""
    plans = mask.__dict__.setdefault("_warpforge_plans", {})
    if s_q not in plans:
        q_valid = mask[:, mask.shape[1] - s_q:]
        lens_q, lens_k = q_valid.sum(1), mask.sum(1)
        plans[s_q] = dict(q_rows=q_valid.reshape(-1).nonzero().squeeze(1),
                          k_rows=mask.reshape(-1).nonzero().squeeze(1),
                          cu_q=F.pad(lens_q.cumsum(0), (1, 0)).to(torch.int32),
                          cu_k=F.pad(lens_k.cumsum(0), (1, 0)).to(torch.int32),
                          max_q=int(lens_q.max()) if lens_q.numel() else 0,
                          max_k=int(lens_k.max()) if lens_k.numel() else 0)
    return plans[s_q]


def dense_mask(mask: torch.Tensor | None, b: int, s_q: int, s_k: int, causal: bool, sliding_window, device):
    """The [b, 1, s_q, s_k] bool mask SDPA needs for what warpforge's path expresses (bottom-right causal, a window,
    a key mask [b, end]), or None where SDPA's own is_causal says it. A query that would see nothing sees every key
    (SDPA would return NaN there; the row is padding either way)."""
    end = s_k if mask is None else mask.shape[1]
    if mask is None and sliding_window is None and (not causal or s_q == s_k or s_q == 1):
        return None
    keys = torch.ones(b, s_k, dtype=torch.bool, device=device)
    if mask is not None:
        keys = torch.zeros(b, s_k, dtype=torch.bool, device=device)
        keys[:, :end] = mask
    q_pos = end - s_q + torch.arange(s_q, device=device)[:, None]
    k_pos = torch.arange(s_k, device=device)[None, :]
    allowed = keys[:, None, None, :].expand(b, 1, s_q, s_k)
    if causal:
        allowed = allowed & (k_pos <= q_pos)
    if sliding_window is not None:
        allowed = allowed & (k_pos > q_pos - int(sliding_window))
    return allowed | ~allowed.any(-1, keepdim=True)


def _sdpa(module, query, key, value, mask, dropout, scaling, causal, sliding_window, softcap, kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if mask is None or (mask.dim() == 2 and mask.dtype == torch.bool):  # one of ours: make SDPA's mask of it
        mask = dense_mask(mask, query.shape[0], query.shape[2], key.shape[2], causal, sliding_window, query.device)
    if softcap:
        kwargs["softcap"] = softcap  # SDPA refuses it by name
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                  is_causal=causal, **kwargs)


def register() -> None:
    """Make "warpforge" an attention implementation (and its mask function) in transformers; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, warpforge_attention_forward)
    AttentionMaskInterface.register(NAME, warpforge_mask)


register()  # on import: `attn_implementation="warpforge"` works once warpforge.hf is imported
