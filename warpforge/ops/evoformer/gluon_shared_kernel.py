"""What the Evoformer's Gluon kernels (fwd_gluon_kernel, dkdv_gluon_kernel, dq_dbias_gluon_kernel) share on the
host: which biases and shapes they take, how many MSA-row groups a launch splits into, and the tensors and TMA
descriptors they read.

Each kernel gives a program one (batch · head, 64-residue block) and a group of MSA rows, and reads the pair bias's
[64, N_res] strip once into shared memory, fp32 in log2 units, where every MSA row's scores take it from (the dq
pass keeps its strip of the pair bias's gradient in registers besides).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...runtime import next_pow2
from .._gluon import tma_addressable, tma_descriptor

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)
BLOCK = 64        # queries a program, keys a step: one warpgroup's wgmma rows
MAX_BLOCKS = 6    # key blocks a row: N_res <= 384 (the strip's 96 KB; the backward's three register tiles a warpgroup)
HEAD_DIMS = (16, 32)


def split_biases(biases, S: int):
    """(pair, mask) from the two expanded bias views [B, S, H, R, R] (stride 0 where broadcast): the pair
    is a [rows, keys] tile the same for every MSA row (stride 0 over S, or S 1), the mask a row of keys (stride 0
    over the queries). None where the biases are anything else (two of a kind, a per-row tile): the portable
    passes take those."""
    pair = mask = None
    for bias in biases:
        if bias is None:
            continue
        if bias.stride(3) == 0:
            if mask is not None:
                return None
            mask = bias
        elif bias.stride(1) == 0 or S == 1:
            if pair is not None:
                return None
            pair = bias
        else:
            return None
    return None if pair is None else (pair, mask)


def fits(q: torch.Tensor, biases) -> bool:
    """fp16 / bf16 [B, N_seq, N_res, H, D] of head dim 16 or 32, N_res <= 384, q's layout TMA-addressable, a pair
    bias shared by the MSA rows and at most one key-row mask (split_biases)."""
    B, S, R, H, D = q.shape
    return (q.dtype in (torch.float16, torch.bfloat16) and D in HEAD_DIMS and 0 < R <= MAX_BLOCKS * BLOCK
            and q.numel() > 0 and tma_addressable(q) and split_biases(biases, S) is not None)


def groups(BH: int, NI: int, S: int, n_sm: int) -> int:
    """MSA-row groups G: the smallest G whose B · H · NI · G programs (one an SM: up to ~220 KB of shared memory, 64K
    registers) fill whole waves to 90% or more, up to 8 waves; else the best fill seen."""
    best, best_fill = 1, 0.0
    for G in range(1, min(S, 64) + 1):
        waves = BH * NI * G / n_sm
        fill = waves / -(-waves // 1)
        if fill >= 0.9 and waves >= 1:
            return G
        if fill > best_fill + 1e-9:
            best, best_fill = G, fill
        if waves > 8:
            break
    return best


def log2_bias_buffers(pair, mask, B, S, H, R):
    """log2_biases' outputs, allocated (unfilled): pair2 [B · H, R, R], mask2 [B · S · Hm, R] or None, and Hm (1 for
    a mask the same for every head, else H); fp32, rows padded to 16 bytes for TMA (the views' shapes stay R: the
    padding is never read)."""
    RP = -(-R // 4) * 4
    pair2 = torch.empty((B * H, R, RP), device=pair.device, dtype=torch.float32)[..., :R]
    if mask is None:
        return pair2, None, 1
    mask_heads = 1 if mask.stride(2) == 0 else H
    return pair2, torch.empty((B * S * mask_heads, RP), device=pair.device, dtype=torch.float32)[:, :R], mask_heads


def log2_biases(pair, mask, B, S, H, R, launch):
    """The biases as the kernels read them, fp32 in log2 units (· log2 e, so a score takes one add a bias): pair
    [B · H, R, R] and mask [B · S · Hm, R] (log2_bias_buffers), filled by one launch of evo_log2_biases_kernel
    (an eager backward's host pays per CUDA op: four torch ops before). Both are small (the pair bias 4.7 MB at
    B 1, H 8, R 384): made once per call. pair, mask: [B, S, H, R, R] views (stride 0 where broadcast)."""
    pair2, mask2, mask_heads = log2_bias_buffers(pair, mask, B, S, H, R)
    p = pair[:, 0]  # [B, H, R, R]
    m = mask[:, :, :mask_heads, 0] if mask is not None else p  # [B, S, Hm, R]
    n_pair = B * H * R
    launch(evo_log2_biases_kernel, (n_pair + (B * S * mask_heads if mask is not None else 0),),
           p, m, pair2, pair2 if mask2 is None else mask2, n_pair, H, S, mask_heads, R, pair2.stride(1),
           *p.stride(), *m.stride(), BLOCK_R=max(16, next_pow2(R)), HAS_MASK=mask is not None)
    return pair2, mask2, mask_heads


@triton.jit
def evo_log2_biases_kernel(PAIR, MASK, PAIR2, MASK2, n_pair_rows, H, S, HM, R, row_stride, p_b, p_h, p_i, p_j,
                           m_b, m_s, m_h, m_j, BLOCK_R: tl.constexpr, HAS_MASK: tl.constexpr):
    """One row a program: the pair bias's rows (b, h, i) first, then the mask's (b, s, h); each converted to fp32,
    then scaled by log2 e in fp32 (as the kernels' scores are in log2 units)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_R)
    inside = cols < R
    if row < n_pair_rows:
        b, h, i = row // (H * R), (row // R) % H, row % R
        pair = tl.load(PAIR + b * p_b + h * p_h + i * p_i + cols * p_j, mask=inside, other=0.0).to(tl.float32)
        tl.store(PAIR2 + row * row_stride + cols, pair * _LOG2E, mask=inside)
    else:
        if HAS_MASK:
            r = row - n_pair_rows
            b, s, h = r // (S * HM), (r // HM) % S, r % HM
            mask = tl.load(MASK + b * m_b + s * m_s + h * m_h + cols * m_j, mask=inside, other=0.0).to(tl.float32)
            tl.store(MASK2 + r * row_stride + cols, mask * _LOG2E, mask=inside)


def row_descriptors(*tensors):
    """TMA descriptors over [B, N_seq, N_res, H, D] tensors as [B · N_seq, N_res, H, D] with [1, 64, 1, D] boxes (rows
    past N_res arrive as zeros)."""
    from triton.experimental.gluon import language as gl
    B, S, R, H, D = tensors[0].shape
    gdt = gl.bfloat16 if tensors[0].dtype == torch.bfloat16 else gl.float16
    return [tma_descriptor(t.view(B * S, R, H, D), (1, BLOCK, 1, D), gdt) for t in tensors]


def bias_descriptors(pair2, mask2):
    """TMA descriptors over log2_biases' pair ([1, 64, 64] boxes) and mask ([1, 64]; the pair's first rows stand in
    where there is none)."""
    from triton.experimental.gluon import language as gl
    return [tma_descriptor(pair2, (1, BLOCK, BLOCK), gl.float32),
            tma_descriptor(mask2 if mask2 is not None else pair2[0], (1, BLOCK), gl.float32)]




def build_helpers():
    """The Gluon functions every kernel here uses (built on first use: importing warpforge never touches Gluon):
    - _program: program id -> (batch · head, residue block, group, batch, head, the group's first MSA row, its row
      count); residue blocks fastest, so that the NI programs that read the same MSA rows run side by side;
    - _load_strip: the producer's TMA loads of the log2 pair bias's strip for residue block `blk` (NB [1, 64, 64]
      boxes along the other residue axis) onto one barrier, once per program."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    @gluon.jit
    def _program(BH, NI: gl.constexpr, H: gl.constexpr, S, rows_per):
        pid = gl.program_id(0)
        bh = (pid // NI) % BH
        g = pid // (NI * BH)
        s0 = g * rows_per
        return bh, pid % NI, g, bh // H, bh % H, s0, gl.minimum(rows_per, S - s0)

    @gluon.jit
    def _load_strip(pair_desc, pair_bufs, pair_bar, bh, blk, NB: gl.constexpr):
        mbarrier.expect(pair_bar, NB * pair_desc.block_type.nbytes)
        for x in gl.static_range(NB):
            tma.async_copy_global_to_shared(pair_desc, [bh, blk * 64, x * 64], pair_bar, pair_bufs.index(x))
    return _program, _load_strip
