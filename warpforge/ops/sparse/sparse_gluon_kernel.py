"""The sparse family's door to the Hopper Gluon forward (the kernel: ops/_gluon_flash_fwd.py, shared with dense
attention): each 128-row item walks its query block's kept blocks, then its own block, through FlashAttention-3's
warp-specialized schedule (TMA ring, two ping-ponging consumer warpgroups). Same outputs as sparse_kernel.sparse_fwd
for batched inputs."""
from .._gluon_flash_fwd import available, fits, flash_fwd_gluon

__all__ = ["available", "fits", "sparse_fwd_gluon"]  # available, fits: api's gate


def sparse_fwd_gluon(q, k, v, sel, n_sel, block_size, causal, scale, knobs):
    """(out [b, s, h_q, d], lse fp32 [b, h_q, s]) over canonical (sel, n_sel) (select.canonical); the caller checked
    fits(q, k, v), available() and that block_size is a multiple of 128. knobs: (BLOCK_N, STAGES, PINGPONG, PERSISTENT)."""
    block_n, stages, pingpong, persistent = knobs
    return flash_fwd_gluon(q, k, v, scale, causal, min(block_n, block_size), stages, pingpong, persistent,
                           blocks=(sel, n_sel, block_size))
