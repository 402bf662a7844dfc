"""`sparse_attention`, `select_blocks`, `sparse_attention_index_loss`: trainable top-k block-sparse attention
(MiniMax Sparse Attention style; the conventions are reference.py's). validate -> plan -> dispatch (the reference,
or the Triton kernels as ops with autograd).

A training step: the index branch picks each query block's top-k key blocks (no gradient: the choice is discrete),
the main attention runs over the kept blocks only (forward and backward), and the index loss, the KL between the
index branch's block distribution and the main attention's block mass, trains the index branch:

    out, lse, idx = wf.sparse_attention(q, k, v, index_q=iq, index_k=ik, return_lse=True, return_indices=True)
    loss = task_loss(out) + wf.sparse_attention_index_loss(q, k, lse, iq, ik, idx)

Batched, the keys may be longer than the queries (by whole blocks; the queries are their last tokens): what a rank of
context parallelism (warpforge/distributed/sparse_attention_cp.py) runs, its chunk of queries against the keys up to it.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ...errors import (check_bool, check_cu_seqlens, check_dtype, check_int, check_last_dim_contiguous,
                       check_positive_float, check_rank, check_same_device, check_same_dtype, check_tensor, fail,
                       host_reads_allowed, read_once)
from ...runtime import arch_key, check_interpreted_matmul_dtype, resolve_backend
from .._op import cached_launch, kernel_op
from . import configs
from .reference import (index_block_scores_reference, index_loss_reference, n_blocks, sparse_attention_reference)
from .select import blocks_per_sequence, canonical, top_blocks

MAX_HEAD_DIM = 256
MAX_BLOCK = 256  # the block scores' program holds a whole query block
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _tiles(q: torch.Tensor, d_v: int) -> configs.SparseTiles:
    dp = max(16, 1 << (max(q.shape[-1], d_v) - 1).bit_length())
    return configs.TILES.lookup(q.device, ("fp32", dp) if q.dtype == torch.float32 else dp)


# ------------------------------------------------------------------------------------------- ops
# max_s_k (last, optional so that positional callers of the s_q == s_k form keep working): k's length when the
# queries are its last max_s positions (batched form only)
def gluon_gate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: Optional[torch.Tensor],
               block_size: int) -> bool:
    """Whether the forward (and, where its tensors fit, the backward) takes the Hopper Gluon kernels
    (sparse_gluon_kernel.py): the switch on (configs.GLUON_ENV), an sm_90 device, a Triton in
    configs.GLUON_TRITON_VERSIONS, batched fp16/bf16 inputs of head dim 64 or 128 (v's too) that TMA can address,
    blocks of a multiple of 128 rows."""
    flag = os.environ.get(configs.GLUON_ENV)
    if not (configs.GLUON_DEFAULT if flag is None else flag != "0"):
        return False
    if cu is not None or q.device.type != "cuda" or block_size % 128 or arch_key(q.device) != "sm90":
        return False
    import triton
    if not triton.__version__.startswith(configs.GLUON_TRITON_VERSIONS):
        return False
    from . import sparse_gluon_kernel
    return sparse_gluon_kernel.fits(q, k, v) and sparse_gluon_kernel.available()


def gluon_knobs(d: int) -> tuple[tuple, tuple]:
    """(forward, backward) knobs of the Gluon kernels at head dim d: configs.GLUON_FWD / GLUON_BWD, each tuple
    replaceable whole for sweeps (scripts/bench_sparse_gluon.py, gpu_session.sh's sparse-sweep) through
    WARPFORGE_SPARSE_GLUON_FWD="BLOCK_N,STAGES,PINGPONG,PERSISTENT" and
    WARPFORGE_SPARSE_GLUON_BWD="BLOCK_M,STAGES,DQ_N,DQ_SPLIT,DQ_TMA,GROUP_SPLIT,HEAD_GROUP,KEY_ROWS" (integers; 0/1
    for the flags)."""
    def knobs(name, table):
        given = os.environ.get(name)
        if not given:
            return table
        values = [int(x) for x in given.split(",")]
        if len(values) != len(table):
            raise ValueError(f"{name} takes {len(table)} comma-separated integers (got {given!r})")
        return tuple(type(t)(v) for t, v in zip(table, values))
    return (knobs("WARPFORGE_SPARSE_GLUON_FWD", configs.GLUON_FWD[d]),
            knobs("WARPFORGE_SPARSE_GLUON_BWD", configs.GLUON_BWD[d]))


def gluon_bwd_knobs(d: int, s_q: int) -> tuple:
    """The Gluon backward's knobs for s_q queries of head dim d: gluon_knobs' (the table's or the environment's), the
    table's HEAD_GROUP capped so that the group's Q, dO and dQ accumulator (8 · d bytes a query a head) stay within
    configs.GLUON_BWD_GROUP_BYTES (their L2 locality; at least 1). Knobs the environment set are taken as given."""
    knobs = gluon_knobs(d)[1]
    if os.environ.get("WARPFORGE_SPARSE_GLUON_BWD"):
        return knobs
    fits_l2 = configs.GLUON_BWD_GROUP_BYTES // max(1, 8 * d * s_q)
    return knobs[:6] + (max(1, min(knobs[6], fits_l2)),) + knobs[7:]


def gluon_bwd_order(d: int, s_q: int) -> str:
    """The Gluon backward's program order for s_q queries of head dim d, "key" or "query": query order where one
    head's Q, dO and dQ accumulator (8 · d bytes a query) pass configs.GLUON_BWD_QUERY_ORDER_BYTES, or the
    environment's (configs.GLUON_BWD_ORDER_ENV)."""
    order = os.environ.get(configs.GLUON_BWD_ORDER_ENV)
    if order is None:
        return "query" if 8 * d * s_q > configs.GLUON_BWD_QUERY_ORDER_BYTES else "key"
    if order not in ("key", "query"):
        raise ValueError(f"{configs.GLUON_BWD_ORDER_ENV} is 'key' or 'query' (got {order!r})")
    return order


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel: torch.Tensor, n_sel: torch.Tensor,
              cu: Optional[torch.Tensor], batch: int, max_s: int, block_size: int, causal: bool,
              scale: float, max_s_k: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    if gluon_gate(q, k, v, cu, block_size):
        from .sparse_gluon_kernel import sparse_fwd_gluon
        return sparse_fwd_gluon(q, k, v, sel, n_sel, block_size, causal, scale, gluon_knobs(q.shape[-1])[0],
                                cached_launch)
    from .sparse_kernel import sparse_fwd
    return sparse_fwd(q, k, v, sel, n_sel, cu, batch, max_s, block_size, causal, scale, _tiles(q, v.shape[-1]).fwd,
                      max_s_k=max_s_k)


def _fwd_fake(q, k, v, sel, n_sel, cu, batch, max_s, block_size, causal, scale, max_s_k=None):
    lse = q.new_empty((q.shape[-2], q.shape[0]) if cu is not None else (batch, q.shape[-2], max_s),
                      dtype=torch.float32)
    return q.new_empty(*q.shape[:-1], v.shape[-1]), lse


def _bwd_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, sel: torch.Tensor, n_sel: torch.Tensor, cu: Optional[torch.Tensor], batch: int,
              max_s: int, block_size: int, causal: bool,
              scale: float, max_s_k: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .sparse_kernel import kept_by
    do = do.contiguous()

    def csr_lists():  # key block -> the query blocks that kept it (the key-order walks')
        return kept_by(sel, n_blocks(max_s if max_s_k is None else max_s_k, block_size), causal, cached_launch)

    if gluon_gate(q, k, v, cu, block_size):
        from . import sparse_gluon_kernel as sg
        if sg.bwd_fits(q, k, v, out, do):
            knobs = gluon_bwd_knobs(q.shape[-1], q.shape[1])
            if (block_size == 128 and gluon_bwd_order(q.shape[-1], q.shape[1]) == "query"
                    and sg.work_list_fits(knobs)):  # no CSR lists needed
                return sg.sparse_bwd_gluon(do, q, k, v, out, lse, None, None, block_size, causal, scale, knobs,
                                           cached_launch, sel=sel)
            return sg.sparse_bwd_gluon(do, q, k, v, out, lse, *csr_lists(), block_size, causal, scale, knobs,
                                       cached_launch)
    offsets, qblocks = csr_lists()
    from .sparse_kernel import sparse_bwd
    tiles = _tiles(q, v.shape[-1])
    return sparse_bwd(do, q, k, v, out, lse, sel, n_sel, offsets, qblocks, cu, batch, max_s, block_size,
                      causal, scale, tiles.dq, tiles.dkdv, max_s_k=max_s_k)


def _bwd_fake(do, q, k, v, out, lse, sel, n_sel, cu, batch, max_s, block_size, causal, scale, max_s_k=None):
    return tuple(torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))  # contiguous, as the impl


_sparse_bwd = kernel_op("sparse_attn_bwd", _bwd_impl, _bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, sel, n_sel, cu, batch, max_s, block_size, causal, scale, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sel, n_sel, cu)
    ctx.args = (batch, max_s, block_size, causal, scale, *rest)
    ctx.n_inputs = len(inputs)  # a gradient (or None) for each input given, max_s_k or not
    ctx.mark_non_differentiable(lse)


def _backward(ctx, d_out, d_lse):
    q, k, v, out, lse, sel, n_sel, cu = ctx.saved_tensors
    dq, dk, dv = _sparse_bwd(d_out, q, k, v, out, lse, sel, n_sel, cu, *ctx.args)
    return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)


