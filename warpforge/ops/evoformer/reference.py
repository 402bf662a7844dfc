"""Evoformer attention in plain PyTorch: what `evoformer_attention` computes (DeepSpeed's DS4Sci_EvoformerAttention
layout), written to be read.

- q, k, v [B, N_seq, N_res, H, D]: for every batch b, MSA row s and head h, attention over the N_res residues.
- biases: up to two tensors broadcastable to [B, N_seq, H, N_res, N_res], added to the scaled scores: typically the
  residue mask as a bias [B, N_seq, 1, 1, N_res] (0 or -inf / a large negative) and the pair bias
  [B, 1, H, N_res, N_res], shared by every MSA row.
- gate: optional [B, N_seq, N_res, H, D]; the output is then sigmoid(gate) · attention.
- Column attention is the same on the transposed MSA, triangle attention the same with the pair representation's
  rows as N_seq (nn/evoformer.py).
A query whose every score is -inf (all keys masked) gets output 0.
"""
from __future__ import annotations

import math

import torch


def evoformer_attention_reference(q, k, v, biases=(), *, gate=None, softmax_scale=None, compute_dtype=torch.float32):
    """out [B, N_seq, N_res, H, D] in q's dtype; differentiable (in compute_dtype)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf = (t.to(compute_dtype) for t in (q, k, v))
    scores = torch.einsum("bsihd,bsjhd->bshij", qf, kf) * scale
    for bias in biases:
        scores = scores + bias.to(compute_dtype)
    dead = torch.isneginf(scores).all(-1, keepdim=True)  # rows whose every key is masked: 0, and no NaN gradient
    probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    out = torch.einsum("bshij,bsjhd->bsihd", probs, vf)
    if gate is not None:
        out = out * torch.sigmoid(gate.to(compute_dtype))
    return out.to(q.dtype)
