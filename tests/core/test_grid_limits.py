"""CUDA grid limits: axis 0 takes up to 2^31 - 1 programs, axes 1 and 2 only 65535; a launch past them fails
("Triton Error [CUDA]: invalid argument", as rope's did on a 64 x 1k-token prefill). Each launch whose big
dimension (tokens, requests, sequences x heads) once sat on axis 1 or 2 is called here with that dimension past
65535, its Triton kernels swapped for stubs that only record the grid: nothing runs, so the large shapes cost no
more than their (mostly untouched) allocations, and the checks need no GPU."""
import math

import pytest
import torch

import warpforge as wf
from warpforge.ops import shared_kernels
from warpforge.ops.attention import flash_kernel, flash_ws_kernel, fp8_api, fp8_kernel, fp8_quantize_kernel
from warpforge.ops.attention.configs import KernelCfg as AttnCfg
from warpforge.ops.evoformer import evoformer_kernel as evo_kernels
from warpforge.ops.evoformer.configs import EvoCfg, EvoformerTiles
from warpforge.ops.mla import decode_kernel as mla_kernels
from warpforge.ops.paged import decode_kernel as paged_kernels
from warpforge.ops.rope import rope_kernel as rope_kernels
from warpforge.ops.sparse import sparse_kernel as sparse_kernels
from warpforge.ops.sparse.configs import KernelCfg

AXIS_MAX = (2 ** 31 - 1, 65535, 65535)  # CUDA's programs per grid axis
BIG = 65536  # one past what axes 1 and 2 take


class GridRecorder:
    """Stands in for a JIT kernel: `stub[grid](*args, **meta)` records the grid (a callable one resolved with the
    launch's keyword arguments, as Triton would with the bound ones), padded to three axes, and runs nothing."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            g = tuple(int(n) for n in (grid(meta) if callable(grid) else grid))
            self.grids.append(g + (1,) * (3 - len(g)))
        return launch


def stub_kernels(monkeypatch, module, *names):
    """Replace module.<name> for each name with a GridRecorder; returns them by name."""
    stubs = {name: GridRecorder() for name in names}
    for name, stub in stubs.items():
        monkeypatch.setattr(module, name, stub)
    return stubs


def assert_within_limits(stubs):
    """Every recorded grid fits CUDA's per-axis limits; every stub was launched at least once."""
    for name, stub in stubs.items():
        assert stub.grids, f"{name} was never launched"
        for grid in stub.grids:
            for axis, (n, most) in enumerate(zip(grid, AXIS_MAX)):
                assert 1 <= n <= most, f"{name}: grid {grid} axis {axis} has {n} programs (CUDA takes {most})"


def programs(grid):
    return math.prod(grid)


# ------------------------------------------------------------------------------------------------- rope
def test_rope_a_million_positions_fit_the_grid(monkeypatch):
    """apply_rope over 2^20 positions (a packed serving prefill): the positions on axis 0."""
    stubs = stub_kernels(monkeypatch, rope_kernels, "rope_kernel")
    s = 1 << 20
    x = torch.empty(1, s, 1, 2)
    cos, sin = torch.empty(s, 1), torch.empty(s, 1)
    wf.apply_rope(x, cos, sin, backend="triton")
    assert_within_limits(stubs)
    assert stubs["rope_kernel"].grids == [(s, 1, 1)]


# ----------------------------------------------------------------------------------------------- sparse
def _sparse_inputs(batch, heads, seq, d=16, topk=1, block_size=16):
    """Shape-only inputs of the sparse launchers (expanded views: the kernels never read them)."""
    nb = seq // block_size

    def view(*shape, dtype=torch.float16):
        return torch.empty((1,) * len(shape), dtype=dtype).expand(*shape)
    q = view(batch, seq, heads, d)
    lse = torch.empty(batch, heads, seq)
    sel = view(batch, heads, nb, topk, dtype=torch.int32)
    n_sel = view(batch, heads, nb, dtype=torch.int32)
    return q, lse, sel, n_sel, nb


@pytest.mark.parametrize("batch, heads, seq", [(1, 1, 1 << 20), (512, 128, 16)],
                         ids=["a million tokens in 16-row tiles", "512 sequences x 128 heads"])
