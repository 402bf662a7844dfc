"""AlphaFold 2's Evoformer attention modules with OpenFold's parameter names, over `evoformer_attention`:

- `MSARowAttentionWithPairBias(c_m, c_z, c_hidden, no_heads)`: every MSA row attends over its residues, biased by
  a per-head projection of the pair representation (supplement algorithm 7);
- `MSAColumnAttention(c_m, c_hidden, no_heads)`: every residue column attends over the MSA rows (algorithm 8): the
  same op on the transposed MSA;
- `TriangleAttention(c_in, c_hidden, no_heads, starting=True)`: around the starting (or ending) node of the pair
  representation (algorithms 13 and 14): the op with the pair rows as N_seq and the triangle bias.

Each returns the update (no residual added), gated by sigmoid(linear_g(x)), as OpenFold's modules do; its state
dict has OpenFold's keys (layer_norm_m, layer_norm_z, linear_z, mha.linear_{q,k,v,o,g}; `_msa_att.` in front for
the column attention; layer_norm, linear, mha.* for the triangle), so an OpenFold checkpoint's weights load. c_hidden
is the per-head width (OpenFold's too), at most 64. The residue mask (1 keep, 0 drop) becomes OpenFold's additive
bias inf · (mask − 1), in fp32. Leading batch dims may be any (none too).

backend: None, "triton", "reference" (warpforge's op) or "torch" (SDPA with the biases summed into attn_mask: what
a PyTorch user writes). A dict backend picks this op by the key "evoformer". The layer norms and projections are
plain torch.nn, so autocast and weight loading work as usual.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as TF

from ..errors import check_int, check_positive_float, check_tensor, fail
from ..ops.evoformer import MAX_HEAD_DIM, evoformer_attention
from . import functional as F


def _gated_attention(q, k, v, biases, gate, backend: F.Backend):
    """q, k, v, gate [B, S, R, H, D]; biases broadcast to [B, S, H, R, R] -> sigmoid(gate) · attention."""
    b = F.pick(backend, "evoformer")
    if b != F.TORCH:
        return evoformer_attention(q, k, v, biases, gate=gate, backend=b)
    B, S, R, H, D = q.shape
    heads = [t.permute(0, 1, 3, 2, 4).reshape(B * S, H, R, D) for t in (q, k, v)]
    mask = None
    if biases:
        total = biases[0] if len(biases) == 1 else biases[0] + biases[1]  # fp32 with the mask's bias
        if q.dtype == torch.float16 and total.dtype == torch.float32:
            # the mask bias inf · (mask - 1) (-1e9 by default) overflows fp16 to -inf: a fully masked row would
            # get zeros where the reference (scores in fp32, the bias swamping them) averages v evenly. The bias
            # stays fp32, and so do the scores SDPA adds it to (bf16 holds -1e9: there q's dtype is kept)
            heads = [t.float() for t in heads]
        mask = total.expand(B, S, H, R, R).reshape(B * S, H, R, R).to(heads[0].dtype)
    out = TF.scaled_dot_product_attention(*heads, attn_mask=mask).to(q.dtype)
    return out.view(B, S, H, R, D).permute(0, 1, 3, 2, 4) * torch.sigmoid(gate)


class _Attention(nn.Module):
    """OpenFold's gated multi-head attention's parameters: linear_q/k/v (no bias), linear_g (gate), linear_o."""

    def __init__(self, c_in: int, c_hidden: int, no_heads: int):
        super().__init__()
        self.c_hidden, self.no_heads = c_hidden, no_heads
        width = c_hidden * no_heads
        self.linear_q = nn.Linear(c_in, width, bias=False)
        self.linear_k = nn.Linear(c_in, width, bias=False)
        self.linear_v = nn.Linear(c_in, width, bias=False)
        self.linear_o = nn.Linear(width, c_in)
        self.linear_g = nn.Linear(c_in, width)
        with torch.no_grad():  # AlphaFold's initialisation: glorot q/k/v, the gate 1 + 0·x, a zero output
            for lin in (self.linear_q, self.linear_k, self.linear_v):
                nn.init.xavier_uniform_(lin.weight)
            self.linear_g.weight.zero_()
            self.linear_g.bias.fill_(1.0)
            self.linear_o.weight.zero_()
            self.linear_o.bias.zero_()

    def forward(self, x: torch.Tensor, biases: list, backend: F.Backend) -> torch.Tensor:
        """x [B, S, R, c_in] (normalised) -> [B, S, R, c_in]: attention over R for every (b, s)."""
        heads = (self.no_heads, self.c_hidden)
        q, k, v, g = (lin(x).unflatten(-1, heads) for lin in (self.linear_q, self.linear_k, self.linear_v,
                                                                 self.linear_g))
        out = _gated_attention(q, k, v, biases, g, backend)
        return self.linear_o(out.flatten(-2))


def _head_bias(linear: nn.Linear, z: torch.Tensor) -> torch.Tensor:
    """z [B, R, R, c] -> the per-head bias [B, 1, H, R, R] (contiguous over the keys)."""
    return linear(z).permute(0, 3, 1, 2).contiguous().unsqueeze(1)


def _mask_bias(mask, inf: float) -> list:
    """mask [B, S, R] (1 keep, 0 drop) -> [OpenFold's key bias inf · (mask − 1), [B, S, 1, 1, R] fp32]; None (every
    residue kept, a zero bias) -> []."""
    return [] if mask is None else [(inf * (mask.to(torch.float32) - 1.0))[:, :, None, None, :]]


def _check_mask(mask, shape, like: torch.Tensor) -> None:
    if mask is None:
        return
    check_tensor("mask", mask)
    if tuple(mask.shape) != tuple(shape):
        fail("mask", f"shape {tuple(shape)} (the input's without its channels)", tuple(mask.shape))
    if mask.device != like.device:
        fail("mask", f"a tensor on {like.device}", f"a tensor on {mask.device}")
    if mask.dtype.is_complex:
        fail("mask", "a real or bool tensor of 1 (keep) and 0 (drop)", str(mask.dtype))


def _check_input(name: str, x, width: int, weight: torch.Tensor) -> None:
    F.check_input(x, width, weight, name=name)
    if x.dim() < 3:
        fail(name, f"a tensor [*, rows, N_res, {width}]", f"shape {tuple(x.shape)}")


def _check_args(c_in: int, c_hidden: int, no_heads: int, inf: float, c_name: str = "c_in") -> None:
    F.check_size(c_name, c_in)
    check_int("c_hidden", c_hidden, lo=1, hi=MAX_HEAD_DIM, what=f"a per-head width from 1 to {MAX_HEAD_DIM} "
              "(evoformer_attention's head dims)")
    F.check_size("no_heads", no_heads)
    check_positive_float("inf", inf, allow_none=False)


class _MSAAttention(nn.Module):
    """Attention along the rows of an MSA m [*, S, R, c_in], with a pair bias from z [*, R, R, c_z] if pair_bias."""

    def __init__(self, c_in: int, c_hidden: int, no_heads: int, pair_bias: bool = False, c_z: int | None = None,
                 inf: float = 1e9, *, backend: F.Backend = None, c_name: str = "c_in"):
        super().__init__()
        _check_args(c_in, c_hidden, no_heads, inf, c_name)
        if pair_bias:
            F.check_size("c_z", c_z)
        self.c_in, self.c_hidden, self.no_heads, self.pair_bias, self.c_z, self.inf = \
            c_in, c_hidden, no_heads, pair_bias, c_z, float(inf)
        self.backend = F.check_backend(backend)
        self.layer_norm_m = nn.LayerNorm(c_in)
        if pair_bias:
            self.layer_norm_z = nn.LayerNorm(c_z)
            self.linear_z = nn.Linear(c_z, no_heads, bias=False)
            nn.init.normal_(self.linear_z.weight, std=1.0 / math.sqrt(c_z))  # AlphaFold's "normal" init
        self.mha = _Attention(c_in, c_hidden, no_heads)

    def _attend(self, m: torch.Tensor, z: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        """m [*, S, R, c_in] checked; z, mask as forward's."""
        lead, (S, R, C) = m.shape[:-3], m.shape[-3:]
        B = math.prod(lead)
        m = m.reshape(B, S, R, C)
        biases = _mask_bias(None if mask is None else mask.reshape(B, S, R), self.inf)
        if self.pair_bias:
            biases.append(_head_bias(self.linear_z, self.layer_norm_z(z.reshape(B, R, R, self.c_z))))
        out = self.mha(self.layer_norm_m(m), biases, self.backend)
        return out.reshape(*lead, S, R, C)

    def forward(self, m: torch.Tensor, z: torch.Tensor | None = None, mask: torch.Tensor | None = None):
        """m [*, N_seq, N_res, c_in] (and z [*, N_res, N_res, c_z] with the pair bias), mask [*, N_seq, N_res]
        -> the update [*, N_seq, N_res, c_in]."""
        _check_input("m", m, self.c_in, self.layer_norm_m.weight)
        if self.pair_bias:
            if z is None:
                fail("z", f"the pair representation [*, N_res, N_res, {self.c_z}]", None)
            F.check_input(z, self.c_z, self.layer_norm_z.weight, name="z")
            want = (*m.shape[:-3], m.shape[-2], m.shape[-2], self.c_z)
            if tuple(z.shape) != want:
                fail("z", f"shape {want} (m's batch, N_res x N_res)", tuple(z.shape))
        elif z is not None:
            fail("z", "None (this attention has no pair bias)", f"a tensor {tuple(z.shape)}")
        _check_mask(mask, m.shape[:-1], m)
        return self._attend(m, z, mask)

    def extra_repr(self) -> str:
        return (f"c_in={self.c_in}, c_hidden={self.c_hidden}, no_heads={self.no_heads}, "
                f"pair_bias={self.pair_bias}, inf={self.inf:g}")


