"""The experts for a handful of tokens (decode), as two token-major GEMV kernels: no `align`, no atomics, no fp32
output to zero and cast back.

At T 1 the grouped path is six graph nodes (route, align, a zero fill, two GEMMs, a cast); for Qwen3-30B-A3B
(H200) that is 46 µs around 24 µs of GEMMs for a 17.7 µs weight-read floor. Here:
  up:   program (slot, I tile) reads its expert's gate and up rows once and writes act = silu(gate) · up,
  down: program (token, H tile) walks the token's k slots and writes out[token] in the model's dtype.
Each slot re-reads its expert's weights, so tokens that share an expert read it twice: this path is for
T · k small next to E (configs.DECODE_GEMV_TOKENS gates it per arch).
"""
import triton
import triton.language as tl


@triton.jit
def moe_decode_up_kernel(HIDDEN, W13, IDS, ACT, stride_h, stride_we, stride_wn, stride_a, H, I,
                         TOPK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr):
    slot = tl.program_id(0)
    token = slot // TOPK
    e = tl.load(IDS + slot).to(tl.int64)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = offs_i < I
    gate_rows = W13 + e * stride_we + offs_i[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + I * stride_wn
    x_row = HIDDEN + token.to(tl.int64) * stride_h
    gate = tl.zeros([BLOCK_I], tl.float32)
    up = tl.zeros([BLOCK_I], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        x = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        m = i_ok[:, None] & k_ok[None, :]
        gate += tl.sum(tl.load(gate_rows + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * x[None, :], 1)
        up += tl.sum(tl.load(up_rows + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * x[None, :], 1)
    act = gate * tl.sigmoid(gate) * up
    tl.store(ACT + slot.to(tl.int64) * stride_a + offs_i, act.to(ACT.dtype.element_ty), mask=i_ok)


@triton.jit
def moe_decode_down_kernel(ACT, W2, IDS, WEIGHTS, OUT, stride_a, stride_we, stride_wn, stride_o, H, I,
                           TOPK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in range(TOPK):
        slot = token * TOPK + j
        e = tl.load(IDS + slot).to(tl.int64)
        w = tl.load(WEIGHTS + slot)
        rows = W2 + e * stride_we + offs_h[:, None].to(tl.int64) * stride_wn
        a_row = ACT + slot.to(tl.int64) * stride_a
        part = tl.zeros([BLOCK_H], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < I
            a = tl.load(a_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            wt = tl.load(rows + offs_k[None, :], mask=h_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            part += tl.sum(wt * a[None, :], 1)
        acc += w * part
    tl.store(OUT + token.to(tl.int64) * stride_o + offs_h, acc.to(OUT.dtype.element_ty), mask=h_ok)


def decode_experts(hidden, w13, w2, topk_weights, topk_ids, tiles):
    """out [T, H] in hidden's dtype; topk_weights fp32 [T, k], topk_ids int32 [T, k]; tiles: (BLOCK_I, BLOCK_H,
    BLOCK_K, warps) from configs.DecodeCfg."""
    import torch

    t, h = hidden.shape
    k = topk_ids.shape[1]
    inter_dim = w2.shape[2]
    block_i, block_h, block_k, warps = tiles
    out = torch.empty((t, h), device=hidden.device, dtype=hidden.dtype)
    if t == 0:
        return out
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    act = torch.empty((t * k, inter_dim), device=hidden.device, dtype=hidden.dtype)
    moe_decode_up_kernel[(t * k, triton.cdiv(inter_dim, block_i))](
        hidden, w13, ids, act, hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0), h, inter_dim,
        TOPK=k, BLOCK_I=block_i, BLOCK_K=block_k, num_warps=warps)
    moe_decode_down_kernel[(t, triton.cdiv(h, block_h))](
        act, w2, ids, weights, out, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), h, inter_dim,
        TOPK=k, BLOCK_H=block_h, BLOCK_K=block_k, num_warps=warps)
    return out
