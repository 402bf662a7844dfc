"""ring_attention on gloo CPU processes against one process's flash_attention on the whole sequence: outputs,
lse and gradients within 1e-5 (relative L2, fp32), on the reference backend and on the Triton kernels through
the interpreter; the layouts' shard/unshard helpers; the combine of partial results; bad input.

Starting processes costs seconds, so each run_ranks call checks a list of cases."""
import pytest
import torch
import torch.distributed as dist

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.distributed.ring_attention import _merge, ring_attention, shard_sequence, unshard_sequence
from warpforge.runtime import interpreter_enabled
from warpforge.testing import poisoned_outputs, rel_l2

from .harness import run_ranks

TOL = 1e-5  # fp32 (DESIGN.md; the bar)


class Case(dict):
    """A ring attention problem: b, s_local, h_q, h_kv, d, d_v, causal, layout, backend, seed, scale, plus
    `group`: None (the world) or the name of a subgroup the test builds (see _groups)."""


def case(b=1, s_local=8, h_q=4, h_kv=2, d=16, d_v=None, causal=True, layout="zigzag", backend="reference",
         seed=0, scale=None, group=None):
    return Case(b=b, s_local=s_local, h_q=h_q, h_kv=h_kv, d=d, d_v=d_v or d, causal=causal, layout=layout,
                backend=backend, seed=seed, scale=scale, group=group)


def _full_inputs(c: Case, world: int):
    """(q, k, v, d_out) of the whole sequence, the same on every process."""
    gen = torch.Generator().manual_seed(1000 + c["seed"])
    s = c["s_local"] * world
    shapes = [(c["b"], s, c["h_q"], c["d"]), (c["b"], s, c["h_kv"], c["d"]), (c["b"], s, c["h_kv"], c["d_v"]),
              (c["b"], s, c["h_q"], c["d_v"])]
    return [torch.randn(shape, generator=gen) for shape in shapes]


def _groups(rank: int, world: int) -> dict:
    """Subgroups every rank must create together (new_group is collective): in a world of 3, "pair" = ranks
    {1, 2} (group ranks 0, 1 are global 1, 2: the ring's peers must be mapped) and "solo" = {0} alone."""
    if world != 3:
        return {}
    solo, pair = dist.new_group([0]), dist.new_group([1, 2])
    return {"solo": solo if rank == 0 else None, "pair": pair if rank in (1, 2) else None}


def _members(c: Case, world: int) -> list[int]:
    """The global ranks of the case's group, in group order."""
    return {None: list(range(world)), "solo": [0], "pair": [1, 2]}[c["group"]]


def _rank_run(rank: int, world: int, cases: list) -> list:
    """On each rank: for every case it takes part in, (out, lse, dq, dk, dv) of its shard; None otherwise."""
    groups = _groups(rank, world)
    results = []
    for c in cases:
        members = _members(c, world)
        if rank not in members:
            results.append(None)
            continue
        w, r = len(members), members.index(rank)
        q, k, v, d_out = (shard_sequence(t, r, w, c["layout"]) for t in _full_inputs(c, w))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        with poisoned_outputs():  # an element the ring forgets to write shows up as NaN
            out, lse = ring_attention(q, k, v, causal=c["causal"], softmax_scale=c["scale"], layout=c["layout"],
                                      group=groups.get(c["group"]), return_lse=True, backend=c["backend"])
            out.backward(d_out)
        results.append((out, lse, q.grad, k.grad, v.grad))
    return results


def _check(cases: list, world: int) -> None:
    """Run the cases on `world` processes and compare every case with single-process flash_attention."""
    got = run_ranks(_rank_run, world, cases)
    for i, c in enumerate(cases):
        members = _members(c, world)
        w = len(members)
        q, k, v, d_out = _full_inputs(c, w)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out, lse = wf.flash_attention(q, k, v, causal=c["causal"], softmax_scale=c["scale"], return_lse=True,
                                      backend=c["backend"])
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        want = (out, lse) + grads
        shards = [got[m][i] for m in members]
        for j, name in enumerate(("out", "lse", "dq", "dk", "dv")):
            full = unshard_sequence([sh[j] for sh in shards], c["layout"], dim=2 if name == "lse" else 1)
            err = rel_l2(full, want[j])
            assert err <= TOL, f"case {i} {dict(c)}: {name} rel L2 {err:.3g}"


# ------------------------------------------------------------------------------- against one process
def _triton(*cases):
    """The Triton cases where the ranks can run them (the interpreter on); the interpreter is slow, so they are
    tiny and fp32."""
    return list(cases) if interpreter_enabled() else []


def test_world2():
    _check([
        case(b=2, s_local=8, h_q=4, h_kv=2, causal=True, layout="zigzag", seed=1),  # GQA, zigzag
        case(b=1, s_local=6, h_q=2, h_kv=2, d_v=24, causal=True, layout="contiguous", seed=2),  # d_v != d
        case(b=2, s_local=8, h_q=4, h_kv=2, causal=False, layout="zigzag", seed=3, scale=0.3),
        case(b=1, s_local=5, h_q=4, h_kv=1, causal=False, layout="contiguous", seed=4),  # MQA, odd length
        case(b=1, s_local=2, h_q=2, h_kv=2, causal=True, layout="zigzag", seed=5),  # one token per chunk
    ] + _triton(
        case(b=1, s_local=16, h_q=4, h_kv=2, causal=True, layout="zigzag", backend="triton", seed=11),
        case(b=2, s_local=16, h_q=2, h_kv=2, d_v=8, causal=True, layout="contiguous", backend="triton", seed=12),
        case(b=1, s_local=16, h_q=4, h_kv=2, causal=False, layout="zigzag", backend="triton", seed=13),
    ), world=2)


