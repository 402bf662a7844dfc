"""expert_parallel_experts on gloo CPU processes against one process's `experts` on every token with the full
weights: outputs and the gradients of hidden, topk_weights, each rank's expert-weight slice and (routing inside)
the router, within 1e-5 (relative L2, fp32), on the reference backend and on the Triton kernels through the
interpreter; routings where a rank has no tokens or receives none; the dispatch sending a token once per
destination rank; the proposed `MoE.shard_experts`; bad input raising on every rank.

Starting processes costs seconds, so one run_ranks call (a world of 3, with subgroups of 2 and 1) checks
everything that needs processes, and the tests below read its results."""
import functools
import re

import pytest
import torch
import torch.distributed as dist

from warpforge import WarpforgeInputError
from warpforge.distributed.expert_parallel import expert_parallel_experts, local_expert_range, shard_experts
from warpforge.nn.moe import MoE
from warpforge.ops.moe import experts, route
from warpforge.runtime import interpreter_enabled
from warpforge.testing import poisoned_outputs, rel_l2

from .harness import run_ranks

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # fp32: the bar
E, K = 6, 2
WORLD = 3
# the ranks run on CPU: the Triton kernels there only through the interpreter (conftest turns it on where no GPU is)
INTERPRETED = interpreter_enabled()


def case(tokens, routing="random", h=16, inter=8, group=None, backend="reference", router=False, seed=0,
         dtype=torch.float32, frozen=None):
    """An expert-parallel problem: `tokens` per rank of the group (None: the world; "pair": global ranks 1, 2;
    "solo": rank 0 alone), routing "random" (k distinct experts), "skew" (no expert of the group's last rank),
    "local" (a token's k experts all on one rank) or, with router=True, `route` on router logits. frozen: a rank
    of the group none of whose inputs requires grad (it still runs the backward, for the others)."""
    return dict(tokens=tokens, routing=routing, h=h, inter=inter, group=group, backend=backend, router=router,
                seed=seed, dtype=dtype, frozen=frozen)


CASES = [
    case([5, 7, 3], seed=1),
    case([6, 0, 4], seed=2),  # rank 1 has no tokens
    case([4, 5, 6], routing="skew", seed=3),  # rank 2 receives nothing
    case([6, 6, 6], routing="local", seed=4),  # several slots per destination: the dispatch sends one row
    case([7, 4], group="pair", seed=5),  # W = 2, group ranks != global ranks
    case([0, 5], routing="skew", group="pair", seed=6),  # W = 2: rank 0 sends nothing, rank 1 receives nothing
    case([5], group="solo", seed=7),  # W = 1: `experts` itself
    case([6, 3, 5], router=True, seed=8),  # the router's gradient through route's weights
    case([4, 6], router=True, group="pair", seed=9),
    case([5, 7, 3], seed=10, dtype=torch.bfloat16),
    case([5, 6, 4], seed=14, frozen=1),
]
if INTERPRETED:  # the interpreter is slow: tiny shapes, fp32
    CASES += [
        case([8, 5, 0], h=32, inter=32, backend="triton", seed=11),
        case([12, 9], routing="local", h=32, inter=32, group="pair", backend="triton", seed=12),
        case([6, 4, 7], routing="skew", h=32, inter=32, router=True, backend="triton", seed=13),
    ]


def _members(c) -> list[int]:
    """The global ranks of the case's group, in group order."""
    return {None: list(range(WORLD)), "pair": [1, 2], "solo": [0]}[c["group"]]


def _groups(rank: int) -> dict:
    """Subgroups every rank creates together (new_group is collective); "pair object" also on rank 0, which is
    not in it."""
    solo, pair = dist.new_group([0]), dist.new_group([1, 2])
    return {None: None, "solo": solo if rank == 0 else None, "pair": pair if rank in (1, 2) else None,
            "pair object": pair}


def _inputs(c):
    """Every rank's problem, the same on every process: (w13 [E, 2I, H], w2 [E, H, I], router [E, H], and per rank
    of the group (hidden, topk_weights, topk_ids, d_out)); with router=True the weights and ids are made by route
    from hidden @ router.T (None here)."""
    gen = torch.Generator().manual_seed(100 + c["seed"])
    h, inter, w = c["h"], c["inter"], len(c["tokens"])
    w13 = torch.randn(E, 2 * inter, h, generator=gen) * h ** -0.5
    w2 = torch.randn(E, h, inter, generator=gen) * inter ** -0.5
    router = torch.randn(E, h, generator=gen)
    per = E // w
    ranks = []
    for r, t in enumerate(c["tokens"]):
        hidden = torch.randn(t, h, generator=gen)
        weights = torch.rand(t, K, generator=gen) + 0.1
        if c["routing"] == "skew":  # only the experts of ranks 0 .. w - 2
            pool = E - per
            ids = torch.stack([torch.randperm(pool, generator=gen)[:K] for _ in range(t)]) if t else None
        elif c["routing"] == "local":  # all k on one rank, that rank's experts
            dest = torch.randint(0, w, (t,), generator=gen)
            ids = torch.stack([d * per + torch.randperm(per, generator=gen)[:K] for d in dest]) if t else None
        else:
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)]) if t else None
        ids = torch.zeros(0, K, dtype=torch.int64) if ids is None else ids
        if c["router"]:
            weights = ids = None
        d_out = torch.randn(t, h, generator=gen)
        ranks.append((hidden, weights, ids, d_out))
    return w13, w2, router, ranks


