"""The hot ops of the nn modules, by backend.

backend None, "triton" or "reference": warpforge's ops (runtime.py says which runs where). "torch": the same math
as a PyTorch user writes it without warpforge (SDPA, F.rms_norm, torch._grouped_mm, ...): the baseline the
benchmarks compare against, and a path for any device PyTorch runs on. A module's backend may also be a dict
{op name: backend} with "*" for the ops it does not name, to swap ops one at a time (the GPT bench's ablation).
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..errors import check_dtype, check_int, check_rank, check_same_device, check_same_dtype, check_tensor, fail
from ..ops import attention as attention_op
from ..ops import linear_ce, mla, moe, monarch, norm
from ..ops import rope as rope_op
from ..ops import sparse as sparse_op
from ..ops import swiglu as swiglu_op
from ..ops.attention.reference import visible_mask

Backend = Union[None, str, Mapping[str, Optional[str]]]
TORCH = "torch"
# the op names a dict backend may key (each is a function below; "moe" covers route and moe_experts)
OPS = ("attention", "rms_norm", "add_rms_norm", "rope", "swiglu", "linear_cross_entropy", "moe", "mla", "evoformer",
       "monarch", "sparse")

FLOATS = (torch.float16, torch.bfloat16, torch.float32)  # what the ops behind the modules take
# the largest size a module's constructor takes (a width, a head count, a sequence length): far past any real model,
# and small enough that 2**70 is refused here rather than overflowing inside torch (nn.Linear, the allocator)
MAX_SIZE = 1 << 24


def check_size(name: str, value: object, lo: int = 1) -> None:
    """A module's size argument: an int from lo to MAX_SIZE."""
    check_int(name, value, lo=lo, hi=MAX_SIZE)


def autocast_on(device: torch.device) -> bool:
    """Whether autocast is on for device's type (False for types autocast does not know, e.g. meta: asking about
    those raises)."""
    # cuda / cpu first: torch 2.11's Dynamo cannot trace torch._C._is_autocast_available (a graph break in every
    # module's forward), while it folds is_autocast_enabled to a constant
    if device.type not in ("cuda", "cpu") and not torch.amp.is_autocast_available(device.type):
        return False
    return torch.is_autocast_enabled(device.type)


def check_input(x: object, width: int, weight: torch.Tensor | None = None, ranks: int | Sequence[int] | None = None,
                name: str = "x") -> None:
    """x, a module's input: a float tensor (of one of `ranks`, where given) whose last dim is `width`, the module's
    dim. With `weight` (its first Linear's), x must also be on that device, and in that dtype unless autocast casts
    it: else the Linear's own device or dtype error would name no argument."""
    check_tensor(name, x)
    if ranks is not None:
        check_rank(name, x, ranks)
    check_dtype(name, x, FLOATS)
    if x.dim() == 0 or x.shape[-1] != width:
        fail(name, f"a tensor [..., {width}] (the module's dim)", f"shape {tuple(x.shape)}")
    if weight is not None:
        check_same_device(name, x, "the module's weights", weight)
        if not autocast_on(x.device):
            check_same_dtype(name, x, "the module's weights", weight)


def pick(backend: Backend, op: str) -> Optional[str]:
    """The backend for `op` out of a module's backend setting."""
    if isinstance(backend, Mapping):
        return backend.get(op, backend.get("*"))
    return backend


def check_backend(backend: Backend) -> Backend:
    """backend, if it is one (a dict's keys among OPS and "*"); else a WarpforgeInputError."""
    choices = (None, "triton", "reference", TORCH)
    values = dict(backend) if isinstance(backend, Mapping) else {"*": backend}
    for op, b in values.items():
        if op != "*" and op not in OPS:
            fail("backend", f"a dict keyed by op names {OPS} or '*'", repr(op))
        if b not in choices:
            fail("backend", f"one of {choices} (or a dict of them)", repr(b))
    return backend


def compute_dtype(device: torch.device, default: torch.dtype) -> torch.dtype:
    """The dtype matmuls run in here: autocast's when it is on (custom ops and caches do not see autocast)."""
    return torch.get_autocast_dtype(device.type) if autocast_on(device) else default


