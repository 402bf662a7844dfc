"""append_kv_slots (vLLM's reshape_and_cache: flat tokens to flat slots, -1 skipped) against quantize_kv and the
reference writer: every format, head dims that are not powers of two, page boundaries, mixed requests in one call,
values the host does not check (a capture) kept inside the caches, bad input.

The Triton kernel runs through the interpreter on a CPU machine (tests/conftest.py). Caches start poisoned (NaN /
0xFF bytes) so that a slot written when it should not be, or left when it should be written, shows.
"""
import pytest
import torch

import warpforge as wf
import warpforge.ops.paged.api as paged_api
from warpforge import WarpforgeInputError
from warpforge.ops.paged.reference import dequantize_kv_reference
from warpforge.testing import device_under_test

DEV = device_under_test()
FORMATS = ("fp32", "fp16", "fp8", "nvfp4", "mxfp4")


def _scale(fmt, value=0.03):
    return torch.full((1,), value, device=DEV) if fmt in ("fp8", "nvfp4") else None


def _caches(fmt, num_pages, page, h_kv, d):
    kv = wf.paged.KV_FORMATS[fmt]
    cache = torch.empty(num_pages, page, h_kv, kv.width(d), device=DEV, dtype=kv.storage)
    cache.view(torch.uint8).fill_(0xFF if kv.fp4 else 0x7F)  # NaN-ish bytes in every format
    return cache, cache.clone()


def _tokens(n, h_kv, d, fmt):
    dtype = torch.float16 if fmt == "fp16" else torch.float32
    return [torch.randn(n, h_kv, d, device=DEV, dtype=dtype) * 2 for _ in range(2)]


def _slots_of_requests(tables, starts, counts, page):
    """Flat slots of each request's new tokens (positions start .. start + count) through its pages, requests one
    after another (a step of mixed lengths)."""
    out = []
    for table, start, n in zip(tables, starts, counts):
        out += [table[t // page] * page + t % page for t in range(start, start + n)]
    return torch.tensor(out, dtype=torch.int64, device=DEV)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 48])
