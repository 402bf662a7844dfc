"""Quantized latent caches on a bf16 decode kernel: dequantise a slice of requests' pages into a bf16 scratch cache
(page 64, its own dense block table), run the bf16 kernel on it, next slice.

Why: at h_q · s_q >= 64 on sm_90 the bf16 cache runs on the Gluon kernel (decode_gluon_kernel.py), which is
compute-bound there, while the portable kernel dequantises inside its loop at a fifth of that speed (benchmarks/
NOTES.md, MLA). A pass that reads the quantized rows once and writes bf16 rows (656 + 1152 bytes a token for FP8)
costs less than that gap. It is not the FP8 kernel issue 13 asks for (which reads 656 bytes a token, nothing more):
it holds the scratch (at most SCRATCH_BYTES, so long batches run in slices) and moves 2.8x the FP8 bytes. Caches of
page 64 may skip it: the Gluon kernel reads FP8 itself, and FP4 where this pass would run the batch in slices
(api.quantized_in_kernel); this pass serves the rest, and every other page size.

Every format's values come out exact in bf16 (e4m3 or e2m1 times a power of two or an e4m3 scale), except NVFP4's
cache-wide fp32 scale, which is applied before the rounding to bf16 (one rounding, ~2^-9 of a value).
"""
import torch
import triton
import triton.language as tl

from .decode_kernel import _latent_chunk, _rope_block, fp4_words

D_QK = 576                    # a latent row: 512 "nope" values, then 64 rope
SCRATCH_PAGE = 64             # the bf16 kernel's page
SCRATCH_BYTES = 1 << 30       # the scratch cache's ceiling: requests run in slices that fit


@triton.jit
def mla_dequant_pages_kernel(CACHE, BLOCK_TABLE, SEQLENS, KV_SCALE, OUT, req0, row_stride, stride_bt, scratch_pages,
                             capacity, last_page, KV_FMT: tl.constexpr, GROUP: tl.constexpr,
                             SCALE_OFF: tl.constexpr, ROPE_OFF: tl.constexpr, PAGE: tl.constexpr,
                             OUT_PAGE: tl.constexpr, PAGES: tl.constexpr, FP4_WORDS: tl.constexpr = False):
    """Program (i, j): scratch pages p = j · PAGES .. j · PAGES + PAGES - 1 of request req0 + i, each its tokens
    [p · OUT_PAGE, (p + 1) · OUT_PAGE) as bf16 rows of OUT [.., OUT_PAGE, 576] at page i · scratch_pages + p, read
    from the quantized CACHE through the request's block table (any source page size). Pages past the request's
    length (or the table) are left as they are: their loads and stores are masked off."""
    per_request = tl.cdiv(scratch_pages, PAGES)
    i = tl.program_id(0) // per_request
    req = (req0 + i).to(tl.int64)
    length = tl.minimum(tl.maximum(tl.load(SEQLENS + req), 0), capacity)
    if KV_FMT == 2:
        latent_scale = tl.load(KV_SCALE)
    else:
        latent_scale = 1.0
    cols = tl.arange(0, 128)[None, :]
    for k in tl.static_range(PAGES):
        p = (tl.program_id(0) % per_request) * PAGES + k
        tok = p * OUT_PAGE + tl.arange(0, OUT_PAGE)
        end = tl.where((p * OUT_PAGE < length) & (p < scratch_pages), capacity, 0)  # 0: a page left as it is
        tok_ok = tok < end
        page = tl.load(BLOCK_TABLE + req * stride_bt + tok // PAGE, mask=tok_ok, other=0)
        rows64 = tl.minimum(tl.maximum(page, 0), last_page).to(tl.int64) * PAGE + tok % PAGE
        out_rows = OUT + ((i * scratch_pages + p).to(tl.int64) * OUT_PAGE + tl.arange(0, OUT_PAGE))[:, None] * 576
        for c in tl.static_range(4):
            vals, scale = _latent_chunk(CACHE, rows64, tok_ok, row_stride, c, KV_FMT, GROUP, SCALE_OFF, tl.float32,
                                        FP4_WORDS)
            if KV_FMT == 1:
                vals = vals * scale[:, None]
            tl.store(out_rows + c * 128 + cols, (vals * latent_scale).to(tl.bfloat16), mask=tok_ok[:, None])
        rope = _rope_block(CACHE, rows64, tok_ok, row_stride, KV_FMT, ROPE_OFF, 64, tl.bfloat16)
        tl.store(out_rows + 512 + tl.arange(0, 64)[None, :], rope, mask=tok_ok[:, None])


def slice_requests(batch: int, max_tokens: int) -> int:
    """Requests per slice: as many as SCRATCH_BYTES of bf16 pages hold (at least one)."""
    per_request = triton.cdiv(max_tokens, SCRATCH_PAGE) * SCRATCH_PAGE * D_QK * 2
    return max(1, batch if per_request == 0 else min(batch, SCRATCH_BYTES // per_request))


def mla_decode_dequantized(q, kv_cache, block_table, cache_seqlens, kv_scale, fmt, run_bf16, per_slice, cfg):
    """(out, lse) of a quantized-cache decode through run_bf16(q, cache, table, seqlens) -> (out, lse) on bf16
    scratch pages, per_slice requests at a time (slice_requests); cfg a configs.DequantCfg."""
    b = q.shape[0]
    page = kv_cache.shape[1]
    max_tokens = block_table.shape[1] * page
    scratch_pages = triton.cdiv(max_tokens, SCRATCH_PAGE)
    n = max(1, min(per_slice, b))
    scratch = torch.empty((n * scratch_pages, SCRATCH_PAGE, 1, D_QK), device=q.device, dtype=torch.bfloat16)
    table = torch.arange(n * scratch_pages, device=q.device, dtype=torch.int32).view(n, scratch_pages)
    cache = kv_cache.view(torch.uint8)
    # lengths past the table's tokens are clamped as the portable kernel clamps them (the scratch's last page may
    # reach further, and its rows there are never written)
    lens = cache_seqlens.clamp(0, max_tokens)
    if b == 0 or scratch_pages == 0:  # nothing to dequantise: the bf16 kernel's own answer for empty requests
        return run_bf16(q, scratch, table[:b], lens)
    outs, lses = [], []
    for r0 in range(0, b, n):
        r1 = min(r0 + n, b)
        mla_dequant_pages_kernel[((r1 - r0) * triton.cdiv(scratch_pages, cfg.pages),)](
            cache, block_table, cache_seqlens, kv_scale if kv_scale is not None else cache_seqlens, scratch, r0,
            kv_cache.stride(1), block_table.stride(0), scratch_pages, max_tokens, max(kv_cache.shape[0] - 1, 0),
            KV_FMT=fmt.code, GROUP=max(fmt.group, 1), SCALE_OFF=fmt.scale_offset, ROPE_OFF=fmt.rope_offset, PAGE=page,
            OUT_PAGE=SCRATCH_PAGE, PAGES=cfg.pages, num_warps=cfg.warps,
            FP4_WORDS=fp4_words(fmt, cache))
        out, lse = run_bf16(q[r0:r1], scratch, table[: r1 - r0], lens[r0:r1])
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)

