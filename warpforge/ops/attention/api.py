"""`flash_attention`: FlashAttention's interface on warpforge kernels. validate -> plan -> dispatch (the
reference, or the Triton kernels as ops with autograd)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ...errors import (check_bool, check_cu_seqlens, check_dtype, check_int, check_last_dim_contiguous,
                       check_positive_float, check_rank, check_same_device, check_same_dtype, check_tensor, fail,
                       host_reads_allowed, read_once)
from ...runtime import check_interpreted_matmul_dtype, resolve_backend
from .._op import kernel_op
from . import configs
from .reference import attention_reference, attention_varlen_reference

HEAD_DIMS = (32, 64, 96, 128, 256)
_UNBOUNDED = 1 << 30  # a window side of -1 becomes "further than any sequence"


def _cfgs(q: torch.Tensor):
    dp = 1 << (q.shape[-1] - 1).bit_length()  # the padded head dim the kernels tile with
    kind = ("fp32", dp) if q.dtype == torch.float32 else dp  # fp32 tiles: twice the bytes per element
    return tuple(table.lookup(q.device, kind) for table in (configs.FWD, configs.BWD_DKDV, configs.BWD_DQ))


# ------------------------------------------------------------------------------------------- ops
def _flash_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Optional[torch.Tensor],
                    cu_k: Optional[torch.Tensor], batch: int, max_q: int, max_k: int, scale: float, left: int,
                    right: int) -> tuple[torch.Tensor, torch.Tensor]:
    from . import flash_ws_kernel
    from .flash_kernel import flash_fwd

    cfg, _, _ = _cfgs(q)
    if cfg.ws and cu_q is None and flash_ws_kernel.fits(q, k, v):  # the Hopper pipeline's forward
        return flash_ws_kernel.flash_fwd_ws(q, k, v, batch, max_q, max_k, scale, left, right, cfg)
    return flash_fwd(q, k, v, cu_q, cu_k, batch, max_q, max_k, scale, left, right, cfg)


def _flash_fwd_fake(q, k, v, cu_q, cu_k, batch, max_q, max_k, scale, left, right):
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

    _, cfg_dkdv, cfg_dq = _cfgs(q)
    if do.stride(-1) != 1:
        do = do.contiguous()
    return flash_bwd(do, q, k, v, out, lse, cu_q, cu_k, batch, max_q, max_k, scale, left, right, cfg_dkdv,
                     cfg_dq)


def _flash_bwd_fake(do, q, k, v, out, lse, cu_q, cu_k, batch, max_q, max_k, scale, left, right):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_flash_bwd = kernel_op("flash_attn_bwd", _flash_bwd_impl, _flash_bwd_fake)


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


_flash_fwd = kernel_op("flash_attn_fwd", _flash_fwd_impl, _flash_fwd_fake, setup_context=_setup_context,
                       backward=_backward)


# ------------------------------------------------------------------------------------ public door
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


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
    check_dtype("q", q, FLOATS)
    check_interpreted_matmul_dtype(backend, "q", q)
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
    check_bool("causal", causal)
    if not isinstance(window, (tuple, list)) or len(window) != 2 or \
            not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window):
        fail("window", "(left, right) ints, each >= 0 or -1 for unbounded", window)
    check_positive_float("softmax_scale", softmax_scale)


def _plan_varlen(q, k, cu_q, cu_k, max_seqlen_q, max_seqlen_k):
    """(cu_seqlens_q, cu_seqlens_k, batch, max_q, max_k) of packed sequences. The offsets and the given max_seqlen
    are checked against the tensors on the host (one sync, once per offsets tensor while its values stay the same),
    except while a CUDA graph is captured or torch.compile traces: then both max_seqlen must be given and are
    trusted, and the offsets are clamped into the tensors on the device, so wrong values can give wrong rows but
    never a read or write outside them."""
    for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if given is not None:
            check_int(name, given, lo=0)
    check_cu_seqlens("cu_seqlens_q", cu_q, q, read_values=False)
    check_cu_seqlens("cu_seqlens_k", cu_k, k, read_values=False)
    batch = cu_q.numel() - 1
    if not host_reads_allowed(q):
        _check_same_count(cu_q, cu_k)
        if max_seqlen_q is None or max_seqlen_k is None:
            fail("max_seqlen_q/max_seqlen_k", "both given while capturing a CUDA graph or compiling (the offsets "
                 "cannot be read then)", (max_seqlen_q, max_seqlen_k))
        return _clamped(cu_q, q.shape[0]), _clamped(cu_k, k.shape[0]), batch, max_seqlen_q, max_seqlen_k

    def read():
        longest = []
        for name, cu, t, given in (("q", cu_q, q, max_seqlen_q), ("k", cu_k, k, max_seqlen_k)):
            host = check_cu_seqlens(f"cu_seqlens_{name}", cu, t)
            longest.append(int((host[1:] - host[:-1]).max()))
            if given is not None and given < longest[-1]:
                fail(f"max_seqlen_{name}", f">= the longest sequence ({longest[-1]})", given)
        return tuple(longest)
    max_q, max_k = read_once((cu_q, cu_k), (q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k), read)
    _check_same_count(cu_q, cu_k)
    return cu_q, cu_k, batch, max_q, max_k


def _check_same_count(cu_q, cu_k):
    if cu_q.numel() != cu_k.numel():
        fail("cu_seqlens_k", f"{cu_q.numel()} entries (like cu_seqlens_q)", cu_k.numel())


def _clamped(cu: torch.Tensor, total: int) -> torch.Tensor:
    return torch.cummax(cu.clamp(0, total), 0).values.to(torch.int32)


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), cu_seqlens_q=None,
                    cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, return_lse=False, backend=None):
    """Softmax(q kᵀ · scale + mask) v, FlashAttention-style.

    q [b, s_q, h_q, d], k/v [b, s_k, h_kv, d] (h_q % h_kv == 0), or the packed varlen form q [total_q, h_q, d]
    with int32 cu_seqlens_q / cu_seqlens_k [batch + 1]. fp16, bf16 or fp32 (fp32 matmuls in full fp32 precision).
    causal aligns bottom-right; window = (left, right), -1 unbounded. A query that sees no key gets out 0 and lse
    -inf. Returns out (like q), and lse fp32 ([b, h_q, s_q], varlen [h_q, total_q]) if return_lse.

    Varlen: the offsets (and max_seqlen_q/k, when given) are checked on the host: one sync, once per cu_seqlens
    tensor as long as its values do not change (the layers of a step share it). Under CUDA-graph capture or
    torch.compile nothing is read back: both max_seqlen must then be given and bound every sequence.
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
        cu_seqlens_q, cu_seqlens_k, batch, max_q, max_k = _plan_varlen(q, k, cu_seqlens_q, cu_seqlens_k,
                                                                        max_seqlen_q, max_seqlen_k)
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