@pytest.mark.parametrize("fmt", FORMATS)
def test_slots_write_what_quantize_kv_writes(fmt, d):
    """A step of three requests at different lengths (crossing page boundaries, one token, a long run), padded
    with -1 slots: the written slots hold exactly quantize_kv's bytes for those tokens, every other slot is
    untouched; the reference writer agrees byte for byte."""
    group = wf.paged.KV_FORMATS[fmt].group
    if group and d % group:
        pytest.skip(f"{fmt} holds head dims that are multiples of {group}")
    page, h_kv = 8, 2
    tables = [[5, 1, 7], [0], [3, 6, 2, 4]]
    slots = _slots_of_requests(tables, [6, 3, 1], [5, 1, 27], page)  # 6..10 crosses pages 5 -> 1
    slots = torch.cat([slots[:4], torch.full((2,), -1, device=DEV), slots[4:], torch.full((3,), -1, device=DEV)])
    k, v = _tokens(slots.numel(), h_kv, d, fmt)
    kc, vc = _caches(fmt, 9, page, h_kv, d)
    before = kc.clone()
    ref_k, ref_v = kc.clone(), vc.clone()
    scale = _scale(fmt)
    wf.paged.append_kv_slots(kc, vc, k, v, slots, kv_format=fmt, k_scale=scale, v_scale=scale, backend="triton")
    wf.paged.append_kv_slots(ref_k, ref_v, k, v, slots, kv_format=fmt, k_scale=scale, v_scale=scale,
                             backend="reference")
    assert torch.equal(kc.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), ref_v.view(torch.uint8))
    keep = slots >= 0
    flat = slots[keep]
    for cache, new in ((kc, k), (vc, v)):
        want, _ = wf.paged.quantize_kv(new[keep], fmt, scale=scale)
        got = cache[flat // page, flat % page]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    written = torch.zeros(9 * page, dtype=torch.bool, device=DEV)
    written[flat] = True
    untouched = ~written.view(9, page)
    assert torch.equal(kc[untouched].view(torch.uint8), before[untouched].view(torch.uint8))


@pytest.mark.parametrize("fmt", ["fp16", "fp8", "nvfp4", "mxfp4"])
def test_slots_and_append_kv_fill_the_same_cache(fmt):
    """Requests appended in one append_kv_slots call per step (decode steps of one token mixed with a prefill
    chunk) leave the same caches as append_kv request by request, and paged_decode reads them alike."""
    page, h_kv, d = 16, 2, 64
    b, lens = 3, [0, 0, 0]
    table = torch.tensor([[4, 0, 9], [2, 7, 5], [1, 8, 3]], dtype=torch.int32, device=DEV)
    a_k, a_v = _caches(fmt, 10, page, h_kv, d)
    s_k, s_v = a_k.clone(), a_v.clone()
    scale = _scale(fmt)
    dtype = torch.float16 if fmt == "fp16" else torch.float32
    for counts in ([20, 6, 17], [1, 1, 1], [4, 0, 16]):  # request 0 crosses into its second page mid-call
        news = [[torch.randn(1, n, h_kv, d, device=DEV, dtype=dtype) for _ in range(2)] for n in counts]
        for i, n in enumerate(counts):
            if n:
                wf.paged.append_kv(a_k, a_v, news[i][0], news[i][1], table[i:i + 1],
                                   torch.tensor([lens[i]], dtype=torch.int32, device=DEV), kv_format=fmt,
                                   k_scale=scale, v_scale=scale)
        slots = _slots_of_requests(table.tolist(), lens, counts, page).int()
        k = torch.cat([news[i][0][0] for i in range(b)])
        v = torch.cat([news[i][1][0] for i in range(b)])
        wf.paged.append_kv_slots(s_k, s_v, k, v, slots, kv_format=fmt, k_scale=scale, v_scale=scale,
                                 backend="triton")
        lens = [n + c for n, c in zip(lens, counts)]
    assert torch.equal(a_k.view(torch.uint8), s_k.view(torch.uint8))
    assert torch.equal(a_v.view(torch.uint8), s_v.view(torch.uint8))
    q = torch.randn(b, 2, 4, d, device=DEV, dtype=dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    outs = [wf.paged_decode(q, kc, vc, table, seqlens, kv_format=fmt, k_scale=scale, v_scale=scale,
                            backend="triton") for kc, vc in ((a_k, a_v), (s_k, s_v))]
    assert torch.equal(outs[0], outs[1])


def test_slots_into_strided_caches():
    """Caches that are views of one buffer (k = kv[:, 0], v = kv[:, 1]) and tokens that are views of a fused qkv
    row (strided heads) are written through their strides."""
    page, h_kv, d, n = 16, 2, 64, 9
    kv = torch.zeros(4, 2, page, h_kv, d, device=DEV)
    qkv = torch.randn(n, 4 * h_kv, d, device=DEV)
    k, v = qkv[:, 2 * h_kv:3 * h_kv], qkv[:, 3 * h_kv:]
    slots = torch.tensor([0, 17, 18, 63, -1, 5, 40, 41, 33], device=DEV)
    wf.paged.append_kv_slots(kv[:, 0], kv[:, 1], k, v, slots, backend="triton")
    flat = kv.permute(1, 0, 2, 3, 4).reshape(2, 4 * page, h_kv, d)
    keep = slots >= 0
    assert torch.equal(flat[0, slots[keep]], k[keep]) and torch.equal(flat[1, slots[keep]], v[keep])
    assert torch.count_nonzero(flat) == 2 * int(keep.sum()) * h_kv * d  # nothing else written


def test_no_tokens_and_all_skipped():
    kc, vc = _caches("fp16", 3, 8, 1, 64)
    before = kc.clone()
    k = torch.randn(0, 1, 64, device=DEV, dtype=torch.float16)
    wf.paged.append_kv_slots(kc, vc, k, k, torch.zeros(0, dtype=torch.int32, device=DEV), backend="triton")
    k = torch.randn(4, 1, 64, device=DEV, dtype=torch.float16)
    wf.paged.append_kv_slots(kc, vc, k, k, torch.full((4,), -1, device=DEV), backend="triton")
    assert torch.equal(kc.view(torch.uint8), before.view(torch.uint8))


def test_mxfp4_near_fp32s_largest_values_stays_finite():
    """A block holding 3e38 (fp32 holds it) takes the scale 2^125, whose 6 is finite, not 2^126, whose 4 overflows:
    quantize_kv and the append kernel choose alike (their block errors in units of the larger scale)."""
    k = torch.randn(3, 1, 64, device=DEV)
    k[0, 0, 0], k[1, 0, 33], k[2, 0, 5] = 3.0e38, -3.3e38, 2.0e38
    kc, vc = _caches("mxfp4", 1, 8, 1, 64)
    wf.paged.append_kv_slots(kc, vc, k, k, torch.arange(3, device=DEV), kv_format="mxfp4", backend="triton")
    want, _ = wf.paged.quantize_kv(k, "mxfp4")
    assert torch.equal(kc[0, :3].view(torch.uint8), want.view(torch.uint8))
    back = dequantize_kv_reference(kc[:, :3], "mxfp4", None)
    assert torch.isfinite(back).all()
    assert back[0, 0, 0, 0] == 6 * 2.0 ** 125 and back[0, 1, 0, 33] == -6 * 2.0 ** 125


@pytest.mark.parametrize("fmt", ["fp32", "nvfp4"])
def test_unchecked_slots_stay_inside_the_caches(fmt, monkeypatch):
    """With the host checks skipped (a CUDA-graph capture), slots past the cache or below -1 are skipped by the
    kernel: the caches (views into a larger buffer, guarded on both sides) are written only at the good slots."""
    monkeypatch.setattr(paged_api, "host_reads_allowed", lambda t: False)
    kv = wf.paged.KV_FORMATS[fmt]
    page, h_kv, d = 8, 1, 64
    buf = torch.zeros(6, page, h_kv, kv.width(d), device=DEV, dtype=kv.storage)
    kc, vc = buf[1:3], buf[3:5]  # pages 0 and 5 of the buffer guard the caches
    k, v = _tokens(5, h_kv, d, fmt)
    slots = torch.tensor([3, 16, 1 << 40, -7, 15], device=DEV)
    scale = _scale(fmt)
    wf.paged.append_kv_slots(kc, vc, k, v, slots, kv_format=fmt, k_scale=scale, v_scale=scale, backend="triton")
    assert not buf[0].view(torch.uint8).any() and not buf[5].view(torch.uint8).any()
    written = kc.reshape(2 * page, -1).view(torch.uint8).any(-1)
    assert written.nonzero().flatten().tolist() == [3, 15]


def _args(fmt="fp32", n=4, d=64):
    kc, vc = _caches(fmt, 4, 8, 2, d)
    k, v = _tokens(n, 2, d, fmt)
    return dict(k_cache=kc, v_cache=vc, k=k, v=v, slot_mapping=torch.arange(n, device=DEV), kv_format=fmt,
                k_scale=_scale(fmt), v_scale=_scale(fmt))


BAD = [  # (format, change, argument named)
    ("fp32", lambda a: {"slot_mapping": torch.tensor([0, 1, 32, 3], device=DEV)}, "slot_mapping"),  # past the end
    ("fp32", lambda a: {"slot_mapping": torch.tensor([0, 1, -2, 3], device=DEV)}, "slot_mapping"),
    ("fp32", lambda a: {"slot_mapping": torch.tensor([0, 5, 2, 5], device=DEV)}, "slot_mapping"),  # a slot twice
    ("fp32", lambda a: {"slot_mapping": torch.arange(3, device=DEV)}, "slot_mapping"),
    ("fp32", lambda a: {"slot_mapping": torch.arange(4, device=DEV).float()}, "slot_mapping"),
    ("fp32", lambda a: {"slot_mapping": torch.arange(8, device=DEV)[::2]}, "slot_mapping"),
    ("fp32", lambda a: {"slot_mapping": torch.arange(4, device=DEV)[None]}, "slot_mapping"),
    ("fp32", lambda a: {"k": a["k"][:, :1], "v": a["v"][:, :1]}, "k"),                  # heads
    ("fp32", lambda a: {"k": a["k"][None]}, "k"),                                        # rank
    ("fp32", lambda a: {"k": a["k"].double(), "v": a["v"].double()}, "k"),
    ("fp32", lambda a: {"k": torch.randn(4, 2, 100, device=DEV)}, "k"),                  # head dim 100
    ("fp32", lambda a: {"v": a["v"].half()}, "v"),
    ("fp32", lambda a: {"v": a["v"][:3]}, "v"),
    ("fp32", lambda a: {"k_cache": a["k_cache"].half()}, "k_cache"),
    ("fp32", lambda a: {"v_cache": a["v_cache"][:2]}, "v_cache"),
    ("fp32", lambda a: {"v_cache": a["k_cache"]}, "v_cache"),                            # one memory
    ("fp32", lambda a: {"k_scale": 1.0}, "k_scale"),
    ("fp8", lambda a: {"k_scale": torch.ones(4, 2, device=DEV)}, "k_scale"),            # no per-page scale
    ("fp8", lambda a: {"v_scale": float("nan")}, "v_scale"),
    ("nvfp4", lambda a: {"k_scale": None}, "k_scale"),
    ("mxfp4", lambda a: {"k_scale": torch.ones(1, device=DEV)}, "k_scale"),
    ("fp8", lambda a: {"k": a["k"].index_fill(0, torch.tensor([2], device=DEV), float("nan"))}, "k"),
    ("nvfp4", lambda a: {"v": a["v"].index_fill(0, torch.tensor([1], device=DEV), float("inf"))}, "v"),
    ("mxfp4", lambda a: {"kv_format": "nvfp4"}, "k_cache"),                              # row width
    ("fp32", lambda a: {"kv_format": "fp5"}, "kv_format"),
]


@pytest.mark.parametrize("fmt,change,name", BAD)
def test_bad_input_names_the_argument(fmt, change, name):
    a = _args(fmt)
    caches = a["k_cache"], a["v_cache"]
    before = [c.clone() for c in caches]
    a.update(change(a))
    with pytest.raises(WarpforgeInputError, match=rf"^{name}"):
        wf.paged.append_kv_slots(a.pop("k_cache"), a.pop("v_cache"), a.pop("k"), a.pop("v"), a.pop("slot_mapping"),
                                 backend="triton", **a)
    for c, b in zip(caches, before):  # nothing written
        assert torch.equal(c.view(torch.uint8), b.view(torch.uint8))


def test_duplicate_slot_message_names_the_tokens():
    a = _args()
    a["slot_mapping"] = torch.tensor([7, 3, -1, 3], device=DEV)
    with pytest.raises(WarpforgeInputError, match=r"^slot_mapping: .*tokens 1 and 3 both to slot 3"):
        wf.paged.append_kv_slots(a["k_cache"], a["v_cache"], a["k"], a["v"], a["slot_mapping"], backend="triton")
    a["slot_mapping"] = torch.tensor([-1, 3, -1, -1], device=DEV)  # several skips are no duplicates
    wf.paged.append_kv_slots(a["k_cache"], a["v_cache"], a["k"], a["v"], a["slot_mapping"], backend="triton")


def test_cache_that_requires_grad_is_refused():
    a = _args()
    a["k_cache"] = a["k_cache"].float().requires_grad_()
    with pytest.raises(WarpforgeInputError, match="^k_cache: .*does not require grad"):
        wf.paged.append_kv_slots(a["k_cache"], a["v_cache"], a["k"], a["v"], a["slot_mapping"], backend="triton")


def test_compiles_without_graph_break():
    """The Triton writer is a custom op that mutates the caches: torch.compile(fullgraph) takes it."""
    a = _args("fp16")

    def step(k, v):
        wf.paged.append_kv_slots(a["k_cache"], a["v_cache"], k, v, a["slot_mapping"], backend="triton")
        return a["k_cache"][0, :4].float() * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(a["k"], a["v"])
    assert torch.equal(a["k_cache"][0, :4], a["k"]) and torch.equal(a["v_cache"][0, :4], a["v"])
    assert torch.equal(got, a["k"].float() * 2)


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 96, 80])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_gpu_slots_bytes_equal_the_reference(fmt, d):
    """The compiled kernel (bf16 tokens, a decode-sized and a prefill-sized step) writes the reference writer's
    bytes: e4m3 rounding (-0 included), NVFP4 / MXFP4 block scales and codes. One exception (benchmarks/NOTES.md,
    session 20): FP4 picks each block's scale by comparing fp32 error sums, whose order (and fused multiply-adds)
    differ from torch's, so a near-tie may go the other way (5 bytes of ~8M, one block): a differing block must be
    rare and its error the reference block's to 1e-5."""
    group = wf.paged.KV_FORMATS[fmt].group
    if group and d % group:
        pytest.skip(f"{fmt} holds head dims that are multiples of {group}")
    page, h_kv, pages = 16, 8, 700
    for n in (64, 8192):
        kc, vc = _caches(fmt, pages, page, h_kv, d)
        ref_k, ref_v = kc.clone(), vc.clone()
        k, v = (torch.randn(n, h_kv, d, device=DEV, dtype=torch.bfloat16) * 3 for _ in range(2))
        slots = torch.randperm(pages * page, device=DEV)[:n]
        slots[::7] = -1
        scale = _scale(fmt)
        wf.paged.append_kv_slots(kc, vc, k, v, slots, kv_format=fmt, k_scale=scale, v_scale=scale)
        wf.paged.append_kv_slots(ref_k, ref_v, k, v, slots, kv_format=fmt, k_scale=scale, v_scale=scale,
                                 backend="reference")
        for got, want, x in ((kc, ref_k, k), (vc, ref_v, v)):
            diff = int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
            if group and diff:
                _assert_near_ties(got, want, x, slots, fmt, scale, group)
            else:
                assert diff == 0, f"{diff} bytes differ"