def test_world3_and_subgroups():
    _check([
        case(b=2, s_local=8, h_q=4, h_kv=2, causal=True, layout="zigzag", seed=6),
        case(b=1, s_local=6, h_q=4, h_kv=2, causal=True, layout="contiguous", seed=7),
        case(b=1, s_local=4, h_q=4, h_kv=2, d_v=8, causal=False, layout="zigzag", seed=8),
        case(b=2, s_local=6, h_q=4, h_kv=2, causal=True, layout="zigzag", seed=9, group="pair"),
        case(b=1, s_local=6, h_q=4, h_kv=2, causal=True, layout="zigzag", seed=10, group="solo"),  # W == 1
    ] + _triton(
        case(b=1, s_local=16, h_q=4, h_kv=2, causal=True, layout="zigzag", backend="triton", seed=14),
        case(b=1, s_local=16, h_q=4, h_kv=2, causal=True, layout="contiguous", backend="triton", seed=15,
             group="pair"),
    ), world=3)


# ------------------------------------------------------------------------------------ without processes
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_unshard_round_trip(layout, world):
    x = torch.randn(2, 12 * world, 3)
    shards = [shard_sequence(x, r, world, layout) for r in range(world)]
    assert torch.equal(unshard_sequence(shards, layout), x)
    assert torch.equal(torch.cat(shards, 1).sort(1).values, x.sort(1).values)  # a partition of the sequence
    y = torch.arange(4 * world)[None]  # token positions
    if layout == "zigzag":
        s = shard_sequence(y, 0, world, layout, dim=-1)
        assert s.tolist() == [[0, 1, 4 * world - 2, 4 * world - 1]]
    else:
        assert shard_sequence(y, world - 1, world, layout, dim=-1).tolist() == [list(range(4 * world - 4, 4 * world))]


def test_shard_bad_input():
    with pytest.raises(WarpforgeInputError, match="divisible by 4"):
        shard_sequence(torch.randn(1, 6, 2), 0, 2, "zigzag")
    with pytest.raises(WarpforgeInputError, match="rank"):
        shard_sequence(torch.randn(1, 8, 2), 2, 2)
    with pytest.raises(WarpforgeInputError, match="layout"):
        shard_sequence(torch.randn(1, 8, 2), 0, 2, "striped")


def test_merge_of_blocks_that_see_nothing():
    """Rows that no block has reached (lse -inf on both sides) stay 0 / -inf, never NaN; a real block takes over."""
    b, s, h, d = 1, 4, 2, 8
    acc_out = torch.zeros(b, s, h, d)
    acc_lse = torch.full((b, h, s), float("-inf"))
    empty = torch.full((b, h, 2), float("-inf"))
    _merge(acc_out, acc_lse, slice(0, 2), torch.zeros(b, 2, h, d), empty)
    assert torch.equal(acc_out, torch.zeros_like(acc_out)) and torch.isinf(acc_lse).all()
    out, lse = torch.randn(b, 2, h, d), torch.randn(b, h, 2)
    _merge(acc_out, acc_lse, slice(2, 4), out, lse)
    _merge(acc_out, acc_lse, slice(2, 4), torch.zeros(b, 2, h, d), empty)
    assert torch.allclose(acc_out[:, 2:], out) and torch.allclose(acc_lse[:, :, 2:], lse)
    assert torch.equal(acc_out[:, :2], torch.zeros(b, 2, h, d))


def _qkv(s=8, dtype=torch.float32, h_kv=2, d_v=16):
    return torch.randn(1, s, 4, 16, dtype=dtype), torch.randn(1, s, h_kv, 16, dtype=dtype), \
        torch.randn(1, s, h_kv, d_v, dtype=dtype)


def test_no_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(WarpforgeInputError, match="init_process_group"):
        ring_attention(*_qkv())


@pytest.mark.parametrize("change, match", [
    (dict(s=7), "even shard length"),
    (dict(h_kv=3), "dividing"),
    (dict(d_v=12), "multiple of 8"),
])
def test_bad_shapes(change, match):
    with pytest.raises(WarpforgeInputError, match=match):
        ring_attention(*_qkv(**change))


def test_bad_arguments():
    q, k, v = _qkv()
    with pytest.raises(WarpforgeInputError, match="layout"):
        ring_attention(q, k, v, layout="striped")
    with pytest.raises(WarpforgeInputError, match="shard length"):
        ring_attention(q, k[:, :4], v[:, :4], layout="contiguous")
    with pytest.raises(WarpforgeInputError, match="causal"):
        ring_attention(q, k, v, causal=1)


@pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (a CPU machine)")
def test_bf16_on_the_interpreter():
    with pytest.raises(WarpforgeInputError, match="bfloat16"):
        ring_attention(*_qkv(dtype=torch.bfloat16), backend="triton")
