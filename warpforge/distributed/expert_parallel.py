"""Expert parallelism for Mixture-of-Experts: each rank of a process group holds a slice of the experts, and every
token travels to the ranks of the experts it was routed to and back, through all-to-alls.

`expert_parallel_experts` is `warpforge.ops.moe.experts` for experts spread over the ranks: rank r of a group of W
holds experts [r·E/W, (r+1)·E/W) (`local_expert_range`). One call on every rank of the group:

1. the counts: each rank works out how many rows and routed slots it sends to every rank and exchanges these
   counts (one all-to-all of a small int tensor), then reads them on the host once: the split sizes of the
   exchanges that follow. The same exchange carries each rank's input-error flag, out-of-range id count, whether
   it trains, and its shapes, so that bad input on any rank raises a WarpforgeInputError on every rank instead of
   leaving the others waiting in a collective.
2. dispatch: each token goes once to each rank that owns at least one of its experts (not once per routed slot),
   with the local ids of those experts;
3. the owner runs its experts (`experts` with weight 1) on one copy of the row per routed slot;
4. combine: every slot's expert output goes back to the token's rank, where the k slots are summed weighted by
   topk_weights in fp32. The routed weights never travel: their gradient is computed where they live.

The exchanges are differentiable (the gradient of an all-to-all is the all-to-all with the split sizes swapped), so
the backward runs two more all-to-alls, and every rank of the group must run the backward too.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..errors import (WarpforgeInputError, check_dtype, check_int, check_rank, check_same_device, check_same_dtype,
                      check_tensor, fail)
from ..ops.moe import experts
from ..runtime import check_interpreted_matmul_dtype, resolve_backend
from .group import resolve_group

__all__ = ["expert_parallel_experts", "local_expert_range", "shard_experts"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(_FLOATS)}  # 0: no valid input on that rank

# The columns of the count exchange: entry [d, c] is what this rank tells rank d.
_ROWS, _SLOTS, _ERROR, _BAD_IDS, _TRAIN, _K, _H, _I, _E, _DTYPE = range(10)
_COLUMNS = 10
# the settings every rank must share (a mismatch would make the exchanges move garbage), with the argument each
# comes from, for the error message
_SHARED = ((_K, "topk_ids", "k"), (_H, "hidden", "H"), (_I, "w2_local", "I"), (_E, "num_experts", "E"),
           (_DTYPE, "hidden", "dtype"))
_DTYPE_NAME = {code: str(d).replace("torch.", "") for d, code in _DTYPE_CODE.items()}


def local_expert_range(num_experts: int, group: Optional[dist.ProcessGroup] = None) -> range:
    """The global ids of the experts this rank holds under expert parallelism over `group` (default: the world):
    [r·E/W, (r+1)·E/W) for rank r of W. Slice full [E, ...] expert weights with it to shard them."""
    _, rank, world = resolve_group(group, "the experts are split over its ranks")
    _check_num_experts(num_experts, world)
    n = num_experts // world
    return range(rank * n, (rank + 1) * n)


def _check_num_experts(num_experts, world: int) -> None:
    check_int("num_experts", num_experts, 1)
    if num_experts % world:
        fail("num_experts", f"a multiple of the group size ({world})", num_experts)


def _check_inputs(hidden, w13_local, w2_local, topk_weights, topk_ids, num_experts, world, backend) -> str:
    """This rank's arguments (everything that can be checked without the other ranks); returns the backend."""
    for name, t, rank in (("hidden", hidden, 2), ("w13_local", w13_local, 3), ("w2_local", w2_local, 3),
                          ("topk_weights", topk_weights, 2), ("topk_ids", topk_ids, 2)):
        check_tensor(name, t)
        check_rank(name, t, rank)
    check_dtype("hidden", hidden, _FLOATS)
    backend = resolve_backend(backend, hidden.device)
    check_interpreted_matmul_dtype(backend, "hidden", hidden)
    _check_num_experts(num_experts, world)
    for name, t in (("w13_local", w13_local), ("w2_local", w2_local)):
        check_same_device(name, t, "hidden", hidden)
        check_same_dtype(name, t, "hidden", hidden)
    n, h = num_experts // world, hidden.shape[1]
    if w13_local.shape[0] != n or w13_local.shape[2] != h or w13_local.shape[1] % 2:
        fail("w13_local", f"[{n}, 2I, {h}] (this rank's num_experts / group size experts; gate rows, then up rows; "
             "H of hidden)", tuple(w13_local.shape))
    inter = w13_local.shape[1] // 2
    if tuple(w2_local.shape) != (n, h, inter):
        fail("w2_local", f"[{n}, {h}, {inter}] ([E / W, H, I], I from w13_local)", tuple(w2_local.shape))
    check_dtype("topk_weights", topk_weights, (torch.float16, torch.bfloat16, torch.float32, torch.float64))
    check_dtype("topk_ids", topk_ids, (torch.int32, torch.int64))
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        check_same_device(name, t, "hidden", hidden)
    if topk_ids.shape[0] != hidden.shape[0] or topk_ids.shape[1] < 1:
        fail("topk_ids", f"[{hidden.shape[0]}, k] with k >= 1 (a row per token of hidden)", tuple(topk_ids.shape))
    if topk_weights.shape != topk_ids.shape:
        fail("topk_weights", f"the shape of topk_ids {tuple(topk_ids.shape)}", tuple(topk_weights.shape))
    return backend


