"""Sparse attention cases: warpforge (selection + sparse forward and backward) vs FlexAttention with the same
block mask (its build not counted, as the issue's anchor) and dense cuDNN SDPA.

Shape (the issue's anchor): b 1, 16 query heads, 2 kv heads (GQA 8:1), d 128, blocks of 128, each query block
keeps its own block and its top 16; the index branch has one 32-wide query head per kv head and one key head.
FLOPs count the kept pairs (own block: causal half). Errors: relative L2 of the forward output against the fp32
reference on the first PREFIX query rows of kv head 0's group (causal: those rows see only the prefix, so the
reference on the prefix is exact); the gradients are checked by tests/sparse.
"""
from __future__ import annotations

import torch

from ..ops.sparse import select_blocks, sparse_attention, sparse_attention_index_loss, sparse_attention_reference
from ..ops.sparse.select import blocks_per_sequence, canonical
from ..testing import rel_l2
from . import baselines
from .cases import Rotation, Setup, peak_memory, register

PREFIX = 2048
H_Q, H_KV, D, D_INDEX, BLOCK, TOPK = 16, 2, 128, 32, 128, 16


def _kept_pairs(n_sel: torch.Tensor, s: int, block: int) -> int:
    """Query-key pairs the kernels compute: every selected block whole, the own block's causal half."""
    own = (s // block) * block * (block + 1) // 2 + (s % block) * (s % block + 1) // 2
    return int(n_sel.sum()) * block * block + own * n_sel.shape[1]


def _flex_mask(sel, n_sel, h_q, s, device):
    """Flex's BlockMask for the same pattern: the selected blocks as full blocks, the own block causal."""
    from torch.nn.attention.flex_attention import BlockMask
    group = h_q // sel.shape[1]
    nb = sel.shape[2]
    full_idx = torch.where(sel >= 0, sel, 0).repeat_interleave(group, 1)
    pad = torch.zeros(*full_idx.shape[:3], nb - full_idx.shape[3], dtype=torch.int32, device=device) \
        if nb > full_idx.shape[3] else None
    full_idx = torch.cat([full_idx, pad], -1) if pad is not None else full_idx[..., :nb]
    own = torch.arange(nb, device=device, dtype=torch.int32).view(1, 1, nb, 1).expand(1, h_q, nb, nb).contiguous()
    return BlockMask.from_kv_blocks(
        torch.ones(1, h_q, nb, device=device, dtype=torch.int32), own,
        n_sel.repeat_interleave(group, 1).contiguous(), full_idx.contiguous(), BLOCK_SIZE=BLOCK,
        mask_mod=lambda b, h, q, kv: q >= kv, seq_lengths=(s, s))


def sparse_setup(device, tiny, *, s, baselines_at, loss=False):
    h_q, h_kv, d, d_i, block, topk = H_Q, H_KV, D, D_INDEX, BLOCK, TOPK
    if tiny:
        s, h_q, h_kv, d, d_i, block, topk = 200, 4, 2, 32, 16, 32, 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    backend = None if device.type == "cuda" else "triton"

    def make_set():
        st = {"q": torch.randn(1, s, h_q, d, device=device, dtype=dtype),
              "k": torch.randn(1, s, h_kv, d, device=device, dtype=dtype),
              "v": torch.randn(1, s, h_kv, d, device=device, dtype=dtype),
              "iq": torch.randn(1, s, h_kv, d_i, device=device, dtype=dtype),
              "ik": torch.randn(1, s, 1, d_i, device=device, dtype=dtype)}
        st["do"] = torch.randn_like(st["q"])
        for key in ("q", "k", "v", "iq", "ik"):
            st[key].requires_grad_()
        return st

    set_bytes = 2.0 * s * (3 * h_q * d + 2 * h_kv * d + (h_kv + 1) * d_i)
    rot = Rotation(make_set, set_bytes, device)
    st0 = rot.sets[0]
    idx0 = select_blocks(st0["iq"].detach(), st0["ik"].detach(), block_size=block, topk=topk, backend=backend)
    sel0, n_sel0 = canonical(idx0, blocks_per_sequence(None, 1, s, block, device), True)
    pairs = _kept_pairs(n_sel0, s, block) * (h_q // h_kv)
    flops = 4.0 * d * pairs * 3.5
    nbytes = set_bytes * 2.5

    def ours():
        st = rot()
        if not loss:
            out, idx = sparse_attention(st["q"], st["k"], st["v"], index_q=st["iq"], index_k=st["ik"],
                                        block_size=block, topk=topk, return_indices=True, backend=backend)
            grads = torch.autograd.grad(out, (st["q"], st["k"], st["v"]), st["do"])
            return out, grads
        out, lse, idx = sparse_attention(st["q"], st["k"], st["v"], index_q=st["iq"], index_k=st["ik"],
                                         block_size=block, topk=topk, return_lse=True, return_indices=True,
                                         backend=backend)
        aux = sparse_attention_index_loss(st["q"], st["k"], lse, st["iq"], st["ik"], idx, block_size=block,
                                          backend=backend)
        grads = torch.autograd.grad((out, aux), (st["q"], st["k"], st["v"], st["iq"], st["ik"]),
                                    (st["do"], torch.ones_like(aux)))
        return out, grads

    impls = {"warpforge" + (" +index loss" if loss else ""): ours}
    if device.type == "cuda" and not loss:
        def bhsd(t):
            return t.detach().transpose(1, 2).contiguous().requires_grad_()
        views = [{key: bhsd(st[key]) for key in ("q", "k", "v", "do")} for st in rot.sets]
        mask = _flex_mask(sel0, n_sel0, h_q, s, device)

        def flex():
            rot()
            st = views[(rot.i - 1) % len(views)]
            out = baselines.flex_attention()(st["q"], st["k"], st["v"], block_mask=mask, enable_gqa=True)
            grads = torch.autograd.grad(out, (st["q"], st["k"], st["v"]), st["do"])
            return out.transpose(1, 2), grads
        impls["flex"] = flex
        if s <= baselines_at:
            def dense():
                st = rot()
                group = h_q // h_kv  # cuDNN takes MHA: kv expanded inside the step (small beside s² attention)
                q, k, v = (t.transpose(1, 2) for t in (st["q"], st["k"].repeat_interleave(group, 2),
                                                       st["v"].repeat_interleave(group, 2)))
                out = baselines.sdpa("CUDNN_ATTENTION")(q, k, v, True)
                grads = torch.autograd.grad(out, (st["q"], st["k"], st["v"]), st["do"].transpose(1, 2))
                return out.transpose(1, 2), grads
            impls["cudnn dense"] = dense

    prefix = min(PREFIX, s)
    reference = {}

    def score(result):
        out = result[0]
        if "ref" not in reference:
            g = h_q // h_kv
            q, k, v = (st0[key].detach()[:, :prefix, sl].float() for key, sl in
                       (("q", slice(0, g)), ("k", slice(0, 1)), ("v", slice(0, 1))))
            reference["ref"] = sparse_attention_reference(q, k, v, idx0[:, :1, :-(-prefix // block)],
                                                          block_size=block)[0]
        return rel_l2(out[:, :prefix, :h_q // h_kv].float(), reference["ref"])

    ran = f"b1 s{s} h{h_q}/{h_kv} d{d} block {block} top{topk} index d{d_i} {str(dtype).replace('torch.', '')}"
    if device.type == "cuda":
        ran += peak_memory(impls, rot, device)
    return Setup(flops=flops, bytes=nbytes, impls=impls, score=score, reset=rot.reset, ran=ran, tokens=s)


for _s, _label, _quick in ((16384, "16k", True), (65536, "64k", False), (131072, "128k", False)):
    register("sparse", f"fwd+bwd s{_label} top16 of 128-blocks GQA 8:1, selection included", quick=_quick)(
        lambda dev, tiny, s=_s: sparse_setup(dev, tiny, s=s, baselines_at=65536))
register("sparse", "fwd+bwd s64k with the index loss")(
    lambda dev, tiny: sparse_setup(dev, tiny, s=65536, baselines_at=0, loss=True))
register("sparse", "fwd+bwd s1M (1048576 tokens), selection included")(
    lambda dev, tiny: sparse_setup(dev, tiny, s=1 << 20, baselines_at=0))
