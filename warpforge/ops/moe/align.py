"""The MoE schedule: token slots grouped by expert, each expert's run padded to a multiple of block_m, so
that every row block of the grouped GEMMs belongs to one expert.

Plain torch ops on the device here (align_kernel.py does the same in one launch for decode sizes), sizes fixed
by shapes alone (T·k slots, at most min(E, T·k) non-empty experts): no host synchronisation, so it can sit
inside a CUDA graph.
"""
from __future__ import annotations

import torch

from ...errors import check_bool, check_dtype, check_int, check_tensor, fail, host_reads_allowed
from ...runtime import resolve_backend
from .configs import ROUTING


def capacity(n_slots: int, num_experts: int, block_m: int) -> int:
    """align's static length P: every slot plus the most padding any routing can need, in whole blocks."""
    cap = n_slots + min(num_experts, max(n_slots, 1)) * (block_m - 1)
    return -(-cap // block_m) * block_m


def align(topk_ids, num_experts, block_m, backend=None, *, check_ids=True):
    """topk_ids [T, k] int32/int64 in [0, num_experts) -> (sorted_ids int32 [P], expert_ids int32 [P / block_m],
    num_post int32 [1]).

    sorted_ids lists slots (token · k + j) expert by expert (in slot order within an expert), padded with
    T·k (an invalid slot); expert_ids[b] is the expert of row block b, -1 past the used blocks; num_post is the
    padded length used. P = T·k + min(E, T·k) · (block_m − 1), rounded up to block_m: the most padding any
    routing can need. On the Triton backend, up to ALIGN_KERNEL_MAX_SLOTS slots run as one kernel launch where
    configs.ROUTING says so for the arch.

    check_ids, as in `experts`: the ids' values are checked on the host (one sync); under CUDA-graph capture or
    torch.compile they are clamped into [0, E) on the device instead. With False the ids are trusted: the
    one-launch kernel leaves out-of-range ids out of the schedule (it never reads or writes outside its
    tensors), the torch ops raise their own index errors.
    """
    check_tensor("topk_ids", topk_ids)
    if topk_ids.dim() != 2:
        fail("topk_ids", "a 2-d tensor [T, k]", f"shape {tuple(topk_ids.shape)}")
    check_dtype("topk_ids", topk_ids, (torch.int32, torch.int64))
    check_int("num_experts", num_experts, 1)
    check_int("block_m", block_m, 1)
    check_bool("check_ids", check_ids)
    backend = resolve_backend(backend, topk_ids.device)
    if check_ids:
        topk_ids = checked_ids(topk_ids, num_experts)
    return align_unchecked(topk_ids, num_experts, block_m, backend)


def checked_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids whose values are checked to lie in [0, num_experts) on the host, or under CUDA-graph capture or
    torch.compile (no host reads) clamped into that range on the device."""
    if host_reads_allowed(ids) and ids.device.type != "meta":
        if ids.numel() and bool(((ids < 0) | (ids >= num_experts)).any()):
            fail("topk_ids", f"expert ids in [0, {num_experts})", f"min {int(ids.min())}, max {int(ids.max())}")
        return ids
    return ids.clamp(0, num_experts - 1)


def align_unchecked(topk_ids: torch.Tensor, num_experts: int, block_m: int, backend: str | None = None):
    """`align` for validated arguments (the experts' launchers: ids from `route`, or checked / clamped by the
    public door)."""
    n = topk_ids.numel()
    cap = capacity(n, num_experts, block_m)
    if 0 < n and resolve_backend(backend, topk_ids.device) == "triton" and \
            ROUTING.lookup(topk_ids.device).one_launch:
        from .align_kernel import ALIGN_KERNEL_MAX_SLOTS, align_triton
        if n <= ALIGN_KERNEL_MAX_SLOTS:
            return align_triton(topk_ids, num_experts, block_m, cap)
    flat = topk_ids.reshape(-1).long()
    device = flat.device
    # scatter_add, not bincount: bincount reads the max back to the host to size its output
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices                   # slots, expert by expert
    first_of_expert = counts.cumsum(0) - counts
    experts_sorted = flat[order]
    rank = torch.arange(n, device=device) - first_of_expert[experts_sorted]
    sorted_ids = torch.full((cap,), n, dtype=torch.int32, device=device)
    sorted_ids[starts[experts_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, cap, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = torch.where(block_starts < ends[-1], expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)
