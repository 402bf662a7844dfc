"""The sparse family's door to the Hopper Gluon kernels (ops/_gluon_flash_fwd.py and _gluon_flash_bwd.py, shared
with dense attention), FlashAttention-3's warp-specialized schedules over the kept blocks: in the forward each
128-row item walks its query block's kept blocks, then its own block; in the backward each program of 128 keys walks
the query blocks that kept its block (the CSR lists of sparse_kernel.kept_by), then its own. Same outputs as
sparse_kernel.sparse_fwd / sparse_bwd for batched inputs (the backward's sums in arrival order)."""
from .._gluon_flash_bwd import fits as bwd_fits
from .._gluon_flash_bwd import flash_bwd_gluon, group_split, head_group, key_rows_knob
from .._gluon_flash_fwd import available, fits, flash_fwd_gluon

__all__ = ["available", "bwd_fits", "fits", "sparse_bwd_gluon", "sparse_fwd_gluon"]  # available, fits: api's gate


def sparse_fwd_gluon(q, k, v, sel, n_sel, block_size, causal, scale, knobs, launch):
    """(out [b, s, h_q, d], lse fp32 [b, h_q, s]) over canonical (sel, n_sel) (select.canonical); the caller checked
    fits(q, k, v), available() and that block_size is a multiple of 128. knobs: (BLOCK_N, STAGES, PINGPONG,
    PERSISTENT). launch: shared_kernels.triton_launch's form."""
    block_n, stages, pingpong, persistent = knobs
    return flash_fwd_gluon(q, k, v, scale, causal, min(block_n, block_size), stages, pingpong, persistent,
                           blocks=(sel, n_sel, block_size), launch=launch)


def sparse_bwd_gluon(do, q, k, v, out, lse, offsets, qblocks, block_size, causal, scale, knobs, launch):
    """(dq, dk, dv) like q, k, v over the kept blocks' CSR lists (sparse_kernel.kept_by over the key blocks); the caller
    checked bwd_fits(...), available() and that block_size is a multiple of 128. knobs: (BLOCK_M, STAGES, DQ_N,
    DQ_SPLIT, DQ_TMA, GROUP_SPLIT, HEAD_GROUP, KEY_ROWS); GROUP_SPLIT 0: one query head per program; HEAD_GROUP: the
    programs' order, kv-head slices in groups of (up to) that many (_gluon_flash_bwd._program); KEY_ROWS: the
    transposed step, where the knobs take it (_gluon_flash_bwd.key_rows_knob). launch: as the forward's."""
    block_m, stages, dq_n, dq_split, dq_tma, want, order, key_rows = knobs
    split = group_split(q.shape[2] // k.shape[2], want, block_m, stages, dq_tma)
    return flash_bwd_gluon(do, q, k, v, out, lse, scale, causal, block_m, stages, dq_n, dq_split, dq_tma, split,
                           blocks=(offsets, qblocks, block_size), launch=launch,
                           head_group=head_group(q.shape[0] * k.shape[2] * split, order),
                           key_rows=key_rows_knob(key_rows, block_m, dq_split, dq_tma))
