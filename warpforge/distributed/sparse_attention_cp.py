"""Context parallelism for top-k block-sparse attention (`warpforge.ops.sparse`): one long sequence cut along its
length over the ranks of a torch.distributed process group (gloo on CPU, NCCL on GPUs), so that a 1M-2M token
sequence trains on W GPUs.

Rank r of a group of W holds the contiguous chunk [r·s, (r+1)·s) of every per-token tensor (q, k, v, index_q,
index_k; s = s_local, the same on every rank, a multiple of block_size). Under the causal mask rank r's queries read
keys [0, (r+1)·s) only, so:

- forward: one all-gather brings every rank's k, v and index_k (packed per token in one buffer: one collective, not
  three); rank r keeps the prefix [0, (r+1)·s) and runs `sparse_attention` of its queries against it, the queries
  being the prefix's last s tokens (the op's s_q < s_k form). Selection, the sparse forward and its backward are the
  one-GPU kernels; the index branch ranks each local query block against every key block of the prefix.
- backward: each rank's dk / dv cover its whole prefix; one reduce-scatter (in fp32) sums them onto the chunks'
  owners. dq stays local.

Contiguous chunks are balanced without ring attention's zigzag: a query keeps its own block and top-k others
wherever they are, so its work is the same at every position (only the index branch's block scores, a small
quadratic term, grow with the rank). A ring would not fit either: a query block reads only its k chosen blocks,
anywhere in the prefix, and the selection needs every key block's score before any of them is read.

Memory: rank r keeps copies of its prefix of k, v and index_k (r+1 chunks: the last rank the whole sequence,
2·S·h_kv·d + S·d_i elements, 8 GB in bf16 at S = 2M, h_kv 8, d 128) for each layer's backward; the forward's
gathered buffer (every rank's tokens) lives only during the call, the backward's fp32 buffer of the whole
sequence's dk and dv only during the reduce-scatter. Recomputing the gather in the backward would cut the saved
copies to one chunk (not done yet).

`sparse_attention_index_loss_cp` is the index branch's loss for the same layout (it gathers k and index_k again:
the attention's gathered copies are not kept between the two calls).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..errors import check_bool, check_rank, check_tensor, fail, host_reads_allowed, read_once
from ..ops.sparse import api as sparse_api
from ..ops.sparse import sparse_attention, sparse_attention_index_loss
from ..runtime import resolve_backend
from .group import Group, all_gather_into, reduce_scatter_into, resolve_group

__all__ = ["sparse_attention_cp", "sparse_attention_index_loss_cp"]


# ------------------------------------------------------------------------------------- the gather
def _pack(tensors) -> torch.Tensor:
    """[s, b, Σ columns]: each [b, s, ...] tensor flattened per token, side by side; sequence first, so that the
    ranks' chunks are contiguous slabs of the gathered buffer."""
    b, s = tensors[0].shape[:2]
    return torch.cat([t.reshape(b, s, -1) for t in tensors], -1).transpose(0, 1).contiguous()


def _unpack(buf: torch.Tensor, shapes) -> list:
    """Views of buf [n, b, C] as [b, n, *shape] tensors (the inverse of _pack, without copies)."""
    out, col = [], 0
    n, b = buf.shape[:2]
    for shape in shapes:
        width = math.prod(shape)
        out.append(buf[:, :, col:col + width].view(n, b, *shape).transpose(0, 1))
        col += width
    return out


