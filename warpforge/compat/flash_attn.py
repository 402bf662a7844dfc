"""flash-attn 2's calls on warpforge: `import warpforge.compat.flash_attn as flash_attn` and call sites run unchanged.

`flash_attn_func`, `flash_attn_varlen_func`, the qkv- and kv-packed forms of both, and `flash_attn_with_kvcache`,
with flash-attn's positional order, defaults and returns: `out`, or with return_attn_probs=True `(out, softmax_lse,
None)` (lse fp32 [b, h_q, s_q], varlen [h_q, total_q]; no attention probabilities); `flash_attn_with_kvcache`
returns `out` or `(out, softmax_lse)`. flash-attn's conventions hold here, not warpforge.flash_attention's:
softcap 0.0 is off, head dims that are not a multiple of 8 are zero-padded (as flash-attn does), and a query that
sees no key gets out 0 and lse +inf.

Where it runs: the dense and varlen calls through `warpforge.flash_attention` (autograd included);
`flash_attn_varlen_func(..., block_table=)` gathers the paged K/V into packed sequences first (a copy; forward and
backward to q). `flash_attn_with_kvcache` appends k/v into the caches in place, then runs `paged_decode` when it
can (s_q <= paged.MAX_S_Q, a head dim paged takes shared by K and V, causal or one query, no ALiBi; a contiguous
cache is read as pages through an identity block table, no copy), else `flash_attention` over the caches' tokens
gathered per cache_seqlens (one host read of the lengths). It has no backward, as in flash-attn.

Refused with a WarpforgeInputError naming the argument: dropout_p != 0, rotary_cos / rotary_sin (no rotary inside
the call: rotate q and k first, e.g. with warpforge.apply_rope), cache_leftpad, cache_batch_idx with a block_table
(flash-attn refuses that too).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import (check_bool, check_dtype, check_int, check_last_dim_contiguous, check_rank, check_same_device,
                      check_same_dtype, check_tensor, fail, host_reads_allowed)
from ..ops import paged
from ..ops.attention import flash_attention


# ------------------------------------------------------------------------------------------ arguments
def _check_dropout(dropout_p) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        fail("dropout_p", "0.0 (warpforge's attention has no dropout; flash-attn also wants 0.0 in evaluation)",
             repr(dropout_p))


def _softcap(softcap):
    """flash-attn's softcap (0.0: off) as warpforge's (None: off)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0:
        fail("softcap", "a float >= 0 (0.0: off)", repr(softcap))
    return float(softcap) if softcap > 0 else None


def _window(window_size) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or \
            not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size):
        fail("window_size", "(left, right) ints, each >= 0 or -1 for unbounded", repr(window_size))
    return int(window_size[0]), int(window_size[1])


def _max_seqlen(value):
    """An int; a one-element integer tensor (some callers keep it on the device) is read once."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() and \
            value.dtype != torch.bool:
        return int(value.item())
    return value


def _lse(lse: torch.Tensor) -> torch.Tensor:
    """flash-attn's lse of a query that sees no key is +inf (warpforge's is -inf)."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def _pad8(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[-1] % 8
    return F.pad(t, (0, pad)) if pad else t


# --------------------------------------------------------------------------------------------- core
def _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    _check_dropout(dropout_p)
    check_bool("return_attn_probs", return_attn_probs)
    window = _window(window_size)
    cap = _softcap(softcap)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    d, d_v = q.shape[-1], v.shape[-1]
    if softmax_scale is None:  # of the head dim as given, before any padding
        softmax_scale = 1.0 / math.sqrt(d) if d > 0 else None
    out, lse = flash_attention(_pad8(q), _pad8(k), _pad8(v), causal=causal, softmax_scale=softmax_scale,
                               window=window, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softcap=cap,
                               alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=True)
    if out.shape[-1] != d_v:
        out = out[..., :d_v]
    return (out, _lse(lse), None) if return_attn_probs else out