def _meta_device(hidden, group) -> torch.device:
    """Where the count exchange's tensor must live: hidden's device, or, when hidden is not even a tensor, the
    group's kind of device (NCCL exchanges CUDA tensors only)."""
    if isinstance(hidden, torch.Tensor):
        return hidden.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_ranks(error: Optional[WarpforgeInputError], mine: list, got: list[list]) -> None:
    """Raise on every rank when any rank's input was bad: own errors first, then other ranks' (`got[r]` is what
    rank r sent here, `mine` what this rank sent)."""
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(got) if row[_ERROR]]
    if failed:
        fail("expert_parallel_experts", "valid input on every rank of the group",
             f"a WarpforgeInputError on rank(s) {failed} of the group (see their error)")
    for col, name, what in _SHARED:
        show = _DTYPE_NAME.get if col == _DTYPE else str
        for r, row in enumerate(got):
            if row[col] != mine[col]:
                fail(name, f"the same {what} on every rank of the group ({show(mine[col])} here)",
                     f"{show(row[col])} on rank {r}")
    bad = [(r, row[_BAD_IDS]) for r, row in enumerate(got) if row[_BAD_IDS]]
    if bad:
        fail("topk_ids", f"global expert ids in [0, {mine[_E]}) on every rank of the group",
             ", ".join(f"{n} out of range on rank {r}" for r, n in bad))


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """all_to_all_single over dim 0: send[d] rows of x (in rank order) to rank d, recv[s] rows from rank s."""
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """_exchange with autograd: the gradient of each received row goes back to where the row came from (the same
    exchange with the split sizes swapped). `anchor`, a tensor requiring grad, makes the output require grad even
    where x does not: every rank must take part in the backward's exchange once any rank trains."""

    @staticmethod
    def forward(ctx, x, anchor, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None, None


class _NoRows(torch.autograd.Function):
    """The expert output when no slot reached this rank: [0, H], still joined to the received rows (so that the
    backward's exchange runs here too) and to the local expert weights (whose gradient is then zeros, as when
    rows come)."""

    @staticmethod
    def forward(ctx, rows, w13, w2):
        ctx.save_for_backward(w13, w2)
        return rows.new_zeros(rows.shape)

    @staticmethod
    def backward(ctx, grad):
        w13, w2 = ctx.saved_tensors
        return (grad.new_zeros(0, grad.shape[1]),
                torch.zeros_like(w13) if ctx.needs_input_grad[1] else None,
                torch.zeros_like(w2) if ctx.needs_input_grad[2] else None)


def _true_positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The positions of the True entries of the 1-d mask, in order, given their number: nonzero() without its
    host sync (the count is known from the count exchange)."""
    place = torch.where(mask, mask.cumsum(0) - 1, count)  # the False entries all go to one spare slot
    out = torch.empty(count + 1, dtype=torch.long, device=mask.device)
    return out.scatter_(0, place, torch.arange(mask.numel(), device=mask.device))[:count]


def expert_parallel_experts(hidden: torch.Tensor, w13_local: torch.Tensor, w2_local: torch.Tensor,
                            topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, num_experts: int,
                            group: Optional[dist.ProcessGroup] = None, backend: Optional[str] = None) -> torch.Tensor:
    """out [T, H] = Σ_k topk_weights[t, k] · expert topk_ids[t, k] (hidden[t]), with the E experts spread over the
    ranks of `group` (default: the world): `warpforge.ops.moe.experts(hidden, w13, w2, topk_weights, topk_ids)`
    where w13 / w2 are every rank's w13_local / w2_local concatenated in rank order. A collective: every rank of
    the group calls it, for its own tokens, and runs the backward of what it returns.

    hidden [T, H] this rank's tokens (T may differ between ranks, 0 included), fp16 / bf16 / fp32;
    w13_local [E / W, 2I, H] and w2_local [E / W, H, I], in hidden's dtype: the experts this rank holds,
    `local_expert_range(num_experts, group)`; topk_weights [T, k] float, topk_ids [T, k] int32 / int64 global expert
    ids in [0, num_experts) (e.g. from `warpforge.ops.moe.route`); num_experts: E, a multiple of the group size W.
    backend: that of `experts` on the local experts.

    Autograd: gradients reach hidden, topk_weights (so the router trains) and w13_local / w2_local, whose gradient
    sums the contributions of every rank's tokens routed to them (data-parallel training that averages gradients
    over these ranks must divide the expert weights' gradients by W to match). Once any rank's inputs require
    grad, every rank's output does (a rank with frozen inputs still serves the others' backward), and every rank
    must run the backward. The slots of a token are summed in a fixed order in fp32 (in fp16 / bf16 each slot's
    expert output is rounded to that dtype first); the backward sums the copies of a row (a token sent to several
    ranks, a received row used by several slots) through torch's indexing backward, deterministic on CUDA under
    torch.use_deterministic_algorithms.

    Host reads: the counts of rows each rank sends to each rank are read on the host once per call (they size
    the exchanges), so the call does not run under CUDA-graph capture. The ids' range is checked in the same
    read: an id out of range raises a WarpforgeInputError on every rank of the group. With W = 1 this is
    `experts` itself.
    """
    world = resolve_group(group, "the experts are split over its ranks").world
    error, backend_name = None, None
    try:
        backend_name = _check_inputs(hidden, w13_local, w2_local, topk_weights, topk_ids, num_experts, world, backend)
    except WarpforgeInputError as e:
        error = e
    if world == 1:
        if error is not None:
            raise error
        return experts(hidden, w13_local, w2_local, topk_weights, topk_ids, backend=backend_name)

    device = _meta_device(hidden, group)
    meta = torch.zeros(world, _COLUMNS, dtype=torch.long, device=device)
    if error is None:
        t, k = topk_ids.shape
        h, inter = hidden.shape[1], w2_local.shape[2]
        per_rank = num_experts // world
        ids = topk_ids.long()
        in_range = (ids >= 0) & (ids < num_experts)
        # out-of-range ids are refused below, on every rank alike; until then they are clamped so that the counts
        # can be formed
        ids = ids.clamp(0, num_experts - 1)
        dest = ids // per_rank  # [T, k]: the rank holding each routed slot's expert
        goes_to = torch.zeros(t, world, dtype=torch.bool, device=device).scatter_(1, dest, True)  # [T, W]
        train = torch.is_grad_enabled() and any(x.requires_grad for x in (hidden, w13_local, w2_local, topk_weights))
        meta[:, _ROWS] = goes_to.sum(0)
        meta[:, _SLOTS].scatter_add_(0, dest.reshape(-1), torch.ones(t * k, dtype=torch.long, device=device))
        meta[:, _BAD_IDS] = (~in_range).sum()
        meta[:, _TRAIN:] = torch.tensor([int(train), k, h, inter, num_experts, _DTYPE_CODE[hidden.dtype]],
                                        device=device)
    else:
        meta[:, _ERROR] = 1
    got = torch.empty_like(meta)
    dist.all_to_all_single(got, meta, group=group)
    host = torch.cat([meta, got]).tolist()  # the one host read
    sent, got = host[:world], host[world:]
    _check_ranks(error, sent[0], got)

    rows_out, slots_out = [r[_ROWS] for r in sent], [r[_SLOTS] for r in sent]
    rows_in, slots_in = [r[_ROWS] for r in got], [r[_SLOTS] for r in got]
    # one flag for the group: the backward's exchanges run only if every rank builds them into its graph
    anchor = torch.zeros(0, device=device, requires_grad=True) if any(r[_TRAIN] for r in got) else None

    # dispatch: one row per (destination rank, token), ordered by rank, then token
    picked = _true_positions(goes_to.t().reshape(-1), sum(rows_out))
    row_token, row_dest = picked % max(t, 1), picked // max(t, 1)
    # each row's k slots: the local id of the expert where the slot goes to that rank, else -1
    slot_ids = torch.where(dest[row_token] == row_dest[:, None], ids[row_token] - row_dest[:, None] * per_rank, -1)
    recv = _AllToAll.apply(hidden[row_token], anchor, rows_out, rows_in, group)
    recv_slot_ids = _exchange(slot_ids.to(torch.int32), rows_out, rows_in, group)

    # the local experts, on one copy of a received row per slot routed here (rows in arrival order, then slots)
    n_in = sum(slots_in)
    slot_pos = _true_positions((recv_slot_ids >= 0).reshape(-1), n_in)
    rows = recv[slot_pos // k]
    if n_in:
        local_ids = recv_slot_ids.reshape(-1)[slot_pos][:, None]
        ones = torch.ones(n_in, 1, dtype=torch.float32, device=device)
        # weight 1: the routed weights are applied back home, so that only rows travel and their gradient stays
        # where they live; the ids were checked above (check_ids=False: no second host read)
        y = experts(rows, w13_local, w2_local, ones, local_ids, check_ids=False, backend=backend_name)
    else:
        y = _NoRows.apply(rows, w13_local, w2_local)

    # combine: each slot's output comes back in (source rank, token, slot) order, i.e. the order of a stable sort
    # of the flat (token, slot) pairs by destination rank; undo that order, then sum the k slots in fp32
    back = _AllToAll.apply(y, anchor, slots_in, slots_out, group)
    order = torch.sort(dest.reshape(-1), stable=True).indices
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=device))
    per_slot = back[inverse].view(t, k, h)
    out = (per_slot.float() * topk_weights.float()[..., None]).sum(1)  # a fixed order: no atomics
    return out.to(hidden.dtype)


def shard_experts(moe, group: Optional[dist.ProcessGroup] = None):
    """Expert parallelism for an `nn.MoE` over the ranks of `group` (default: the world), in place: keep only this
    rank's num_experts / W experts of w13 / w2 (local_expert_range) and from then on send each token to the ranks
    that hold its experts (expert_parallel_experts). Every rank calls it, on modules with the same weights; the
    module's forward is then a collective. The router and shared experts stay replicated (for DDP). The expert
    weights' gradients sum every rank's tokens: a loss averaged over the ranks (DDP's) wants them divided by W.
    Returns moe."""
    from functools import partial

    from ..nn.functional import backend_across_ranks
    from ..nn.moe import MoE
    if not isinstance(moe, MoE):
        fail("moe", "a warpforge.nn.MoE", type(moe).__name__)
    if moe.dispatch is not None:
        fail("moe", "a module whose experts are not sharded yet", "one already sharded")
    own = local_expert_range(moe.num_experts, group)  # also checks the group and num_experts % W
    moe.w13 = torch.nn.Parameter(moe.w13.detach()[own.start:own.stop].clone())
    moe.w2 = torch.nn.Parameter(moe.w2.detach()[own.start:own.stop].clone())
    moe.dispatch = partial(expert_parallel_experts, num_experts=moe.num_experts, group=group,
                           backend=backend_across_ranks(moe.backend, "moe"))
    return moe
