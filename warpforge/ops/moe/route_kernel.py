"""`route` in one Triton launch for inference: scores, DeepSeek-V3's group filter, top-k, renormalisation.

The torch version (reference.py) is 5–15 small kernels (softmax or sigmoid, topk, gather, sum, divide, and for
the grouped router two more topk, a scatter and a mask); at decode they cost more than a small model's expert
GEMMs. Here a program takes BLOCK_T tokens with all E scores in registers and picks the top-k by k passes of
argmax, choosing as reference.py says: ties go to the lower expert id (argmax's tie_break_left), a NaN score
ranks as NAN_RANK and an expert of a group left out as LEFT_OUT_RANK, below every score, and a taken expert
(or a padding column) as -inf, below those: the k ids of a row are distinct and in [0, E) whatever the
logits, and no NaN reaches an argmax (whose NaN handling differs between GPUs and the interpreter). Training
keeps the torch version: its weights are differentiable in the router logits.

The launcher gives each token one program of one warp: every reduction is then a few lane shuffles and no
barrier, and instruction counts grow linearly with BLOCK_T, so batching tokens in a program saves nothing
(benchmarks/NOTES.md, MoE: the 4-warp version's barriers).
"""
import torch
import triton
import triton.language as tl

NAN_RANK = tl.constexpr(-1.0)       # reference.NAN_RANK: a NaN score, below every score (scores lie in [0, 1])
LEFT_OUT_RANK = tl.constexpr(-2.0)  # reference.LEFT_OUT_RANK: an expert of a group not kept, below that

ROUTE_KERNEL_MAX_EXPERTS = 1024
TOKENS_PER_PROGRAM = 1  # one warp a token (see above); the kernel takes any BLOCK_T


@triton.jit
def _take_max(sel, cols):
    """Index of each row's largest entry and a one-hot mask of it."""
    j = tl.argmax(sel, 1)
    return j, cols[None, :] == j[:, None]


@triton.jit
def moe_route_kernel(LOGITS, WEIGHTS, IDS, n_tokens, stride_l, scaling,
                     E: tl.constexpr, E_PAD: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr,
                     SIGMOID: tl.constexpr, RENORM: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_tokens
    cols = tl.arange(0, E_PAD)
    col_ok = cols < E
    x = tl.load(LOGITS + rows[:, None].to(tl.int64) * stride_l + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # rows past T: finite
    if SIGMOID:
        scores = tl.where(col_ok[None, :], tl.sigmoid(x), 0.0)
    else:
        x = tl.where(col_ok[None, :], x, float("-inf"))
        # the max of the numbers (NaN-free, as the GPU's max): a NaN logit still makes the row's scores NaN
        row_max = tl.max(tl.where(x == x, x, float("-inf")), 1)
        p = tl.where(col_ok[None, :], tl.exp(x - row_max[:, None]), 0.0)
        scores = p / tl.sum(p, 1)[:, None]
    choose = tl.where(col_ok[None, :], tl.where(scores == scores, scores, NAN_RANK), float("-inf"))
    if GROUPS > 1:  # (launcher: E is a power of two here) a group scores the sum of its two best experts
        PER: tl.constexpr = E // GROUPS
        grouped = tl.reshape(choose, [BLOCK_T, GROUPS, PER])
        best = tl.max(grouped, 2)
        first = tl.argmax(grouped, 2)
        second = tl.max(tl.where(tl.arange(0, PER)[None, None, :] == first[:, :, None], float("-inf"), grouped), 2)
        group_score = best + second if PER > 1 else best
        gcols = tl.arange(0, GROUPS)
        keep = gcols[None, :] < 0
        for _ in tl.static_range(TOPK_GROUP):
            _, hit = _take_max(group_score, gcols)
            keep = keep | hit
            group_score = tl.where(hit, float("-inf"), group_score)
        choose = tl.reshape(tl.where(keep[:, :, None], grouped, LEFT_OUT_RANK), [BLOCK_T, E_PAD])
    kcols = tl.arange(0, K_PAD)
    weights = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    for i in tl.static_range(TOPK):
        j, hit = _take_max(choose, cols)
        put = kcols[None, :] == i
        weights = tl.where(put, tl.sum(tl.where(hit, scores, 0.0), 1)[:, None], weights)
        ids = tl.where(put, j[:, None].to(tl.int32), ids)
        choose = tl.where(hit, float("-inf"), choose)
    if RENORM:
        total = tl.sum(weights, 1)
        weights = weights / tl.where(total < 1e-20, 1e-20, total)[:, None]  # a NaN total stays NaN (torch's clamp)
    out = rows[:, None].to(tl.int64) * TOPK + kcols[None, :]
    mask = row_ok[:, None] & (kcols[None, :] < TOPK)
    tl.store(WEIGHTS + out, weights * scaling, mask=mask)
    tl.store(IDS + out, ids, mask=mask)


def route_triton(router_logits, topk, renormalize, scoring, num_expert_group, topk_group, routed_scaling_factor):
    """(topk_weights fp32 [T, k], topk_ids int32 [T, k]); the caller checked the arguments and fits()."""
    t, e = router_logits.shape
    weights = torch.empty((t, topk), device=router_logits.device, dtype=torch.float32)
    ids = torch.empty((t, topk), device=router_logits.device, dtype=torch.int32)
    if t == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    e_pad = triton.next_power_of_2(e)
    moe_route_kernel[(triton.cdiv(t, TOKENS_PER_PROGRAM),)](
        logits, weights, ids, t, logits.stride(0), float(routed_scaling_factor),
        E=e, E_PAD=e_pad, TOPK=topk, K_PAD=triton.next_power_of_2(topk), SIGMOID=scoring == "sigmoid",
        RENORM=bool(renormalize), GROUPS=num_expert_group or 1, TOPK_GROUP=topk_group or 1,
        BLOCK_T=TOKENS_PER_PROGRAM, num_warps=1)
    return weights, ids


def fits(num_experts, num_expert_group):
    """Whether the kernel takes this router: E up to ROUTE_KERNEL_MAX_EXPERTS, and a power of two when grouped."""
    if num_experts > ROUTE_KERNEL_MAX_EXPERTS:
        return False
    return not num_expert_group or num_experts & (num_experts - 1) == 0
