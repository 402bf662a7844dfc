"""Q, K and V quantised for FP8 attention (fp8_kernel.py), in plain PyTorch: the format, written to be read.

- q, k: e4m3 (or int8, qk_format="int8", SageAttention's INT8 Q·Kᵀ) with one fp32 scale per token and head,
  amax over the head dim mapped to the format's largest value (448 / 127); int8 rounds half up. A NaN in a row
  makes its scale NaN (the amax propagates it), so the NaN reaches the scores instead of vanishing in the codes.
- q_lo (e4m3 q only, on by default in quantize_qkv / flash_attention_fp8): q's rounding residual as a second e4m3 code at the same scale, q ≈ (q̂ +
  q̂_lo) · scale, ~7 significant bits instead of 4; the kernels add q̂_lo · k̂ into the same score accumulator (one
  more Q·Kᵀ MMA, no work per score). e4m3 in all four operands costs ~1e-3 of cosine on Gaussian inputs (each of
  q, k, v and P ~2-3e-4, benchmarks/NOTES.md "Session 34"), the issue's whole budget; q's residual takes ~2.5e-4
  of it back (H100: 1 - cos 1.15e-3 -> 8.9e-4 at s 8192, for ~10% more time).
- int8 K is smoothed first (SageAttention): the per-head mean over tokens is subtracted, which shifts every score
  of a query row by the same q · mean and leaves the softmax unchanged; the shift comes back into lse.
- k_block (e4m3 k only, 128 by default in quantize_qkv / flash_attention_fp8): one scale per aligned block of 128 keys of a head instead of one per
  key (k_scale keeps its [b, s_k, h_kv] shape, the block's scale at each of its keys). The Gluon kernel then takes a
  key tile's scale once into the row's exponent factor instead of multiplying every score by its key's scale.
- v: e4m3 with one fp32 scale per channel (amax over tokens), stored transposed as v_t [b, h_kv, d_v, s_k_pad]
  (s_k padded to 16 with zeros): the P·V product's B operand must be K-major for FP8 MMAs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FP8 = torch.float8_e4m3fn
FORMAT_MAX = {"fp8": 448.0, "int8": 127.0}
QK_FORMATS = tuple(FORMAT_MAX)
_TINY = 1e-20  # an all-zero row quantises to zeros with this scale, never to 0 / 0


@dataclass(frozen=True)
class QuantizedQKV:
    qk_format: str                  # "fp8" or "int8" (q and k); v is always e4m3
    q: torch.Tensor                 # [b, s_q, h_q, d] e4m3 / int8
    q_scale: torch.Tensor           # [b, s_q, h_q] fp32
    k: torch.Tensor                 # [b, s_k, h_kv, d] e4m3 / int8
    k_scale: torch.Tensor           # [b, s_k, h_kv] fp32
    v_t: torch.Tensor               # [b, h_kv, d_v, s_k_pad] e4m3, channel-major
    v_scale: torch.Tensor           # [b, h_kv, d_v] fp32
    lse_shift: Optional[torch.Tensor]  # [b, h_q, s_q] fp32: q · mean(k), what smoothing took out of the scores
    dtype: torch.dtype              # the unquantised inputs' (the output's)
    q_lo: Optional[torch.Tensor] = None  # [b, s_q, h_q, d] e4m3 like q (its strides too): q's rounding residual
    k_block: int = 0                # 0: k_scale per key; 128: the same over each aligned block of 128 keys

    @property
    def s_k(self) -> int:
        return self.k.shape[1]


def smoothing_mean(k: torch.Tensor) -> torch.Tensor:
    """The mean of k over tokens [b, h_kv, d] fp32 that int8's smoothing subtracts from K."""
    if k.shape[1] == 0:  # no keys: nothing to smooth (a mean over no tokens would be NaN and poison lse's -inf)
        return k.new_zeros((k.shape[0], k.shape[2], k.shape[3]), dtype=torch.float32)
    return k.mean(1, dtype=torch.float32)


