"""sparse_attention, select_blocks and sparse_attention_index_loss against the references: forward, lse, gradients,
selection, varlen, blocks that are not full at sequence ends, top-k larger than the visible blocks, bad input.

On a CPU machine the kernels run through the Triton interpreter at small shapes (fp16 / fp32); on a GPU the same
tests run compiled, in bf16 too, plus the larger shapes marked gpu.
"""
import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.ops.sparse import (index_block_scores_reference, index_loss_reference, sparse_attention_reference,
                                  sparse_attention_varlen_reference)
from warpforge.ops.sparse.select import blocks_per_sequence, canonical, top_blocks
from warpforge.testing import (REL_L2, device_under_test, dtypes_under_test, graph_replayed, poisoned_outputs,
                               ragged_cu_seqlens, rel_l2)

DEV = device_under_test()
DTYPES = dtypes_under_test()


def _qkv(lead, h_q, h_kv, d, dtype, d_v=None):
    q = torch.randn(*lead, h_q, d, device=DEV, dtype=dtype)
    k = torch.randn(*lead, h_kv, d, device=DEV, dtype=dtype)
    v = torch.randn(*lead, h_kv, d_v or d, device=DEV, dtype=dtype)
    return q, k, v


def _index(lead, h_kv, d_i, dtype):
    return (torch.randn(*lead, h_kv, d_i, device=DEV, dtype=dtype), torch.randn(*lead, 1, d_i, device=DEV, dtype=dtype))


def _random_indices(b, h_kv, nb, topk):
    """Random entries from -1 to nb - 1: repeats, the own block and (causal) later blocks included, which the op
    must ignore."""
    return torch.randint(-1, nb, (b, h_kv, nb, topk), device=DEV, dtype=torch.int32)


