"""MLA decode cases: FlashMLA's benchmark shapes (b 128, s_q 1, page 64, cache_seqlens = L + 2i).

Ours is timed as a replayed CUDA graph of the decode call (how serving runs decode).
Baseline: the plain-PyTorch path a serving stack without a fused kernel runs: gather the pages into a
dense [b, L_max, 576] tensor (the token-row index is built once, outside the timing), two batched matmuls
and a masked fp32 softmax.
"""
from __future__ import annotations

import math

import torch

from ..ops.mla import D_QK, D_V, KV_FORMATS, mla_decode, mla_decode_reference, nvfp4_tensor_scale, quantize_kv
from ..testing import cosine
from . import baselines
from .cases import Rotation, Setup, graphed, register

PAGE = 64


def mla_setup(device, tiny, *, L, h_q, fmt, b=128, s_q=1):
    if tiny:
        b, L, h_q = 2, 40, 16
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    page = PAGE if not tiny else 16
    lens = [L + 2 * i for i in range(b)]
    max_pages = -(-max(lens) // page)
    row_bytes = KV_FORMATS[fmt].row_bytes
    tokens = sum(lens)
    nbytes = tokens * row_bytes + b * s_q * h_q * (D_QK + D_V) * 2
    flops = 2.0 * h_q * s_q * tokens * (D_QK + D_V)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = 1 / math.sqrt(D_QK)
    # nvfp4's cache-wide scale, fixed up front as a server would (randn latents: amax about 5)
    kv_scale = nvfp4_tensor_scale(torch.full((1, D_QK), 6.0, device=device)) if fmt == "nvfp4" else None

    def make_set():
        q = torch.randn(b, s_q, h_q, D_QK, device=device, dtype=dtype)
        cache = quantize_kv(torch.randn(b * max_pages, page, 1, D_QK, device=device, dtype=dtype), fmt, kv_scale)
        table = torch.randperm(b * max_pages, device=device).view(b, max_pages).int()
        st = dict(q=q, cache=cache, table=table)
        if fmt == "bf16" and device.type == "cuda":
            t = torch.arange(max_pages * page, device=device)
            st["rows"] = (table.long()[:, t // page] * page + t % page)  # [b, L_max] cache rows
        return st

    rot = Rotation(make_set, tokens * row_bytes, device)

    def decode(st):
        return mla_decode(st["q"], st["cache"], st["table"], seqlens, softmax_scale=scale, kv_format=fmt,
                          kv_scale=kv_scale, backend="triton")[0]

    ours = graphed(decode, rot, device)  # decode is served from CUDA graphs
    impls = {"warpforge": ours}
    if fmt == "bf16" and device.type == "cuda":
        def torch_path():
            st = rot()
            return baselines.gathered_mla_decode(st["q"], st["cache"], st["rows"], seqlens, scale)
        impls["torch"] = torch_path

    reference = {}

    def score(out):
        if "ref" not in reference:
            st = rot.sets[0]
            cache = st["cache"].float() if fmt == "bf16" else st["cache"]
            reference["ref"] = mla_decode_reference(st["q"].float(), cache, st["table"], seqlens,
                                                    softmax_scale=scale, kv_format=fmt, kv_scale=kv_scale)[0]
        return 1 - cosine(out, reference["ref"])

    return Setup(flops=flops, bytes=nbytes, impls=impls, score=score, reset=rot.reset, err_kind="1-cos", tol=1e-5,
                 ran=f"b{b} h{h_q} s_q{s_q} L{L} page {page} {fmt}")


def mla_sparse_setup(device, tiny, *, b=128, s_q=2, h_q=128, topk=2048, fmt="fp8", pool_tokens=65536):
    """Token-level sparse decode (DeepSeek-V3.2 style): each query position reads `topk` slots of a pool."""
    if tiny:
        b, s_q, h_q, topk, pool_tokens = 2, 2, 16, 40, 256
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    page = PAGE if not tiny else 16
    row_bytes = KV_FORMATS[fmt].row_bytes
    reads = b * s_q * topk
    nbytes = reads * row_bytes + b * s_q * h_q * (D_QK + D_V) * 2
    flops = 2.0 * h_q * reads * (D_QK + D_V)
    scale = 1 / math.sqrt(D_QK)

    def make_set():
        q = torch.randn(b, s_q, h_q, D_QK, device=device, dtype=dtype)
        cache = quantize_kv(torch.randn(pool_tokens // page, page, 1, D_QK, device=device, dtype=dtype), fmt)
        idx = torch.randint(0, pool_tokens, (b, s_q, topk), device=device, dtype=torch.int32)
        return dict(q=q, cache=cache, idx=idx)

    rot = Rotation(make_set, pool_tokens * row_bytes, device)

    def decode(st):
        return mla_decode(st["q"], st["cache"], None, None, softmax_scale=scale, kv_format=fmt, indices=st["idx"],
                          backend="triton")[0]

    ours = graphed(decode, rot, device)

    reference = {}

    def score(out):
        if "ref" not in reference:
            st = rot.sets[0]
            cache = st["cache"].float() if fmt == "bf16" else st["cache"]
            reference["ref"] = mla_decode_reference(st["q"][:4].float(), cache, None, None, softmax_scale=scale,
                                                    kv_format=fmt, indices=st["idx"][:4])[0]
        return 1 - cosine(out[:4], reference["ref"])

    return Setup(flops=flops, bytes=nbytes, impls={"warpforge": ours}, score=score, reset=rot.reset,
                 err_kind="1-cos", tol=1e-5, ran=f"b{b} h{h_q} s_q{s_q} topk {topk} of {pool_tokens} {fmt}")


def _register():
    register("mla", "sparse b128 h128 s_q2 topk2048 fp8", quick=True)(
        lambda dev, tiny: mla_sparse_setup(dev, tiny))
    for h_q in (16, 128):
        for fmt in ("bf16", "fp8", "nvfp4", "mxfp4"):
            for L in (1024, 2048, 4096, 8192, 16384, 32768):
                register("mla", f"b128 h{h_q} s_q1 L{L // 1024}k {fmt}", quick=(L == 8192 and (h_q == 16 or fmt == "bf16")),
                         h_q=h_q, fmt=fmt, L=L)(
                    lambda dev, tiny, L=L, h_q=h_q, fmt=fmt: mla_setup(dev, tiny, L=L, h_q=h_q, fmt=fmt))


_register()
