"""The Hopper Gluon forward and backward of sparse_attention (ops/sparse/sparse_gluon_kernel.py over the kernels they
share with dense attention, ops/_gluon_flash_fwd.py and _gluon_flash_bwd.py): the gate, a compile for sm_90 on CPU
where the installed Triton is one their Gluon API was written for, and on an sm_90 GPU their outputs against the
fp32 reference and the portable kernels (forced on with WARPFORGE_SPARSE_GLUON=1, the portable ones with =0)."""
import itertools
import math
import os

import pytest
import torch

import warpforge as wf
from warpforge.ops import _gluon_flash_fwd as fg
from warpforge.ops._gluon import compile_in_subprocess, import_loads_gluon
from warpforge.ops.sparse import api, configs, sparse_attention_reference
from warpforge.ops.sparse import sparse_gluon_kernel as sg
from warpforge.ops.sparse.select import blocks_per_sequence, canonical
from warpforge.ops.sparse.sparse_kernel import kept_by
from warpforge.testing import REL_L2, gluon_triton, on_sm90_gluon, poisoned_outputs, rel_l2, spy_launches, \
    triton_version

from tests.attention.test_attention_gluon_bwd import LOG2E, emulate_step, emulate_store  # the backward's step, shared

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_table_fits_and_import_is_lazy():
    assert configs.GLUON_TRITON_VERSIONS == fg.GLUON_TRITON_VERSIONS
    for d, (block_n, stages, _, persistent) in configs.GLUON_FWD.items():
        assert d in fg.HEAD_DIMS and stages >= 2 and fg.smem_bytes(d, block_n, stages, persistent) <= fg.SMEM_MAX
    assert not import_loads_gluon(("warpforge.ops.sparse.sparse_gluon_kernel",), ROOT)


def test_knobs_are_the_tables_unless_replaced_whole(monkeypatch):
    for name in ("WARPFORGE_SPARSE_GLUON_FWD", "WARPFORGE_SPARSE_GLUON_BWD"):
        monkeypatch.delenv(name, raising=False)
    assert api.gluon_knobs(128) == (configs.GLUON_FWD[128], configs.GLUON_BWD[128])
    monkeypatch.setenv("WARPFORGE_SPARSE_GLUON_FWD", "64,4,1,0")
    monkeypatch.setenv("WARPFORGE_SPARSE_GLUON_BWD", "64,2,128,0,1,2,1,2")
    assert api.gluon_knobs(64) == ((64, 4, True, False), (64, 2, 128, False, True, 2, 1, 2))
    monkeypatch.setenv("WARPFORGE_SPARSE_GLUON_BWD", "64,2")
    with pytest.raises(ValueError, match="8 comma-separated"):
        api.gluon_knobs(128)


def test_backward_head_groups_fit_their_working_set(monkeypatch):
    """HEAD_GROUP (the backward's program order) is capped so that the group's Q, dO and dQ accumulator fit
    configs.GLUON_BWD_GROUP_BYTES: the table's 4 at 16k (d 128), 2 at 32k, 1 (head after head) at 64k and past; knobs
    the environment set are taken as given (a sweep)."""
    monkeypatch.delenv("WARPFORGE_SPARSE_GLUON_BWD", raising=False)
    table = configs.GLUON_BWD[128]
    assert [api.gluon_bwd_knobs(128, s)[6] for s in (1024, 16384, 32768, 65536, 1 << 20)] == [4, 4, 2, 1, 1]
    knobs = api.gluon_bwd_knobs(128, 65536)
    assert knobs[:6] == table[:6] and knobs[7:] == table[7:]
    monkeypatch.setenv("WARPFORGE_SPARSE_GLUON_BWD", "64,3,64,1,1,0,4,0")
    assert api.gluon_bwd_knobs(128, 65536)[6] == 4


def test_gate_off_where_it_does_not_apply(monkeypatch):
    monkeypatch.setenv(configs.GLUON_ENV, "1")
    q = torch.randn(1, 256, 2, 128, dtype=torch.bfloat16)
    assert not api.gluon_gate(q, q, q, None, 128)  # a CPU tensor
    monkeypatch.setattr(api, "arch_key", lambda device: "sm90")
    assert not api.gluon_gate(q, q, q, None, 128)  # still a CPU tensor
    monkeypatch.setenv(configs.GLUON_ENV, "0")
    assert not api.gluon_gate(q, q, q, None, 128)


