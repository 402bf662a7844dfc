"""`flash_attention_fp8`: FP8 (or INT8-QK) attention forward. validate -> quantise (fp8_quantize.py) -> dispatch
(the reference on the dequantised inputs, or the Triton FP8 kernel as an op)."""
from __future__ import annotations

import math
import os
from typing import Optional, Union

import torch

from ...errors import (check_bool, check_choice, check_last_dim_contiguous, check_no_grad, check_positive_float,
                       check_rank, check_same_device, check_tensor, fail)
from ...runtime import arch_key, resolve_backend
from .._op import kernel_op
from . import configs
from .api import FLOATS, MAX_HEAD_DIM, band, causal_or_unmasked, check_window
from .fp8_quantize import (FP8, QK_FORMATS, QuantizedQKV, dequantize_qkv_reference, padded_tokens,
                           quantize_qkv_reference, smoothing, smoothing_mean, v_channel_scale)
from .reference import attention_reference

# ---------------------------------------------------------------------------------- the Hopper Gluon FP8 forward
# fp8_gluon_kernel.py (QGMMA / IGMMA on the bf16 Gluon forward's schedule): sm_90, a Triton whose Gluon API it was
# written for, head dim 64/128 (d_v = d), causal or no mask, batched (fixed length). Kept here rather than in
# configs.py for now (another engineer owns configs.py this session).
FP8_GLUON_ENV = "WARPFORGE_ATTN_FP8_GLUON"  # "1" on, "0" off (the portable FP8 kernel runs), unset: FP8_GLUON_DEFAULT
FP8_GLUON_DEFAULT = True                    # on: its 57 GPU tests pass on the H200, and all-in it is 2.6x the portable
# FP8 kernel at the headline (session 12, runs/2026-12-02-s12/call4/fp8_gluon.log: 2.145 vs 5.583 ms)
FP8_GLUON_TRITON_VERSIONS = ("3.6",)
FP8_GLUON_HEAD_DIMS = (64, 128)
# (head dim, causal) -> (BLOCK_N, STAGES, PINGPONG, PERSISTENT); 128 query rows per work item. Compiled without
# spills for sm_90 (Triton 3.6); not yet timed. Overridable for sweeps: WARPFORGE_ATTN_FP8_GLUON_BLOCK_N / _STAGES /
# _PINGPONG / _PERSISTENT.
FP8_GLUON_FWD = {
    (64, False): (128, 4, True, False), (64, True): (128, 4, True, False),
    (128, False): (128, 3, True, False), (128, True): (128, 3, True, False),
}


def fp8_gluon_knobs(d: int, causal: bool) -> tuple[int, int, bool, bool]:
    """(BLOCK_N, STAGES, PINGPONG, PERSISTENT): FP8_GLUON_FWD, each overridable through the environment."""
    block_n, stages, pingpong, persistent = FP8_GLUON_FWD[(d, bool(causal))]
    env, pre = os.environ, FP8_GLUON_ENV + "_"
    return (int(env.get(pre + "BLOCK_N", block_n)), int(env.get(pre + "STAGES", stages)),
            env.get(pre + "PINGPONG", "1" if pingpong else "0") != "0",
            env.get(pre + "PERSISTENT", "1" if persistent else "0") != "0")


def fp8_gluon_permute_k() -> bool:
    """WARPFORGE_ATTN_FP8_GLUON_PERMUTE_K ("0" off; on by default: 5-10% faster on the H200, session 11): K's rows
    loaded permuted within 16-key groups so that P moves into the P·V operand without data movement
    (fp8_gluon_kernel._p_operand); the quantiser then writes K as [b, h_kv, s_pad16, d] memory for the kernel's 5-D
    descriptor."""
    return os.environ.get(FP8_GLUON_ENV + "_PERMUTE_K", "1") != "0"


def _fp8_gluon_switch() -> bool:
    flag = os.environ.get(FP8_GLUON_ENV)
    if not (FP8_GLUON_DEFAULT if flag is None else flag != "0"):
        return False
    import triton
    return triton.__version__.startswith(FP8_GLUON_TRITON_VERSIONS)


