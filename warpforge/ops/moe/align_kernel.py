"""`align` in one Triton launch, for decode-sized routings (T·k up to ALIGN_KERNEL_MAX_SLOTS slots).

The torch version (align.py) is about twenty small kernels (sort, scans, scatters): even inside a CUDA graph
they cost more than the GEMMs of a small model at T 1 (benchmarks/NOTES.md). Here one program holds every slot:
  counts  = histogram of the expert ids; padded to block_m; starts/ends by a cumulative sum,
  order   = sort of (expert · N_PAD + slot): slots expert by expert, in slot order within an expert
            (the same order as the torch version, so results are identical and deterministic),
  dest    = sorted position + (padded start − unpadded start) of its expert, gathered through SCRATCH,
  blocks  = for each row block, how many experts end at or before it (a searchsorted by comparison).
"""
import torch
import triton
import triton.language as tl

ALIGN_KERNEL_MAX_SLOTS = 4096


@triton.jit
def moe_align_kernel(TOPK_IDS, SORTED_IDS, EXPERT_IDS, NUM_POST, SCRATCH, n, cap,
                     E: tl.constexpr, E_PAD: tl.constexpr, N_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                     FILL: tl.constexpr):
    slot = tl.arange(0, N_PAD)
    live = slot < n
    ids = tl.load(TOPK_IDS + slot, mask=live, other=E)  # padding lands in bin E, dropped below
    ids = tl.where((ids >= 0) & (ids < E), ids, E)  # so do ids out of range (trusted ids, unchecked): never scheduled
    bins = tl.arange(0, E_PAD)
    counts = tl.where(bins < E, tl.histogram(ids, E_PAD), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    first = tl.cumsum(counts, 0) - counts  # an expert's first position among the sorted (unpadded) slots
    total = tl.sum(padded, 0)
    tl.store(SCRATCH + bins, ends - padded - first)  # sorted position -> padded destination, per expert
    for i in range(0, cap, FILL):
        offs = i + tl.arange(0, FILL)
        tl.store(SORTED_IDS + offs, tl.zeros([FILL], tl.int32) + n, mask=offs < cap)
    tl.debug_barrier()  # the shift table and the padding fill are visible to every thread from here
    keys = tl.sort(tl.where(live, ids * N_PAD + slot, E * N_PAD + slot))
    expert = keys // N_PAD
    pos = tl.arange(0, N_PAD)
    scheduled = expert < E  # the first (in-range) slots of the sorted keys
    shift = tl.load(SCRATCH + expert, mask=scheduled, other=0)
    tl.store(SORTED_IDS + pos + shift, (keys % N_PAD).to(tl.int32), mask=scheduled)
    for b0 in range(0, cap // BLOCK_M, FILL):
        blk = b0 + tl.arange(0, FILL)
        row = blk * BLOCK_M
        owner = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), 1)
        tl.store(EXPERT_IDS + blk, tl.where(row < total, owner, -1), mask=blk < cap // BLOCK_M)
    tl.store(NUM_POST, total)


def align_triton(topk_ids, num_experts, block_m, cap):
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()  # the kernel reads the ids as one dense row
    n = flat.numel()
    device = flat.device
    e_pad = triton.next_power_of_2(num_experts + 1)
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=device)
    expert_ids = torch.empty(cap // block_m, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    scratch = torch.empty(e_pad, dtype=torch.int32, device=device)
    moe_align_kernel[(1,)](flat, sorted_ids, expert_ids, num_post, scratch, n, cap, E=num_experts, E_PAD=e_pad,
                           N_PAD=max(16, triton.next_power_of_2(n)), BLOCK_M=block_m, FILL=64,
                           num_warps=8 if n > 1024 else 4)
    return sorted_ids, expert_ids, num_post