def _cast(c, *ts):
    return [None if t is None else t.to(c["dtype"]) for t in ts]


def _spy_rows(real, record: list):
    """all_to_all_single that records the rows of every floating-point exchange in `record` (the first of a
    forward is the dispatch of hidden rows)."""
    def spy(output, input, *args, **kw):
        if input.is_floating_point():
            record.append(input.shape[0])
        return real(output, input, *args, **kw)
    return spy


def _rank_cases(rank: int, groups: dict) -> list:
    """For every case this rank takes part in: (out, d hidden, d topk_weights, d w13 slice, d w2 slice, d router,
    rows dispatched); None otherwise."""
    results = []
    for c in CASES:
        members = _members(c)
        if rank not in members:
            results.append(None)
            continue
        r = members.index(rank)
        w13, w2, router, ranks = _inputs(c)
        hidden, weights, ids, d_out = ranks[r]
        own = local_expert_range(E, groups[c["group"]])
        hidden, w13_local, w2_local, d_out = _cast(c, hidden, w13[own.start:own.stop], w2[own.start:own.stop], d_out)
        train = r != c["frozen"]
        hidden, w13_local, w2_local, router = (t.clone().requires_grad_(train)
                                               for t in (hidden, w13_local, w2_local, router))
        if c["router"]:
            weights, ids = route(hidden @ router.T.to(c["dtype"]), K)
            leaf_weights = None
        else:
            weights = leaf_weights = weights.clone().requires_grad_(train)
        record, real = [], dist.all_to_all_single
        dist.all_to_all_single = _spy_rows(real, record)
        try:
            with poisoned_outputs():  # an element the exchanges forget to write shows up as NaN
                out = expert_parallel_experts(hidden, w13_local, w2_local, weights, ids, num_experts=E,
                                              group=groups[c["group"]], backend=c["backend"])
                out.backward(d_out)
        finally:
            dist.all_to_all_single = real
        results.append((out, hidden.grad, None if leaf_weights is None else leaf_weights.grad, w13_local.grad,
                        w2_local.grad, router.grad if c["router"] else None, record[0] if record else None))
    return results


@functools.lru_cache(maxsize=None)
def _one_process(i: int):
    """What one process computes for CASES[i] on every rank's tokens with all the experts: per rank (out,
    d hidden, d topk_weights, d w13 slice, d w2 slice, the ids used), and the router's gradient."""
    c = CASES[i]
    w13, w2, router, ranks = _inputs(c)
    hidden, d_out, w13, w2 = _cast(c, torch.cat([x[0] for x in ranks]), torch.cat([x[3] for x in ranks]), w13, w2)
    hidden, w13, w2, router = (t.clone().requires_grad_() for t in (hidden, w13, w2, router))
    if c["router"]:
        weights, ids = route(hidden @ router.T.to(c["dtype"]), K)
    else:
        weights = torch.cat([x[1] for x in ranks]).requires_grad_()
        ids = torch.cat([x[2] for x in ranks])
    out = experts(hidden, w13, w2, weights, ids, backend=c["backend"])
    inputs = (hidden, w13, w2, router) if c["router"] else (hidden, w13, w2, weights)
    grads = torch.autograd.grad(out, inputs, d_out)
    d_hidden, d_w13, d_w2, last = grads
    split, per = c["tokens"], E // len(c["tokens"])
    per_rank = []
    for r, (o, dh, dw, i) in enumerate(zip(out.split(split), d_hidden.split(split),
                                           (last if not c["router"] else weights).split(split), ids.split(split))):
        per_rank.append((o, dh, None if c["router"] else dw, d_w13[r * per:(r + 1) * per],
                         d_w2[r * per:(r + 1) * per], i))
    return per_rank, (last if c["router"] else None)