class MSARowAttentionWithPairBias(_MSAAttention):
    """MSA row attention with the pair bias: m [*, N_seq, N_res, c_m], z [*, N_res, N_res, c_z], mask
    [*, N_seq, N_res] -> the update [*, N_seq, N_res, c_m]."""

    def __init__(self, c_m: int, c_z: int, c_hidden: int, no_heads: int, inf: float = 1e9, *,
                 backend: F.Backend = None):
        super().__init__(c_m, c_hidden, no_heads, pair_bias=True, c_z=c_z, inf=inf, backend=backend, c_name="c_m")

    def forward(self, m: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(m, z, mask)


class MSAColumnAttention(nn.Module):
    """MSA column attention: m [*, N_seq, N_res, c_m], mask [*, N_seq, N_res] -> the update [*, N_seq, N_res, c_m];
    each residue's column attends over the N_seq rows (row attention on the transposed MSA)."""

    def __init__(self, c_m: int, c_hidden: int, no_heads: int, inf: float = 1e9, *, backend: F.Backend = None):
        super().__init__()
        self._msa_att = _MSAAttention(c_m, c_hidden, no_heads, pair_bias=False, inf=inf, backend=backend,
                                      c_name="c_m")

    def forward(self, m: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        _check_input("m", m, self._msa_att.c_in, self._msa_att.layer_norm_m.weight)
        _check_mask(mask, m.shape[:-1], m)
        out = self._msa_att._attend(m.transpose(-2, -3), None, None if mask is None else mask.transpose(-1, -2))
        return out.transpose(-2, -3)


class TriangleAttention(nn.Module):
    """Triangle attention around the starting node (starting=True: each pair row i attends over its j) or the
    ending node (over the columns): x [*, N_res, N_res, c_in], mask [*, N_res, N_res] -> the update, x's shape.
    The bias is a per-head projection of x itself."""

    def __init__(self, c_in: int, c_hidden: int, no_heads: int, starting: bool = True, inf: float = 1e9, *,
                 backend: F.Backend = None):
        super().__init__()
        _check_args(c_in, c_hidden, no_heads, inf)
        if not isinstance(starting, bool):
            fail("starting", "a bool", repr(starting))
        self.c_in, self.c_hidden, self.no_heads, self.starting, self.inf = c_in, c_hidden, no_heads, starting, \
            float(inf)
        self.backend = F.check_backend(backend)
        self.layer_norm = nn.LayerNorm(c_in)
        self.linear = nn.Linear(c_in, no_heads, bias=False)
        nn.init.normal_(self.linear.weight, std=1.0 / math.sqrt(c_in))
        self.mha = _Attention(c_in, c_hidden, no_heads)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        _check_input("x", x, self.c_in, self.layer_norm.weight)
        if x.shape[-2] != x.shape[-3]:
            fail("x", f"a square pair representation [*, N_res, N_res, {self.c_in}]", f"shape {tuple(x.shape)}")
        _check_mask(mask, x.shape[:-1], x)
        if not self.starting:
            x = x.transpose(-2, -3)
            mask = None if mask is None else mask.transpose(-1, -2)
        lead, (I, J, C) = x.shape[:-3], x.shape[-3:]
        B = math.prod(lead)
        x = self.layer_norm(x.reshape(B, I, J, C))
        biases = _mask_bias(None if mask is None else mask.reshape(B, I, J), self.inf) + [_head_bias(self.linear, x)]
        out = self.mha(x, biases, self.backend).reshape(*lead, I, J, C)
        return out if self.starting else out.transpose(-2, -3)

    def extra_repr(self) -> str:
        return (f"c_in={self.c_in}, c_hidden={self.c_hidden}, no_heads={self.no_heads}, starting={self.starting}, "
                f"inf={self.inf:g}")