def smoothing(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean of k over tokens [b, h_kv, d] fp32, lse_shift = q · that mean [b, h_q, s_q]) for int8's smoothed K."""
    mean = smoothing_mean(k)
    per_q_head = mean.repeat_interleave(q.shape[2] // k.shape[2], dim=1)
    return mean, torch.einsum("bqhd,bhd->bhq", q.float(), per_q_head)


def v_channel_scale(v: torch.Tensor) -> torch.Tensor:
    """[b, h_kv, d_v] fp32, contiguous (quantize_v_kernel indexes it flat): each channel's amax over tokens at
    e4m3's largest value (one pass over v). A NaN in a channel makes its scale NaN (the norm propagates it)."""
    b, s_k, h_kv, d_v = v.shape
    if s_k == 0:  # no keys: the amax of nothing is 0 (the inf norm refuses an empty dim)
        amax = v.new_zeros((b, h_kv, d_v), dtype=torch.float32)
    else:
        amax = torch.linalg.vector_norm(v, float("inf"), dim=1, dtype=torch.float32)
    return (amax.clamp(min=_TINY) / FORMAT_MAX["fp8"]).contiguous()


def padded_tokens(s_k: int) -> int:
    return s_k + (-s_k % 16)


def _per_row(x: torch.Tensor, fmt: str, residual: bool = False):
    """x [..., d] -> (codes, fp32 scale [...]) with amax over the last dim at the format's largest value, both
    contiguous: the kernel indexes the codes' last dim with stride 1, and any q / k quantize_qkv takes (a strided
    last dim included) must give codes flash_attention_quantized takes, as the Triton quantiser's do. residual (e4m3):
    (codes, scale, residual codes), the residual x / scale - codes in e4m3 at the same scale."""
    x = x.float().contiguous()
    scale = x.abs().amax(-1).clamp(min=_TINY) / FORMAT_MAX[fmt]
    scaled = x / scale[..., None]
    codes = torch.floor(scaled + 0.5).clamp(-127, 127).to(torch.int8) if fmt == "int8" else scaled.to(FP8)
    if residual:
        return codes, scale, (scaled - codes.float()).to(FP8)
    return codes, scale


def _per_key_block(k: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k [b, s, h, d] -> (e4m3 codes, fp32 scale [b, s, h]) with one amax over each aligned block of `block` keys of a
    head (the last block short), the block's scale repeated at each of its keys."""
    b, s, h, d = k.shape
    x = k.float().contiguous()
    pad = -s % block
    amax = torch.nn.functional.pad(x.abs().amax(-1), (0, 0, 0, pad)).view(b, -1, block, h).amax(2)
    scale = (amax.clamp(min=_TINY) / FORMAT_MAX["fp8"]).repeat_interleave(block, 1)[:, :s].contiguous()
    return (x / scale[..., None]).to(FP8), scale


def quantize_qkv_reference(q, k, v, qk_format: str, q_residual: bool, k_block: int) -> QuantizedQKV:
    """q [b, s_q, h_q, d], k [b, s_k, h_kv, d], v [b, s_k, h_kv, d_v] (validated) -> QuantizedQKV; q_residual (fp8
    only): with q's rounding residual, q_lo; k_block (fp8 only): k's scales per block of that many keys."""
    b, s_k, h_kv = k.shape[:3]
    lse_shift = q_lo = None
    if qk_format == "int8":
        mean, lse_shift = smoothing(q, k)
        k = k.float() - mean[:, None]
    if q_residual:
        q8, q_scale, q_lo = _per_row(q, qk_format, residual=True)
    else:
        q8, q_scale = _per_row(q, qk_format)
    k8, k_scale = _per_key_block(k, k_block) if k_block else _per_row(k, qk_format)
    v_scale = v_channel_scale(v)
    v_t = torch.zeros(b, h_kv, v.shape[-1], padded_tokens(s_k), dtype=FP8, device=v.device)
    v_t[..., :s_k] = (v.float() / v_scale[:, None]).permute(0, 2, 3, 1).to(FP8)
    return QuantizedQKV(qk_format, q8, q_scale, k8, k_scale, v_t, v_scale, lse_shift, q.dtype, q_lo, k_block)


def dequantize_qkv_reference(qkv: QuantizedQKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) fp32 as the kernel sees them (k without the smoothing mean: the softmax does not see it; q with its
    residual codes added, where there are)."""
    q = qkv.q.float() if qkv.q_lo is None else qkv.q.float() + qkv.q_lo.float()
    q = q * qkv.q_scale[..., None]
    k = qkv.k.float() * qkv.k_scale[..., None]
    v = (qkv.v_t[..., :qkv.s_k].float() * qkv.v_scale[..., None]).permute(0, 3, 1, 2)
    return q, k, v