# ------------------------------------------------------------------------------------- bad input, on every rank
def _bad_calls(rank: int, groups: dict) -> list:
    """The WarpforgeInputError message of each bad call on this rank (None where the call did not raise)."""
    h, inter, per = 16, 8, E // WORLD

    def args(t=4, h=h, dtype=torch.float32):
        return [torch.randn(t, h, dtype=dtype), torch.randn(per, 2 * inter, h, dtype=dtype),
                torch.randn(per, h, inter, dtype=dtype), torch.rand(t, K), torch.randint(0, E, (t, K))]

    def call(a, **kw):
        kw = {"num_experts": E, **kw}
        try:
            expert_parallel_experts(*a, **kw)
        except WarpforgeInputError as e:
            return str(e)
        return None

    msgs = []
    msgs.append(call(args(), num_experts=4))  # 0: E % W
    a = args()
    a[1] = a[1][:, :-1]
    msgs.append(call(a))  # 1: w13_local shape (odd 2I)
    a = args()
    a[2] = a[2][:, :, :-1]
    msgs.append(call(a))  # 2: w2_local's I
    a = args()
    if rank == 1:
        a[4] = a[4].float()
    msgs.append(call(a))  # 3: rank 1's ids are floats: rank 1 says why, the others that rank 1 failed
    a = args()
    if rank == 2:
        a[4][1, 0] = E
    msgs.append(call(a))  # 4: an id out of range on rank 2 only
    msgs.append(call(args(h=8 if rank == 0 else h)))  # 5: H differs between ranks
    a = args()
    a[3] = a[3][:, :1]
    msgs.append(call(a))  # 6: topk_weights' shape
    msgs.append(call(args(), backend="cuda"))  # 7: backend
    msgs.append(call(args(), group="world"))  # 8: not a group
    a = args()
    a[4] = torch.randint(0, 4, (4, K))
    msgs.append(call(a, group=groups["pair object"], num_experts=4))  # 9: rank 0 is not a member (ranks 1, 2 run)
    a = args(t=3)
    a[4] = a[4][:2]
    msgs.append(call(a))  # 10: ids for other tokens
    msgs.append(call(args(dtype=torch.float16 if rank == 2 else torch.float32)))  # 11: dtype differs between ranks
    a = args()
    a[3] = torch.rand(4, K, dtype=torch.float64)  # fp64 weights are fine: a valid call, after the failed ones
    out = expert_parallel_experts(*a, num_experts=E)
    msgs.append(tuple(out.shape))  # 12
    return msgs


# ---------------------------------------------------------------------- nn.MoE.shard_experts
MOE_TOKENS = [(2, 3), (1, 4), (2, 0)]  # [batch, seq] per rank: rank 2 has no tokens


def _moe(cls):
    torch.manual_seed(21)
    return cls(16, 8, E, K, num_shared_experts=1, backend="reference")


def _moe_data():
    gen = torch.Generator().manual_seed(22)
    return [(torch.randn(b, s, 16, generator=gen), torch.randn(b, s, 16, generator=gen)) for b, s in MOE_TOKENS]


def _rank_moe(rank: int) -> dict:
    moe = shard_experts(_moe(MoE))
    x, g = _moe_data()[rank]
    x.requires_grad_()
    out = moe(x)
    (out * g).sum().backward()
    return dict(out=out, dx=x.grad, **{n: p.grad for n, p in moe.named_parameters()})


def _rank_run(rank: int, world: int) -> dict:
    groups = _groups(rank)
    return dict(cases=_rank_cases(rank, groups), bad=_bad_calls(rank, groups), moe=_rank_moe(rank))


@pytest.fixture(scope="module")
def ranks():
    """Every rank's results, from one run of 3 processes."""
    return run_ranks(_rank_run, WORLD)


def _assert_close(got, want, tol, what):
    got = torch.zeros_like(want) if got is None else got  # a tensor that got no gradient
    if want.numel() == 0:
        assert got.shape == want.shape, what
        return
    err = rel_l2(got, want)
    assert err <= tol, f"{what}: rel L2 {err:.3g}"


def _or_zeros(grad, like):
    return torch.zeros_like(like) if grad is None else grad


# ---------------------------------------------------------------------------------------- against one process
def _case_id(i: int) -> str:
    c = CASES[i]
    return "-".join([str(i), c["backend"], c["group"] or "world", c["routing"]] + ["router"] * c["router"] +
                    ["bf16"] * (c["dtype"] == torch.bfloat16) + ["frozen"] * (c["frozen"] is not None))


@pytest.mark.parametrize("i", range(len(CASES)), ids=_case_id)
def test_same_as_one_process(ranks, i):
    c = CASES[i]
    members = _members(c)
    want, d_router = _one_process(i)
    tol = TOL[c["dtype"]]
    router_sum = 0
    for r, m in enumerate(members):
        got = ranks[m]["cases"][i]
        for j, name in enumerate(("out", "d_hidden", "d_topk_weights", "d_w13", "d_w2")):
            if want[r][j] is not None and (j == 0 or r != c["frozen"]):
                _assert_close(got[j], want[r][j], tol, f"case {i} {c}, rank {r}: {name}")
        if c["router"]:
            router_sum = router_sum + got[5]
    if c["router"]:
        _assert_close(router_sum, d_router, tol, f"case {i} {c}: d_router")
    if len(members) == 1:  # W = 1 is `experts` itself: bitwise
        assert torch.equal(ranks[members[0]]["cases"][i][0], want[0][0])