class _GatherPrefix(torch.autograd.Function):
    """(tensors gathered over the ranks along the sequence, each cut to this rank's prefix [0, (rank + 1)·s)):
    forward one all-gather; backward one reduce-scatter of the differentiable ones' fp32 gradients (zeros past the
    prefix), which sums every rank's gradient of chunk c onto rank c. Every rank of the group must run both."""

    @staticmethod
    def forward(ctx, grp: Group, differentiable: tuple, *tensors):
        ctx.grp, ctx.differentiable = grp, differentiable
        ctx.meta = [(t.shape, t.dtype) for t in tensors]
        ctx.device = tensors[0].device
        s = tensors[0].shape[1]
        local = _pack(tensors)
        full = local.new_empty((grp.world * s, *local.shape[1:]))
        all_gather_into(full, local, group=grp.group)
        prefix = full[:(grp.rank + 1) * s]
        # copies of the prefix, each its own tensor: views would keep the whole gathered buffer (every rank's
        # tokens, every packed column) alive in each layer's saved tensors until its backward
        outs = [o.clone(memory_format=torch.contiguous_format)
                for o in _unpack(prefix, [t.shape[2:] for t in tensors])]
        del full, prefix
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, differentiable) if not d])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        grp = ctx.grp
        which = [i for i, d in enumerate(ctx.differentiable) if d]
        shapes = [ctx.meta[i][0] for i in which]
        b, s = shapes[0][:2]
        end = (grp.rank + 1) * s
        widths = [math.prod(shape[2:]) for shape in shapes]
        full = torch.zeros(grp.world * s, b, sum(widths), device=ctx.device, dtype=torch.float32)
        col = 0
        for i, width in zip(which, widths):
            if grads[i] is not None:  # an output no loss reached: zeros
                full[:end, :, col:col + width] = grads[i].reshape(b, end, width).transpose(0, 1)
            col += width
        mine = full.new_empty((s, b, full.shape[-1]))
        reduce_scatter_into(mine, full, group=grp.group)
        result = [None] * len(ctx.meta)
        for i, g in zip(which, _unpack(mine, [shape[2:] for shape in shapes])):
            result[i] = g.to(ctx.meta[i][1]).contiguous()
        return (None, None, *result)


def _gathered(grp: Group, tensors: tuple, differentiable: tuple) -> tuple:
    return _GatherPrefix.apply(grp, differentiable, *tensors)


# ----------------------------------------------------------------------------------- validation
def _check_chunks(q, k, block_size):
    """Every per-token tensor holds the same s_local tokens of the chunk, a whole number of blocks."""
    if k.shape[:2] != q.shape[:2]:
        fail("k", f"batch and chunk length {tuple(q.shape[:2])} (like q: each rank holds the same s_local tokens of "
             "q, k and v)", tuple(k.shape[:2]))
    if q.shape[1] % block_size:
        fail("q", f"a chunk length s_local that is a multiple of block_size {block_size} (chunks of whole blocks)",
             q.shape[1])


def _global_block_indices(block_indices, k, grp, s_local, block_size):
    """The rank's block_indices (key blocks of the whole sequence) checked, and cut to the prefix's key blocks: an
    entry past it is past the query block too, which the causal mask ignores anyway."""
    batch = k.shape[0]
    n_prefix = (grp.rank + 1) * s_local // block_size
    sparse_api._check_block_indices(block_indices, k, batch, s_local, block_size, grp.world * s_local)
    cut = torch.where(block_indices < n_prefix, block_indices, -1)
    if host_reads_allowed(cut):  # in range by construction: the op need not read it back
        read_once((cut,), sparse_api._checked(n_prefix), lambda: None)
    return cut


