"""Dense attention: `flash_attention`, FlashAttention's interface on warpforge kernels.

validate -> pick backend -> (reference | torch.library custom op with autograd over the Triton kernels)
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ...errors import (check_cu_seqlens, check_dtype, check_last_dim_contiguous,
                       check_rank, check_same_device, check_same_dtype, check_tensor, fail)
from ...runtime import arch_key, eager_or_op, resolve_backend
from . import configs
from .reference import attention_reference, attention_varlen_reference

__all__ = ["flash_attention", "attention_reference", "attention_varlen_reference", "HEAD_DIMS"]

HEAD_DIMS = (32, 64, 96, 128, 256)
_UNBOUNDED = 1 << 30  # a window side of -1 becomes "further than any sequence"


def _cfgs(device: torch.device, d: int):
    arch = arch_key(device)
    dp = 1 << (d - 1).bit_length()  # the padded head dim the kernels tile with
    return (configs.pick(configs.FWD, arch, dp), configs.pick(configs.BWD_DKDV, arch, dp),
            configs.pick(configs.BWD_DQ, arch, dp))


# ------------------------------------------------------------------------- custom ops (Triton path)
# Under torch.compile the custom ops; eager calls take the same impls through runtime.eager_or_op.
def _flash_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Optional[torch.Tensor],
                    cu_k: Optional[torch.Tensor], batch: int, max_q: int, max_k: int, scale: float, left: int,
                    right: int) -> tuple[torch.Tensor, torch.Tensor]:
    from .flash_kernel import flash_fwd

    cfg, _, _ = _cfgs(q.device, q.shape[-1])
    return flash_fwd(q, k, v, cu_q, cu_k, batch, max_q, max_k, scale, left, right, cfg)


_flash_fwd_op = torch.library.custom_op("warpforge::flash_attn_fwd", _flash_fwd_impl, mutates_args=())


@_flash_fwd_op.register_fake
def _(q, k, v, cu_q, cu_k, batch, max_q, max_k, scale, left, right):
    if cu_q is not None:
        lse = q.new_empty((q.shape[-2], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((batch, q.shape[-2], max_q), dtype=torch.float32)
    return torch.empty_like(q), lse


def _flash_bwd_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu_q: Optional[torch.Tensor], cu_k: Optional[torch.Tensor], batch: int,
                    max_q: int, max_k: int, scale: float, left: int,
                    right: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .flash_kernel import flash_bwd

    _, cfg_dkdv, cfg_dq = _cfgs(q.device, q.shape[-1])
    if do.stride(-1) != 1:
        do = do.contiguous()
    return flash_bwd(do, q, k, v, out, lse, cu_q, cu_k, batch, max_q, max_k, scale, left, right, cfg_dkdv,
                     cfg_dq)


_flash_bwd_op = torch.library.custom_op("warpforge::flash_attn_bwd", _flash_bwd_impl, mutates_args=())


@_flash_bwd_op.register_fake
def _(do, q, k, v, out, lse, cu_q, cu_k, batch, max_q, max_k, scale, left, right):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_flash_bwd = eager_or_op(_flash_bwd_op, _flash_bwd_impl)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, batch, max_q, max_k, scale, left, right = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (batch, max_q, max_k, scale, left, right)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, d_out, d_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _flash_bwd(d_out, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_flash_fwd_op.register_autograd(_backward, setup_context=_setup_context)
_flash_fwd = eager_or_op(_flash_fwd_op, _flash_fwd_impl, _setup_context, _backward)


# ---------------------------------------------------------------------------------- public door
def _validate(q, k, v, causal, softmax_scale, window, cu_seqlens_q, cu_seqlens_k, backend):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        fail("cu_seqlens_q/cu_seqlens_k", "both given (varlen) or neither", "only one")
    rank = 3 if varlen else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rank(name, t, rank)
        check_same_device(name, t, "q", q)
    dtypes = (torch.float16, torch.bfloat16) + ((torch.float32,) if backend == "reference" else ())
    check_dtype("q", q, dtypes)
    check_same_dtype("k", k, "q", q)
    check_same_dtype("v", v, "q", q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_last_dim_contiguous(name, t)
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        fail("q", f"head dim in {HEAD_DIMS}", d)
    if k.shape != v.shape:
        fail("v", f"the shape of k {tuple(k.shape)}", tuple(v.shape))
    if k.shape[-1] != d:
        fail("k", f"head dim {d} (like q)", k.shape[-1])
    h_q, h_kv = q.shape[-2], k.shape[-2]
    if h_kv == 0 or h_q % h_kv != 0:
        fail("k", f"a number of heads dividing q's {h_q}", h_kv)
    if not varlen and k.shape[0] != q.shape[0]:
        fail("k", f"batch {q.shape[0]} (like q)", k.shape[0])
    if not isinstance(causal, bool):
        fail("causal", "a bool", type(causal).__name__)
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and w >= -1 for w in window)):
        fail("window", "(left, right) ints, each >= 0 or -1 for unbounded", window)
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        fail("softmax_scale", "a positive float or None", softmax_scale)


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), cu_seqlens_q=None,
                    cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, return_lse=False, backend=None):
    """Softmax(q kᵀ · scale + mask) v, FlashAttention-style.

    q [b, s_q, h_q, d], k/v [b, s_k, h_kv, d] (h_q % h_kv == 0), or the packed varlen form q [total_q, h_q, d]
    with int32 cu_seqlens_q / cu_seqlens_k [batch + 1]. causal aligns bottom-right; window = (left, right),
    -1 unbounded. Returns out (like q), and lse fp32 ([b, h_q, s_q], varlen [h_q, total_q]) if return_lse.

    Varlen: without max_seqlen_q/k the offsets are read on the host and fully checked (one sync); with
    both given, nothing is read back (CUDA-graph safe) and they must bound every sequence.
    """
    if isinstance(q, torch.Tensor):
        backend = resolve_backend(backend, q.device)
    _validate(q, k, v, causal, softmax_scale, window, cu_seqlens_q, cu_seqlens_k, backend)
    d = q.shape[-1]
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    left, right = window
    if causal:
        right = 0
    varlen = cu_seqlens_q is not None

    if varlen:
        # Given both max_seqlen, the door stays sync-free (CUDA-graph safe) and trusts the offsets' values.
        sync_free = max_seqlen_q is not None and max_seqlen_k is not None
        host_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q, read_values=not sync_free)
        host_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k, read_values=not sync_free)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            fail("cu_seqlens_k", f"{cu_seqlens_q.numel()} entries (like cu_seqlens_q)", cu_seqlens_k.numel())
        batch = cu_seqlens_q.numel() - 1
        if sync_free:
            for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
                if not isinstance(given, int) or given < 0:
                    fail(name, "a non-negative int", given)
            max_q, max_k = max_seqlen_q, max_seqlen_k
        else:
            longest_q = int((host_q[1:] - host_q[:-1]).max())
            longest_k = int((host_k[1:] - host_k[:-1]).max())
            for name, given, longest in (("max_seqlen_q", max_seqlen_q, longest_q),
                                         ("max_seqlen_k", max_seqlen_k, longest_k)):
                if given is not None and given < longest:
                    fail(name, f">= the longest sequence ({longest})", given)
            max_q, max_k = longest_q, longest_k
    else:
        batch, max_q, max_k = q.shape[0], q.shape[1], k.shape[1]

    if backend == "reference":
        win = (left, right)
        if varlen:
            out, lse = attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=scale,
                                                  window=win)
        else:
            out, lse = attention_reference(q, k, v, softmax_scale=scale, window=win)
        return (out, lse) if return_lse else out

    out, lse = _flash_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, batch, max_q, max_k, scale,
                          _UNBOUNDED if left < 0 else left, _UNBOUNDED if right < 0 else right)
    return (out, lse) if return_lse else out