@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if len(_members(c)) > 1], ids=_case_id)
def test_dispatch_sends_a_row_per_destination_rank(ranks, i):
    """The rows a rank dispatches: one per (token, destination rank), not one per routed slot."""
    c = CASES[i]
    want, _ = _one_process(i)
    per = E // len(c["tokens"])
    for r, m in enumerate(_members(c)):
        ids = want[r][5].long()
        rows = len({(t, d) for t, row in enumerate((ids // per).tolist()) for d in row})
        assert ranks[m]["cases"][i][6] == rows
        if c["routing"] == "local":  # each token once
            assert rows == c["tokens"][r]


def test_moe_shard_experts(ranks):
    """shard_experts(MoE): every rank's output and gradients (x, expert slices) equal one unsharded
    MoE's on all the tokens; the replicated parameters' gradients (router, shared expert) sum to its."""
    moe = _moe(MoE)
    data = _moe_data()
    xs = [x.clone().requires_grad_() for x, _ in data]
    loss = sum((moe(x) * g).sum() for x, (_, g) in zip(xs, data))
    loss.backward()
    per = E // WORLD
    for r in range(WORLD):
        got = ranks[r]["moe"]
        _assert_close(got["dx"], xs[r].grad, TOL[torch.float32], f"rank {r}: dx")
        for name in ("w13", "w2"):
            _assert_close(got[name], getattr(moe, name).grad[r * per:(r + 1) * per], TOL[torch.float32],
                          f"rank {r}: d {name}")
    for name, p in moe.named_parameters():
        if name not in ("w13", "w2"):
            got = sum(_or_zeros(ranks[r]["moe"][name], p) for r in range(WORLD))
            _assert_close(got, p.grad, TOL[torch.float32], f"d {name}")
    for r in range(WORLD):  # the outputs, one rank's tokens at a time (the balance loss is per batch)
        _assert_close(ranks[r]["moe"]["out"], moe(data[r][0]).detach(), TOL[torch.float32], f"rank {r}: out")


ALL = range(WORLD)
BAD = [  # (the call in _bad_calls, the ranks that raise this message, the message)
    (0, ALL, r"num_experts: expected a multiple of the group size \(3\)"),
    (1, ALL, r"w13_local: expected \[2, 2I, 16\]"),
    (2, ALL, r"w2_local: expected \[2, 16, 8\]"),
    (3, [1], r"topk_ids: expected dtype in \(int32, int64\)"),
    (3, [0, 2], r"WarpforgeInputError on rank\(s\) \[1\]"),
    (4, ALL, r"topk_ids: expected global expert ids in \[0, 6\).*1 out of range on rank 2"),
    (5, ALL, r"hidden: expected the same H on every rank"),
    (6, ALL, r"topk_weights: expected the shape of topk_ids"),
    (7, ALL, r"backend"),
    (8, ALL, r"group: expected None .* or a torch.distributed ProcessGroup, got str"),
    (9, [0], r"group: expected a process group this process belongs to"),
    (10, ALL, r"topk_ids: expected \[3, k\]"),
    (11, [0, 1], r"hidden: expected the same dtype on every rank of the group \(float32 here\), got float16 on rank 2"),
    (11, [2], r"hidden: expected the same dtype .*\(float16 here\), got float32 on rank 0"),
]


@pytest.mark.parametrize("call, on, match", BAD, ids=[f"{c}-{m.split(':')[0]}" for c, _, m in BAD])
def test_bad_input_raises_on_every_rank(ranks, call, on, match):
    for r in on:
        msg = ranks[r]["bad"][call]
        assert msg is not None and re.search(match, msg), f"rank {r}: {msg!r}"


def test_a_valid_call_after_bad_ones(ranks):
    """The failed calls left the ranks in step: the next call runs (rank 0's non-member call raised before any
    exchange while ranks 1 and 2 ran theirs on their pair)."""
    for r in range(WORLD):
        assert ranks[r]["bad"][12] == (4, 16)
        assert (ranks[r]["bad"][9] is None) == (r != 0)


# ------------------------------------------------------------------------------------------ without processes
def test_no_process_group():
    assert not dist.is_initialized()
    h = torch.randn(2, 16)
    with pytest.raises(WarpforgeInputError, match="init_process_group"):
        expert_parallel_experts(h, torch.randn(2, 16, 16), torch.randn(2, 16, 8), torch.rand(2, K),
                                torch.randint(0, E, (2, K)), num_experts=E)
    with pytest.raises(WarpforgeInputError, match="init_process_group"):
        local_expert_range(E)