_sparse_fwd = kernel_op("sparse_attn_fwd", _fwd_impl, _fwd_fake, setup_context=_setup_context, backward=_backward)


def _scores_impl(index_q: torch.Tensor, index_k: torch.Tensor, cu: Optional[torch.Tensor], batch: int, max_s: int,
                 block_size: int, causal: bool, scale: float, max_s_k: Optional[int] = None) -> torch.Tensor:
    from .sparse_kernel import index_block_scores, pool_index_queries
    pooled = pool_index_queries(index_q, cu, batch, max_s, block_size, cached_launch)
    return index_block_scores(pooled, index_k, cu, batch, max_s, block_size, causal, scale,
                              _tiles(index_q, index_q.shape[-1]).index, max_s_k, cached_launch)


def _scores_fake(index_q, index_k, cu, batch, max_s, block_size, causal, scale, max_s_k=None):
    nb = n_blocks(max_s, block_size)
    nkb = n_blocks(max_s if max_s_k is None else max_s_k, block_size)
    return index_q.new_empty((batch, index_q.shape[-2], nb, nkb), dtype=torch.float32)


_index_scores = kernel_op("sparse_index_scores", _scores_impl, _scores_fake)


def _stats_impl(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
                sel: torch.Tensor, n_sel: torch.Tensor, cu: Optional[torch.Tensor], batch: int, max_s: int,
                block_size: int, causal: bool, scale: float,
                max_s_k: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    from .sparse_kernel import index_stats
    return index_stats(q, k, lse, index_q, index_k, sel, n_sel, cu, batch, max_s, block_size, causal, scale,
                       _tiles(q, q.shape[-1]).index, max_s_k=max_s_k)


def _stats_fake(q, k, lse, index_q, index_k, sel, n_sel, cu, batch, max_s, block_size, causal, scale, max_s_k=None):
    rows = (1, k.shape[-2], q.shape[0]) if cu is not None else (batch, k.shape[-2], max_s)
    c = sel.shape[-1] + 1
    return q.new_empty(*rows, c, dtype=torch.float32), q.new_empty(*rows, c, dtype=torch.int64)


_index_stats = kernel_op("sparse_index_stats", _stats_impl, _stats_fake)


class _GatheredScores(torch.autograd.Function):
    """z[..., c] = iq[...] · ik[arg[..., c]] · scale (arg -1: 0), with gradients to iq and ik: the index branch's
    max-pooled score of each kept block, its argmax key found by the stats kernel. Chunked over rows so that the
    gathered keys never exist all at once."""
    CHUNK = 1 << 24  # gathered elements per chunk

    @staticmethod
    def forward(ctx, iq, ik, arg, scale):
        ctx.save_for_backward(iq, ik, arg)
        ctx.scale = scale
        rows = iq.reshape(-1, iq.shape[-1])
        flat = arg.reshape(rows.shape[0], arg.shape[-1])
        z = torch.empty(flat.shape, device=iq.device, dtype=torch.float32)
        step = max(1, _GatheredScores.CHUNK // max(flat.shape[1] * rows.shape[1], 1))
        for r in range(0, rows.shape[0], step):
            keys = ik[flat[r:r + step].clamp_min(0)].float()  # [rows, c, d_i]
            z[r:r + step] = torch.einsum("rd,rcd->rc", rows[r:r + step].float(), keys) * scale
        return z.view(arg.shape)

    @staticmethod
    def backward(ctx, dz):
        iq, ik, arg = ctx.saved_tensors
        rows = iq.reshape(-1, iq.shape[-1])
        flat = arg.reshape(rows.shape[0], arg.shape[-1])
        dz = torch.where(flat >= 0, dz.reshape(flat.shape), 0.0) * ctx.scale
        d_iq = torch.empty(rows.shape, device=iq.device, dtype=torch.float32)
        d_ik = torch.zeros(ik.shape, device=ik.device, dtype=torch.float32)
        step = max(1, _GatheredScores.CHUNK // max(flat.shape[1] * rows.shape[1], 1))
        for r in range(0, rows.shape[0], step):
            idx = flat[r:r + step].clamp_min(0)
            d_iq[r:r + step] = torch.einsum("rc,rcd->rd", dz[r:r + step], ik[idx].float())
            contrib = dz[r:r + step, :, None] * rows[r:r + step, None, :].float()
            d_ik.index_add_(0, idx.flatten(), contrib.reshape(-1, rows.shape[1]))
        return d_iq.view(iq.shape).to(iq.dtype), d_ik.to(ik.dtype), None, None


# ------------------------------------------------------------------------------------ public door
def _check_qkv(q, k, v, cu_seqlens, max_seqlen, backend):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    varlen = cu_seqlens is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rank(name, t, 3 if varlen else 4)
        check_same_device(name, t, "q", q)
        check_last_dim_contiguous(name, t)
    check_dtype("q", q, FLOATS)
    check_interpreted_matmul_dtype(backend, "q", q)
    check_same_dtype("k", k, "q", q)
    check_same_dtype("v", v, "q", q)
    for name, width in (("q", q.shape[-1]), ("v", v.shape[-1])):
        if width % 8 or not 8 <= width <= MAX_HEAD_DIM:
            fail(name, f"a head dim that is a multiple of 8 from 8 to {MAX_HEAD_DIM}", width)
    if k.shape[-1] != q.shape[-1]:
        fail("k", f"head dim {q.shape[-1]} (like q)", k.shape[-1])
    if k.shape[:-1] != v.shape[:-1]:
        fail("v", f"the shape of k but its head dim, {tuple(k.shape[:-1])} + (d_v,)", tuple(v.shape))
    _check_key_lead("k", k, q, cu_seqlens is not None)
    h_q, h_kv = q.shape[-2], k.shape[-2]
    if h_kv == 0 or h_q % h_kv:
        fail("k", f"a number of kv heads dividing q's {h_q} heads (GQA)", h_kv)
    batch, max_s = _seq_plan(q, cu_seqlens, max_seqlen)
    return batch, max_s, max_s if varlen else k.shape[1]


def _check_key_lead(name, k, q, varlen):
    """k's batch and sequence: q's, or (batched form) the same batch and a longer sequence whose last tokens are
    the queries'."""
    if varlen:
        if k.shape[:-2] != q.shape[:-2]:
            fail(name, f"q's {q.shape[0]} packed tokens (self-attention; keys longer than the queries are taken in "
                 "the batched form only, not with cu_seqlens)", tuple(k.shape[:-2]))
    elif k.shape[0] != q.shape[0] or k.shape[1] < q.shape[1]:
        fail(name, f"batch {q.shape[0]} and at least q's {q.shape[1]} tokens (self-attention; a longer sequence puts "
             "the queries at its end)", tuple(k.shape[:2]))


def _check_key_offset(name, max_s, max_s_k, block_size):
    """Keys longer than the queries: by whole blocks, so that query blocks are key blocks."""
    if (max_s_k - max_s) % block_size:
        fail(name, f"a sequence longer than q's {max_s} tokens by a multiple of block_size {block_size} (the queries "
             "are its last tokens, block-aligned)", max_s_k)


def _seq_plan(q, cu_seqlens, max_seqlen):
    """(batch, max_s) of the batched or the varlen form."""
    if cu_seqlens is None:
        if max_seqlen is not None:
            fail("max_seqlen", "None unless cu_seqlens is given (varlen)", repr(max_seqlen))
        return q.shape[0], q.shape[1]
    read = host_reads_allowed(cu_seqlens)
    host = read_once((cu_seqlens,), ("sparse", q.shape[0]), lambda: check_cu_seqlens("cu_seqlens", cu_seqlens, q,
                                                                                       read_values=read))
    longest = int((host[1:] - host[:-1]).max()) if host is not None and host.numel() > 1 else None
    if max_seqlen is None:
        if host is None:
            fail("max_seqlen", "an int when cu_seqlens cannot be read (CUDA-graph capture, torch.compile)", None)
        max_seqlen = longest or 0
    check_int("max_seqlen", max_seqlen, 0)
    if longest is not None and max_seqlen < longest:
        fail("max_seqlen", f"at least the longest sequence in cu_seqlens ({longest})", max_seqlen)
    return cu_seqlens.numel() - 1, max_seqlen


def _check_options(block_size, causal, softmax_scale, index_scale):
    check_int("block_size", block_size, 16, MAX_BLOCK, what=f"a power of two from 16 to {MAX_BLOCK}")
    if block_size & (block_size - 1):
        fail("block_size", f"a power of two from 16 to {MAX_BLOCK}", block_size)
    check_bool("causal", causal)
    check_positive_float("softmax_scale", softmax_scale)
    check_positive_float("index_scale", index_scale)


def _check_index(index_q, index_k, lead, h_kv, ref_name, ref, varlen, lead_k=None):
    """index_q [*lead, h_kv, d_i], index_k [*lead_k, 1, d_i] (lead_k: lead by default), on ref's device and of
    its dtype."""
    check_tensor("index_q", index_q)
    check_tensor("index_k", index_k)
    rank = 3 if varlen else 4
    for name, t in (("index_q", index_q), ("index_k", index_k)):
        check_rank(name, t, rank)
        check_same_device(name, t, ref_name, ref)
        check_same_dtype(name, t, ref_name, ref)
        check_last_dim_contiguous(name, t)
    want_q = (*lead, h_kv)
    if tuple(index_q.shape[:-1]) != want_q:
        fail("index_q", f"shape {want_q} + (d_index,): one index query head per kv head", tuple(index_q.shape))
    want_k = (*(lead if lead_k is None else lead_k), 1, index_q.shape[-1])
    if tuple(index_k.shape) != want_k:
        fail("index_k", f"shape {want_k}: one shared index key head", tuple(index_k.shape))
    d_i = index_q.shape[-1]
    if d_i % 8 or not 8 <= d_i <= 128:
        fail("index_q", "an index head dim that is a multiple of 8 from 8 to 128", d_i)


def _check_selection_args(index_q, index_k, topk) -> None:
    """Without block_indices the index branch selects the blocks: both its inputs, and a topk."""
    if index_q is None or index_k is None:
        fail("index_q/index_k", "both given (the index branch selects the blocks) unless block_indices is",
             "index_q" if index_k is not None else "index_k" if index_q is not None else "neither")
    check_int("topk", topk, 1)


def _check_block_indices(block_indices, k, batch, max_s, block_size, max_s_k=None):
    check_tensor("block_indices", block_indices)
    check_rank("block_indices", block_indices, 4)
    check_dtype("block_indices", block_indices, (torch.int32, torch.int64))
    check_same_device("block_indices", block_indices, "k", k)
    want = (batch, k.shape[-2], n_blocks(max_s, block_size))
    if tuple(block_indices.shape[:3]) != want or block_indices.shape[3] < 1:
        fail("block_indices", f"shape {want} + (topk >= 1,): [batch, kv heads, query blocks, topk]",
             tuple(block_indices.shape))
    nb = n_blocks(max_s if max_s_k is None else max_s_k, block_size)  # the key blocks
    if host_reads_allowed(block_indices) and block_indices.numel():
        return read_once((block_indices,), _checked(nb), lambda: _check_block_values(block_indices, nb))
    return None


def _checked(nb):
    """read_once's context for block_indices known to hold key blocks from -1 to nb - 1. What it remembers: the
    selector's causal flag for lists top_blocks made (select_blocks' form, canonical already), None for others."""
    return ("sparse block_indices", nb)


def _remember_selected(block_indices, max_s_k, block_size, causal):
    """The selector's lists are in range and canonical by construction: later calls given them (the index loss, every
    layer, every step) need not read them back to check, nor sort them again."""
    if host_reads_allowed(block_indices):
        read_once((block_indices,), _checked(n_blocks(max_s_k, block_size)), lambda: causal)


def _kept_lists(block_indices, selected_causal, cu, batch, max_s, max_s_k, block_size, causal, n_sel=None):
    """(sel, n_sel) the kernels walk. Lists the selector made (selected_causal: the causal flag it chose them under;
    None for any other lists) are canonical already (ascending, in reach, -1 after the kept ones) wherever every
    entry is visible: chosen causally, or walked without the causal mask; n_sel: their counts where the selector gave
    them. Others go through canonical()."""
    if selected_causal is not None and (selected_causal or not causal):
        return block_indices, n_sel if n_sel is not None else (block_indices >= 0).sum(-1, dtype=torch.int32)
    nb_seq = blocks_per_sequence(cu, batch, max_s_k, block_size, block_indices.device)
    return canonical(block_indices, nb_seq, causal, (max_s_k - max_s) // block_size)


def _check_block_values(block_indices, nb):
    lo, hi = int(block_indices.min()), int(block_indices.max())  # a host sync
    if lo < -1 or hi >= nb:
        fail("block_indices", f"key blocks from 0 to {nb - 1}, or -1 for none", f"values from {lo} to {hi}")


def _scale(x, given):
    return given if given is not None else 1.0 / math.sqrt(x.shape[-1])


def _per_sequence(cu, *tensors):
    """[(slices of each tensor for sequence i, with a batch dim of 1)] for the references' varlen loops."""
    bounds = cu.tolist()
    return [[t[None, bounds[i]:bounds[i + 1]] for t in tensors] for i in range(len(bounds) - 1)]


def _select(index_q, index_k, cu, batch, max_s, block_size, topk, causal, index_scale, backend, max_s_k):
    """(block_indices int32 [b, h_kv, nqb, topk] canonical, their counts [b, h_kv, nqb] or None)."""
    if backend == "reference":
        if cu is None:
            z = index_block_scores_reference(index_q, index_k, block_size=block_size, index_scale=index_scale)
        else:
            nb = n_blocks(max_s, block_size)
            z = index_q.new_full((batch, index_q.shape[-2], nb, nb), float("-inf"), dtype=torch.float32)
            for i, (iq, ik) in enumerate(_per_sequence(cu, index_q, index_k)):
                zi = index_block_scores_reference(iq, ik, block_size=block_size, index_scale=index_scale)
                z[i, :, :zi.shape[2], :zi.shape[3]] = zi[0]
        return top_blocks(z, topk, causal), None
    z = _index_scores(index_q, index_k, cu, batch, max_s, block_size, causal, index_scale, max_s_k)
    from .sparse_kernel import top_blocks as top_blocks_launched
    return top_blocks_launched(z, topk, cached_launch)


def select_blocks(index_q: torch.Tensor, index_k: torch.Tensor, *, block_size: int = 128, topk: int = 16,
                  causal: bool = True, cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                  index_scale: Optional[float] = None, backend: Optional[str] = None) -> torch.Tensor:
    """The index branch's selection: block_indices int32 [batch, h_kv, n_blocks, topk], each query block's top-k
    key blocks by max-pooled index score (its own block not among them: it is always kept), ascending, -1 padded.
    index_q [b, s, h_kv, d_i] (one index query head per kv head), index_k [b, s, 1, d_i]; packed [total, ., d_i]
    with cu_seqlens. Batched, index_k may be longer, [b, s_k, 1, d_i] with s_k - s a multiple of block_size: the
    queries are then its last s tokens, n_blocks counts theirs and the entries are key blocks of s_k. No gradient
    (the choice is discrete); no host sync on the GPU."""
    check_tensor("index_q", index_q)
    backend = resolve_backend(backend, index_q.device)
    _check_options(block_size, causal, None, index_scale)
    check_int("topk", topk, 1)
    check_dtype("index_q", index_q, FLOATS)
    check_interpreted_matmul_dtype(backend, "index_q", index_q)
    varlen = cu_seqlens is not None
    check_rank("index_q", index_q, 3 if varlen else 4)
    batch, max_s = _seq_plan(index_q, cu_seqlens, max_seqlen)
    check_tensor("index_k", index_k)
    check_rank("index_k", index_k, 3 if varlen else 4)
    _check_key_lead("index_k", index_k, index_q, varlen)
    max_s_k = max_s if varlen else index_k.shape[1]
    _check_key_offset("index_k", max_s, max_s_k, block_size)
    _check_index(index_q, index_k, index_q.shape[:-2], index_q.shape[-2], "index_q", index_q, varlen,
                 index_k.shape[:-2])
    with torch.no_grad():
        block_indices = _select(index_q.detach(), index_k.detach(), cu_seqlens, batch, max_s, block_size, topk,
                                causal, _scale(index_q, index_scale), backend, max_s_k)[0]
    _remember_selected(block_indices, max_s_k, block_size, causal)
    return block_indices


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int = 128, topk: int = 16,
                     causal: bool = True, index_q: Optional[torch.Tensor] = None,
                     index_k: Optional[torch.Tensor] = None, block_indices: Optional[torch.Tensor] = None,
                     cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                     softmax_scale: Optional[float] = None, index_scale: Optional[float] = None,
                     return_lse: bool = False, return_indices: bool = False, backend: Optional[str] = None):
    """Top-k block-sparse attention, forward and backward (gradients for q, k, v).

    q [b, s, h_q, d], k [b, s, h_kv, d], v [b, s, h_kv, d_v] (any GQA group); packed [total, h, d] with cu_seqlens
    (int32 [n + 1]) and max_seqlen (at least the longest sequence: checked where cu_seqlens can be read; under a
    CUDA-graph capture or torch.compile that is the caller's contract, as in flash-attn). Each query block (block_size
    tokens) of each kv head's group attends its own block (causal within it) and its top-`topk` key blocks: chosen
    by the index branch (index_q [b, s, h_kv, d_i], index_k [b, s, 1, d_i]; see select_blocks) or given as
    block_indices [b, h_kv, n_blocks, topk'] (-1 for none; out-of-reach, repeated and own entries are ignored).
    Returns out [b, s, h_q, d_v], then lse (fp32, [b, h_q, s] or [h_q, total], natural log) if return_lse, then the
    block_indices used if return_indices.

    Batched, k / v (and index_k) may be longer than q: [b, s_k, h_kv, d] with s_k - s a multiple of block_size. The
    queries are then the last s of the s_k positions (bottom-right aligned, as flash-attn's causal with s_q < s_k:
    query t sits at s_k - s + t), as a context-parallel rank's chunk against the keys up to it; n_blocks counts the
    query blocks and block_indices holds key blocks of s_k. Gradients for k and v cover all s_k keys.

    Kernels: portable Triton everywhere (the backward deterministic). On sm_90 with Triton 3.6, batched bf16/fp16
    inputs of head dim 64 or 128 with blocks of a multiple of 128 can take the Hopper Gluon kernels, dense
    attention's warp-specialized schedules walking the kept blocks (switch WARPFORGE_SPARSE_GLUON, see
    ops/sparse/configs.py); their backward sums dq, and dk / dv over a GQA group (and over query blocks in the
    query-block order long sequences take), in arrival order."""
    check_tensor("q", q)
    backend = resolve_backend(backend, q.device)
    batch, max_s, max_s_k = _check_qkv(q, k, v, cu_seqlens, max_seqlen, backend)
    _check_options(block_size, causal, softmax_scale, index_scale)
    _check_key_offset("k", max_s, max_s_k, block_size)
    check_bool("return_lse", return_lse)
    check_bool("return_indices", return_indices)
    varlen = cu_seqlens is not None
    if block_indices is None:
        _check_selection_args(index_q, index_k, topk)
        _check_index(index_q, index_k, q.shape[:-2], k.shape[-2], "q", q, varlen, k.shape[:-2])
        with torch.no_grad():
            block_indices, n_sel = _select(index_q.detach(), index_k.detach(), cu_seqlens, batch, max_s, block_size,
                                           topk, causal, _scale(index_q, index_scale), backend, max_s_k)
        selected_causal = causal
        _remember_selected(block_indices, max_s_k, block_size, causal)
    else:
        selected_causal, n_sel = _check_block_indices(block_indices, k, batch, max_s, block_size, max_s_k), None
    scale = _scale(q, softmax_scale)
    if backend == "reference":
        kw = dict(block_size=block_size, causal=causal, softmax_scale=scale)
        if not varlen:
            out, lse = sparse_attention_reference(q, k, v, block_indices, **kw)
        else:
            parts = [sparse_attention_reference(qi, ki, vi, block_indices[i:i + 1, :, :n_blocks(qi.shape[1],
                                                                                                 block_size)], **kw)
                     for i, (qi, ki, vi) in enumerate(_per_sequence(cu_seqlens, q, k, v))]
            out = torch.cat([o[0] for o, _ in parts], 0) if parts else q.new_empty(*q.shape[:-1], v.shape[-1])
            lse = torch.cat([lse[0] for _, lse in parts], 1) if parts else q.new_empty(q.shape[-2], 0)
    else:
        sel, n_sel = _kept_lists(block_indices, selected_causal, cu_seqlens, batch, max_s, max_s_k, block_size,
                                 causal, n_sel)
        out, lse = _sparse_fwd(q, k, v, sel, n_sel, cu_seqlens, batch, max_s, block_size, causal, scale, max_s_k)
    results = (out,) + ((lse,) if return_lse else ()) + ((block_indices,) if return_indices else ())
    return results[0] if len(results) == 1 else results


def sparse_attention_index_loss(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, index_q: torch.Tensor,
                                index_k: torch.Tensor, block_indices: torch.Tensor, *, block_size: int = 128,
                                causal: bool = True, cu_seqlens: Optional[torch.Tensor] = None,
                                max_seqlen: Optional[int] = None, softmax_scale: Optional[float] = None,
                                index_scale: Optional[float] = None, backend: Optional[str] = None) -> torch.Tensor:
    """The index branch's loss (fp32 scalar): the mean over tokens and kv heads of KL(main attention's block mass
    ‖ softmax of the index branch's max-pooled block scores), over each token's kept blocks. q, k and lse are the
    main attention's (lse from sparse_attention(..., return_lse=True) on the same q and k: the Triton path uses it as
    given, the reference recomputes it); the gradient goes to index_q and index_k only. Batched, k and index_k may
    be longer than q and index_q, as in sparse_attention (the queries are their last tokens; gradients for all of
    index_k)."""
    check_tensor("q", q)
    backend = resolve_backend(backend, q.device)
    batch, max_s, max_s_k = _check_qkv(q, k, k, cu_seqlens, max_seqlen, backend)
    _check_options(block_size, causal, softmax_scale, index_scale)
    _check_key_offset("k", max_s, max_s_k, block_size)
    varlen = cu_seqlens is not None
    _check_index(index_q, index_k, q.shape[:-2], k.shape[-2], "q", q, varlen, k.shape[:-2])
    selected_causal = _check_block_indices(block_indices, k, batch, max_s, block_size, max_s_k)
    check_tensor("lse", lse)
    check_dtype("lse", lse, (torch.float32,))
    check_same_device("lse", lse, "q", q)
    check_last_dim_contiguous("lse", lse)  # the kernel steps along the tokens with stride 1
    want = (q.shape[-2], q.shape[0]) if varlen else (batch, q.shape[-2], max_s)
    if tuple(lse.shape) != want:
        fail("lse", f"shape {want} (sparse_attention's lse)", tuple(lse.shape))
    scale, i_scale = _scale(q, softmax_scale), _scale(index_q, index_scale)
    if lse.numel() == 0:  # no tokens: nothing to match (a zero that still reaches the index branch's graph)
        return (index_q.sum() + index_k.sum()).float() * 0.0
    q, k, lse = q.detach(), k.detach(), lse.detach()
    kw = dict(block_size=block_size, causal=causal, softmax_scale=scale, index_scale=i_scale)
    if backend == "reference":
        if not varlen:
            return index_loss_reference(q, k, index_q, index_k, block_indices, **kw)
        parts = _per_sequence(cu_seqlens, q, k, index_q, index_k)
        losses = [index_loss_reference(qi, ki, iq, ik, block_indices[i:i + 1, :, :n_blocks(qi.shape[1], block_size)],
                                       **kw) * qi.shape[1] for i, (qi, ki, iq, ik) in enumerate(parts)
                  if qi.shape[1]]  # an empty sequence has no tokens to average (its mean would be NaN)
        return torch.stack(losses).sum() / q.shape[0]
    sel, n_sel = _kept_lists(block_indices, selected_causal, cu_seqlens, batch, max_s, max_s_k, block_size, causal)
    with torch.no_grad():
        mass, arg = _index_stats(q, k, lse, index_q.detach(), index_k.detach(), sel, n_sel, cu_seqlens, batch, max_s,
                                 block_size, causal, scale, max_s_k)
    iq_rows = index_q.permute(1, 0, 2)[None] if varlen else index_q.permute(0, 2, 1, 3)  # [b, h_kv, s, d_i]
    z = _GatheredScores.apply(iq_rows, index_k.reshape(-1, index_k.shape[-1]), arg, i_scale)
    z = z.masked_fill(arg < 0, float("-inf"))
    kl = torch.where(mass > 0, mass * (torch.log(mass.clamp_min(1e-30)) - torch.log_softmax(z, -1)), 0.0)
    return kl.sum(-1).mean()