# ------------------------------------------------------------------------------------ attention
def attention(q, k, v, *, causal=True, softmax_scale=None, window=(-1, -1), cu_seqlens=None, max_seqlen=None,
              backend: Backend = None):
    """flash_attention's call (bottom-right causal; packed varlen with cu_seqlens and max_seqlen)."""
    b = pick(backend, "attention")
    if b != TORCH:
        return attention_op.flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                             cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                             max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, backend=b)
    if cu_seqlens is not None:  # one sequence at a time (reads the offsets on the host)
        bounds = cu_seqlens.tolist()
        return torch.cat([sdpa(q[None, s:e], k[None, s:e], v[None, s:e], causal, softmax_scale, window)[0]
                          for s, e in zip(bounds[:-1], bounds[1:])])
    return sdpa(q, k, v, causal, softmax_scale, window)


def sparse_attention(q, k, v, index_q, index_k, *, block_size=128, topk=16, softmax_scale=None,
                     backend: Backend = None):
    """sparse_attention's call with the index branch: (out, lse, block_indices). "torch" is its reference (dense
    attention under the block mask: quadratic memory, for small shapes)."""
    b = pick(backend, "sparse")
    return sparse_op.sparse_attention(q, k, v, index_q=index_q, index_k=index_k, block_size=block_size, topk=topk,
                                      softmax_scale=softmax_scale, return_lse=True, return_indices=True,
                                      backend="reference" if b == TORCH else b)


def sparse_index_loss(q, k, lse, index_q, index_k, block_indices, *, block_size=128, softmax_scale=None,
                      backend: Backend = None):
    b = pick(backend, "sparse")
    return sparse_op.sparse_attention_index_loss(q, k, lse, index_q, index_k, block_indices, block_size=block_size,
                                                 softmax_scale=softmax_scale,
                                                 backend="reference" if b == TORCH else b)


def sdpa(q, k, v, causal=True, softmax_scale=None, window=(-1, -1)):
    """[b, s, h, d] attention through torch's scaled_dot_product_attention (GQA by enable_gqa), with an explicit
    mask only where is_causal cannot say it (s_q != s_k, a window)."""
    s_q, s_k = q.shape[1], k.shape[1]
    left, right = window
    right = 0 if causal else right
    mask = None
    if (left, right) != (-1, -1) and not (right == 0 and left < 0 and s_q == s_k):
        mask = visible_mask(s_q, s_k, (left, right), device=q.device)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=mask is None and right == 0 and left < 0, scale=softmax_scale,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


# ------------------------------------------------------------------------------------ norms, RoPE, SwiGLU, CE
def rms_norm(x, weight, eps=1e-6, out_dtype=None, backend: Backend = None):
    b = pick(backend, "rms_norm")
    if b != TORCH:
        return norm.rms_norm(x, weight, eps, b, out_dtype=out_dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps).to(out_dtype or x.dtype)


def add_rms_norm(x, residual, weight, eps=1e-6, out_dtype=None, backend: Backend = None):
    """(rms_norm(x + residual), x + residual)."""
    b = pick(backend, "add_rms_norm")
    if b != TORCH:
        return norm.add_rms_norm(x, residual, weight, eps, b, out_dtype=out_dtype)
    total = x + residual
    return F.rms_norm(total, (total.shape[-1],), weight, eps).to(out_dtype or total.dtype), total


def rope(x, cos, sin, backend: Backend = None):
    """Rotate pairs (x_i, x_{i + d/2}) of x [b, s, h, d] by cos/sin [s, d/2]."""
    b = pick(backend, "rope")
    if b != TORCH:
        return rope_op.apply_rope(x, cos, sin, b)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def swiglu(gate_up, backend: Backend = None):
    b = pick(backend, "swiglu")
    if b != TORCH:
        return swiglu_op.swiglu(gate_up, b)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def monarch_linear(x, w_left, w_right, bias=None, backend: Backend = None):
    """x Mᵀ (+ bias) for the Monarch matrix of the two factors (warpforge.monarch_linear's convention). The torch
    path is the layer as PyTorch writes it without a kernel (two bmms, the shuffles as copies), in x's dtype."""
    b = pick(backend, "monarch")
    if b != TORCH:
        return monarch.monarch_linear(x, w_left, w_right, bias=bias, backend=b)
    y = monarch.monarch_bmm(x, w_left, w_right)
    return y if bias is None else y + bias


def linear_cross_entropy(hidden, weight, targets, ignore_index=-100, backend: Backend = None, **options):
    """Cross-entropy of hidden @ weightᵀ (options: warpforge.linear_cross_entropy's bias, reduction,
    label_smoothing, lse_square_scale, softcap). The torch path materialises the logits: F.cross_entropy, or the
    fp32 reference where an option is given."""
    b = pick(backend, "linear_cross_entropy")
    if b != TORCH:
        return linear_ce.linear_cross_entropy(hidden, weight, targets, ignore_index, b, **options)
    if options:
        return linear_ce.linear_cross_entropy_reference(hidden, weight, targets, ignore_index, **options)
    return F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=ignore_index)