def test_sparse_attention_tiles_and_heads_fit_the_grid(monkeypatch, batch, heads, seq):
    """The forward, both backward passes, the delta pass and the index statistics: (sequence, head) pairs and
    row tiles together on axis 0, one program each."""
    stubs = stub_kernels(monkeypatch, sparse_kernels, "sparse_fwd_kernel", "sparse_dq_kernel", "sparse_dkdv_kernel",
                         "softmax_delta_kernel", "index_stats_kernel")
    block = 16
    cfg = KernelCfg(block, block, 1, 1)
    q, lse, sel, n_sel, nb = _sparse_inputs(batch, heads, seq, block_size=block)
    args = (None, batch, seq, block, True, 0.25)  # cu, batch, max_s, block_size, causal, scale
    sparse_kernels.sparse_fwd(q, q, q, sel, n_sel, *args, cfg)
    offsets = torch.zeros(batch * heads * nb + 1, dtype=torch.int32)
    sparse_kernels.sparse_bwd(q, q, q, q, q, lse, sel, n_sel, offsets, offsets, *args, cfg, cfg)
    sparse_kernels.index_stats(q, q, lse, q, q, sel, n_sel, *args, cfg)
    assert_within_limits(stubs)
    tiles = batch * heads * (seq // block)
    for name in ("sparse_fwd_kernel", "sparse_dq_kernel", "sparse_dkdv_kernel", "index_stats_kernel"):
        assert [programs(g) for g in stubs[name].grids] == [tiles], name


def test_sparse_block_means_fit_the_grid(monkeypatch):
    """The selection's block means: every (sequence, block) on axis 0, a million tokens in 16-row blocks and 65536
    sequences alike."""
    stubs = stub_kernels(monkeypatch, sparse_kernels, "pool_index_queries_kernel")
    for batch, seq in ((1, 1 << 20), (BIG, 16)):
        iq = torch.empty(1, 1, 1, 8, dtype=torch.float16).expand(batch, seq, 1, 8)
        sparse_kernels.pool_index_queries(iq, None, batch, seq, 16)
    assert_within_limits(stubs)
    assert [programs(g) for g in stubs["pool_index_queries_kernel"].grids] == [1 << 16, BIG]


# -------------------------------------------------------------------------------------------------- MLA
def _mla_inputs(batch, s_q, h_q=1, page=16):
    q = torch.empty(1, 1, 1, 576, dtype=torch.float16).expand(batch, s_q, h_q, 576)
    cache = torch.zeros(1, page, 1, 576, dtype=torch.float16)
    return q, cache


def test_mla_decode_batch_past_65535_fits_the_grid(monkeypatch):
    """Dense MLA decode over 65536 requests: the requests folded into axis 0 with the row tiles."""
    stubs = stub_kernels(monkeypatch, mla_kernels, "mla_decode_split_kernel")
    q, cache = _mla_inputs(BIG, 1)
    table = torch.zeros(BIG, 1, dtype=torch.int32)
    lens = torch.ones(BIG, dtype=torch.int32)
    wf.mla_decode(q, cache, table, lens, num_splits=1, backend="triton")
    assert_within_limits(stubs)
    assert [programs(g) for g in stubs["mla_decode_split_kernel"].grids] == [BIG]


def test_mla_sparse_decode_requests_times_queries_past_65535_fit_the_grid(monkeypatch):
    """Sparse (top-k) MLA decode, 16384 requests x 4 queries: the b · s_q programs on axis 0 with the head tiles."""
    stubs = stub_kernels(monkeypatch, mla_kernels, "mla_decode_split_kernel")
    batch, s_q = BIG // 4, 4
    q, cache = _mla_inputs(batch, s_q)
    indices = torch.zeros(batch, s_q, 1, dtype=torch.int32)
    wf.mla_decode(q, cache, None, None, indices=indices, num_splits=1, backend="triton")
    assert_within_limits(stubs)
    assert [programs(g) for g in stubs["mla_decode_split_kernel"].grids] == [batch * s_q]


# ------------------------------------------------------------------------------------------------ paged
@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_batch_past_65535_fits_the_grid(monkeypatch, num_splits):
    """Paged decode over 65536 requests, with and without the split-KV combine: the requests on axis 0 (with the
    splits)."""
    stubs = stub_kernels(monkeypatch, paged_kernels, "paged_decode_split_kernel")
    if num_splits > 1:
        stubs.update(stub_kernels(monkeypatch, shared_kernels, "combine_splits_kernel"))
    q = torch.empty(1, 1, 1, 8, dtype=torch.float16).expand(BIG, 1, 1, 8)
    cache = torch.zeros(1, 16, 1, 8, dtype=torch.float16)
    table = torch.zeros(BIG, 1, dtype=torch.int32)
    lens = torch.ones(BIG, dtype=torch.int32)
    wf.paged_decode(q, cache, cache, table, lens, num_splits=num_splits, backend="triton")
    assert_within_limits(stubs)
    assert [programs(g) for g in stubs["paged_decode_split_kernel"].grids] == [BIG * num_splits]


# -------------------------------------------------------------------------------------------- attention
ATTN_CFG = AttnCfg(16, 16, 1, 1)


def _expanded(*shape, dtype=torch.float16):
    """A shape-only input: one element seen at every index (the stubbed kernels never read it)."""
    return torch.empty((1,) * len(shape), dtype=dtype).expand(*shape)


def test_attention_512_sequences_x_128_heads_fit_the_grid(monkeypatch):
    """Batched forward and backward (dk/dv, delta and dq passes), 512 x 128 = 65536 (sequence, head) pairs: the
    pairs and their row (key) blocks together on axis 0."""
    stubs = stub_kernels(monkeypatch, flash_kernel, "flash_query_kernel", "flash_bwd_dkdv_kernel",
                         "softmax_delta_kernel")
    batch, heads, seq, d = 512, 128, 32, 16
    q = _expanded(batch, seq, heads, d)
    out, lse = flash_kernel.flash_fwd(q, q, q, None, None, batch, seq, seq, 0.25, 1 << 30, 0, ATTN_CFG)
    flash_kernel.flash_bwd(q, q, q, q, q, lse, None, None, batch, seq, seq, 0.25, 1 << 30, 0, ATTN_CFG, ATTN_CFG)
    assert_within_limits(stubs)
    tiles = batch * heads * (seq // 16)
    assert [programs(g) for g in stubs["flash_query_kernel"].grids] == [tiles, tiles]  # forward, dq
    assert [programs(g) for g in stubs["flash_bwd_dkdv_kernel"].grids] == [tiles]


def test_attention_varlen_65536_sequences_fit_the_grid(monkeypatch):
    """Packed (varlen) forward over 65536 one-token sequences of one head."""
    stubs = stub_kernels(monkeypatch, flash_kernel, "flash_query_kernel")
    n = BIG
    q = _expanded(n, 1, 16)
    cu = torch.arange(n + 1, dtype=torch.int32)
    flash_kernel.flash_fwd(q, q, q, cu, cu, n, 1, 1, 0.25, 1 << 30, 0, ATTN_CFG)
    assert_within_limits(stubs)
    assert [programs(g) for g in stubs["flash_query_kernel"].grids] == [n]


def test_attention_warp_specialized_forward_512_x_128_fits_the_grid(monkeypatch):
    """Hopper's warp-specialized forward, 512 sequences x 128 heads: the heads and row blocks on axis 0."""
    stubs = stub_kernels(monkeypatch, flash_ws_kernel, "flash_fwd_ws_kernel")
    batch, heads, seq = 512, 128, 32
    q = _expanded(batch, seq, heads, 64)
    flash_ws_kernel.flash_fwd_ws(q, q, q, batch, seq, seq, 0.125, 1 << 30, 0, AttnCfg(16, 16, 4, 1, ws=True))
    assert_within_limits(stubs)
    assert [programs(g) for g in stubs["flash_fwd_ws_kernel"].grids] == [batch * heads * 2]


def test_attention_fp8_512_sequences_x_128_heads_fit_the_grid(monkeypatch):
    """FP8 attention, 512 x 128: quantize_qkv's row, key-block and v passes, then the forward kernel (heads and row
    blocks on axis 0; the key blocks' and v's (sequence, head) pairs on axis 0, their token tiles on axis 1)."""
    stubs = stub_kernels(monkeypatch, fp8_quantize_kernel, "quantize_rows_kernel", "quantize_key_blocks_kernel",
                         "quantize_v_kernel")
    stubs.update(stub_kernels(monkeypatch, fp8_kernel, "flash_fp8_fwd_kernel"))
    batch, heads, seq, d = 512, 128, 16, 32
    x = torch.zeros(batch, seq, heads, d, dtype=torch.bfloat16)
    qkv = fp8_api.quantize_qkv(x, x, x, qk_format="fp8", backend="triton")
    fp8_api.flash_attention_quantized(qkv, causal=True, backend="triton")
    assert_within_limits(stubs)
    assert stubs["quantize_v_kernel"].grids == [(batch * heads, 1, 1)]
    assert stubs["quantize_key_blocks_kernel"].grids == [(batch * heads, 1, 1)]  # e4m3's default 128-key scales
    assert [programs(g) for g in stubs["flash_fp8_fwd_kernel"].grids] == [batch * heads]


# -------------------------------------------------------------------------------------------- evoformer
@pytest.mark.parametrize("fused", [False, True], ids=["two-pass backward", "fused backward"])
def test_evoformer_2_x_5120_rows_x_8_heads_fit_the_grid(monkeypatch, fused):
    """Evoformer forward and backward over a batch of 2 x 5120 extra-MSA rows x 8 heads (81920 (b, s, h) rows):
    the rows on axis 0, their residue tiles on axis 1."""
    stubs = stub_kernels(monkeypatch, evo_kernels, "evo_fwd_kernel", "evo_bwd_prep_kernel", "evo_bwd_dbias_kernel",
                         "evo_bwd_fused_kernel" if fused else "evo_bwd_kernel")
    B, S, R, H, D = 2, 5120, 32, 8, 8
    q = torch.empty(B, S, R, H, D, dtype=torch.float16)
    pair = _expanded(B, 1, H, R, R).expand(B, S, H, R, R)
    cfg = EvoCfg(16, 16, 1, 1)
    out, lse = evo_kernels.evoformer_fwd(q, q, q, (pair,), None, 0.25, cfg)
    evo_kernels.evoformer_bwd(q, q, q, q, out, lse, (pair,), None, 0.25, True, EvoformerTiles(cfg, cfg, cfg, cfg),
                              fused=fused)
    assert_within_limits(stubs)
    rows = B * S * H
    assert stubs["evo_fwd_kernel"].grids == [(rows, R // 16, 1)]
    if fused:
        assert stubs["evo_bwd_fused_kernel"].grids == [(rows, 1, 1)]
    else:
        assert stubs["evo_bwd_kernel"].grids == [(rows, R // 16, 1)] * 2  # dk/dv, dq