def _unpack(name, t, rank, dim, count):
    check_tensor(name, t)
    check_rank(name, t, rank)
    if t.shape[dim] != count:
        fail(name, f"size {count} in dim {dim} ({'q, k, v' if count == 3 else 'k, v'} stacked)",
             f"shape {tuple(t.shape)}")
    return t.unbind(dim)


# ------------------------------------------------------------------------------------------ public
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q [b, s_q, h_q, d], k [b, s_k, h_kv, d], v [b, s_k, h_kv, d_v] -> out [b, s_q, h_q, d_v] (with
    return_attn_probs: (out, lse fp32 [b, h_q, s_q], None))."""
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv [b, s, 3, h, d]."""
    q, k, v = _unpack("qkv", qkv, 5, 2, 3)
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q [b, s_q, h_q, d], kv [b, s_k, 2, h_kv, d]."""
    k, v = _unpack("kv", kv, 5, 2, 2)
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Packed sequences: q [total_q, h_q, d], k / v [total_k, h_kv, d / d_v], int32 cu_seqlens [batch + 1]; with
    block_table (int32 [batch, max_pages]) k / v are paged caches [num_pages, page_size, h_kv, d] whose first
    cu_seqlens_k[i + 1] - cu_seqlens_k[i] tokens of row i are sequence i's (gathered first: a copy)."""
    max_seqlen_q, max_seqlen_k = _max_seqlen(max_seqlen_q), _max_seqlen(max_seqlen_k)
    if block_table is not None:
        k, v = _gather_varlen_pages(q, k, v, cu_seqlens_k, block_table)
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv [total, 3, h, d]; one cu_seqlens / max_seqlen for q and k."""
    q, k, v = _unpack("qkv", qkv, 4, 1, 3)
    max_seqlen = _max_seqlen(max_seqlen)
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q [total_q, h_q, d], kv [total_k, 2, h_kv, d]."""
    k, v = _unpack("kv", kv, 4, 1, 2)
    max_seqlen_q, max_seqlen_k = _max_seqlen(max_seqlen_q), _max_seqlen(max_seqlen_k)
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


# ----------------------------------------------------------------------------------- paged helpers
def _int32_rows(name, t, rank, batch, ref, what):
    """An int32 tensor of this rank on q's device with one row per sequence (`what` says so in the error)."""
    check_tensor(name, t)
    check_same_device(name, t, "q", ref)
    check_rank(name, t, rank)
    check_dtype(name, t, (torch.int32,))
    if t.shape[0] != batch:
        fail(name, what, f"shape {tuple(t.shape)}")


def _check_table(block_table, batch, ref):
    _int32_rows("block_table", block_table, 2, batch, ref, f"{batch} rows (one per sequence)")