def route(router_logits, topk, backend: Backend = None, **route_kw):
    """(topk_weights fp32, topk_ids int32); the torch path is the reference's plain torch ops."""
    b = pick(backend, "moe")
    if b != TORCH:
        return moe.route(router_logits, topk, backend=b, **route_kw)
    return moe.route_reference(router_logits, topk, **route_kw)


def moe_experts(hidden, w13, w2, topk_weights, topk_ids, backend: Backend = None):
    """Σ_k weight · expert(hidden) for a routing `route` made (its ids are in range: not read back to check):
    warpforge's grouped GEMMs, or torch's (rows sorted by expert, torch._grouped_mm on CUDA, scatter-add back)."""
    b = pick(backend, "moe")
    if b != TORCH:
        return moe.experts(hidden, w13, w2, topk_weights, topk_ids, check_ids=False, backend=b)
    return grouped_mm_experts(hidden, w13, w2, topk_weights, topk_ids)


def backend_across_ranks(backend: Backend, op: str) -> Optional[str]:
    """The backend of `op`'s local work when it runs across ranks (expert parallelism, ring attention): warpforge's
    ops as chosen, and for the torch baseline the reference's plain torch ops (torch's own paths, e.g.
    torch._grouped_mm's or SDPA's, take the whole problem, not a rank's share of it)."""
    b = pick(backend, op)
    return "reference" if b == TORCH else b


def grouped_mm_experts(hidden, w13, w2, topk_weights, topk_ids):
    t, k = topk_ids.shape
    inter = w2.shape[2]
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    rows = hidden[order // k]
    # counts by scatter_add (bincount syncs with the host)
    counts = torch.zeros(w13.shape[0], dtype=torch.long, device=flat.device).scatter_add_(0, flat,
                                                                                          torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    gate_up = _grouped_mm(rows, w13.transpose(1, 2), offs)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    down = _grouped_mm(act, w2.transpose(1, 2), offs) * topk_weights.reshape(-1)[order, None].to(act.dtype)
    return torch.zeros_like(hidden).index_add_(0, order // k, down)


def _grouped_mm(a, b, offs):
    """a [rows, K] with rows grouped by offs (cumulative ends) times b [groups, K, N]."""
    if a.is_cuda and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a, b, offs=offs)
    starts = [0] + offs.tolist()[:-1]
    return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, offs.tolist()))])


def mla_decode(q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal=False, backend: Backend = None):
    """Absorbed MLA decode over an unquantized latent cache in q's dtype; returns the output only. The torch path
    gathers each request's pages into a dense [b, max_len, 576] tensor and runs two batched matmuls and an fp32
    softmax."""
    b = pick(backend, "mla")
    if b != TORCH:
        return mla.mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale=softmax_scale,
                              causal=causal, backend=b)[0]
    page = kv_cache.shape[1]
    t = torch.arange(block_table.shape[1] * page, device=q.device)
    rows = block_table.long()[:, t // page] * page + t % page
    return gathered_mla_decode(q, kv_cache, rows, cache_seqlens, softmax_scale, causal)


def gathered_mla_decode(q, kv_cache, rows, cache_seqlens, softmax_scale, causal=False):
    """The torch MLA decode given each request's cache rows [b, max_len] (page * page_size + offset)."""
    bsz, s_q, h_q, d = q.shape
    d_v = mla.D_V
    kv = kv_cache.reshape(-1, d)[rows]                                      # [b, max_len, 576]
    scores = torch.bmm(q.reshape(bsz, s_q * h_q, d), kv.transpose(1, 2)).float() * softmax_scale
    pos = torch.arange(rows.shape[1], device=q.device)
    limit = cache_seqlens.long()[:, None, None]                             # [b, 1, 1]
    if causal:  # query j of s_q sees the first len - s_q + 1 + j tokens
        j = torch.arange(s_q, device=q.device).repeat_interleave(h_q)
        limit = limit - s_q + 1 + j[None, :, None]
    scores = scores.masked_fill(pos[None, None, :] >= limit, float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num_(0.0).to(q.dtype)
    return torch.bmm(p, kv[..., :d_v]).view(bsz, s_q, h_q, d_v)