def test_bad_sparse_blocks_are_refused():
    """An item of 128 query rows must lie in one query block, and a block in whole key tiles."""
    q = torch.empty(1, 256, 2, 128)
    sel, n_sel = torch.empty(1, 2, 4, 2, dtype=torch.int32), torch.empty(1, 2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 128"):
        fg.launch_args(q, q, q, q, torch.empty(1, 2, 256), 1.0, True, 128, 2, True, blocks=(sel, n_sel, 64))


# ------------------------------------------------------------------------------ the sparse walks, emulated
def _lists(idx, s_q, s_k, bs, causal):
    """The kernels' inputs from block_indices: canonical (sel, n_sel) and the CSR lists (offsets, qblocks)."""
    nb_seq = blocks_per_sequence(None, idx.shape[0], s_k, bs, idx.device)
    sel, n_sel = canonical(idx, nb_seq, causal, (s_k - s_q) // bs)
    offsets, qblocks = kept_by(sel, -(-s_k // bs), causal)
    return sel, n_sel, offsets, qblocks


def _emulate_fwd(q, k, v, sel, n_sel, bs, causal, BLOCK_N=128):
    """_gluon_flash_fwd's SPARSE _tile / _key_row / _step_mask in float64: items of 128 rows (two 64-row warpgroups)
    walk the kept blocks' tiles (unmasked when causal: rows past s_k would count as zero keys), then the own
    block's. Returns (out, lse) like sparse_attention."""
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    G, scale, shift = h_q // h_kv, d ** -0.5, s_k - s_q
    n_kb = -(-s_k // bs)
    Kp = torch.cat([k, k.new_zeros(b, n_kb * bs + BLOCK_N - s_k, h_kv, d)], 1)  # TMA: rows past s_k read as 0
    Vp = torch.cat([v, v.new_zeros(b, n_kb * bs + BLOCK_N - s_k, h_kv, d)], 1)
    out = torch.zeros_like(q)
    lse = torch.full((b, h_q, s_q), -math.inf, dtype=torch.float64)
    for bb, pid_m, h in itertools.product(range(b), range(-(-s_q // 128)), range(h_q)):
        m_lo, g = pid_m * 128, h // G
        i = m_lo // bs
        n_kept = int(n_sel[bb, g, i]) * (bs // BLOCK_N)
        own_lo = i * bs + shift
        own_hi = min(m_lo + 128, s_q) + shift if causal else min(own_lo + bs, s_k)
        j0, n_tiles = own_lo // BLOCK_N, n_kept + -(-(own_hi - own_lo) // BLOCK_N)
        for wg in range(2):
            rows = torch.arange(m_lo + 64 * wg, m_lo + 64 * wg + 64)
            live = rows < s_q
            if not live.any():
                continue
            scores, values = [], []
            for j in range(n_tiles):
                if j < n_kept:
                    n0 = int(sel[bb, g, i, j // (bs // BLOCK_N)]) * bs + (j % (bs // BLOCK_N)) * BLOCK_N
                else:
                    n0 = (j0 + j - n_kept) * BLOCK_N
                masked = j >= n_kept if causal else (j >= n_kept or n0 + BLOCK_N > s_k)
                cols = torch.arange(n0, n0 + BLOCK_N)
                S = q[bb, rows[live], h] @ Kp[bb, n0:n0 + BLOCK_N, g].T * scale
                if masked:
                    ok = (cols < s_k)[None, :] & ((cols[None, :] <= (rows[live] + shift)[:, None]) if causal else True)
                    S = torch.where(ok, S, -math.inf)
                scores.append(S)
                values.append(Vp[bb, n0:n0 + BLOCK_N, g])
            S = torch.cat(scores, 1)
            lse[bb, h, rows[live]] = torch.logsumexp(S, 1)
            out[bb, rows[live], h] = torch.softmax(S, 1) @ torch.cat(values, 0)
    return out, lse


def _padded(q, k, v, do, out, lse, bs):
    """The backward emulations' inputs as the kernel sees them: Q, dO padded to whole query blocks, K, V to whole key
    blocks (zeros), lse2 (+inf past s_q) and delta (0 past s_q) per row, the fp64 dQ accumulator."""
    b, s_q, h_q, d = q.shape
    n_kb, s_pad = -(-k.shape[1] // bs), -(-s_q // bs) * bs
    pad = lambda t, n: torch.cat([t, t.new_zeros(t.shape[0], n - t.shape[1], *t.shape[2:])], 1)
    lse2 = torch.full((b, h_q, s_pad), math.inf, dtype=torch.float64)
    lse2[:, :, :s_q] = lse * LOG2E
    dl = torch.zeros((b, h_q, s_pad), dtype=torch.float64)
    dl[:, :, :s_q] = (out * do).sum(-1).transpose(1, 2)
    return (pad(q, s_pad), pad(do, s_pad), pad(k, n_kb * bs), pad(v, n_kb * bs), lse2, dl,
            torch.zeros((b, h_q, s_pad, d), dtype=torch.float64))


def _emulate_program(padded, bb, kvh, heads, n0, tiles, s_q, s_k, causal, BM):
    """One program's two 64-key warpgroups over query tiles `tiles` of query heads `heads` (emulate_step, the kernel's
    mask branches); dQ summed into padded's accumulator. Returns [(key_lo, dK unscaled, dV)] per warpgroup."""
    Qp, DOp, Kp, Vp, lse2, dl, dq_acc = padded
    d = Qp.shape[-1]
    sums = []
    for wg in range(2):
        key_lo = n0 + 64 * wg
        K, V = Kp[bb, key_lo:key_lo + 64, kvh], Vp[bb, key_lo:key_lo + 64, kvh]
        dK = torch.zeros(64, d, dtype=torch.float64)
        dV = torch.zeros(64, d, dtype=torch.float64)
        for h, i in itertools.product(heads, tiles):
            emulate_step(Qp, DOp, K, V, lse2, dl, dq_acc, dK, dV, bb, h, i * BM, BM, d ** -0.5, s_k - 1 - key_lo,
                         s_k - s_q - key_lo, causal)
        sums.append((key_lo, dK, dV))
    return sums


def _own_tiles(j, n0, s_q, s_k, bs, causal, BM):
    """A key block's own query block's tiles (from the first that sees the program's first key when causal)."""
    own, TPB = j - (s_k - s_q) // bs, bs // BM
    first = max(own * bs, n0 - (s_k - s_q)) // BM if causal else own * TPB
    return list(range(first, (own + 1) * TPB)) if own >= 0 else []


def _emulate_bwd(q, k, v, do, out, lse, offsets, qblocks, bs, causal, BM=64):
    """_gluon_flash_bwd's SPARSE _walk / _query_tile and its mask rule in float64: programs of 128 keys (two 64-key
    warpgroups) walk, per head, the query blocks that kept their key block, BS / BM tiles each, then their own
    block's tiles from the first that sees their keys; statistics padded to whole blocks (lse2 +inf, delta 0)."""
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    G, n_kb, TPB = h_q // h_kv, -(-s_k // bs), bs // BM
    padded = _padded(q, k, v, do, out, lse, bs)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for pid0, bb, kvh in itertools.product(range(-(-s_k // 128)), range(b), range(h_kv)):
        n0 = pid0 * 128
        key = (bb * h_kv + kvh) * n_kb + n0 // bs
        kept = [int(x) * TPB + t for x in qblocks[int(offsets[key]):int(offsets[key + 1])] for t in range(TPB)]
        tiles = kept + _own_tiles(n0 // bs, n0, s_q, s_k, bs, causal, BM)
        for key_lo, dK, dV in _emulate_program(padded, bb, kvh, range(kvh * G, kvh * G + G), n0, tiles, s_q, s_k,
                                               causal, BM):
            emulate_store(dk, dv, dK, dV, bb, key_lo, kvh, s_k, d ** -0.5)
    return (padded[-1][:, :, :s_q] * d ** -0.5).transpose(1, 2), dk, dv


def _emulate_bwd_items(q, k, v, do, out, lse, items, bs, causal, group_split, BM=64):
    """The same in query-block order (flash_bwd_gluon's work list, sparse_gluon_kernel.query_block_items): program
    p's item (key tile, slice, query block, kind) walks GROUP / group_split heads over the query block's tiles (kind
    1) or the key block's own tiles (kind 2, as the key-major walk's own part) or nothing (kind 0); dK / dV summed over
    the items (the kernel's fp32 reduce-adds)."""
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    n_kb, TPB = -(-s_k // bs), bs // BM
    heads = h_q // h_kv // group_split
    padded = _padded(q, k, v, do, out, lse, bs)
    dk_acc = torch.zeros((b, n_kb * bs, h_kv, d), dtype=torch.float64)
    dv_acc = torch.zeros_like(dk_acc)
    for kt, bkv, qb, kind in items.tolist():
        n0 = kt * 128
        bb, kvh_split = bkv // (h_kv * group_split), bkv % (h_kv * group_split)
        tiles = {0: [], 1: list(range(qb * TPB, (qb + 1) * TPB)),
                 2: _own_tiles(n0 // bs, n0, s_q, s_k, bs, causal, BM)}[kind]
        for key_lo, dK, dV in _emulate_program(padded, bb, kvh_split // group_split,
                                               range(kvh_split * heads, kvh_split * heads + heads), n0, tiles, s_q,
                                               s_k, causal, BM):
            dk_acc[bb, key_lo:key_lo + 64, kvh_split // group_split] += dK * d ** -0.5
            dv_acc[bb, key_lo:key_lo + 64, kvh_split // group_split] += dV
    return (padded[-1][:, :, :s_q] * d ** -0.5).transpose(1, 2), dk_acc[:, :s_k], dv_acc[:, :s_k]


@pytest.mark.parametrize("group_split", [1, 2])
@pytest.mark.parametrize("causal, s_q, s_k, h_q, h_kv, topk", [
    (True, 300, 300, 4, 2, 2),     # a partial last block
    (True, 200, 456, 4, 1, 3),     # keys longer than the queries (by 2 blocks), partial last block
    (False, 300, 300, 4, 2, 2),    # not causal: the own block whole
])
def test_query_block_items_emulated_match_reference(causal, s_q, s_k, h_q, h_kv, topk, group_split):
    """The backward in query-block order (the work list's items, each walked as _walk's WORKLIST branch does) gives
    the reference's gradients: every kept pair and every own block once, for each head of each slice."""
    torch.manual_seed(0)
    d, bs = 16, 128
    q, k, v = (torch.randn(2, n, h, d, dtype=torch.float64) for n, h in ((s_q, h_q), (s_k, h_kv), (s_k, h_kv)))
    do = torch.randn(2, s_q, h_q, d, dtype=torch.float64)
    idx = torch.randint(-1, -(-s_k // bs), (2, h_kv, -(-s_q // bs), topk), dtype=torch.int32)
    sel, n_sel, _, _ = _lists(idx, s_q, s_k, bs, causal)
    items = sg.query_block_items(sel, -(-s_k // bs), group_split)
    assert items.shape == (2 * h_kv * group_split * sel.shape[2] * (topk + 1), 4) and items.dtype == torch.int32
    assert int((items[:, 3] == 1).sum()) == int(n_sel.sum()) * group_split
    out, lse = _emulate_fwd(q, k, v, sel, n_sel, bs, causal)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = sparse_attention_reference(*ref_in, idx, block_size=bs, causal=causal, compute_dtype=torch.float64)
    want = torch.autograd.grad(ref_out, ref_in, do)
    got = _emulate_bwd_items(q, k, v, do, out, lse, items, bs, causal, group_split)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.allclose(g, w, atol=1e-9), name


@pytest.mark.parametrize("causal, s_q, s_k, h_q, h_kv, bs, topk", [
    (True, 300, 300, 4, 2, 128, 2),     # a partial last block
    (True, 200, 456, 2, 1, 128, 3),     # keys longer than the queries (by 2 blocks), partial last block
    (False, 300, 300, 2, 2, 256, 2),    # blocks of two items / two key programs; kept partial last blocks
    (True, 520, 520, 4, 1, 256, 1),     # block 256: own-block tiles from the first that sees the keys
])
def test_walks_emulated_match_reference(causal, s_q, s_k, h_q, h_kv, bs, topk):
    """The Gluon kernels' sparse walks (which tiles, which get the mask, the padded statistics), replayed in float64
    on CPU, give the reference's outputs and gradients: a wrong tile, limit or mask branch would not."""
    torch.manual_seed(0)
    d = 16
    q, k, v = (torch.randn(1, n, h, d, dtype=torch.float64) for n, h in ((s_q, h_q), (s_k, h_kv), (s_k, h_kv)))
    do = torch.randn(1, s_q, h_q, d, dtype=torch.float64)
    idx = torch.randint(-1, -(-s_k // bs), (1, h_kv, -(-s_q // bs), topk), dtype=torch.int32)
    sel, n_sel, offsets, qblocks = _lists(idx, s_q, s_k, bs, causal)
    out, lse = _emulate_fwd(q, k, v, sel, n_sel, bs, causal)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = sparse_attention_reference(*ref_in, idx, block_size=bs, causal=causal,
                                                  compute_dtype=torch.float64)
    assert torch.allclose(out, ref_out, atol=1e-10) and torch.allclose(lse, ref_lse.double(), atol=1e-10)
    want = torch.autograd.grad(ref_out, ref_in, do)
    got = _emulate_bwd(q, k, v, do, out, lse, offsets, qblocks, bs, causal)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.allclose(g, w, atol=1e-9), name


def test_work_list_needs_the_staging_knobs():
    """Query order stages dK / dV fp32 in the ring for TMA reduce-adds: knobs without DQ_TMA, or with too small a ring,
    keep key order (api._bwd_impl asks work_list_fits)."""
    assert sg.work_list_fits(configs.GLUON_BWD[128]) and sg.work_list_fits(configs.GLUON_BWD[64])
    assert not sg.work_list_fits((64, 3, 64, 1, 0, 0, 1, 0))      # dQ by atomics
    assert not sg.work_list_fits((64, 1, 64, 1, 1, 0, 1, 0))      # one 64-row slot: no room for a [64, d] fp32 tile


def test_backward_order_knob(monkeypatch):
    """Query order once a head's Q, dO and dQ accumulator pass configs.GLUON_BWD_QUERY_ORDER_BYTES (d 128: 64k
    queries, not 32k), unless the environment says "key" or "query"; anything else is an error naming it."""
    monkeypatch.delenv(configs.GLUON_BWD_ORDER_ENV, raising=False)
    assert api.gluon_bwd_order(128, 32768) == "key" and api.gluon_bwd_order(128, 65536) == "query"
    assert api.gluon_bwd_order(64, 65536) == "key" and api.gluon_bwd_order(64, 131072) == "query"
    monkeypatch.setenv(configs.GLUON_BWD_ORDER_ENV, "query")
    assert api.gluon_bwd_order(128, 1024) == "query"
    monkeypatch.setenv(configs.GLUON_BWD_ORDER_ENV, "key")
    assert api.gluon_bwd_order(128, 1 << 20) == "key"
    monkeypatch.setenv(configs.GLUON_BWD_ORDER_ENV, "rows")
    with pytest.raises(ValueError, match=configs.GLUON_BWD_ORDER_ENV):
        api.gluon_bwd_order(128, 1024)


# ------------------------------------------------------------------------------------ compile for sm_90
COMPILE_CASES = [  # (module, its compile_sm90's arguments): the forward's, then the backward's
    ("_gluon_flash_fwd", dict(d=128, causal=True, block_n=128, stages=2, block_size=128)),
    ("_gluon_flash_fwd", dict(d=64, causal=False, block_n=64, stages=3, block_size=256, h_q=4, h_kv=4,
                              dtype="float16")),
    ("_gluon_flash_bwd", dict(d=128, causal=True, stages=3, dq_split=True, dq_tma=True, group_split=2,
                              block_size=128)),
    ("_gluon_flash_bwd", dict(d=64, causal=False, stages=4, dq_tma=True, block_size=256, dtype="float16")),
    # the programs in query-block order (a work list), the table's d 128 knobs
    ("_gluon_flash_bwd", dict(d=128, causal=True, stages=3, dq_split=True, dq_tma=True, block_size=128, key_rows=2,
                              worklist=True)),
]


@pytest.mark.skipif(not gluon_triton(fg.GLUON_TRITON_VERSIONS), reason=f"the Gluon kernel is written for Triton "
                    f"{fg.GLUON_TRITON_VERSIONS} (installed: {triton_version()}); its API differs between releases")
@pytest.mark.parametrize("module, case", COMPILE_CASES,
                         ids=[m[-3:] + "-" + "-".join(f"{k}{v}" for k, v in c.items()) for m, c in COMPILE_CASES])
def test_compiles_for_sm90(module, case):
    r = compile_in_subprocess("warpforge.ops." + module, case, ROOT)
    assert r["wgmma"] and r["tma"] and r["setmaxnreg"] and r["warp_specialize"] and r["num_warps"] == 12
    assert r["ptxas_rc"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas_log"]
    assert not r["wgmma_serialized"], r["ptxas_log"]


# ------------------------------------------------------------------------------------------ GPU numerics
needs_h200 = pytest.mark.skipif(not on_sm90_gluon(fg.GLUON_TRITON_VERSIONS),
                                reason=f"the Gluon forward runs on sm_90 with Triton {fg.GLUON_TRITON_VERSIONS}")


def _grads(q, k, v, idx, bs, causal, d_out):
    """out, lse and (dq, dk, dv) of wf.sparse_attention (the kernels the gate picks)."""
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with poisoned_outputs():
        out, lse = wf.sparse_attention(*ins, block_indices=idx, block_size=bs, causal=causal, return_lse=True)
        grads = torch.autograd.grad(out, ins, d_out)
    return out, lse, grads


@pytest.mark.gpu
@needs_h200
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal, s_q, s_k, h_q, h_kv, d, bs, topk", [
    (True, 1000, 1000, 8, 2, 128, 128, 3),    # a partial last block, GQA 4
    (True, 384, 1152, 4, 1, 64, 128, 4),      # keys longer than the queries by 6 blocks, MQA
    (False, 1000, 1000, 4, 4, 128, 256, 2),   # blocks of two items; a kept block may be the partial last one
    (True, 640, 640, 16, 2, 128, 256, 8),     # top-k past the blocks a query block can see; GQA 8
    (True, 1024, 1024, 8, 1, 128, 128, 1),    # every query block keeps block 0: one key block walked by all
    (False, 1000, 1000, 4, 4, 128, 128, 3),   # MHA, not causal, a partial last block
])
@pytest.mark.parametrize("order", ["key", "query"])
def test_gpu_matches_reference_and_portable_kernels(monkeypatch, dtype, causal, s_q, s_k, h_q, h_kv, d, bs, topk,
                                                    order):
    """Forward and backward on the Gluon kernels against the fp32 reference and the portable kernels; the backward's
    programs key tile by key tile or in query-block order (128-row blocks; 256 keep key order)."""
    monkeypatch.setenv(configs.GLUON_BWD_ORDER_ENV, order)
    work_lists = spy_launches(monkeypatch, sg, "query_block_items", lambda args: args[0].shape)
    dev = "cuda"
    q = torch.randn(2, s_q, h_q, d, device=dev, dtype=dtype)
    k = torch.randn(2, s_k, h_kv, d, device=dev, dtype=dtype)
    v = torch.randn(2, s_k, h_kv, d, device=dev, dtype=dtype)
    nqb, nkb = -(-s_q // bs), -(-s_k // bs)
    idx = torch.randint(-1, nkb, (2, h_kv, nqb, topk), device=dev, dtype=torch.int32)  # repeats and own included
    if topk == 1:
        idx.zero_()
    d_out = torch.randn(2, s_q, h_q, d, device=dev, dtype=dtype)
    fwd = spy_launches(monkeypatch, sg, "sparse_fwd_gluon", lambda args: args[5], {configs.GLUON_ENV: "1"})
    bwd = spy_launches(monkeypatch, sg, "sparse_bwd_gluon", lambda args: args[8])
    out, lse, grads = _grads(q, k, v, idx, bs, causal, d_out)
    assert fwd == [bs] and bwd == [bs]
    assert len(work_lists) == (order == "query" and bs == 128)   # query order ran where it applies
    monkeypatch.setenv(configs.GLUON_ENV, "0")
    out_p, lse_p, grads_p = _grads(q, k, v, idx, bs, causal, d_out)
    assert len(fwd) == 1 and len(bwd) == 1
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = sparse_attention_reference(*ref_in, idx, block_size=bs, causal=causal)
    want = torch.autograd.grad(ref_out, ref_in, d_out.float())
    assert rel_l2(out, ref_out) <= REL_L2[dtype]
    assert rel_l2(lse, ref_lse) <= 1e-3
    assert rel_l2(out, out_p) <= REL_L2[dtype] and rel_l2(lse, lse_p) <= 1e-3
    for name, g, g_p, r in zip(("dq", "dk", "dv"), grads, grads_p, want):
        assert rel_l2(g, r) <= 2e-2, name
        assert rel_l2(g, g_p) <= 2e-2, name