# --------------------------------------------------------------------------------- public doors
def sparse_attention_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, index_q: Optional[torch.Tensor] = None,
                        index_k: Optional[torch.Tensor] = None, block_indices: Optional[torch.Tensor] = None,
                        block_size: int = 128, topk: int = 16, group=None, softmax_scale: Optional[float] = None,
                        index_scale: Optional[float] = None, return_lse: bool = False, return_indices: bool = False,
                        backend: Optional[str] = None):
    """This rank's chunk of `sparse_attention(q_full, k_full, v_full, causal=True, ...)` over one sequence split in
    contiguous chunks across the ranks of `group` (default: the world), with autograd.

    q [b, s_local, h_q, d], k [b, s_local, h_kv, d], v [b, s_local, h_kv, d_v]: rank r's tokens [r·s_local,
    (r+1)·s_local); s_local a multiple of block_size, the same on every rank (as are all shapes and arguments: not
    checked across ranks, which would cost a collective per call); every rank calls this together, and runs the
    backward together. The blocks are chosen by the index branch (index_q [b, s_local, h_kv, d_i], index_k [b,
    s_local, 1, d_i], this rank's chunks) or given as block_indices [b, h_kv, s_local / block_size, topk'] for this
    rank's query blocks, holding key blocks of the whole sequence (-1 for none). backend: as sparse_attention's.

    Returns out [b, s_local, h_q, d_v], then lse (fp32 [b, h_q, s_local]) if return_lse, then the block_indices
    used (key blocks of the whole sequence) if return_indices: what the one-process op returns for these rows.
    Gradients: dq for the local queries; dk and dv of the local keys summed over every rank's queries."""
    check_tensor("q", q)
    backend = resolve_backend(backend, q.device)
    sparse_api._check_qkv(q, k, v, None, None, backend)
    sparse_api._check_options(block_size, True, softmax_scale, index_scale)
    _check_chunks(q, k, block_size)
    check_bool("return_lse", return_lse)
    check_bool("return_indices", return_indices)
    if block_indices is None:
        sparse_api._check_selection_args(index_q, index_k, topk)
        sparse_api._check_index(index_q, index_k, q.shape[:-2], k.shape[-2], "q", q, False)
    grp = resolve_group(group, "the sequence is split over its ranks")
    if block_indices is None:
        k_all, v_all, ik_all = _gathered(grp, (k, v, index_k), (True, True, False))
        cut = None
    else:
        cut = _global_block_indices(block_indices, k, grp, q.shape[1], block_size)
        index_q = None
        k_all, v_all = _gathered(grp, (k, v), (True, True))
        ik_all = None
    results = sparse_attention(q, k_all, v_all, block_size=block_size, topk=topk, causal=True, index_q=index_q,
                               index_k=ik_all, block_indices=cut, softmax_scale=softmax_scale,
                               index_scale=index_scale, return_lse=return_lse, return_indices=return_indices,
                               backend=backend)
    if cut is not None and return_indices:  # the indices as given (the one-process op returns those too)
        results = results[:-1] + (block_indices,)
    elif return_indices and host_reads_allowed(results[-1]):
        # selected key blocks lie in the prefix, so in the whole sequence's range too: the index loss, which checks
        # them against that range, need not read them back
        read_once((results[-1],), sparse_api._checked(grp.world * q.shape[1] // block_size), lambda: None)
    return results


def sparse_attention_index_loss_cp(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, index_q: torch.Tensor,
                                   index_k: torch.Tensor, block_indices: torch.Tensor, *, block_size: int = 128,
                                   group=None, softmax_scale: Optional[float] = None,
                                   index_scale: Optional[float] = None, backend: Optional[str] = None) -> torch.Tensor:
    """The index branch's loss for this rank's chunk (layout and contract as sparse_attention_cp's): the mean over
    its tokens and kv heads of sparse_attention_index_loss's KL, with lse and block_indices from
    sparse_attention_cp(..., return_lse=True, return_indices=True) on the same q and k. The whole sequence's loss is
    the mean of the ranks' (equal chunks); the gradient goes to index_q and index_k only, index_k's summed over
    every rank's loss onto the chunk's owner (as dk in sparse_attention_cp)."""
    check_tensor("q", q)
    backend = resolve_backend(backend, q.device)
    check_tensor("k", k)
    check_rank("q", q, 4)
    check_rank("k", k, 4)
    sparse_api._check_qkv(q, k, k, None, None, backend)
    sparse_api._check_options(block_size, True, softmax_scale, index_scale)
    _check_chunks(q, k, block_size)
    sparse_api._check_index(index_q, index_k, q.shape[:-2], k.shape[-2], "q", q, False)
    grp = resolve_group(group, "the sequence is split over its ranks")
    block_indices = _global_block_indices(block_indices, k, grp, q.shape[1], block_size)
    k_all, ik_all = _gathered(grp, (k.detach(), index_k), (False, True))
    return sparse_attention_index_loss(q, k_all, lse, index_q, ik_all, block_indices, block_size=block_size,
                                       causal=True, softmax_scale=softmax_scale, index_scale=index_scale,
                                       backend=backend)