def fp8_gluon_gate(qkv: QuantizedQKV, left: int, right: int) -> bool:
    """Whether flash_attention_quantized takes the Hopper Gluon kernel: an sm_90 device, the switch on, a Triton in
    FP8_GLUON_TRITON_VERSIONS, head dim 64/128 with d_v = d, no mask or causal (no window), TMA-aligned codes and an
    fp16/bf16 output. Everything else runs the portable FP8 kernel (fp8_kernel.py)."""
    q = qkv.q
    if q.device.type != "cuda" or q.dim() != 4 or arch_key(q.device) != "sm90":
        return False
    if not causal_or_unmasked(q.shape[1], qkv.k.shape[1], left, right):  # a window or a one-sided band
        return False
    if q.shape[-1] not in FP8_GLUON_HEAD_DIMS or not _fp8_gluon_switch():
        return False
    from . import fp8_gluon_kernel
    return fp8_gluon_kernel.fits(qkv) and fp8_gluon_kernel.available()


def _fp8_impl(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v_t: torch.Tensor,
              v_scale: torch.Tensor, qk_format: str, out_dtype: torch.dtype, sm_scale: float, left: int,
              right: int, q_lo: Optional[torch.Tensor], k_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    from .fp8_kernel import _block, flash_fp8_fwd
    b, s_q, h_q, d = q.shape
    qkv = QuantizedQKV(qk_format, q, q_scale, k, k_scale, v_t, v_scale, None, out_dtype, q_lo, k_block)
    if fp8_gluon_gate(qkv, left, right):  # Hopper: QGMMA on the Gluon forward's schedule
        from .fp8_gluon_kernel import flash_fp8_fwd_gluon
        return flash_fp8_fwd_gluon(qkv, sm_scale, right == 0, *fp8_gluon_knobs(d, right == 0),
                                   permute_k=fp8_gluon_permute_k())
    out = torch.empty((b, s_q, h_q, v_t.shape[2]), device=q.device, dtype=out_dtype)
    lse = torch.empty((b, h_q, s_q), device=q.device, dtype=torch.float32)
    if out.numel():
        cfg = configs.FP8_TILES.lookup(q.device, max(_block(d), _block(v_t.shape[2])))
        flash_fp8_fwd(qkv, sm_scale, left, right, cfg, out, lse)
    return out, lse


def _fp8_fake(q, q_scale, k, k_scale, v_t, v_scale, qk_format, out_dtype, sm_scale, left, right, q_lo, k_block):
    b, s_q, h_q, _ = q.shape
    return q.new_empty((b, s_q, h_q, v_t.shape[2]), dtype=out_dtype), q.new_empty((b, h_q, s_q), dtype=torch.float32)


_flash_fp8 = kernel_op("flash_attention_fp8", _fp8_impl, _fp8_fake)


def _check_no_grad(name, t):
    """Forward only, on both backends: the Triton op has no backward and the reference's would differentiate through
    the rounding, so a tensor that would build a graph is refused rather than silently detached."""
    check_no_grad(name, t, "flash_attention_fp8")


def _check_head_dim(name, width):
    if width % 16 or not 16 <= width <= MAX_HEAD_DIM:
        fail(name, f"a head dim that is a multiple of 16 from 16 to {MAX_HEAD_DIM}", width)


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        check_rank(name, t, 4)
        check_same_device(name, t, "q", q)
        if t.dtype not in FLOATS:
            fail(name, f"dtype in {FLOATS} (quantised here)", str(t.dtype))
        _check_no_grad(name, t)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        fail("k/v", f"dtype {q.dtype} (like q)", f"{k.dtype}/{v.dtype}")
    for name, width in (("q", q.shape[-1]), ("v", v.shape[-1])):
        _check_head_dim(name, width)
    if k.shape[-1] != q.shape[-1]:
        fail("k", f"head dim {q.shape[-1]} (like q)", k.shape[-1])
    if k.shape[:-1] != v.shape[:-1]:
        fail("v", f"the shape of k but its head dim, {tuple(k.shape[:-1])} + (d_v,)", tuple(v.shape))
    if k.shape[0] != q.shape[0]:
        fail("k", f"batch {q.shape[0]} (like q)", k.shape[0])
    h_q, h_kv = q.shape[2], k.shape[2]
    if h_kv == 0 or h_q % h_kv:
        fail("k", f"a number of heads dividing q's {h_q}", h_kv)


def _check_quantized(qkv):
    """Every field of a QuantizedQKV, as the kernel reads it (it may come from a cache rather than quantize_qkv):
    the codes' and scales' dtypes and shapes against q's and k's, the formats, the heads, v_t covering k's tokens,
    and stride 1 where the kernel indexes without a stride (the codes' last dims, v_scale's channels)."""
    if not isinstance(qkv, QuantizedQKV):
        fail("qkv", "a QuantizedQKV (from quantize_qkv)", type(qkv).__name__)
    check_choice("qkv.qk_format", qkv.qk_format, QK_FORMATS)
    if qkv.dtype not in FLOATS:
        fail("qkv.dtype", f"one of {FLOATS} (the output's)", repr(qkv.dtype))
    codes = torch.int8 if qkv.qk_format == "int8" else FP8
    fields = ("q", "q_scale", "k", "k_scale", "v_t", "v_scale") + tuple(
        f for f in ("lse_shift", "q_lo") if getattr(qkv, f) is not None)
    for field in fields:
        name, t = f"qkv.{field}", getattr(qkv, field)
        check_tensor(name, t)
        check_rank(name, t, 4 if field in ("q", "k", "v_t", "q_lo") else 3)
        check_same_device(name, t, "qkv.q", qkv.q)
        want = codes if field in ("q", "k") else FP8 if field in ("v_t", "q_lo") else torch.float32
        if t.dtype != want:
            fail(name, f"dtype {want}" + (f" (qk_format {qkv.qk_format!r})" if field in ("q", "k") else ""),
                 str(t.dtype))
        _check_no_grad(name, t)
    for field in ("q", "k", "v_t", "v_scale"):
        check_last_dim_contiguous(f"qkv.{field}", getattr(qkv, field))
    b, s_q, h_q, d = qkv.q.shape
    _, s_k, h_kv, _ = qkv.k.shape
    _check_head_dim("qkv.q", d)
    if qkv.k.shape[0] != b or qkv.k.shape[3] != d:
        fail("qkv.k", f"[{b}, s_k, h_kv, {d}] (q's batch and head dim)", tuple(qkv.k.shape))
    if h_kv == 0 or h_q % h_kv:
        fail("qkv.k", f"a number of heads dividing q's {h_q}", h_kv)
    d_v = qkv.v_t.shape[2]
    if qkv.v_t.shape[:2] != (b, h_kv) or qkv.v_t.shape[3] < s_k:
        fail("qkv.v_t", f"[{b}, {h_kv}, d_v, >= {s_k}] (k's batch and heads, at least its {s_k} tokens)",
             tuple(qkv.v_t.shape))
    _check_head_dim("qkv.v_t", d_v)
    for field, shape in (("q_scale", (b, s_q, h_q)), ("k_scale", (b, s_k, h_kv)), ("v_scale", (b, h_kv, d_v)),
                         ("lse_shift", (b, h_q, s_q))):
        t = getattr(qkv, field)
        if t is not None and tuple(t.shape) != shape:
            fail(f"qkv.{field}", f"shape {shape}", tuple(t.shape))
    if qkv.q_lo is not None:  # the kernels index q's residual codes at q's strides
        if qkv.qk_format != "fp8":
            fail("qkv.q_lo", "None with qk_format 'int8' (q's residual is an e4m3 code)", "a tensor")
        if qkv.q_lo.shape != qkv.q.shape or qkv.q_lo.stride() != qkv.q.stride():
            fail("qkv.q_lo", f"the shape and strides of qkv.q, {tuple(qkv.q.shape)} / {qkv.q.stride()}",
                 f"{tuple(qkv.q_lo.shape)} / {qkv.q_lo.stride()}")
    _check_k_block("qkv.k_block", qkv.k_block, qkv.qk_format)


K_BLOCKS = (0, 128)  # k_block: per-key scales, or one scale per aligned 128 keys


def _k_block(name: str, k_block: Optional[int], qk_format: str) -> int:
    """k_block, checked; None: 128 for e4m3 (4% faster on the Hopper kernel, within the accuracy), 0 for int8."""
    if k_block is None:
        return 128 if qk_format == "fp8" else 0
    _check_k_block(name, k_block, qk_format)
    return k_block


def _check_k_block(name: str, k_block, qk_format: str) -> None:
    if isinstance(k_block, bool) or k_block not in K_BLOCKS:
        fail(name, f"one of {K_BLOCKS} (0: a scale per key)", k_block)
    if k_block and qk_format != "fp8":
        fail(name, "0 with qk_format 'int8' (block scales are an e4m3 option)", k_block)


def _q_residual(qk_format: str, q_residual: Optional[bool]) -> bool:
    """q_residual, checked: a bool, and only with e4m3 Q·Kᵀ (int8's codes carry 8 bits already); None: on for e4m3
    (the accuracy the bar asks, cos >= 0.999, needs it), off for int8."""
    if q_residual is None:
        return qk_format == "fp8"
    check_bool("q_residual", q_residual)
    if q_residual and qk_format != "fp8":
        fail("q_residual", "False with qk_format 'int8' (the residual is an e4m3 code)", q_residual)
    return q_residual


def quantize_qkv(q, k, v, *, qk_format: str = "fp8", q_residual: Optional[bool] = None,
                 k_block: Optional[int] = None, backend=None) -> QuantizedQKV:
    """q [b, s_q, h_q, d], k [b, s_k, h_kv, d], v [b, s_k, h_kv, d_v] (fp16 / bf16 / fp32; d, d_v multiples of 16
    up to 256) -> a QuantizedQKV for flash_attention_quantized: e4m3 (or int8 q/k, qk_format="int8") with
    per-token q/k scales and per-channel v scales (fp8_quantize.py). A cache can keep k and v quantised.
    q_residual (e4m3 only; on by default there): q's rounding residual as a second e4m3 code (QuantizedQKV.q_lo), so
    that the scores see q to ~7 significant bits for one more Q·Kᵀ MMA: 1 - cos 1.15e-3 -> 8.9e-4 at b1 h4 s8192
    d128 causal, ~10% slower (H100, benchmarks/NOTES.md "Session 34"); False gives the single code. k_block (e4m3
    only; 0 or 128, 128 by default there): one scale per aligned block of 128 keys of a head instead of one per key
    (0), which the Hopper kernel applies once a key tile rather than once a score: 4% faster; with q's residual
    1 - cos 9.1e-4 (H100, session 36). int8 takes neither (the defaults are off for it).

    Values are not read on the host (no sync): a NaN propagates instead. A row's amax keeps it, so its scale is NaN
    and so is every output it reaches (int8 smooths K by its per-head mean, so there a NaN key reaches all of its
    head's rows); an inf gives an inf scale, which dequantises to NaN too. Forward only: inputs that require grad are
    refused while grad mode is on."""
    _check_qkv(q, k, v)
    check_choice("qk_format", qk_format, QK_FORMATS)
    return _quantize(q, k, v, qk_format, backend, True, q_residual=_q_residual(qk_format, q_residual),
                     k_block=_k_block("k_block", k_block, qk_format))


def _keys_for_gluon(q, k) -> bool:
    """Whether flash_attention_fp8 should have the quantiser write K as [b, h_kv, s_pad16, d] memory (a [b, s, h, d]
    view of it): the Gluon kernel with PERMUTE_K would otherwise copy K into that layout."""
    return (q.device.type == "cuda" and q.shape[-1] in FP8_GLUON_HEAD_DIMS and fp8_gluon_permute_k()
            and arch_key(q.device) == "sm90" and _fp8_gluon_switch())


def _quantize(q, k, v, qk_format, backend, lse_shift_needed: bool, keys_by_head: bool = False,
              q_residual: bool = False, k_block: int = 0) -> QuantizedQKV:
    """quantize_qkv on validated inputs. Without lse_shift_needed (flash_attention_fp8 when lse is not returned) the
    Triton path skips int8's lse shift, q · mean(k) over every query in fp32: it only ever feeds lse. keys_by_head:
    k's codes go to [b, h_kv, s_pad16, d] memory (_keys_for_gluon). q_residual: with q's residual codes (fp8).
    k_block: k's scales per block of that many keys (fp8)."""
    if resolve_backend(backend, q.device) == "reference":
        return quantize_qkv_reference(q, k, v, qk_format, q_residual, k_block)
    from .fp8_quantize_kernel import quantize_key_blocks, quantize_rows, quantize_v
    if qk_format != "int8":
        mean = lse_shift = None
    elif lse_shift_needed:
        mean, lse_shift = smoothing(q, k)
    else:
        mean, lse_shift = smoothing_mean(k), None
    q_lo = None
    if q_residual:
        q8, q_scale, q_lo = quantize_rows(q.contiguous(), None, qk_format, residual=True)
    else:
        q8, q_scale = quantize_rows(q.contiguous(), None, qk_format)
    codes = None
    if keys_by_head:
        b, s_k, h_kv, d = k.shape
        pad = padded_tokens(s_k)
        buf = torch.empty((b, h_kv, pad, d), device=k.device, dtype=torch.int8 if qk_format == "int8" else FP8)
        buf[:, :, s_k:].zero_()
        codes = buf.transpose(1, 2)[:, :s_k]
    if k_block:
        k8, k_scale = quantize_key_blocks(k, k_block, codes=codes)
    else:
        k8, k_scale = quantize_rows(k.contiguous(), mean, qk_format, codes=codes)
    v_scale = v_channel_scale(v)
    v_t = quantize_v(v, v_scale, padded_tokens(k.shape[1]))
    return QuantizedQKV(qk_format, q8, q_scale, k8, k_scale, v_t, v_scale, lse_shift, q.dtype, q_lo, k_block)


def flash_attention_quantized(qkv: QuantizedQKV, *, causal: bool = False, softmax_scale: Optional[float] = None,
                              window=(-1, -1), return_lse: bool = False, backend=None):
    """Attention forward over quantize_qkv's output; out [b, s_q, h_q, d_v] in the inputs' dtype, lse fp32
    [b, h_q, s_q] if return_lse. Masks and conventions as flash_attention's (causal bottom-right; a query that
    sees no key gets 0 and lse -inf, so s_k = 0 gives zeros). Every field of qkv is checked (shapes, dtypes, the
    format, the heads); its tensors must not require grad while grad mode is on (forward only)."""
    _check_quantized(qkv)
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_positive_float("softmax_scale", softmax_scale)
    check_window(window)
    backend = resolve_backend(backend, qkv.q.device)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(qkv.q.shape[-1])
    ref_window, kernel_window = band(causal, window)
    if backend == "reference":
        q, k, v = dequantize_qkv_reference(qkv)
        out, lse = attention_reference(q, k, v, softmax_scale=scale, window=ref_window)
        out = out.to(qkv.dtype)
    else:
        out, lse = _flash_fp8(qkv.q, qkv.q_scale, qkv.k, qkv.k_scale, qkv.v_t, qkv.v_scale, qkv.qk_format,
                              qkv.dtype, scale, *kernel_window, qkv.q_lo, qkv.k_block)
    if not return_lse:
        return out
    if qkv.lse_shift is not None:  # the smoothing's per-row shift, back in the natural-log lse
        lse = lse + qkv.lse_shift * scale
    return out, lse


def flash_attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        softmax_scale: Optional[float] = None, window: tuple[int, int] = (-1, -1),
                        qk_format: str = "fp8", q_residual: Optional[bool] = None, k_block: Optional[int] = None,
                        return_lse: bool = False,
                        backend: Optional[str] = None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """FP8 attention forward from unquantised inputs: quantize_qkv then flash_attention_quantized (the
    quantisation's cost included). qk_format "fp8" (e4m3 Q·Kᵀ) or "int8" (SageAttention's INT8 Q·Kᵀ with
    smoothed K); P·V is e4m3 either way. q_residual (quantize_qkv's, e4m3 only, on by default): q's rounding
    residual as a second e4m3 code, one more Q·Kᵀ MMA (~10% of the time) for ~25% less output error; k_block (0 or
    128, e4m3 only, 128 by default): k's scales per aligned block of 128 keys (quantize_qkv's). Forward only (inference), on both
    backends: inputs that require grad are refused while grad mode is on (call it under torch.no_grad(), or detach
    them). NaN and inf propagate to the outputs they reach without a host read (quantize_qkv); s_k = 0 gives zeros
    and lse -inf, as flash_attention."""
    _check_qkv(q, k, v)
    check_choice("qk_format", qk_format, QK_FORMATS)
    check_bool("return_lse", return_lse)
    k_block = _k_block("k_block", k_block, qk_format)
    qkv = _quantize(q, k, v, qk_format, backend, return_lse,
                    resolve_backend(backend, q.device) != "reference" and _keys_for_gluon(q, k),
                    q_residual=_q_residual(qk_format, q_residual), k_block=k_block)
    return flash_attention_quantized(qkv, causal=causal, softmax_scale=softmax_scale, window=window,
                                     return_lse=return_lse, backend=backend)