def _check_attention(q, k, v, idx, bs, causal, cu=None):
    dtype = q.dtype
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kw = dict(block_indices=idx, block_size=bs, causal=causal, return_lse=True, backend="triton")
    if cu is not None:
        kw["cu_seqlens"] = cu
    with poisoned_outputs():
        out, lse = wf.sparse_attention(q, k, v, **kw)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    if cu is None:
        ref_out, ref_lse = sparse_attention_reference(*ref_in, idx, block_size=bs, causal=causal)
    else:
        ref_out, ref_lse = sparse_attention_varlen_reference(*ref_in, idx, cu, block_size=bs, causal=causal)
    assert rel_l2(out, ref_out) <= REL_L2[dtype]
    assert rel_l2(lse, ref_lse) <= 1e-3
    d_out = torch.randn_like(out)
    with poisoned_outputs():
        got = torch.autograd.grad(out, (q, k, v), d_out)
    want = torch.autograd.grad(ref_out, ref_in, d_out.float())
    for name, g, r in zip(("dq", "dk", "dv"), got, want):
        assert rel_l2(g, r) <= (2e-2 if dtype != torch.float32 else 1e-4), name


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s, h_q, h_kv, d, topk", [(80, 4, 2, 16, 2), (37, 3, 1, 24, 5), (16, 2, 2, 32, 1)])
def test_given_blocks_match_reference(dtype, causal, s, h_q, h_kv, d, topk):
    """Partial last blocks (80 and 37 are not multiples of 16), a top-k larger than the blocks a query block can
    see, head dims that are not powers of two, GQA groups 2, 3 and 1."""
    bs = 16
    q, k, v = _qkv((2, s), h_q, h_kv, d, dtype)
    idx = _random_indices(2, h_kv, -(-s // bs), topk)
    _check_attention(q, k, v, idx, bs, causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_matches_reference(dtype):
    lengths = [33, 0, 16, 50]
    cu = ragged_cu_seqlens(lengths, DEV)
    q, k, v = _qkv((sum(lengths),), 4, 2, 16, dtype)
    idx = _random_indices(len(lengths), 2, -(-max(lengths) // 16), 3)
    _check_attention(q, k, v, idx, 16, True, cu)


def test_v_head_dim_different_from_qk():
    q, k, v = _qkv((1, 48), 2, 1, 32, torch.float16, d_v=16)
    _check_attention(q, k, v, _random_indices(1, 1, 3, 2), 16, True)


@pytest.mark.parametrize("nb,topk", [(9, 3), (5, 8), (40, 16), (1, 2)])
def test_launched_top_blocks_match_the_tensor_ops(nb, topk):
    """sparse_kernel.top_blocks (one launch after the top-k) gives select.top_blocks' lists and their counts on
    scores with non-candidates at -inf (fewer candidates than topk, none at all, topk past the blocks)."""
    from warpforge.ops.sparse import sparse_kernel
    torch.manual_seed(nb * 100 + topk)
    z = torch.randn(2, 3, 7, nb, device=DEV)
    z = z.masked_fill(torch.rand_like(z) < 0.4, float("-inf"))
    z[0, 0, 0] = float("-inf")  # a query block without candidates
    sel, n_sel = sparse_kernel.top_blocks(z, topk)
    want = top_blocks(z, topk, True, masked=True)
    assert sel.dtype == n_sel.dtype == torch.int32 and sel.is_contiguous()
    assert torch.equal(sel, want) and torch.equal(n_sel, (want >= 0).sum(-1, dtype=torch.int32))


@pytest.mark.parametrize("causal", [True, False])
def test_selection_matches_reference(causal):
    b, s, h_kv, bs = 2, 70, 2, 16
    iq, ik = _index((b, s), h_kv, 16, torch.float32)
    got = wf.select_blocks(iq, ik, block_size=bs, topk=3, causal=causal, index_scale=0.25, backend="triton")
    z_ref = index_block_scores_reference(iq, ik, block_size=bs, index_scale=0.25)
    assert torch.equal(got, top_blocks(z_ref, 3, causal))
    # canonical already: sparse_attention walks the selector's lists as they are
    assert torch.equal(canonical(got, blocks_per_sequence(None, b, s, bs, DEV), causal)[0], got)
    nb = -(-s // bs)
    i = torch.arange(nb, device=DEV)[:, None]
    valid = got >= 0
    assert bool(((got < i) | ~valid).all()) if causal else bool(((got != i) | ~valid).all())
    # the first query blocks see fewer earlier blocks than topk: the rest is -1
    if causal:
        assert torch.equal((got[:, :, 0] >= 0).sum(-1), torch.zeros(b, h_kv, dtype=torch.int64, device=DEV))
        assert torch.equal((got[:, :, 1] >= 0).sum(-1), torch.ones(b, h_kv, dtype=torch.int64, device=DEV))


@pytest.mark.parametrize("causal, q_off, topk", [(True, 0, 3), (False, 0, 5), (True, 2, 4), (False, 3, 1)])
def test_kept_by_inverts_the_lists(causal, q_off, topk):
    """kept_by's CSR lists: for each key block, the query blocks whose canonical list holds it, ascending; the
    offsets their running counts. Against the lists inverted in Python, over two sequences and two kv heads,
    padded lists (-1) and keys longer than the queries."""
    from warpforge.ops.sparse.sparse_kernel import kept_by
    b, h_kv, nqb = 2, 2, 37
    nkb = nqb + q_off
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(-1, nkb, (b, h_kv, nqb, topk), generator=gen).to(DEV)
    sel, _ = canonical(idx, blocks_per_sequence(None, b, nkb, 1, DEV), causal, q_off)
    offsets, qblocks = kept_by(sel, nkb, causal)
    assert offsets.dtype == qblocks.dtype == torch.int32 and offsets.shape == (b * h_kv * nkb + 1,)
    lists = sel.reshape(b * h_kv, nqb, topk).tolist()
    start = 0
    for key in range(b * h_kv * nkb):
        g, j = divmod(key, nkb)
        want = [i for i in range(nqb) if j in lists[g][i]]
        assert offsets[key].item() == start
        assert qblocks[start:start + len(want)].tolist() == want
        start += len(want)
    assert offsets[-1].item() == start


def test_index_side_launches_keep_the_cached_launch_contract():
    """The api passes ops/_op.py's cached_launch to the block means, the block scores and the kept lists: on a GPU it
    calls the compiled kernel with the positional arguments as its non-constexpr parameters, in order, and the
    constexprs (its last parameters) from the keywords; anything else would launch with arguments shifted."""
    import inspect
    import triton.language as tl
    from warpforge.ops.sparse import sparse_kernel as sk
    from warpforge.ops.sparse.configs import TILES
    calls = []

    def launch(kernel, grid, *args, **meta):
        calls.append(kernel.fn.__name__)
        params = list(inspect.signature(kernel.fn).parameters.values())
        constexprs = [p.name for p in params if p.annotation is tl.constexpr]
        assert [p.name for p in params[len(args):]] == constexprs and set(constexprs) <= set(meta)
        assert not any(a is None for a in args)
        kernel[grid](*args, **meta)

    cfg = TILES.lookup(torch.device(DEV), 16).index
    iq, ik = _index((1, 70), 2, 16, torch.float16)
    ik_long = torch.cat([ik, ik[:, :32]], 1)  # keys two blocks longer than the queries
    pooled = sk.pool_index_queries(iq, None, 1, 70, 16, launch)
    z = sk.index_block_scores(pooled, ik_long, None, 1, 70, 16, True, 0.25, cfg, 102, launch)
    sel, _ = canonical(top_blocks(z, 3, True, masked=True), blocks_per_sequence(None, 1, 102, 16, DEV), True, 2)
    sk.kept_by(sel, 7, True, launch)
    assert calls == ["pool_index_queries_kernel", "index_scores_kernel", "kept_by_kernel", "kept_by_kernel"]


def test_index_scores_of_16bit_inputs_are_the_fp32_scores():
    """16-bit index inputs take the three-part TF32 dot (exact products): the block scores are the fp32 reference's
    (to fp32 rounding of the sums), over a partial last block and varlen sequences."""
    from warpforge.ops.sparse.sparse_kernel import index_block_scores, pool_index_queries
    from warpforge.ops.sparse.configs import TILES
    cfg = TILES.lookup(torch.device(DEV), 16).index
    iq, ik = _index((1, 70), 2, 16, torch.float16)
    ref = index_block_scores_reference(iq.float(), ik.float(), block_size=16, index_scale=0.25)
    pooled = pool_index_queries(iq, None, 1, 70, 16)
    got = index_block_scores(pooled, ik, None, 1, 70, 16, True, 0.25, cfg)
    seen = got > float("-inf")
    torch.testing.assert_close(got[seen], ref[seen], rtol=1e-5, atol=1e-5)
    lengths = [40, 17, 64]
    cu = ragged_cu_seqlens(lengths, DEV)
    iq, _ = _index((sum(lengths),), 2, 8, torch.float16)
    pooled = pool_index_queries(iq, cu, 3, 64, 16)
    for n, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        nb = -(-(e - a) // 16)
        want = torch.stack([iq[a + 16 * i:min(a + 16 * (i + 1), e)].float().mean(0) for i in range(nb)], 1)
        torch.testing.assert_close(pooled[n, :, :nb], want, rtol=1e-5, atol=1e-6)
        assert not pooled[n, :, nb:].any()  # blocks past the sequence pool to 0


def test_selection_varlen_matches_per_sequence():
    lengths = [40, 17, 64]
    cu = ragged_cu_seqlens(lengths, DEV)
    iq, ik = _index((sum(lengths),), 2, 8, torch.float32)
    got = wf.select_blocks(iq, ik, block_size=16, topk=2, cu_seqlens=cu, backend="triton")
    ref = wf.select_blocks(iq, ik, block_size=16, topk=2, cu_seqlens=cu, backend="reference")
    assert torch.equal(got, ref)
    assert torch.equal(canonical(got, blocks_per_sequence(cu, 3, 64, 16, DEV), True)[0], got)
    starts = cu.tolist()
    for n, (a, e) in enumerate(zip(starts[:-1], starts[1:])):
        alone = wf.select_blocks(iq[None, a:e], ik[None, a:e], block_size=16, topk=2, backend="reference")
        nb = -(-(e - a) // 16)
        assert torch.equal(got[n, :, :nb], alone[0])


@pytest.mark.parametrize("causal", [True, False])
def test_end_to_end_with_index_branch(causal):
    q, k, v = _qkv((1, 64), 4, 2, 16, torch.float32)
    iq, ik = _index((1, 64), 2, 8, torch.float32)
    out, idx = wf.sparse_attention(q, k, v, index_q=iq, index_k=ik, block_size=16, topk=2, causal=causal,
                                   return_indices=True, backend="triton")
    ref, _, ref_idx = wf.ops.sparse.sparse_attention_full_reference(q, k, v, iq, ik, None, block_size=16, topk=2,
                                                                    causal=causal)
    assert torch.equal(idx, ref_idx)
    assert rel_l2(out, ref) <= 1e-5


def test_every_block_kept_is_dense_attention():
    """topk covering every earlier block: the sparse attention is causal dense attention."""
    from warpforge.ops.attention import attention_reference
    q, k, v = _qkv((1, 50), 2, 1, 16, torch.float32)
    idx = torch.arange(4, device=DEV, dtype=torch.int32).expand(1, 1, 4, 4).contiguous()
    out = wf.sparse_attention(q, k, v, block_indices=idx, block_size=16, backend="triton")
    ref, _ = attention_reference(q, k, v, causal=True)
    assert rel_l2(out, ref) <= 1e-5


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_index_loss_matches_reference(varlen, causal):
    lengths = [40, 23]
    if varlen:
        cu = ragged_cu_seqlens(lengths, DEV)
        lead, b, nb = (sum(lengths),), len(lengths), 3
    else:
        cu, lead, b, nb = None, (2, 40), 2, 3
    q, k, v = _qkv(lead, 4, 2, 16, torch.float32)
    iq, ik = _index(lead, 2, 8, torch.float32)
    idx = _random_indices(b, 2, nb, 2)
    kw = dict(block_size=16, causal=causal, cu_seqlens=cu)
    _, lse = wf.sparse_attention(q, k, v, block_indices=idx, return_lse=True, backend="triton", **kw)
    grads = []
    losses = []
    for backend in ("triton", "reference"):
        a, c = iq.clone().requires_grad_(), ik.clone().requires_grad_()
        loss = wf.sparse_attention_index_loss(q, k, lse, a, c, idx, backend=backend, **kw)
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, (a, c)))
    assert abs(losses[0].item() - losses[1].item()) <= 1e-5 * max(1.0, abs(losses[1].item()))
    for g, r in zip(*grads):
        assert rel_l2(g, r) <= 1e-4


@pytest.mark.parametrize("group", [3, 16])
def test_index_loss_any_group(group):
    """The statistics kernel walks every head of a group, of any size."""
    q, k, v = _qkv((1, 40), group, 1, 16, torch.float32)
    iq, ik = _index((1, 40), 1, 8, torch.float32)
    idx = _random_indices(1, 1, 3, 2)
    _, lse = wf.sparse_attention(q, k, v, block_indices=idx, block_size=16, return_lse=True, backend="triton")
    losses = [wf.sparse_attention_index_loss(q, k, lse, iq, ik, idx, block_size=16, backend=backend)
              for backend in ("triton", "reference")]
    assert abs(losses[0].item() - losses[1].item()) <= 1e-5 * max(1.0, abs(losses[1].item()))


def test_lists_selected_without_the_mask_are_canonicalised_for_a_causal_walk(monkeypatch):
    """select_blocks(causal=False) may keep later blocks: a causal sparse_attention / index loss given them drops
    those (canonical), where lists selected causally are walked as they are."""
    import warpforge.ops.sparse.api as api
    q, k, v = _qkv((1, 64), 4, 2, 16, torch.float32)
    iq, ik = _index((1, 64), 2, 8, torch.float32)
    sorts = []
    real_canonical = api.canonical
    monkeypatch.setattr(api, "canonical", lambda *a: sorts.append(1) or real_canonical(*a))
    for selected_causal in (False, True):
        sorts.clear()
        idx = wf.select_blocks(iq, ik, block_size=16, topk=3, causal=selected_causal, backend="triton")
        out, lse = wf.sparse_attention(q, k, v, block_indices=idx, block_size=16, return_lse=True, backend="triton")
        loss = wf.sparse_attention_index_loss(q, k, lse, iq, ik, idx, block_size=16, backend="triton")
        assert bool(sorts) == (not selected_causal)
        ref_out, _ = sparse_attention_reference(q, k, v, idx, block_size=16)
        ref_loss = wf.sparse_attention_index_loss(q, k, lse, iq, ik, idx, block_size=16, backend="reference")
        assert rel_l2(out, ref_out) <= 1e-5
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item()))


def test_index_loss_gradient_reaches_index_branch_only():
    q, k, v = _qkv((1, 32), 2, 1, 16, torch.float32)
    q.requires_grad_()
    iq, ik = (t.requires_grad_() for t in _index((1, 32), 1, 8, torch.float32))
    out, lse, idx = wf.sparse_attention(q, k, v, index_q=iq, index_k=ik, block_size=16, topk=1, return_lse=True,
                                        return_indices=True, backend="triton")
    loss = wf.sparse_attention_index_loss(q, k, lse, iq, ik, idx, block_size=16, backend="triton")
    loss.backward()
    assert q.grad is None and iq.grad is not None and ik.grad is not None
    assert torch.isfinite(loss) and loss.item() >= 0


def test_index_loss_reference_is_zero_when_branches_agree():
    """KL is 0 when the index branch's distribution equals the attention's block mass: one kept block per token."""
    q, k, _ = _qkv((1, 16), 2, 1, 16, torch.float32)
    iq, ik = _index((1, 16), 1, 8, torch.float32)
    idx = torch.full((1, 1, 1, 1), -1, dtype=torch.int32, device=DEV)
    assert index_loss_reference(q, k, iq, ik, idx, block_size=16).abs().item() < 1e-6


@pytest.mark.parametrize("bad, match", [
    (dict(block_size=24), "block_size"), (dict(block_size=8), "block_size"), (dict(topk=0), "topk"),
    (dict(block_indices="oob"), "block_indices"), (dict(block_indices="shape"), "block_indices"),
    (dict(gqa=True), "kv heads"), (dict(no_index=True), "index_q"), (dict(index_heads=2), "index_q"),
])
def test_bad_input(bad, match):
    q, k, v = _qkv((1, 32), 4, 2, 16, torch.float16)
    iq, ik = _index((1, 32), 2, 8, torch.float16)
    kw = dict(index_q=iq, index_k=ik, block_size=16, topk=2, backend="triton")
    if "block_size" in bad:
        kw["block_size"] = bad["block_size"]
    if "topk" in bad:
        kw["topk"] = bad["topk"]
    if bad.get("block_indices") == "oob":
        kw["block_indices"] = torch.full((1, 2, 2, 2), 2, dtype=torch.int32, device=DEV)
    if bad.get("block_indices") == "shape":
        kw["block_indices"] = torch.zeros((1, 2, 3, 2), dtype=torch.int32, device=DEV)
    if bad.get("gqa"):
        k, v = k[:, :, :1].expand(1, 32, 3, 16).contiguous(), v[:, :, :1].expand(1, 32, 3, 16).contiguous()
    if bad.get("no_index"):
        kw.pop("index_q")
    if "index_heads" in bad:
        kw["index_q"] = torch.randn(1, 32, 1, 8, device=DEV, dtype=torch.float16)
    with pytest.raises(WarpforgeInputError, match=match):
        wf.sparse_attention(q, k, v, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_bf16_long(d):
    s, bs = 2048 + 77, 128
    q, k, v = _qkv((1, s), 16, 2, d, torch.bfloat16)
    iq, ik = _index((1, s), 2, 32, torch.bfloat16)
    idx = wf.select_blocks(iq, ik, block_size=bs, topk=4)
    _check_attention(q, k, v, idx, bs, True)


def test_every_pass_through_tensor_descriptors(monkeypatch):
    """The passes' TMA paths (sm90's table takes dk/dv's at d 64 / 128), forced on whatever runs the tests."""
    from warpforge.ops.sparse import configs
    monkeypatch.setattr(configs, "TILES", configs.TILES.map(lambda t: t._replace(
        fwd=t.fwd._replace(tma=True), dq=t.dq._replace(tma=True), dkdv=t.dkdv._replace(tma=True))))
    q, k, v = _qkv((2, 40), 4, 2, 32, torch.float16)
    _check_attention(q, k, v, _random_indices(2, 2, 3, 2), 16, True)


def test_views_of_a_packed_qkv():
    """q, k, v as column slices of one projection (as nn modules make them): the gradients have layouts of their
    own, and the kernels write them through their own strides."""
    qkv = torch.randn(2, 40, 4 + 2 * 2, 16, device=DEV, dtype=torch.float16)
    q, k, v = (t.detach().clone() for t in qkv.split([4, 2, 2], dim=2))
    qv, kv_, vv = qkv.requires_grad_().split([4, 2, 2], dim=2)
    idx = _random_indices(2, 2, 3, 2)
    out = wf.sparse_attention(qv, kv_, vv, block_indices=idx, block_size=16, backend="triton")
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    ref, _ = sparse_attention_reference(*ref_in, idx, block_size=16)
    assert rel_l2(out, ref) <= 1e-2
    d_out = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, qkv, d_out)
    want = torch.cat(torch.autograd.grad(ref, ref_in, d_out.float()), dim=2)
    assert rel_l2(g, want) <= 2e-2


def test_dq_by_atomics_in_the_dkdv_pass(monkeypatch):
    from warpforge.ops.sparse import configs
    monkeypatch.setattr(configs, "TILES", configs.TILES.map(lambda t: t._replace(dkdv=t.dkdv._replace(atomic_dq=True))))
    q, k, v = _qkv((2, 40), 4, 2, 32, torch.float16)
    _check_attention(q, k, v, _random_indices(2, 2, 3, 2), 16, True)


@pytest.mark.parametrize("lead", [(1, 0), (0, 32), (2, 1)])
def test_empty_and_one_token_sequences(lead):
    q, k, v = (t.requires_grad_() for t in _qkv(lead, 4, 2, 16, torch.float32))
    iq, ik = _index(lead, 2, 8, torch.float32)
    out, lse, idx = wf.sparse_attention(q, k, v, index_q=iq, index_k=ik, block_size=16, topk=2, return_lse=True,
                                        return_indices=True, backend="triton")
    ref, _ = sparse_attention_reference(q.detach(), k.detach(), v.detach(), idx, block_size=16)
    assert out.shape == ref.shape and (out.numel() == 0 or rel_l2(out, ref) <= 1e-5)
    out.sum().backward()
    a, c = iq.clone().requires_grad_(), ik.clone().requires_grad_()
    loss = wf.sparse_attention_index_loss(q, k, lse, a, c, idx, block_size=16, backend="triton")
    assert torch.isfinite(loss)
    loss.backward()


def test_max_seqlen_shorter_than_a_sequence_is_refused():
    cu = ragged_cu_seqlens([20, 40], DEV)
    q, k, v = _qkv((60,), 2, 1, 16, torch.float16)
    idx = _random_indices(2, 1, 2, 1)
    with pytest.raises(WarpforgeInputError, match="max_seqlen"):
        wf.sparse_attention(q, k, v, block_indices=idx, block_size=32, cu_seqlens=cu, max_seqlen=30, backend="triton")


def test_lse_must_be_the_ops_layout():
    q, k, v = _qkv((1, 32), 2, 1, 16, torch.float32)
    iq, ik = _index((1, 32), 1, 8, torch.float32)
    _, lse, idx = wf.sparse_attention(q, k, v, index_q=iq, index_k=ik, block_size=16, topk=1, return_lse=True,
                                      return_indices=True, backend="triton")
    strided = lse.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(WarpforgeInputError, match="lse"):
        wf.sparse_attention_index_loss(q, k, strided, iq, ik, idx, block_size=16, backend="triton")


def test_backward_fake_is_laid_out_as_the_kernels_write():
    """torch.compile checks the real gradients' strides against the fake's: both contiguous, whatever q's layout."""
    from warpforge.ops.sparse.api import _bwd_fake
    q = torch.randn(1, 4, 32, 16).transpose(1, 2)
    grads = _bwd_fake(None, q, q, q, None, None, None, None, None, 1, 32, 16, True, 0.25)
    assert all(g.is_contiguous() and g.shape == q.shape for g in grads)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_varlen_with_empty_sequences_on_both_backends(backend):
    lengths = [0, 1, 17, 0]
    cu = ragged_cu_seqlens(lengths, DEV)
    q, k, v = _qkv((sum(lengths),), 2, 1, 16, torch.float32)
    iq, ik = _index((sum(lengths),), 1, 8, torch.float32)
    out, lse, idx = wf.sparse_attention(q, k, v, index_q=iq, index_k=ik, block_size=16, topk=1, cu_seqlens=cu,
                                        return_lse=True, return_indices=True, backend=backend)
    loss = wf.sparse_attention_index_loss(q, k, lse, iq, ik, idx, block_size=16, cu_seqlens=cu, backend=backend)
    assert torch.isfinite(out).all() and torch.isfinite(loss)


@pytest.mark.gpu
@pytest.mark.parametrize("gluon", ["0", None])
def test_gpu_selection_and_attention_capture_in_a_cuda_graph(gluon, monkeypatch):
    """No host sync anywhere in selection, forward and backward: the whole step captures, and replays to the eager
    step's values: bitwise on the portable kernels (WARPFORGE_SPARSE_GLUON=0); the default kernels (the Gluon ones
    on an H200) sum dq, dk and dv in arrival order, so there the gradients agree to that order's rounding."""
    from warpforge.ops.sparse import configs
    if gluon is not None:
        monkeypatch.setenv(configs.GLUON_ENV, gluon)
    s, bs = 1024 + 40, 128
    q, k, v = (t.requires_grad_() for t in _qkv((1, s), 8, 2, 64, torch.bfloat16))
    iq, ik = _index((1, s), 2, 32, torch.bfloat16)

    def step():
        out = wf.sparse_attention(q, k, v, index_q=iq, index_k=ik, block_size=bs, topk=3)
        return (out,) + torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    # detached: an output that keeps its graph keeps q/k/v's AccumulateGrad nodes, made on the default stream, and
    # the captured backward would then sync with that stream (torch 2.11 refuses: cudaErrorStreamCaptureImplicit)
    want = tuple(t.detach() for t in step())
    got = graph_replayed(step)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        if gluon == "0":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
            assert rel_l2(a.float(), b.float()) < 1e-3


def test_index_loss_reads_the_selectors_own_indices_back_once(monkeypatch):
    """block_indices that sparse_attention selected are in range by construction: the index loss (every layer, every
    step) does not read them back to check (a host sync); indices changed since are checked again."""
    import warpforge.ops.sparse.api as api
    q, k, v = _qkv((1, 64), 4, 2, 16, torch.float32)
    iq, ik = _index((1, 64), 2, 8, torch.float32)
    _, lse, idx = wf.sparse_attention(q, k, v, index_q=iq, index_k=ik, block_size=16, topk=2, return_lse=True,
                                      return_indices=True, backend="triton")
    reads, sorts = [], []
    real, real_canonical = api._check_block_values, api.canonical
    monkeypatch.setattr(api, "_check_block_values", lambda t, nb: reads.append(1) or real(t, nb))
    monkeypatch.setattr(api, "canonical", lambda *a: sorts.append(1) or real_canonical(*a))
    want = wf.sparse_attention_index_loss(q, k, lse, iq, ik, idx.clone(), block_size=16, backend="triton")
    assert reads and sorts  # a copy: not the selector's tensor, so checked and canonicalised
    reads.clear(), sorts.clear()
    got = wf.sparse_attention_index_loss(q, k, lse, iq, ik, idx, block_size=16, backend="triton")
    assert not reads and not sorts and torch.equal(got, want)  # nor sorted again: canonical by construction
    idx[0, 0, 3, 0] = 99
    with pytest.raises(WarpforgeInputError, match="block_indices"):
        wf.sparse_attention_index_loss(q, k, lse, iq, ik, idx, block_size=16, backend="triton")
    assert reads


def test_a_topk_past_the_blocks_pads_with_minus_one():
    """topk beyond the key blocks: the lists are still topk wide (context-parallel ranks concatenate theirs), the
    entries past the blocks -1, the rest the lists of topk = the blocks; the launched selection sorts only
    min(topk, blocks)-wide lists (a huge topk compiles no huge sort)."""
    b, s, h_kv, bs = 1, 70, 2, 16
    iq, ik = _index((b, s), h_kv, 16, torch.float32)
    nb = -(-s // bs)
    want = wf.select_blocks(iq, ik, block_size=bs, topk=nb, backend="triton")
    for backend in ("triton", "reference"):
        got = wf.select_blocks(iq, ik, block_size=bs, topk=1000, backend=backend)
        assert got.shape == (b, h_kv, nb, 1000), backend
        assert torch.equal(got[..., :nb], want) and bool((got[..., nb:] == -1).all()), backend


@pytest.mark.parametrize("varlen", [False, True])
def test_no_query_heads_give_zero_gradients(varlen):
    """h_q 0 (every head pruned) is an empty problem like an empty batch: empty outputs, zero key gradients (the
    backward divided by the GQA group, 0, session 41's fuzz)."""
    lead = (32,) if varlen else (1, 32)
    q = torch.randn(*lead, 0, 16, device=DEV, requires_grad=True)
    k, v = (torch.randn(*lead, 2, 16, device=DEV, requires_grad=True) for _ in range(2))
    extra = dict(cu_seqlens=ragged_cu_seqlens([20, 12], DEV), max_seqlen=20) if varlen else {}
    idx = torch.zeros(2 if varlen else 1, 2, 2, 1, dtype=torch.int32, device=DEV)
    if varlen:
        idx = idx[:, :, :, :1].expand(2, 2, 2, 1).contiguous()
    out = wf.sparse_attention(q, k, v, block_indices=idx, block_size=16, backend="triton", **extra)
    assert out.shape == (*lead, 0, 16)
    out.sum().backward()
    assert torch.all(k.grad == 0) and torch.all(v.grad == 0) and q.grad.shape == q.shape
