"""FP4 caches as the pair (values [.., d/2], block scales [.., d/block]) (FlashInfer's layout, kv_format.py): the
same bytes as a row-layout cache split in two give the same decode, bitwise; quantize_kv(split_scales=True),
append_kv and append_kv_slots write the same bytes the row layout holds; bad pairs are refused naming the part.
"""
import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.ops.paged import paged_decode_reference
from warpforge.testing import device_under_test, poisoned_outputs

from .test_paged_decode import _problem

DEV = device_under_test()


def _split(cache, d):
    """A row-layout FP4 cache's two parts, each a tensor of its own (contiguous)."""
    return cache[..., :d // 2].contiguous(), cache[..., d // 2:].contiguous()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("b,s_q,h_q,h_kv,d,page,lens,splits", [
    (2, 1, 8, 2, 64, 16, [37, 5], None),
    (2, 3, 8, 2, 128, 1, [9, 20], 3),
])
def test_split_cache_decodes_as_the_row_cache(fmt, b, s_q, h_q, h_kv, d, page, lens, splits):
    p = _problem(b, s_q, h_q, h_kv, d, page, lens, fmt, torch.float16)
    args = (p["block_table"], p["cache_seqlens"])
    kw = dict(kv_format=fmt, k_scale=p["k_scale"], v_scale=p["v_scale"], num_splits=splits, return_lse=True)
    kc, vc = _split(p["k_cache"], d), _split(p["v_cache"], d)
    with poisoned_outputs():
        rows = wf.paged_decode(p["q"], p["k_cache"], p["v_cache"], *args, backend="triton", **kw)
        split = wf.paged_decode(p["q"], kc, vc, *args, backend="triton", **kw)
    assert torch.equal(rows[0], split[0]) and torch.equal(rows[1], split[1])
    kw.pop("num_splits")
    q = p["q"].float()
    ref_rows = paged_decode_reference(q, p["k_cache"], p["v_cache"], *args, **{k: v for k, v in kw.items()
                                                                                 if k != "return_lse"})
    ref_split = paged_decode_reference(q, kc, vc, *args, **{k: v for k, v in kw.items() if k != "return_lse"})
    assert torch.equal(ref_rows[0], ref_split[0])
    plan = wf.paged.plan(p["q"], kc, p["block_table"], kv_format=fmt, num_splits=splits)
    with poisoned_outputs():
        again = plan.run(p["q"], kc, vc, *args, k_scale=p["k_scale"], v_scale=p["v_scale"], return_lse=True,
                         backend="triton")
    assert torch.equal(again[0], split[0])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantize_kv_split_scales_is_the_row_layout_split(fmt):
    x = torch.randn(3, 16, 2, 64, device=DEV)
    rows, scale = wf.paged.quantize_kv(x, fmt)
    (values, scales), scale2 = wf.paged.quantize_kv(x, fmt, split_scales=True, scale=scale)
    assert values.shape == (3, 16, 2, 32) and scales.shape == (3, 16, 2, 64 // wf.paged.KV_FORMATS[fmt].group)
    assert torch.equal(values, rows[..., :32]) and torch.equal(scales, rows[..., 32:])
    with pytest.raises(WarpforgeInputError, match="^split_scales"):
        wf.paged.quantize_kv(x, "fp8", split_scales=True)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_appends_write_the_row_layouts_bytes(fmt, backend):
    """append_kv and append_kv_slots into a pair write what they write into a row-layout cache, split."""
    num_pages, page, h_kv, d = 5, 16, 2, 64
    width = wf.paged.KV_FORMATS[fmt].width(d)
    scale = torch.full((1,), 0.01, device=DEV) if fmt == "nvfp4" else None
    kw = dict(kv_format=fmt, k_scale=scale, v_scale=scale)
    rows = [torch.zeros(num_pages, page, h_kv, width, dtype=torch.uint8, device=DEV) for _ in range(2)]
    pairs = [_split(r, d) for r in rows]
    table = torch.tensor([[3, 1], [0, 4]], dtype=torch.int32, device=DEV)
    seqlens = torch.tensor([14, 2], dtype=torch.int32, device=DEV)
    new = [torch.randn(2, 5, h_kv, d, device=DEV) for _ in range(2)]   # request 0 crosses into its second page
    for caches in (rows, pairs):
        wf.paged.append_kv(*caches, *new, table, seqlens, **kw)
    tok = [torch.randn(4, h_kv, d, device=DEV) for _ in range(2)]
    slots = torch.tensor([2 * page + 3, -1, 79, 17], dtype=torch.int64, device=DEV)
    for caches in (rows, pairs):
        wf.paged.append_kv_slots(*caches, *tok, slots, backend=backend, **kw)
    for row, (values, scales) in zip(rows, pairs):
        assert row.any()
        assert torch.equal(row[..., :d // 2], values) and torch.equal(row[..., d // 2:], scales)


def _pair_args(fmt="nvfp4", num_pages=4, page=16, h_kv=2, d=64):
    x = torch.randn(num_pages, page, h_kv, d, device=DEV)
    (kc, scale), (vc, _) = (wf.paged.quantize_kv(x, fmt, split_scales=True) for _ in range(2))
    return kc, vc, scale


def test_bad_pairs_are_refused_naming_the_part():
    kc, vc, scale = _pair_args()
    q = torch.randn(1, 1, 4, 64, device=DEV, dtype=torch.float16)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([20], dtype=torch.int32, device=DEV)

    def decode(k, v, **kw):
        return wf.paged_decode(q, k, v, table, lens, **{"kv_format": "nvfp4", "k_scale": scale, "v_scale": scale,
                                                         **kw})
    assert torch.equal(decode(kc, vc), decode(kc, torch.cat(vc, -1)))   # K and V may differ in layout
    cases = [
        ((kc[0], kc[1], kc[1]), vc, {}, r"^k_cache: expected a tensor, or for nvfp4 / mxfp4 the pair"),
        (kc, vc, {"kv_format": "fp8", "k_scale": None, "v_scale": None},
         r"^k_cache: expected a tensor for kv_format 'fp8'"),
        ((kc[0], kc[1][..., :2]), vc, {}, r"^k_cache\[1\]: expected 4 entries per token and head"),
        ((kc[0], kc[1][:3]), vc, {}, r"^k_cache\[1\]: expected k_cache\[0\]'s \[num_pages, page_size, h_kv\]"),
        ((kc[0], kc[1].float()), vc, {}, r"^k_cache\[1\]: expected dtype uint8"),
        (kc, (vc[0], vc[1][:3]), {}, r"^v_cache\[1\]: expected 4 pages"),
        (kc, torch.cat(vc, -1)[..., 1:], {}, r"^v_cache: expected a \[num_pages, 16, 2, 36\]"),
        ((kc[0], kc[1]), None, {}, r"^v_cache"),
    ]
    for k, v, kw, says in cases:
        with pytest.raises(WarpforgeInputError, match=says):
            decode(k, v, **kw)
    fp8 = wf.paged.quantize_kv(torch.randn(4, 16, 2, 64, device=DEV), "fp8")[0]
    with pytest.raises(WarpforgeInputError, match=r"^k_cache: expected a tensor for kv_format 'fp8'"):
        wf.paged.plan(q, (fp8, fp8), table, kv_format="fp8")


def test_appends_refuse_pairs_that_meet_in_memory():
    """A pair's four tensors are each written: values and scales that share bytes (or K's parts V's) are refused
    naming the later one, before anything is written; parts of one buffer side by side are fine."""
    kc, vc, scale = _pair_args()
    new = torch.randn(1, 2, 2, 64, device=DEV)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([3], dtype=torch.int32, device=DEV)
    kw = dict(kv_format="nvfp4", k_scale=scale, v_scale=scale)
    buf = torch.zeros(kc[0].numel() + kc[1].numel(), dtype=torch.uint8, device=DEV)
    values = buf[:kc[0].numel()].view(kc[0].shape)
    scales = buf[kc[0].numel():].view(kc[1].shape)
    wf.paged.append_kv((values, scales), vc, new, new, table, lens, **kw)   # side by side in one buffer
    assert values.any() and scales.any()
    rows = torch.zeros(*kc[0].shape[:3], 32 + kc[1].shape[3], dtype=torch.uint8, device=DEV)
    interleaved = (rows[..., :32], rows[..., 32:])                            # a row cache's two views: apart too
    wf.paged.append_kv(interleaved, vc, new, new, table, lens, **kw)
    assert torch.equal(rows[..., :32], values) and torch.equal(rows[..., 32:], scales)
    wf.paged.append_kv_slots(interleaved, vc, new[0], new[0], torch.tensor([40, 41], device=DEV), **kw)
    assert rows[2, 8:10].any()
    overlapping = buf[:kc[1].numel()].view(kc[1].shape)                        # the scales inside the values
    with pytest.raises(WarpforgeInputError, match=r"^k_cache\[1\]: expected a tensor apart from k_cache\[0\]"):
        wf.paged.append_kv((values, overlapping), vc, new, new, table, lens, **kw)
    with pytest.raises(WarpforgeInputError, match=r"^v_cache\[0\]: expected a tensor apart from k_cache\[0\]"):
        wf.paged.append_kv(kc, (kc[0], vc[1]), new, new, table, lens, **kw)
    with pytest.raises(WarpforgeInputError, match=r"^v_cache: expected a pair"):
        wf.paged.append_kv_slots(kc, torch.cat(vc, -1), new[0], new[0], torch.tensor([0, 1], device=DEV), **kw)