def _check_pages(lengths: torch.Tensor, block_table, num_pages, page, len_name="block_table") -> None:
    """Host-side: every length within its row's pages, every page it uses in [0, num_pages)."""
    capacity = block_table.shape[1] * page
    lens = lengths.long().cpu()
    if bool((lens < 0).any()) or bool((lens > capacity).any()):
        fail(len_name, f"lengths from 0 to {capacity} (block_table rows of {page}-token pages; new tokens included)",
             lens.tolist()[:8])
    used = torch.arange(block_table.shape[1])[None, :] < ((lens + page - 1) // page)[:, None]
    table = block_table.cpu()
    bad = used & ((table < 0) | (table >= num_pages))
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        fail("block_table", f"page indices in [0, {num_pages})", f"{int(table[i, j])} at [{i}, {j}]")


def _gather_tokens(cache, rows_or_table, lengths: list[int], paged_cache: bool):
    """The first lengths[i] tokens of sequence i, packed: [sum(lengths), h, d]. Contiguous caches [B, S, h, d] are
    indexed by row (rows_or_table [b]), paged ones [num_pages, page, h, d] through the block table."""
    device = cache.device
    lens = torch.tensor(lengths, dtype=torch.long, device=device)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens)
    starts = torch.cumsum(lens, 0) - lens
    t = torch.arange(int(lens.sum()), device=device) - torch.repeat_interleave(starts, lens)
    if paged_cache:
        page = cache.shape[1]
        return cache[rows_or_table[seq, t // page].long(), t % page]
    return cache[rows_or_table[seq].long(), t]


def _gather_varlen_pages(q, k, v, cu_seqlens_k, block_table):
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, t)
    for name, t in (("k", k), ("v", v)):
        check_rank(name, t, 4)
        check_same_device(name, t, "q", q)
    if k.shape[:3] != v.shape[:3]:
        fail("v", f"k's pages {tuple(k.shape[:3])} + (d_v,) (paged, with block_table)", tuple(v.shape))
    check_rank("cu_seqlens_k", cu_seqlens_k, 1)
    check_dtype("cu_seqlens_k", cu_seqlens_k, (torch.int32,))
    _check_table(block_table, cu_seqlens_k.numel() - 1, q)
    if not host_reads_allowed(q):
        fail("block_table", "None while a CUDA graph is captured or torch.compile traces (the paged varlen call "
             "gathers the pages by their lengths, read on the host)", "a tensor")
    host = cu_seqlens_k.detach().cpu().long()
    if host.numel() < 1 or int(host[0]) != 0 or bool((host[1:] < host[:-1]).any()):
        fail("cu_seqlens_k", "non-decreasing offsets from 0", host.tolist()[:16])
    lengths = host[1:] - host[:-1]
    _check_pages(lengths, block_table, k.shape[0], k.shape[1])
    return (_gather_tokens(k, block_table, lengths.tolist(), True),
            _gather_tokens(v, block_table, lengths.tolist(), True))


def _as_pages(cache, rows):
    """A contiguous cache [B, S, h, d] seen as pages [B·S/page, page, h, d] (a view, no copy) with the block table of
    `rows`: the largest page size of paged.PAGE_SIZES dividing S. None where the strides allow no such view."""
    s = cache.shape[1]
    page = max(p for p in paged.PAGE_SIZES if s % p == 0)
    n = s // page
    try:
        pages = cache.view(cache.shape[0] * n, page, *cache.shape[2:])
    except RuntimeError:
        return None, None
    table = (rows.long()[:, None] * n + torch.arange(n, device=cache.device)[None, :]).to(torch.int32)
    return pages, table


# --------------------------------------------------------------------------------------------- kv cache
def _cache_seqlens(cache_seqlens, batch, ref, have_new):
    if cache_seqlens is None:
        if have_new:
            fail("cache_seqlens", "the cache lengths (an int or int32 [b]) where the new k / v go", None)
        return None
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        check_int("cache_seqlens", cache_seqlens, lo=0)
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=ref.device)
    _int32_rows("cache_seqlens", cache_seqlens, 1, batch, ref, f"[{batch}] (q's batch)")
    return cache_seqlens