def _assert_near_ties(got, want, x, slots, fmt, scale, group):
    """FP4 caches that differ only in blocks where the two scale choices' squared errors agree to 1e-5, in at most
    1e-4 of the blocks."""
    keep = slots >= 0
    rows = [c.flatten(0, 1)[slots[keep]] for c in (got, want)]   # [tokens, h_kv, width]
    errs = [(dequantize_kv_reference(r, fmt, scale).double() - x[keep].double()).unflatten(-1, (-1, group))
            .square().sum(-1) for r in rows]
    differ = (rows[0].view(torch.uint8) != rows[1].view(torch.uint8)).any(-1)   # per token and head
    assert int(differ.sum()) <= max(1, differ.numel() // 10_000), f"{int(differ.sum())} rows differ"
    assert torch.allclose(errs[0][differ], errs[1][differ], rtol=1e-5, atol=1e-12), "a differing block is worse"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_gpu_slots_capture(fmt):
    """append_kv_slots in a CUDA graph: replays write the new tokens of each replay at the slots of each replay."""
    page, h_kv, d, n = 16, 8, 128, 32
    kc, vc = _caches(fmt, 64, page, h_kv, d)
    k, v = (torch.randn(n, h_kv, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.randperm(64 * page, device=DEV)[:n]
    scale = _scale(fmt)
    kw = dict(kv_format=fmt, k_scale=scale, v_scale=scale)
    wf.paged.append_kv_slots(kc, vc, k, v, slots, **kw)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wf.paged.append_kv_slots(kc, vc, k, v, slots, **kw)
    for _ in range(2):
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
        slots.copy_(torch.randperm(64 * page, device=DEV)[:n])
        twin_k, twin_v = kc.clone(), vc.clone()
        graph.replay()
        wf.paged.append_kv_slots(twin_k, twin_v, k, v, slots, **kw)
        assert torch.equal(kc.view(torch.uint8), twin_k.view(torch.uint8))
        assert torch.equal(vc.view(torch.uint8), twin_v.view(torch.uint8))
