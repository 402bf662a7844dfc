"""Paged GQA decode cases (issue 18's bar): Llama-3-8B attention heads (h_q 32, h_kv 8, d 128), b 64, page 16,
s_q 1, every request at L tokens (L 1k / 4k / 16k), the pages shuffled.

Ours is a plan made once and its run() replayed from CUDA graphs (how serving runs decode). Baselines, plain
PyTorch, replayed from graphs too: "gather+sdpa" gathers each request's pages into [b, L, h_kv, d] (the page
index is built once, outside the timing) and calls F.scaled_dot_product_attention on the [b, h_kv, L, d] view
with enable_gqa (what a serving stack without a paged kernel runs); "sdpa-contiguous" is the same SDPA call on a
cache that is already contiguous per request (no paging at all: the floor a paged kernel is held to).
Quantised caches (FP8 per-tensor scale, NVFP4, MXFP4) at L 4k and 16k, ours only; the FP4 formats in both layouts
(kv_format.py): rows of values then block scales ("warpforge nvfp4"), and the same bytes as FlashInfer's pair of
tensors ("warpforge nvfp4 split"; an NVFP4 pair takes the portable kernel unless configs.GLUON_NVFP4_PAIR_ENV is set,
session 42).

Scored as 1 - cos against the fp32 reference on the unquantised cache (the bf16 values; for the quantised
formats the values before quantisation), request 0. bytes: the K and V bytes read (the floor of a decode step).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ops.paged import KV_FORMATS, paged_decode_reference, plan, quantize_kv
from ..ops.paged.kv_format import split_fp4
from ..testing import cosine
from .cases import Rotation, Setup, graphed, register

H_Q, H_KV, D, PAGE = 32, 8, 128, 16
# 1 - cos at which an output counts as wrong: bf16 rounding is ~1e-6; the quantised formats' own error on random
# normal K/V is ~7e-4 (FP8 e4m3: the bar is cos >= 0.999), ~1e-2 (NVFP4) and ~1.3e-2 (MXFP4) against the
# unquantised values (tests/paged: END_TO_END), so these bounds catch a wrong kernel, not the format's rounding.
TOL = {"bf16": 1e-5, "fp8": 2e-3, "nvfp4": 2e-2, "mxfp4": 2.5e-2}
# per-tensor scales fixed up front, as a server calibrates them (random normal values: amax about 6.1 at 16k)
AMAX = 8.0
QUANTIZE_PAGES = 4096  # pages quantised at a time (FP4's quantiser holds ~40 B per value in flight)


def paged_setup(device, tiny, *, L, fmt, b=64, s_q=1):
    h_q, h_kv, d, page = H_Q, H_KV, D, PAGE
    if tiny:  # interpreter sizes: crosses pages (L not a multiple of them) and the kernel's 16-row tiles
        b, L, h_q, h_kv, d = 2, 37, 8, 2, 64
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float16
    values_fmt = "bf16" if on_gpu else "fp16"
    kv_format = values_fmt if fmt == "bf16" else fmt
    width = KV_FORMATS[kv_format].width(d)
    row_bytes = width * (1 if KV_FORMATS[kv_format].quantized else 2)
    max_pages = -(-L // page)
    num_pages = b * max_pages
    kv_bytes = 2.0 * b * L * h_kv * row_bytes
    flops = 4.0 * b * s_q * h_q * L * d
    seqlens = torch.full((b,), L, dtype=torch.int32, device=device)
    scale = 1.0 / math.sqrt(d)
    kv_scale = None
    if fmt == "fp8":
        kv_scale = torch.full((1,), AMAX / 448.0, device=device)
    elif fmt == "nvfp4":
        kv_scale = torch.full((1,), AMAX / (6.0 * 448.0), device=device)
    baselines = fmt == "bf16"
    split = KV_FORMATS[kv_format].fp4   # the FP4 formats run in both layouts
    made = []

    def to_cache(vals):
        if fmt == "bf16":
            return vals
        cache = torch.empty(num_pages, page, h_kv, width, device=device, dtype=KV_FORMATS[fmt].storage)
        for p0 in range(0, num_pages, QUANTIZE_PAGES):
            cache[p0:p0 + QUANTIZE_PAGES] = quantize_kv(vals[p0:p0 + QUANTIZE_PAGES], fmt, scale=kv_scale)[0]
        return cache

    def make_set():
        q = torch.randn(b, s_q, h_q, d, device=device, dtype=dtype)
        table = torch.randperm(num_pages, device=device).view(b, max_pages).int()
        st = dict(q=q, table=table)
        for name in ("k", "v"):
            vals = torch.randn(num_pages, page, h_kv, d, device=device, dtype=dtype)
            if not made:  # set 0: request 0's pages, unquantised, for the reference
                st[f"{name}0"] = vals[table[0].long()].float()
            if baselines:
                st[f"{name}_bhld"] = vals[table.long()].flatten(1, 2)[:, :L].transpose(1, 2).contiguous()
            st[name] = to_cache(vals)
            if split:
                st[f"{name}_split"] = tuple(t.contiguous() for t in split_fp4(st[name], d))
            del vals
        if baselines:
            st["table_long"] = table.long()
        made.append(True)
        return st

    rot = Rotation(make_set, kv_bytes * (2 if baselines or split else 1), device)
    the_plan = plan(rot.sets[0]["q"], rot.sets[0]["k"], rot.sets[0]["table"], kv_format=kv_format,
                    softmax_scale=scale)

    def decode(st, layout=""):
        return the_plan.run(st["q"], st["k" + layout], st["v" + layout], st["table"], seqlens, k_scale=kv_scale,
                            v_scale=kv_scale, backend="triton")

    impls = {"warpforge" if fmt == "bf16" else f"warpforge {fmt}": graphed(decode, rot, device)}
    if split:
        impls[f"warpforge {fmt} split"] = graphed(lambda st: decode(st, "_split"), rot, device)
    if baselines:
        def sdpa(q, k, v):  # q [b, s_q, h_q, d]; k, v [b, h_kv, L, d] (any strides, last dim contiguous)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, scale=scale, enable_gqa=h_q != h_kv)
            return out.transpose(1, 2)

        def gather_sdpa(st):
            k, v = (st[name][st["table_long"]].flatten(1, 2)[:, :L].transpose(1, 2) for name in ("k", "v"))
            return sdpa(st["q"], k, v)

        impls["gather+sdpa"] = graphed(gather_sdpa, rot, device)
        impls["sdpa-contiguous"] = graphed(lambda st: sdpa(st["q"], st["k_bhld"], st["v_bhld"]), rot, device)

    reference = {}

    def score(out):
        if "ref" not in reference:
            st = rot.sets[0]
            local = torch.arange(max_pages, dtype=torch.int32, device=device)[None]
            reference["ref"] = paged_decode_reference(st["q"][:1].float(), st["k0"], st["v0"], local, seqlens[:1],
                                                      softmax_scale=scale, kv_format="fp32")[0]
        return 1.0 - cosine(out[:1], reference["ref"])

    return Setup(flops=flops, bytes=kv_bytes, impls=impls, score=score, reset=rot.reset, err_kind="1-cos",
                 tol=TOL[fmt], tokens=b * s_q,
                 ran=f"b{b} h{h_q}/kv{h_kv} d{d} page {page} L{L} {kv_format} cache, {values_fmt} q")


def _register():
    for fmt, lengths in (("bf16", (1024, 4096, 16384)), ("fp8", (4096, 16384)), ("nvfp4", (4096, 16384)),
                         ("mxfp4", (4096, 16384))):
        for L in lengths:
            register("paged", f"b64 h32/kv8 d128 page16 L{L // 1024}k {fmt}", quick=(fmt == "bf16" and L == 4096),
                     fmt=fmt, L=L)(lambda dev, tiny, L=L, fmt=fmt: paged_setup(dev, tiny, L=L, fmt=fmt))


_register()
