"""The sparse family's door to the Hopper Gluon kernels (ops/_gluon_flash_fwd.py and _gluon_flash_bwd.py, shared
with dense attention), FlashAttention-3's warp-specialized schedules over the kept blocks: in the forward each
128-row item walks its query block's kept blocks, then its own block; in the backward each program of 128 keys walks
the query blocks that kept its block (the CSR lists of sparse_kernel.kept_by), then its own. Same outputs as
sparse_kernel.sparse_fwd / sparse_bwd for batched inputs (the backward's sums in arrival order). Long sequences
(api.gluon_bwd_order) run the backward's programs in query-block order instead: one a (query block, key block) pair,
a query block's pairs side by side (query_block_items)."""
import torch

from .._gluon_flash_bwd import fits as bwd_fits
from .._gluon_flash_bwd import flash_bwd_gluon, group_split, head_group, key_rows_knob
from .._gluon_flash_fwd import available, fits, flash_fwd_gluon

__all__ = ["available", "bwd_fits", "fits", "query_block_items", "sparse_bwd_gluon", "sparse_fwd_gluon",
           "work_list_fits"]


def sparse_fwd_gluon(q, k, v, sel, n_sel, block_size, causal, scale, knobs, launch):
    """(out [b, s, h_q, d], lse fp32 [b, h_q, s]) over canonical (sel, n_sel) (select.canonical); the caller checked
    fits(q, k, v), available() and that block_size is a multiple of 128. knobs: (BLOCK_N, STAGES, PINGPONG,
    PERSISTENT). launch: shared_kernels.triton_launch's form."""
    block_n, stages, pingpong, persistent = knobs
    return flash_fwd_gluon(q, k, v, scale, causal, min(block_n, block_size), stages, pingpong, persistent,
                           blocks=(sel, n_sel, block_size), launch=launch)


def query_block_items(sel, n_key_blocks, group_split):
    """The backward's programs in query-block order (flash_bwd_gluon's work list, 128-row blocks): int32 [b · h_kv ·
    group_split · nqb · (topk + 1), 4] = (key tile, slice, query block, kind), for each slice (b · h_kv + kv head) ·
    group_split + part, each query block i: its kept pairs (kind 1; 0 where sel is -1 padding), then its own block
    (key block i + n_key_blocks - nqb, kind 2). A query block's programs run side by side, so its Q, dO and dQ rows
    serve all of its key blocks from L2, where key-tile order (one program a key block) reads them once per key block
    that kept them, from anywhere in the sequence. sel: select.canonical's [b, h_kv, nqb, topk]."""
    b, h_kv, nqb, topk = sel.shape
    dev = sel.device
    i = torch.arange(nqb, device=dev, dtype=torch.int32).view(1, 1, nqb, 1)
    own = (i + (n_key_blocks - nqb)).expand(b, h_kv, nqb, 1)
    key_tile = torch.cat([sel.clamp_min(0), own], -1)                                   # [b, h_kv, nqb, topk + 1]
    kind = torch.cat([(sel >= 0).to(torch.int32), torch.full_like(own, 2)], -1)
    kv = torch.arange(b * h_kv, device=dev, dtype=torch.int32).view(b, h_kv, 1, 1, 1)
    part = torch.arange(group_split, device=dev, dtype=torch.int32).view(1, 1, group_split, 1, 1)
    shape = (b, h_kv, group_split, nqb, topk + 1)
    items = torch.stack([key_tile[:, :, None].expand(shape), (kv * group_split + part).expand(shape),
                         i[:, :, None].expand(shape), kind[:, :, None].expand(shape)], -1)
    return items.reshape(-1, 4).contiguous()


def work_list_fits(knobs) -> bool:
    """Whether the backward's knobs can take a work list: its dK / dV partials are staged fp32 in the ring for TMA
    reduce-adds (DQ_TMA, STAGES · BLOCK_M >= 128), as GROUP_SPLIT's are."""
    block_m, stages, _, _, dq_tma = knobs[:5]
    return bool(dq_tma) and stages * block_m >= 128


def sparse_bwd_gluon(do, q, k, v, out, lse, offsets, qblocks, block_size, causal, scale, knobs, launch, sel=None):
    """(dq, dk, dv) like q, k, v over the kept blocks' CSR lists (sparse_kernel.kept_by over the key blocks; None
    with sel); the caller checked bwd_fits(...), available() and that block_size is a multiple of 128 (128 with sel,
    and work_list_fits(knobs)). knobs:
    (BLOCK_M, STAGES, DQ_N, DQ_SPLIT, DQ_TMA, GROUP_SPLIT, HEAD_GROUP, KEY_ROWS); GROUP_SPLIT 0: one query head per
    program; HEAD_GROUP: the programs' order, kv-head slices in groups of (up to) that many
    (_gluon_flash_bwd._program); KEY_ROWS: the transposed step, where the knobs take it
    (_gluon_flash_bwd.key_rows_knob). launch: as the forward's. sel (the canonical lists, 128-row blocks): the
    programs in query-block order instead (query_block_items), each over GROUP / GROUP_SPLIT query heads of one query
    block against one key block (GROUP_SPLIT 0, one head a program in key order, is read as 1 there: the whole
    group a program)."""
    block_m, stages, dq_n, dq_split, dq_tma, want, order, key_rows = knobs
    group = q.shape[2] // k.shape[2]
    work = None
    if sel is not None:
        split = group_split(group, want if want > 0 else 1, block_m, stages, dq_tma)
        work = query_block_items(sel, -(-k.shape[1] // block_size), split)
    else:
        split = group_split(group, want, block_m, stages, dq_tma)
    return flash_bwd_gluon(do, q, k, v, out, lse, scale, causal, block_m, stages, dq_n, dq_split, dq_tma, split,
                           blocks=(offsets, qblocks, block_size), launch=launch,
                           head_group=head_group(q.shape[0] * k.shape[2] * split, order),
                           key_rows=key_rows_knob(key_rows, block_m, dq_split, dq_tma), work=work)
