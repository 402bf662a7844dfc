"""Evoformer attention cases (issue 16's bar): AlphaFold's MSA row attention with the pair bias and the gate
(N_seq 512, N_res 384, 8 heads x 32), the extra-MSA stack's (N_seq 5120, N_res 384, 8 heads x 8) and triangle
attention (the 384 pair rows as N_seq, 4 heads x 32, the triangle bias), bf16, forward and forward+backward (the
gradients of q, k, v, the gate and the pair bias).

Every case carries OpenFold's two biases: the residue mask as a key bias [B, N_seq, 1, 1, N_res] (-1e9, its inf, on
the last N_res/16 residues, padding) and the pair bias [B, 1, H, N_res, N_res]. Baselines, each given its preferred
layout ([B · N_seq, H, N_res, D] contiguous) built from the same data outside the timing:
- "flex": FlexAttention with both biases added in score_mod (the pair bias learnable: its gradient comes from
  flex's backward); head dims below 16 (flex's minimum) zero-padded to 16;
- "sdpa": scaled_dot_product_attention with the biases summed into attn_mask (materialised [B · N_seq, H, R, R],
  inside the timing, as a user must each step);
- "torch": eager PyTorch, OpenFold's own math (scores, softmax, @ v in bf16).
The gate (sigmoid(gate) · out) is applied by each.

Peak extra memory: the bench framework (Setup / runner rows) has no memory column, so on a GPU each impl's peak
allocation above what was allocated before its call (outputs and gradients included) is measured once here, after
a warm-up call, and written into the case's `ran` text ("peak MiB ...").

Scored against the fp32 reference (rows of N_seq in chunks, so the extra-MSA scores never exist at once): the output
and dq, dk, dv, dgate on the first MSA rows, the pair bias's gradient (a sum over every row) in full; the error is the
largest rel L2.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ops.evoformer import evoformer_attention, evoformer_attention_reference
from ..testing import rel_l2
from . import baselines
from .cases import Rotation, Setup, peak_memory, register

SCORED_ROWS = 64  # MSA rows whose output and q/k/v/gate gradients are scored (the pair gradient: all rows)
REF_CHUNK = 256   # MSA rows per fp32 reference chunk
MASK_INF = 1e9    # OpenFold's inf: its mask bias is inf · (mask - 1)
FLEX_MIN_D = 16   # FlexAttention's smallest head dim


def _eager(q, k, v, g, pair, mask, shape, scale):
    """OpenFold's math on [B · S, H, R, D] inputs: softmax(q · kᵀ · scale + mask + pair) · v, gated."""
    B, S, H, R, D = shape
    q5, k5, v5, g5 = (t.view(B, S, H, R, D) for t in (q, k, v, g))
    scores = (q5 * scale) @ k5.transpose(-1, -2) + mask.view(B, S, 1, 1, R) + pair.view(B, 1, H, R, R)
    return (torch.softmax(scores, dim=-1) @ v5 * torch.sigmoid(g5)).view(B * S, H, R, D)


def _sdpa(q, k, v, g, pair, mask, shape, scale):
    """SDPA with the two biases summed into attn_mask [B · S, H, R, R] (materialised)."""
    B, S, H, R, D = shape
    bias = (mask.view(B, S, 1, 1, R) + pair.view(B, 1, H, R, R)).view(B * S, H, R, R)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale) * torch.sigmoid(g)


