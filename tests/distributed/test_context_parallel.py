"""sparse_attention_cp and sparse_attention_index_loss_cp on gloo CPU processes against one process's
sparse_attention / sparse_attention_index_loss on the whole sequence: out, lse, the chosen blocks, dq, dk, dv, the
index loss and its gradients within 1e-5 (relative L2, fp32), with the index branch selecting and with block_indices
given, on the Triton kernels through the interpreter and on the reference; bad input.

Starting processes costs seconds, so each run_ranks call checks a list of cases."""
import pytest
import torch
import torch.distributed as dist

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.distributed.sparse_attention_cp import sparse_attention_cp, sparse_attention_index_loss_cp
from warpforge.runtime import interpreter_enabled
from warpforge.testing import poisoned_outputs, rel_l2

from .harness import run_ranks

TOL = 1e-5
BS = 16
needs_interpreter = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (a CPU machine)")


def case(b=1, s_local=32, h_q=4, h_kv=2, d=16, d_v=16, d_i=8, topk=2, given=False, backend="triton", seed=0,
         pair=False):
    """given: block_indices given (random, with -1, repeats and later blocks) instead of the index branch. pair: run
    on the subgroup of global ranks 1 and 2 of a world of 3 (group ranks 0 and 1), rank 0 sitting out."""
    return dict(b=b, s_local=s_local, h_q=h_q, h_kv=h_kv, d=d, d_v=d_v, d_i=d_i, topk=topk, given=given,
                backend=backend, seed=seed, pair=pair)


def _full_inputs(c, world):
    """q, k, v, index_q, index_k, d_out and block_indices of the whole sequence, the same in every process."""
    gen = torch.Generator().manual_seed(100 + c["seed"])
    b, s = c["b"], c["s_local"] * world
    shapes = [(b, s, c["h_q"], c["d"]), (b, s, c["h_kv"], c["d"]), (b, s, c["h_kv"], c["d_v"]),
              (b, s, c["h_kv"], c["d_i"]), (b, s, 1, c["d_i"]), (b, s, c["h_q"], c["d_v"])]
    tensors = [torch.randn(shape, generator=gen) for shape in shapes]
    nb = s // BS
    idx = torch.randint(-1, nb, (b, c["h_kv"], nb, c["topk"] + 1), generator=gen, dtype=torch.int32)
    return tensors + [idx]


def _chunk(x, rank, world, dim=1):
    n = x.shape[dim] // world
    return x.narrow(dim, rank * n, n).contiguous()


def _rank_run(rank, world, cases):
    pair = dist.new_group([1, 2]) if world == 3 else None  # collective: every rank makes it
    results = []
    for c in cases:
        group = None
        if c["pair"]:
            if rank == 0:
                results.append(None)
                continue
            rank, world, group = rank - 1, 2, pair
        q, k, v, iq, ik, d_out, idx = _full_inputs(c, world)
        q, k, v, iq, ik, d_out = (_chunk(t, rank, world) for t in (q, k, v, iq, ik, d_out))
        q, k, v, iq, ik = (t.requires_grad_() for t in (q, k, v, iq, ik))
        kw = dict(block_size=BS, topk=c["topk"], return_lse=True, return_indices=True, backend=c["backend"],
                  group=group)
        if c["given"]:
            kw["block_indices"] = _chunk(idx, rank, world, dim=2)
        else:
            kw.update(index_q=iq, index_k=ik)
        with poisoned_outputs():  # an element left unwritten shows up as NaN
            out, lse, used = sparse_attention_cp(q, k, v, **kw)
            out.backward(d_out)
        got = dict(out=out, lse=lse, idx=used, dq=q.grad, dk=k.grad, dv=v.grad)
        if not c["given"]:
            loss = sparse_attention_index_loss_cp(q.detach(), k.detach(), lse, iq, ik, used, block_size=BS,
                                                  group=group, backend=c["backend"])
            loss.backward()
            got.update(loss=loss, diq=iq.grad, dik=ik.grad)
        results.append(got)
        if c["pair"]:
            rank, world = rank + 1, 3
    return results


