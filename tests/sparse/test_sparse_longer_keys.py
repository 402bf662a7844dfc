"""sparse_attention, select_blocks and sparse_attention_index_loss with keys longer than the queries (the queries the
last s_q of s_k positions, s_k - s_q a multiple of block_size: a context-parallel rank's chunk against the keys up to
it): the kernels against the reference, and both against the whole sequence's op on its last rows; partial last
blocks, keys before the queries that no query block keeps, no queries at all, the TMA and atomic-dq paths, bad input.

On a CPU machine the kernels run through the Triton interpreter at small shapes (fp16 / fp32)."""
import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.ops.sparse import index_loss_reference, sparse_attention_reference
from warpforge.testing import device_under_test, dtypes_under_test, poisoned_outputs, rel_l2

from .test_sparse_attention import _check_attention

DEV = device_under_test()
DTYPES = dtypes_under_test()
BS = 16


def _inputs(b, s_q, s_k, h_q, h_kv, d, dtype, d_v=None):
    q = torch.randn(b, s_q, h_q, d, device=DEV, dtype=dtype)
    k = torch.randn(b, s_k, h_kv, d, device=DEV, dtype=dtype)
    v = torch.randn(b, s_k, h_kv, d_v or d, device=DEV, dtype=dtype)
    return q, k, v


def _indices(b, h_kv, nqb, nkb, topk):
    """Random key blocks from -1 to nkb - 1 (repeats, the own block and later blocks included: ignored)."""
    return torch.randint(-1, nkb, (b, h_kv, nqb, topk), device=DEV, dtype=torch.int32)


def _check(q, k, v, idx, causal, block_size=BS):
    _check_attention(q, k, v, idx, block_size, causal)  # kernels vs reference, forward and gradients


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype, s_q, s_k, h_q, h_kv, d, topk",
                         [(t, 24, 56, 4, 2, 16, 3) for t in DTYPES + [torch.float32]] +
                         [(torch.float32, 32, 80, 3, 1, 24, 2)])
