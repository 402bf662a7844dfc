"""Fused MoE grouped GEMMs in Triton. Rows are gathered inside the GEMM from the aligned slot list (no
permuted copy of the activations); every block of BLOCK_M slots belongs to one expert (see align.py).

gate_up: inter[slot] = SiLU(x[token] · W13[e][:I]ᵀ) ⊙ (x[token] · W13[e][I:]ᵀ); both halves are
         accumulated by the same program, so only [T·k, I] is written.
down:    out[token] += weight[slot] · inter[slot] · W2[e]ᵀ, an fp32 atomic add: the routed-weight multiply
         and the top-k combine happen in the epilogue, with no separate sum pass.
slot = token · topk + k. Expert and token offsets are int64 (E · 2I · H passes 2^31 for DeepSeek-V3).
"""
import triton
import triton.language as tl


@triton.jit
def _block_rows(SORTED_IDS, EXPERT_IDS, NUM_POST, pid_m, n_slots, TOPK: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, slots, slot mask, tokens) of row block pid_m; expert -1 when the block is past the end."""
    e = tl.load(EXPERT_IDS + pid_m)
    if pid_m * BLOCK_M >= tl.load(NUM_POST):
        e = -1
    slots = tl.load(SORTED_IDS + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = slots < n_slots
    tokens = tl.where(ok, slots // TOPK, 0).to(tl.int64)
    return e, slots.to(tl.int64), ok, tokens


@triton.jit
def moe_gate_up_kernel(X, W13, INTER, SORTED_IDS, EXPERT_IDS, NUM_POST,
                       stride_xt, stride_we, stride_wn, stride_it, n_slots, H, I,
                       TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, slots, ok, tokens = _block_rows(SORTED_IDS, EXPERT_IDS, NUM_POST, pid_m, n_slots, TOPK, BLOCK_M)
    if e < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    w_gate = W13 + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + I * stride_wn
    x_rows = X + tokens[:, None] * stride_xt
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        a = tl.load(x_rows + offs_k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & n_ok[None, :]
        acc_g = tl.dot(a, tl.load(w_gate + offs_k[:, None], mask=wmask, other=0.0), acc_g)
        acc_u = tl.dot(a, tl.load(w_up + offs_k[:, None], mask=wmask, other=0.0), acc_u)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(INTER + slots[:, None] * stride_it + offs_n[None, :], act.to(INTER.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@triton.jit
def moe_down_kernel(INTER, W2, OUT, TOPK_W, SORTED_IDS, EXPERT_IDS, NUM_POST,
                    stride_it, stride_we, stride_wn, stride_ot, n_slots, H, I,
                    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, slots, ok, tokens = _block_rows(SORTED_IDS, EXPERT_IDS, NUM_POST, pid_m, n_slots, TOPK, BLOCK_M)
    if e < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    w_rows = W2 + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    a_rows = INTER + slots[:, None] * stride_it
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        a = tl.load(a_rows + offs_k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.load(w_rows + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0), acc)
    weight = tl.load(TOPK_W + slots, mask=ok, other=0.0)
    tl.atomic_add(OUT + tokens[:, None] * stride_ot + offs_n[None, :], acc * weight[:, None],
                  mask=ok[:, None] & n_ok[None, :], sem="relaxed")


def fused_experts(hidden, w13, w2, topk_weights, sorted_ids, expert_ids, num_post, topk, cfg):
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; the aligned schedule from align(); cfg (BLOCK_M, BLOCK_N,
    BLOCK_K, warps, stages) with BLOCK_M equal to align's block_m. Returns out [T, H] in hidden's dtype."""
    import torch

    t, h = hidden.shape
    inter_dim = w2.shape[2]
    n_slots = t * topk
    bm, bn, bk, warps, stages = cfg
    inter = torch.empty((n_slots, inter_dim), device=hidden.device, dtype=hidden.dtype)
    out = torch.zeros((t, h), device=hidden.device, dtype=torch.float32)
    blocks = sorted_ids.numel() // bm
    if t == 0 or blocks == 0:
        return out.to(hidden.dtype)
    weights = topk_weights.reshape(-1).float().contiguous()
    moe_gate_up_kernel[(blocks, triton.cdiv(inter_dim, bn))](
        hidden, w13, inter, sorted_ids, expert_ids, num_post,
        hidden.stride(0), w13.stride(0), w13.stride(1), inter.stride(0), n_slots, h, inter_dim,
        TOPK=topk, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    moe_down_kernel[(blocks, triton.cdiv(h, bn))](
        inter, w2, out, weights, sorted_ids, expert_ids, num_post,
        inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0), n_slots, h, inter_dim,
        TOPK=topk, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out.to(hidden.dtype)