def _one_process(c, world):
    q, k, v, iq, ik, d_out, idx = _full_inputs(c, world)
    q, k, v, iq, ik = (t.requires_grad_() for t in (q, k, v, iq, ik))
    kw = dict(block_size=BS, topk=c["topk"], return_lse=True, return_indices=True, backend=c["backend"])
    if c["given"]:
        kw["block_indices"] = idx
    else:
        kw.update(index_q=iq, index_k=ik)
    out, lse, used = wf.sparse_attention(q, k, v, **kw)
    out.backward(d_out)
    want = dict(out=out, lse=lse, idx=used, dq=q.grad, dk=k.grad, dv=v.grad)
    if not c["given"]:
        loss = wf.sparse_attention_index_loss(q.detach(), k.detach(), lse, iq, ik, used, block_size=BS,
                                              backend=c["backend"])
        loss.backward()
        # each rank's loss is the mean over its chunk, the whole one the mean of those: a rank's gradients are
        # the whole loss's times the number of ranks
        want.update(loss=loss, diq=iq.grad * world, dik=ik.grad * world)
    return want


def _check(cases, world):
    got = run_ranks(_rank_run, world, cases)
    for i, c in enumerate(cases):
        ranks = [r[i] for r in got if r[i] is not None]
        want = _one_process(c, len(ranks))
        seq_dim = dict(out=1, lse=2, idx=2, dq=1, dk=1, dv=1, diq=1, dik=1)
        for name, full in want.items():
            if name == "loss":
                mean = sum(r["loss"] for r in ranks) / len(ranks)
                assert abs(mean.item() - full.item()) <= TOL * max(1.0, abs(full.item())), (c, name)
                continue
            parts = torch.cat([r[name] for r in ranks], seq_dim[name])
            if name == "idx":
                assert torch.equal(parts, full), (c, name)
            else:
                assert rel_l2(parts, full.detach()) <= TOL, (c, name, rel_l2(parts, full.detach()))


@needs_interpreter
def test_two_ranks_match_one_process():
    _check([case(b=2), case(given=True, d_v=8, h_q=2, h_kv=1, topk=3, seed=1),
            case(backend="reference", seed=2)], 2)


@needs_interpreter
def test_three_ranks_match_one_process():
    _check([case(s_local=16), case(s_local=16, given=True, seed=3), case(backend="reference", pair=True, seed=4)], 3)


def test_without_a_process_group_is_refused():
    q, k, v = torch.randn(1, 32, 2, 16), torch.randn(1, 32, 1, 16), torch.randn(1, 32, 1, 16)
    iq, ik = torch.randn(1, 32, 1, 8), torch.randn(1, 32, 1, 8)
    with pytest.raises(WarpforgeInputError, match="process group"):
        sparse_attention_cp(q, k, v, index_q=iq, index_k=ik, block_size=16, backend="reference")


@pytest.mark.parametrize("bad, match", [("chunk", "multiple of block_size"), ("k_len", "chunk length"),
                                        ("index_k", "index_k"), ("none", "index_q")])
def test_bad_input(bad, match):
    s = 24 if bad == "chunk" else 32
    q, k, v = torch.randn(1, s, 2, 16), torch.randn(1, s, 1, 16), torch.randn(1, s, 1, 16)
    iq, ik = torch.randn(1, s, 1, 8), torch.randn(1, s, 1, 8)
    if bad == "k_len":
        k, v = torch.randn(1, 2 * s, 1, 16), torch.randn(1, 2 * s, 1, 16)
    if bad == "index_k":
        ik = torch.randn(1, s, 2, 8)
    kw = dict(index_q=iq, index_k=ik) if bad != "none" else {}
    with pytest.raises(WarpforgeInputError, match=match):
        sparse_attention_cp(q, k, v, block_size=16, backend="reference", **kw)