def _append(k_cache, v_cache, k, v, rows, block_table, cache_seqlens, capacity):
    """k / v [b, s_new, h_kv, d] into the caches in place at cache_seqlens[i] + j (checked by the caller where the
    values can be read; clamped into the cache otherwise, so a bad length overwrites a slot of the cache, never
    memory outside it)."""
    s_new = k.shape[1]
    pos = (cache_seqlens.long()[:, None] + torch.arange(s_new, device=k.device)[None, :]).clamp(0, capacity - 1)
    if block_table is None:
        index = (rows.long()[:, None].expand_as(pos), pos)
    else:
        page = k_cache.shape[1]
        index = (block_table.gather(1, pos // page).long().clamp(0, k_cache.shape[0] - 1), pos % page)
    k_cache[index] = k
    v_cache[index] = v


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Decode / chunked prefill over a KV cache, flash-attn's call: q [b, s_q, h_q, d]; k_cache / v_cache
    [b_cache, s_cache, h_kv, d] (rows picked by cache_batch_idx int32 [b], default 0..b-1), or with block_table
    (int32 [b, max_pages]) paged [num_pages, page_size, h_kv, d]; k / v [b, s_new, h_kv, d] are written into the
    caches in place at cache_seqlens (an int or int32 [b]: the tokens already there) first. Each query sees the
    cache's first cache_seqlens (+ s_new) tokens, bottom-right aligned. Returns out [b, s_q, h_q, d_v] (and lse
    fp32 [b, h_q, s_q] with return_softmax_lse). No backward (nothing here records a graph)."""
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if value is not None:
            fail(name, "None (warpforge applies no rotary inside the cache call: rotate q and k first, e.g. with "
                 "warpforge.apply_rope)", "a tensor")
    if cache_leftpad is not None:
        fail("cache_leftpad", "None (not supported by warpforge yet)", "a tensor")
    check_bool("rotary_interleaved", rotary_interleaved)
    check_bool("return_softmax_lse", return_softmax_lse)
    check_bool("causal", causal)
    check_int("num_splits", num_splits, lo=0, what="an int >= 0 (0: chosen from the shapes)")
    left, right = _window(window_size)
    cap = _softcap(softcap)
    check_tensor("q", q)
    check_rank("q", q, 4)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t)
        check_rank(name, t, 4)
        check_same_device(name, t, "q", q)
        check_same_dtype(name, t, "q", q)
        check_last_dim_contiguous(name, t)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        fail("v_cache", f"k_cache's shape but its head dim, {tuple(k_cache.shape[:3])} + (d_v,)", tuple(v_cache.shape))
    b, s_q, h_q, d = q.shape
    d_v = v_cache.shape[3]
    if (k is None) != (v is None):
        fail("k/v", "both given (new tokens to append) or neither", "only one")
    if k is not None:
        for name, t, width in (("k", k, d), ("v", v, d_v)):
            check_tensor(name, t)
            check_rank(name, t, 4)
            check_same_device(name, t, "q", q)
            check_same_dtype(name, t, "q", q)
            if tuple(t.shape[:1]) + tuple(t.shape[2:]) != (b, k_cache.shape[2], width):
                fail(name, f"[{b}, s_new, {k_cache.shape[2]}, {width}]", f"shape {tuple(t.shape)}")
        if v.shape[1] != k.shape[1]:
            fail("v", f"{k.shape[1]} new tokens (like k)", v.shape[1])
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if torch.is_grad_enabled() and cache.requires_grad:
                fail(name, "a cache that does not require grad (the new k / v are written into it in place)",
                     "requires_grad=True")
    s_new = 0 if k is None else k.shape[1]
    readable = host_reads_allowed(q)
    if block_table is not None:
        if cache_batch_idx is not None:
            fail("cache_batch_idx", "None with a block_table (a paged cache is indexed by its block table)",
                 "a tensor")
        _check_table(block_table, b, q)
        page = k_cache.shape[1]
        capacity = block_table.shape[1] * page
        rows = None
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None:
            if k_cache.shape[0] < b:
                fail("k_cache", f"at least {b} rows (q's batch; or pick rows with cache_batch_idx)",
                     f"shape {tuple(k_cache.shape)}")
            rows = torch.arange(b, device=q.device)
        else:
            check_tensor("cache_batch_idx", cache_batch_idx)
            check_same_device("cache_batch_idx", cache_batch_idx, "q", q)
            check_rank("cache_batch_idx", cache_batch_idx, 1)
            check_dtype("cache_batch_idx", cache_batch_idx, (torch.int32,))
            if cache_batch_idx.shape[0] != b:
                fail("cache_batch_idx", f"[{b}] (q's batch)", f"shape {tuple(cache_batch_idx.shape)}")
            if readable and b and not bool(((cache_batch_idx >= 0) & (cache_batch_idx < k_cache.shape[0])).all()):
                fail("cache_batch_idx", f"cache rows in [0, {k_cache.shape[0]})", cache_batch_idx.tolist()[:8])
            rows = cache_batch_idx.long().clamp(0, max(k_cache.shape[0] - 1, 0))
        if b and k_cache.shape[0] == 0:
            fail("k_cache", "at least one cache row", "0 rows")
    seqlens = _cache_seqlens(cache_seqlens, b, q, k is not None)
    if seqlens is None:
        seqlens = torch.full((b,), capacity, dtype=torch.int32, device=q.device)
    if readable and block_table is None and b and (bool((seqlens < 0).any()) or
                                                   bool((seqlens.long() + s_new > capacity).any())):
        fail("cache_seqlens", f"values from 0 to {capacity - s_new} (the cache holds {capacity} tokens per row)",
             seqlens.tolist()[:8])
    if readable and block_table is not None:
        _check_pages(seqlens.long() + s_new, block_table, k_cache.shape[0], k_cache.shape[1], "cache_seqlens")
    with torch.no_grad():
        if k is not None:
            _append(k_cache, v_cache, k, v, rows, block_table, seqlens, capacity)
        lengths = (seqlens.long() + s_new).to(torch.int32)
        out, lse = _kvcache_attention(q, k_cache, v_cache, rows, block_table, lengths, softmax_scale, causal,
                                      (left, right), cap, alibi_slopes, num_splits, readable)
    lse = _lse(lse)
    return (out, lse) if return_softmax_lse else out


def _kvcache_attention(q, k_cache, v_cache, rows, block_table, lengths, softmax_scale, causal, window, cap,
                       alibi_slopes, num_splits, readable):
    b, s_q, h_q, d = q.shape
    left, right = window
    if causal:
        right = 0
    decode_ok = (s_q <= paged.MAX_S_Q and d == v_cache.shape[3] and d in paged.HEAD_DIMS and alibi_slopes is None
                 and (s_q == 1 or right == 0) and not (readable and b and bool((lengths < s_q).any())))
    if decode_ok:
        if block_table is None:
            k_pages, table = _as_pages(k_cache, rows)
            v_pages, _ = _as_pages(v_cache, rows)
        else:
            k_pages, v_pages, table = k_cache, v_cache, block_table
            if k_cache.shape[1] not in paged.PAGE_SIZES:
                k_pages = None
        if k_pages is not None and v_pages is not None:
            return paged.paged_decode(q, k_pages, v_pages, table, lengths, softmax_scale=softmax_scale,
                                      softcap=cap, window=left if left >= 0 else None,
                                      num_splits=num_splits or None, return_lse=True)
    # flash_attention over each sequence's tokens, packed (q as b sequences of s_q)
    if not readable:
        fail("cache_seqlens", f"a call paged_decode can take (s_q <= {paged.MAX_S_Q}, a head dim that is a multiple of 8 "
             "up to 256 for K and V, causal or "
             "one query, no alibi_slopes, a page size it supports) while a CUDA graph is captured or torch.compile "
             "traces: the other path reads the lengths on the host", f"q {tuple(q.shape)}")
    lens = lengths.tolist()
    if block_table is None:
        keys, values = (_gather_tokens(c, rows, lens, False) for c in (k_cache, v_cache))
    else:
        keys, values = (_gather_tokens(c, block_table, lens, True) for c in (k_cache, v_cache))
    cu_q = torch.arange(b + 1, device=q.device, dtype=torch.int32) * s_q
    cu_k = torch.tensor([0] + lens, device=q.device, dtype=torch.long).cumsum(0).to(torch.int32)
    out, lse, _ = _attend(q.reshape(b * s_q, h_q, d), keys, values, 0.0, softmax_scale, causal, (left, window[1]),
                          cap or 0.0, alibi_slopes, False, True, cu_q, cu_k, s_q, max(lens, default=0))
    return out.reshape(b, s_q, h_q, -1), lse.reshape(h_q, b, s_q).permute(1, 0, 2).contiguous()


__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]