def test_kernels_match_reference(dtype, causal, s_q, s_k, h_q, h_kv, d, topk):
    """A partial last block (24 + 32 = 56), GQA groups 2 and 3, a head dim that is not a power of two."""
    q, k, v = _inputs(2, s_q, s_k, h_q, h_kv, d, dtype)
    _check(q, k, v, _indices(2, h_kv, -(-s_q // BS), -(-s_k // BS), topk), causal)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_last_rows_of_the_whole_sequence(backend, causal):
    """The queries at the end of a longer key sequence are the whole sequence's last rows: out, lse and every
    gradient (the whole sequence's with no gradient on its first rows) agree."""
    s, s_q, h_q, h_kv = 56, 24, 2, 1
    off = s - s_q
    q, k, v = _inputs(1, s, s, h_q, h_kv, 16, torch.float32)
    idx = _indices(1, h_kv, -(-s // BS), -(-s // BS), 3)
    d_out = torch.randn(1, s_q, h_q, 16, device=DEV)
    full_in = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = wf.sparse_attention(*full_in, block_indices=idx, block_size=BS, causal=causal, return_lse=True,
                                   backend=backend)
    want = torch.autograd.grad(out, full_in, torch.cat([torch.zeros_like(out[:, :off]), d_out], 1))
    part_in = [t.clone().requires_grad_() for t in (q[:, off:], k, v)]
    with poisoned_outputs():
        p_out, p_lse = wf.sparse_attention(*part_in, block_indices=idx[:, :, off // BS:], block_size=BS,
                                           causal=causal, return_lse=True, backend=backend)
        got = torch.autograd.grad(p_out, part_in, d_out)
    assert rel_l2(p_out, out[:, off:]) <= 1e-5
    assert rel_l2(p_lse, lse[:, :, off:]) <= 1e-5
    for name, g, r in zip(("dq", "dk", "dv"), got, (want[0][:, off:], want[1], want[2])):
        assert rel_l2(g, r) <= 1e-5, name


@pytest.mark.parametrize("causal", [True, False])
def test_selection_is_the_whole_sequences_last_rows(causal):
    s, s_q = 80, 32
    iq = torch.randn(2, s, 2, 8, device=DEV)
    ik = torch.randn(2, s, 1, 8, device=DEV)
    whole = wf.select_blocks(iq, ik, block_size=BS, topk=3, causal=causal, backend="reference")
    for backend in ("triton", "reference"):
        got = wf.select_blocks(iq[:, s - s_q:], ik, block_size=BS, topk=3, causal=causal, backend=backend)
        assert torch.equal(got, whole[:, :, (s - s_q) // BS:]), backend


def test_index_branch_end_to_end_and_index_loss():
    s_q, s_k = 24, 56
    q, k, v = _inputs(2, s_q, s_k, 4, 2, 16, torch.float32)
    iq = torch.randn(2, s_q, 2, 8, device=DEV)
    ik = torch.randn(2, s_k, 1, 8, device=DEV)
    out, lse, idx = wf.sparse_attention(q, k, v, index_q=iq, index_k=ik, block_size=BS, topk=2, return_lse=True,
                                        return_indices=True, backend="triton")
    ref_idx = wf.select_blocks(iq, ik, block_size=BS, topk=2, backend="reference")
    assert torch.equal(idx, ref_idx)
    ref, _ = sparse_attention_reference(q, k, v, idx, block_size=BS)
    assert rel_l2(out, ref) <= 1e-5
    grads, losses = [], []
    for backend in ("triton", "reference"):
        a, c = iq.clone().requires_grad_(), ik.clone().requires_grad_()
        loss = wf.sparse_attention_index_loss(q, k, lse, a, c, idx, block_size=BS, backend=backend)
        losses.append(loss.item())
        grads.append(torch.autograd.grad(loss, (a, c)))
    assert abs(losses[0] - losses[1]) <= 1e-5 * max(1.0, abs(losses[1]))
    assert losses[1] == pytest.approx(index_loss_reference(q, k, iq, ik, idx, block_size=BS).item(), rel=1e-6)
    for g, r in zip(*grads):
        assert rel_l2(g, r) <= 1e-4


def test_no_queries_and_unkept_keys():
    """No queries: empty out, zero dk / dv. Keys before the queries that no query block keeps: zero dk / dv."""
    q, k, v = (t.requires_grad_() for t in _inputs(1, 0, 32, 2, 1, 16, torch.float32))
    out = wf.sparse_attention(q, k, v, block_indices=torch.zeros(1, 1, 0, 2, dtype=torch.int32, device=DEV),
                              block_size=BS, backend="triton")
    assert out.shape == (1, 0, 2, 16)
    with poisoned_outputs():
        _, dk, dv = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True, materialize_grads=True)
    assert not dk.any() and not dv.any()
    q, k, v = (t.requires_grad_() for t in _inputs(1, 16, 64, 2, 1, 16, torch.float32))
    idx = torch.tensor([[[[1, -1]]]], dtype=torch.int32, device=DEV)  # keeps key block 1 of the 3 before it
    with poisoned_outputs():
        out = wf.sparse_attention(q, k, v, block_indices=idx, block_size=BS, backend="triton")
        _, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    for g in (dk, dv):
        assert not g[:, :16].any() and not g[:, 32:48].any() and g[:, 16:32].abs().sum() > 0 and g[:, 48:].any()


@pytest.mark.parametrize("variant", ["tma", "atomic_dq"])
def test_tma_and_atomic_dq_paths(monkeypatch, variant):
    from warpforge.ops.sparse import configs
    if variant == "tma":
        change = dict(fwd=lambda c: c._replace(tma=True), dq=lambda c: c._replace(tma=True),
                      dkdv=lambda c: c._replace(tma=True))
    else:
        change = dict(dkdv=lambda c: c._replace(atomic_dq=True))
    monkeypatch.setattr(configs, "TILES", configs.TILES.map(
        lambda t: t._replace(**{name: f(getattr(t, name)) for name, f in change.items()})))
    q, k, v = _inputs(2, 24, 56, 4, 2, 32, torch.float16)
    _check(q, k, v, _indices(2, 2, 2, 4, 2), True)


@pytest.mark.parametrize("bad, match", [("offset", "multiple of block_size"), ("shorter", "at least q's"),
                                        ("varlen", "batched form only"), ("index_k", "index_k"),
                                        ("oob", "block_indices")])
def test_bad_input(bad, match):
    s_q = 32
    s_k = {"offset": 40, "shorter": 16}.get(bad, 64)
    q, k, v = _inputs(1, s_q, s_k, 2, 1, 16, torch.float16)
    kw = dict(index_q=torch.randn(1, s_q, 1, 8, device=DEV, dtype=torch.float16),
              index_k=torch.randn(1, s_k, 1, 8, device=DEV, dtype=torch.float16), block_size=BS, backend="triton")
    if bad == "varlen":
        q, k, v = q[0], k[0], v[0]
        kw = dict(block_indices=_indices(1, 1, 2, 2, 1), cu_seqlens=torch.tensor([0, s_q], dtype=torch.int32,
                                                                                 device=DEV), backend="triton")
    if bad == "index_k":
        kw["index_k"] = kw["index_k"][:, :s_q]
    if bad == "oob":
        kw = dict(block_indices=torch.full((1, 1, 2, 1), 4, dtype=torch.int32, device=DEV), block_size=BS,
                  backend="triton")
    with pytest.raises(WarpforgeInputError, match=match):
        wf.sparse_attention(q, k, v, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_bf16_longer_keys(d):
    """The compiled kernels (sm90's tiles: the TMA dk/dv pass) at block 128: 24 key blocks before the first query,
    a partial last block, the index branch selecting."""
    s_q, s_k = 1024 + 77, 4096 + 77
    q, k, v = _inputs(1, s_q, s_k, 16, 2, d, torch.bfloat16)
    iq = torch.randn(1, s_q, 2, 32, device=DEV, dtype=torch.bfloat16)
    ik = torch.randn(1, s_k, 1, 32, device=DEV, dtype=torch.bfloat16)
    idx = wf.select_blocks(iq, ik, block_size=128, topk=4)
    ref = wf.select_blocks(iq.float(), ik.float(), block_size=128, topk=4, backend="reference")
    assert (idx == ref).float().mean() > 0.99  # bf16 inputs, fp32 scores: a near tie may rank apart
    _check(q, k, v, idx, True, block_size=128)
