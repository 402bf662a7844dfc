"""Monarch matrices in plain PyTorch: what the Monarch kernels compute, and the projection of a dense weight.

The convention (Dao et al., ICML 2022; the layout of HazyResearch fly's `blockdiag_butterfly_multiply`, with its
w1_bfly = w_right and w2_bfly = w_left and nblocks1 = nblocks2 = nblocks):

    M = P_out · L · P_mid · R        y = x Mᵀ (+ bias),   x [..., d_in] -> y [..., d_out]

- R = blockdiag(w_right), w_right [nb, d_mid/nb, d_in/nb]: input block k (columns k·p .. k·p + p - 1,
  p = d_in/nb) goes to intermediate columns k·q .. k·q + q - 1 (q = d_mid/nb). Applied first.
- P_mid, the perfect shuffle of the intermediate: viewed as [q, nb] (index ri·nb + l), transposed to [nb, q];
  block l of L reads the intermediate's columns l, l + nb, l + 2·nb, ...
- L = blockdiag(w_left), w_left [nb, d_out/nb, d_mid/nb].
- P_out, the inverse shuffle on the output: block l's output si lands at column si·nb + l.

For a square M (d_in = d_mid = d_out), P_out = P_midᵀ: M = P L Pᵀ R with P = P_out, the paper's form.
"""
from __future__ import annotations

import torch


def monarch_bmm(x, w_left, w_right, round_to=None):
    """x Mᵀ as PyTorch writes it without a kernel (HazyResearch fly's): a batched matmul per factor, the permutations
    as reshapes and copies, in the operands' dtype. round_to: a dtype the intermediate is rounded to between the two
    (and, through autograd, its gradient with it). x [..., d_in] -> [..., d_out]."""
    nb, q, p = w_right.shape
    s = w_left.shape[1]
    lead = x.shape[:-1]
    xb = x.reshape(-1, nb, p).transpose(0, 1)                       # [nb, T, p]: input block k
    h = torch.bmm(xb, w_right.transpose(1, 2))                      # [nb, T, q]: R's block k
    h = h.transpose(0, 1).reshape(-1, nb * q)                       # [T, d_mid], the intermediate in order
    if round_to is not None:
        h = h.to(round_to).to(x.dtype)
    u = h.reshape(-1, q, nb).permute(2, 0, 1)                       # P_mid: [nb, T, q], u[l, t, ri] = h[t, ri·nb + l]
    out = torch.bmm(u, w_left.transpose(1, 2))                      # [nb, T, s]: L's block l
    return out.permute(1, 2, 0).reshape(*lead, s * nb)              # P_out: y[t, si·nb + l] = out[l, t, si]


def monarch_linear_reference(x, w_left, w_right, bias=None):
    """y = x Mᵀ (+ bias), fp32 math (monarch_bmm on fp32 operands): x [..., d_in] -> y [..., d_out] in x's dtype.
    For fp16 / bf16 x the intermediate is rounded to x's dtype between the factors, as the kernels store it (fp16
    past 65504 is inf there), and its gradient with it, as the kernels' backward does."""
    half = x.dtype in (torch.float16, torch.bfloat16)
    y = monarch_bmm(x.float(), w_left.float(), w_right.float(), round_to=x.dtype if half else None)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def monarch_dense_reference(w_left, w_right):
    """The dense M [d_out, d_in] (fp32) the two factors stand for: y = x Mᵀ."""
    d_in = w_right.shape[0] * w_right.shape[2]
    eye = torch.eye(d_in, device=w_right.device, dtype=torch.float32)
    return monarch_linear_reference(eye, w_left.float(), w_right.float()).T.contiguous()


def _pairs(nb, q):
    """For each (input block k, output block l): the intermediate columns ri of L's block l that R's block k
    feeds (ri·nb + l lies in k's run [k·q, k·q + q)). Every ri of every l belongs to exactly one k."""
    return {(k, l): [ri for ri in range(q) if (ri * nb + l) // q == k] for k in range(nb) for l in range(nb)}


def monarch_project_reference(weight, nblocks, d_mid=None):
    """The Monarch factors (w_left, w_right) nearest, in Frobenius norm, to a dense weight [d_out, d_in].

    Through the convention above, M's block (output block l: rows si·nb + l; input block k: columns k·p ..)
    is Σ over the ri that pair k with l of L[l, :, ri] ⊗ R[k, ri·nb + l - k·q, :]: a matrix of rank at most
    c(k, l) = the number of those ri, and every entry of L and R sits in exactly one such block. So the
    nearest Monarch matrix is, block by block, the truncated SVD of rank c(k, l) (Eckart–Young); with
    nb² dividing d_mid every c is d_mid / nb² (1 for the paper's nb = √d). The singular values are split
    evenly (√σ) between the two factors. fp32 math; factors in weight's dtype."""
    d_out, d_in = weight.shape
    d_mid = min(d_in, d_out) if d_mid is None else d_mid
    nb = nblocks
    p, q, s = d_in // nb, d_mid // nb, d_out // nb
    w = weight.detach().float().reshape(s, nb, nb, p).permute(1, 2, 0, 3)  # [l, k, si, pp]
    w_left = torch.zeros(nb, s, q, device=weight.device, dtype=torch.float32)
    w_right = torch.zeros(nb, q, p, device=weight.device, dtype=torch.float32)
    for (k, l), ris in _pairs(nb, q).items():
        if not ris:
            continue
        u, sv, vh = torch.linalg.svd(w[l, k], full_matrices=False)
        c = min(len(ris), sv.numel())
        root = sv[:c].sqrt()
        idx = torch.tensor(ris[:c], device=weight.device)
        w_left[l][:, idx] = u[:, :c] * root
        w_right[k][idx * nb + l - k * q] = root[:, None] * vh[:c]
    return w_left.to(weight.dtype), w_right.to(weight.dtype)