def _flex(q, k, v, g, pair, mask, shape, scale):
    """FlexAttention, the biases in score_mod (batch index b = (batch, MSA row)); q, k, v padded to FLEX_MIN_D."""
    B, S, H, R, D = shape
    pair = pair.view(B, H, R, R)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + pair[b // S, h, q_idx, kv_idx] + mask[b, kv_idx]

    out = baselines.flex_attention()(q, k, v, score_mod=score_mod, scale=scale)
    return out[..., :D] * torch.sigmoid(g)


def evoformer_setup(device, tiny, *, S, R, H, D, backward, B=1):
    if tiny:  # interpreter sizes: N_res crosses the 16-residue tiles
        S, R, H = 3, 37, 2
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float16
    scale = 1.0 / math.sqrt(D)
    shape = (B, S, H, R, D)
    pad = max(1, R // 16)
    elems = B * S * R * H * D
    pair_elems = B * H * R * R
    fwd_flops = 4.0 * B * S * H * R * R * D
    flops = fwd_flops * (3.5 if backward else 1.0)
    # fwd: q, k, v, gate in, out; bwd: those and do, out in, dq, dk, dv, dgate; the pair bias (and its gradient)
    nbytes = 2.0 * ((15 if backward else 5) * elems + (3 if backward else 1) * pair_elems + B * S * R)
    d_flex = max(D, FLEX_MIN_D)

    def make_set():
        st = {name: torch.randn(B, S, R, H, D, device=device, dtype=dtype) for name in ("q", "k", "v", "g", "do")}
        mask = torch.zeros(B, S, 1, 1, R, device=device, dtype=dtype)
        mask[..., R - pad:] = -MASK_INF
        st.update(mask=mask, pair=torch.randn(B, 1, H, R, R, device=device, dtype=dtype))
        # the baselines' layout, [B · S, H, R, D]; the biases as [B · S, R] and their own pair leaf
        for name in ("q", "k", "v", "g", "do"):
            st[name + "_t"] = st[name].permute(0, 1, 3, 2, 4).reshape(B * S, H, R, D).contiguous()
        st.update(mask_t=mask.view(B * S, R).clone(), pair_t=st["pair"].detach().clone())
        leaves = ["q", "k", "v", "g", "pair", "q_t", "k_t", "v_t", "g_t", "pair_t"]
        if on_gpu:  # flex's inputs: the baseline layout, zero-padded to its smallest head dim
            for name in ("q", "k", "v"):
                st[name + "_f"] = F.pad(st[name + "_t"], (0, d_flex - D)) if d_flex != D else st[name + "_t"]
            leaves += ["q_f", "k_f", "v_f"] if d_flex != D else []
        for name in leaves:
            st[name].requires_grad_(backward)
        return st

    rot = Rotation(make_set, 2.0 * (6 * elems + pair_elems), device)

    def ours(st):
        return evoformer_attention(st["q"], st["k"], st["v"], [st["mask"], st["pair"]], gate=st["g"],
                                   backend="triton")

    def run(fn, leaves, layout, to_canonical):
        def step():
            st = rot()
            if not backward:
                with torch.no_grad():
                    return to_canonical(fn(st))
            out = fn(st)
            grads = torch.autograd.grad(out, [st[key] for key in leaves], st["do" + layout])
            return tuple(to_canonical(t) for t in (out, *grads[:4])) + (grads[4],)
        return step

    def back(t):  # [B · S, H, R, d >= D] -> [B, S, R, H, D] (a view)
        return t[..., :D].unflatten(0, (B, S)).transpose(2, 3)

    impls = {"warpforge": run(ours, ("q", "k", "v", "g", "pair"), "", lambda t: t)}
    base_leaves = ("q_t", "k_t", "v_t", "g_t", "pair_t")
    if on_gpu:
        impls["flex"] = run(lambda st: _flex(st["q_f"], st["k_f"], st["v_f"], st["g_t"], st["pair_t"],
                                             st["mask_t"], shape, scale),
                            ("q_f", "k_f", "v_f", "g_t", "pair_t"), "_t", back)
    impls["sdpa"] = run(lambda st: _sdpa(st["q_t"], st["k_t"], st["v_t"], st["g_t"], st["pair_t"], st["mask_t"],
                                         shape, scale), base_leaves, "_t", back)
    impls["torch"] = run(lambda st: _eager(st["q_t"], st["k_t"], st["v_t"], st["g_t"], st["pair_t"],
                                           st["mask_t"], shape, scale), base_leaves, "_t", back)

    reference = {}

    def score(result):
        if "ref" not in reference:
            reference["ref"] = _reference(rot.sets[0], backward, min(S, SCORED_ROWS))
        result = result if isinstance(result, tuple) else (result,)
        rows = min(S, SCORED_ROWS)
        errs = []
        for got, want in zip(result, reference["ref"]):
            got = got if got.shape == want.shape else got[:, :rows]
            errs.append(rel_l2(got.reshape(want.shape), want))
        return max(errs)

    peaks = peak_memory(impls, rot, device) if on_gpu else ""
    ran = f"b{B} s{S} r{R} h{H} d{D} {str(dtype).replace('torch.', '')}" + peaks
    return Setup(flops=flops, bytes=nbytes, impls=impls, score=score, reset=rot.reset,
                 tol=2e-2 if backward else 1e-2, ran=ran)


def _reference(st, backward, rows):
    """fp32: out (and dq, dk, dv, dgate) on the first `rows` MSA rows; dpair summed over all rows, in chunks."""
    def part(s0, s1, grad):
        ins = [st[name][:, s0:s1].detach().float().requires_grad_(grad) for name in ("q", "k", "v", "g")]
        return ins
    if not backward:
        q, k, v, g = part(0, rows, False)
        out = evoformer_attention_reference(q, k, v, [st["mask"][:, :rows].float(), st["pair"].detach().float()],
                                            gate=g)
        return (out,)
    pair = st["pair"].detach().float().requires_grad_()
    dpair = torch.zeros_like(pair)
    first = None
    S = st["q"].shape[1]
    for s0 in range(0, S, REF_CHUNK):
        s1 = min(S, s0 + REF_CHUNK)
        ins = part(s0, s1, True)
        out = evoformer_attention_reference(*ins[:3], [st["mask"][:, s0:s1].float(), pair], gate=ins[3])
        grads = torch.autograd.grad(out, ins + [pair], st["do"][:, s0:s1].float())
        dpair += grads[4]
        if first is None:
            first = tuple(t[:, :rows].detach() for t in (out, *grads[:4]))
        del out, grads
    return (*first, dpair)


def _register():
    cases = [("row", "s512 r384 h8 d32 pair bias+gate", dict(S=512, R=384, H=8, D=32), (True, True)),
             ("extra-msa", "s5120 r384 h8 d8 pair bias+gate", dict(S=5120, R=384, H=8, D=8), (False, True)),
             ("triangle", "r384 h4 d32 triangle bias+gate", dict(S=384, R=384, H=4, D=32), (False, True))]
    for kind, label, dims, quick in cases:
        for backward in (False, True):
            mode = "fwd+bwd" if backward else "fwd"
            register("evoformer", f"{kind} {mode} {label}", quick=quick[backward])(
                lambda dev, tiny, dims=dims, bw=backward: evoformer_setup(dev, tiny, backward=bw, **dims))


_register()
