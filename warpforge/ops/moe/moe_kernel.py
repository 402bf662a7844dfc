"""Fused MoE grouped GEMMs in Triton. Rows are gathered inside the GEMM from the aligned slot list (no
permuted copy of the activations); every block of BLOCK_M slots belongs to one expert (see align.py).

One GEMM kernel serves forward and backward, B's layout given by strides, with two epilogues:
- per slot: OUT[slot] = A[token or slot] · B[e]; with SWIGLU the program accumulates gate and up together,
  so the forward writes only [T·k, I] (and [T·k, 2I] pre-activations when training).
- SCATTER: OUT[token] += w[slot] · A[slot] · B[e] by fp32 atomics: the routed-weight multiply and the top-k
  combine in the epilogue, with no separate sum pass.
and the weight gradient: dW[e] = Σ over e's slots of Gᵀ A, one program per (expert, tile), no atomics.
slot = token · topk + k. Expert and token offsets are int64 (E · 2I · H passes 2^31 for DeepSeek-V3).
"""
import os

import torch
import triton
import triton.language as tl

from ..shared_kernels import dot, swiglu_grads


@triton.jit
def _grouped_tile(pid, num_a, num_b, GROUP: tl.constexpr):
    """Linear program id -> (a, b) tile, walking GROUP a-tiles across all b-tiles before the next group (the
    Triton matmul tutorial's order): programs that run together share their a-side and b-side data in L2."""
    per_group = GROUP * num_b
    first = (pid // per_group) * GROUP
    size = tl.minimum(num_a - first, GROUP)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _block_rows(SORTED_IDS, EXPERT_IDS, pid_m, n_slots, TOPK: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, slots, slot mask, tokens) of row block pid_m, one of the blocks in use."""
    e = tl.load(EXPERT_IDS + pid_m)
    slots = tl.load(SORTED_IDS + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = slots < n_slots
    tokens = tl.where(ok, slots // TOPK, 0).to(tl.int64)
    return e, slots.to(tl.int64), ok, tokens


@triton.jit
def _b_columns(B, e, pid_n, stride_be, stride_bn, N, BLOCK_N: tl.constexpr):
    """This program's output columns of expert e's B: (offsets, mask, pointers to each column's start)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_n, offs_n < N, B + e.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn


@triton.jit
def _load_b(ptrs, mask, n_ok, SCALE, e, k0, offs_n, stride_se, stride_sk, stride_sn, FP8_B: tl.constexpr,
            OUT_DTYPE: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] tile of B: as stored, or FP8 (e4m3 bytes) times its 128x128 block scale. FP8 tiles
    start at a multiple of BLOCK_K <= 128 (launcher), so the tile's k lies in one scale block: one scale per
    column, not a [BLOCK_K, BLOCK_N] gather (which the pipeliner would stage in shared memory)."""
    if FP8_B:
        if OUT_DTYPE == tl.float16:
            # e4m3 -> fp16 is one cvt per pair, the scale one packed multiply: no fp32 round trip (the fp16
            # math of the paged kernel's FP8 cache; the operands' other side is fp16 too, FP16_MATH)
            vals, scale = _fp8_tile(ptrs, mask, n_ok, SCALE, e, k0, offs_n, stride_se, stride_sk, stride_sn,
                                    tl.float16)
            tile = vals * scale[None, :].to(tl.float16)
        else:
            vals, scale = _fp8_tile(ptrs, mask, n_ok, SCALE, e, k0, offs_n, stride_se, stride_sk, stride_sn,
                                    tl.float32)
            tile = (vals * scale[None, :]).to(OUT_DTYPE)
    else:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile


@triton.jit
def _fp8_tile(ptrs, mask, n_ok, SCALE, e, k0, offs_n, stride_se, stride_sk, stride_sn, OUT_DTYPE: tl.constexpr):
    """(the raw e4m3 tile in OUT_DTYPE, exact; its columns' scales) of an FP8 B tile (see _load_b)."""
    codes = tl.load(ptrs, mask=mask, other=0)
    scale = tl.load(SCALE + e.to(tl.int64) * stride_se + (k0 // 128) * stride_sk + (offs_n // 128) * stride_sn,
                    mask=n_ok, other=0.0)
    if OUT_DTYPE == tl.float16:
        vals = codes.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # one cvt per pair
    else:
        vals = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(OUT_DTYPE)
    return vals, scale


@triton.jit
def _dot_b(a, acc, ptrs, mask, n_ok, SCALE, e, k0, offs_n, stride_se, stride_sk, stride_sn, FP8_B: tl.constexpr,
           SCALE_AFTER: tl.constexpr):
    """acc + a · B, B's [BLOCK_K, BLOCK_N] tile as _load_b reads it. SCALE_AFTER (FP8): the MMA on the raw e4m3
    values, the columns' scales applied to its [rows, BLOCK_N] product rather than to the [BLOCK_K, BLOCK_N] tile
    (an eighth of the multiplies at 16 rows against BLOCK_K 128). The decode kernel's form; in the gathered GEMMs
    it bought nothing on the H200 (session 17: Mixtral T1 FP8 0.111 -> 0.112 ms, DeepSeek-V3 0.120 -> 0.127)."""
    if FP8_B and SCALE_AFTER:
        vals, scale = _fp8_tile(ptrs, mask, n_ok, SCALE, e, k0, offs_n, stride_se, stride_sk, stride_sn, a.dtype)
        out = acc + dot(a, vals) * scale[None, :]
    else:
        out = dot(a, _load_b(ptrs, mask, n_ok, SCALE, e, k0, offs_n, stride_se, stride_sk, stride_sn, FP8_B,
                             a.dtype), acc)
    return out


@triton.jit
def swiglu_bwd_epilogue(acc, w, rows, slots, ok, omask, offs_n, pid_n, OUT, PRE, ACT, ACT_W, DW_PART, stride_o,
                        stride_pre, stride_act, stride_dwp, N):
    """The backward's epilogue (acc = d act of `rows`, int64 row indices of OUT / PRE / ACT; w [BLOCK_M, 1] the
    rows' routed weights; slots their slot ids): DW_PART[slot, pid_n] = Σ_n act · acc (router-weight gradient
    partials), ACT_W = w · act (the w2 weight gradient's operand), OUT = [d gate | d up] of w · acc through
    SiLU(gate) ⊙ up with PRE's [gate | up]."""
    act = tl.load(ACT + rows[:, None] * stride_act + offs_n[None, :], mask=omask, other=0.0).to(tl.float32)
    tl.store(DW_PART + slots * stride_dwp + pid_n, tl.sum(act * acc, 1), mask=ok)
    # the weight gradient reads w · act as a plain operand, which its loads can then stream through shared
    # memory asynchronously (scaling rows there put the loads in registers, synchronous)
    tl.store(ACT_W + rows[:, None] * stride_act + offs_n[None, :], (w * act).to(ACT_W.dtype.element_ty), mask=omask)
    pre = PRE + rows[:, None] * stride_pre + offs_n[None, :]
    d_gate, d_up = swiglu_grads(acc * w, tl.load(pre, mask=omask, other=0.0).to(tl.float32),
                                tl.load(pre + N, mask=omask, other=0.0).to(tl.float32))
    out = OUT + rows[:, None] * stride_o + offs_n[None, :]
    tl.store(out, d_gate.to(OUT.dtype.element_ty), mask=omask)
    tl.store(out + N, d_up.to(OUT.dtype.element_ty), mask=omask)


@triton.jit
def swiglu_fwd_epilogue(acc, acc_up, rows, omask, offs_n, PRE, stride_pre, N, SAVE_PRE: tl.constexpr):
    """SiLU(gate) ⊙ up of the forward's two accumulators; SAVE_PRE keeps [gate | up] in PRE's `rows` (training)."""
    if SAVE_PRE:
        pre = PRE + rows[:, None] * stride_pre + offs_n[None, :]
        tl.store(pre, acc.to(PRE.dtype.element_ty), mask=omask)
        tl.store(pre + N, acc_up.to(PRE.dtype.element_ty), mask=omask)
    return acc * tl.sigmoid(acc) * acc_up


@triton.jit
def _zero_slice(ZERO, numel, ZERO_BLOCK: tl.constexpr):
    """This program's share of ZERO[0 : numel] (fp32) set to 0: the next GEMM's scatter target, zeroed by the
    programs of this one (which runs before it in stream order) instead of by a fill launch of its own."""
    programs = tl.num_programs(0)
    chunk = tl.cdiv(tl.cdiv(numel, programs), ZERO_BLOCK) * ZERO_BLOCK
    lo = tl.program_id(0).to(tl.int64) * chunk
    for z0 in range(lo, tl.minimum(lo + chunk, numel), ZERO_BLOCK):
        offs = z0 + tl.arange(0, ZERO_BLOCK)
        tl.store(ZERO + offs, tl.zeros([ZERO_BLOCK], tl.float32), mask=offs < numel)


@triton.jit
def moe_gemm_kernel(A, B, B_SCALE, OUT, PRE, ROW_W, ACT, ACT_W, DW_PART, SORTED_IDS, EXPERT_IDS, NUM_POST, ZERO,
                    stride_a, stride_be, stride_bk, stride_bn, stride_se, stride_sk, stride_sn,
                    stride_o, stride_pre, stride_act, stride_dwp, n_slots, K, N, zero_numel,
                    TOPK: tl.constexpr, A_BY_TOKEN: tl.constexpr, SCATTER: tl.constexpr, SWIGLU: tl.constexpr,
                    SAVE_PRE: tl.constexpr, SWIGLU_BWD: tl.constexpr, HAS_W: tl.constexpr, FP8_B: tl.constexpr,
                    FP16_MATH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    ZERO_BLOCK: tl.constexpr):
    """acc[slot, n] = Σ_k A[row, k] · B[e][k, n], row = the slot's token (A_BY_TOKEN) or the slot. Then one of
    - OUT[slot] = acc; SWIGLU: B's columns n and N + n are gate and up, OUT = SiLU(gate) ⊙ up, PRE keeps
      [gate | up] (forward);
    - SWIGLU_BWD: acc is d act; DW_PART[slot, tile] = Σ_n act · acc (router-weight gradient partials),
      OUT = [d gate | d up] of w[slot] · acc through SiLU(gate) ⊙ up with PRE's [gate | up], and ACT_W =
      w[slot] · act, the w2 weight gradient's operand (backward);
    - SCATTER: OUT[token] += (w[slot] ·) acc by fp32 atomics, the top-k combine.
    ZERO_BLOCK > 0: first, every program (used or not) zeroes its share of ZERO [zero_numel] fp32 (_zero_slice)."""
    if ZERO_BLOCK > 0:
        _zero_slice(ZERO, zero_numel, ZERO_BLOCK)
    # the grid covers align's static capacity; only the row blocks in use get tiles
    used_blocks = tl.cdiv(tl.load(NUM_POST), BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    if tl.program_id(0) >= used_blocks * num_n:
        return
    pid_m, pid_n = _grouped_tile(tl.program_id(0), used_blocks, num_n, 8)
    e, slots, ok, tokens = _block_rows(SORTED_IDS, EXPERT_IDS, pid_m, n_slots, TOPK, BLOCK_M)
    offs_n, n_ok, b_cols = _b_columns(B, e, pid_n, stride_be, stride_bn, N, BLOCK_N)
    a_rows = A + (tokens if A_BY_TOKEN else slots)[:, None] * stride_a
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # split-K (SCATTER only, whose atomics sum the ranges): program_id(2) owns a BLOCK_K-aligned range of K
    k_chunk = tl.cdiv(tl.cdiv(K, tl.num_programs(2)), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(2) * k_chunk
    for k0 in range(k_lo, tl.minimum(k_lo + k_chunk, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        if FP16_MATH:  # FP8 weights dequantised to fp16 (cheaper than to bf16): the MMA runs in fp16
            a = a.to(tl.float16)
        b_ptrs = b_cols + offs_k[:, None].to(tl.int64) * stride_bk
        bmask = k_ok[:, None] & n_ok[None, :]
        acc = _dot_b(a, acc, b_ptrs, bmask, n_ok, B_SCALE, e, k0, offs_n, stride_se, stride_sk, stride_sn, FP8_B,
                     False)
        if SWIGLU:
            acc_up = _dot_b(a, acc_up, b_ptrs + N * stride_bn, bmask, n_ok, B_SCALE, e, k0, offs_n + N, stride_se,
                            stride_sk, stride_sn, FP8_B, False)
    omask = ok[:, None] & n_ok[None, :]
    if SCATTER:
        if HAS_W:
            acc = acc * tl.load(ROW_W + slots, mask=ok, other=0.0)[:, None]
        tl.atomic_add(OUT + tokens[:, None] * stride_o + offs_n[None, :], acc, mask=omask, sem="relaxed")
    elif SWIGLU_BWD:
        w = tl.load(ROW_W + slots, mask=ok, other=0.0)[:, None]
        swiglu_bwd_epilogue(acc, w, slots, slots, ok, omask, offs_n, pid_n, OUT, PRE, ACT, ACT_W, DW_PART, stride_o,
                            stride_pre, stride_act, stride_dwp, N)
    else:
        if SWIGLU:
            acc = swiglu_fwd_epilogue(acc, acc_up, slots, omask, offs_n, PRE, stride_pre, N, SAVE_PRE)
        tl.store(OUT + slots[:, None] * stride_o + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=omask)


@triton.jit
def moe_weight_grad_kernel(G, A, DW, SORTED_IDS, BLOCK_START, BLOCK_COUNT,
                           stride_g, stride_a, stride_de, stride_dn, n_slots, N, K,
                           TOPK: tl.constexpr, G_BY_TOKEN: tl.constexpr, A_BY_TOKEN: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """DW[e][n, k] = Σ over expert e's slots of G[g_row, n] · A[a_row, k]: one program per
    (expert, tile), walking the expert's row blocks in order (deterministic, no atomics)."""
    e = tl.program_id(1)
    pid_n, pid_k = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K), 8)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    first = tl.load(BLOCK_START + e)
    count = tl.load(BLOCK_COUNT + e)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for blk in range(first, first + count):
        slots = tl.load(SORTED_IDS + blk * BLOCK_M + tl.arange(0, BLOCK_M))
        ok = slots < n_slots
        slots64 = slots.to(tl.int64)
        tokens = tl.where(ok, slots // TOPK, 0).to(tl.int64)
        g = tl.load(G + (tokens if G_BY_TOKEN else slots64)[:, None] * stride_g + offs_n[None, :],
                    mask=ok[:, None] & n_ok[None, :], other=0.0)
        a = tl.load(A + (tokens if A_BY_TOKEN else slots64)[:, None] * stride_a + offs_k[None, :],
                    mask=ok[:, None] & k_ok[None, :], other=0.0)
        acc = dot(tl.trans(g), a, acc)
    tl.store(DW + e.to(tl.int64) * stride_de + offs_n[:, None].to(tl.int64) * stride_dn + offs_k[None, :],
             acc.to(DW.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


# ------------------------------------------------------------------------------------------ launch
def _scale_args(b, scale, b_strides):
    """(scale tensor, its expert / k-block / n-block strides) for an FP8 B, matching B's (k, n) orientation."""
    if scale is None:
        return b, 0, 0, 0
    # scales are [E, rows / 128, cols / 128] of the stored [E, rows, cols] weight; k runs along the stored
    # cols when B's k stride is 1 (B = Wᵀ), else along the rows
    if b_strides[0] == 1:
        return scale, scale.stride(0), scale.stride(2), scale.stride(1)
    return scale, scale.stride(0), scale.stride(1), scale.stride(2)


def or_stand_in(t, stand_in):
    """t, or a tensor to pass in its place for a kernel argument the chosen mode never reads."""
    return t if t is not None else stand_in


def row_stride(t) -> int:
    """t's row stride, 0 for an argument that is not there."""
    return t.stride(0) if t is not None else 0


ZERO_BLOCK = 1024  # elements a program zeroes per store when a launch zeroes the next scatter GEMM's output


def _moe_gemm(a, b, out, b_strides, schedule, topk, n, k, cfg, *, a_by_token, scatter=False, swiglu=False,
              pre=None, row_w=None, scale=None, swiglu_bwd=None, zero=None):
    """One launch of moe_gemm_kernel over the aligned schedule; n_slots is the rows of the per-slot side.
    Scatter GEMMs take cfg.down's tiles and cfg.split_k, per-slot ones cfg.up's. swiglu_bwd: (act, act_w,
    pre, dw_part) for the backward epilogue (act_w written like act; dw_part [slots, cdiv(n, cfg.up BLOCK_N)]
    fp32). zero: a contiguous fp32 tensor this launch zeroes (the next scatter GEMM's output)."""
    sorted_ids, expert_ids, num_post = schedule
    bm = cfg.block_m
    bn, bk, warps, stages = cfg.down if scatter else cfg.up
    split_k = cfg.split_k if scatter else 1
    if scale is not None:
        bk = min(bk, 128)  # an FP8 tile's k must lie in one 128-wide scale block
    sc, *sc_strides = _scale_args(b, scale, b_strides)
    n_slots = a.shape[0] if scatter else out.shape[0]
    act = act_w = dw_part = None
    if swiglu_bwd is not None:
        act, act_w, pre, dw_part = swiglu_bwd  # pre is read here (the forward's pre-activations), not written

    def ptr(t):
        return or_stand_in(t, out)
    assert zero is None or (split_k == 1 and zero.dtype == torch.float32 and zero.is_contiguous())
    moe_gemm_kernel[(sorted_ids.numel() // bm * triton.cdiv(n, bn), 1, split_k)](
        a, b, sc, out, ptr(pre), ptr(row_w), ptr(act), ptr(act_w), ptr(dw_part), sorted_ids, expert_ids, num_post,
        ptr(zero), a.stride(0), b.stride(0), b_strides[0], b_strides[1], *sc_strides, out.stride(0), row_stride(pre),
        row_stride(act), row_stride(dw_part), n_slots, k, n, zero.numel() if zero is not None else 0,
        TOPK=topk, A_BY_TOKEN=a_by_token, SCATTER=scatter, SWIGLU=swiglu,
        SAVE_PRE=pre is not None and swiglu_bwd is None, SWIGLU_BWD=swiglu_bwd is not None,
        HAS_W=row_w is not None, FP8_B=scale is not None, FP16_MATH=scale is not None and fp16_math(cfg),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, ZERO_BLOCK=ZERO_BLOCK if zero is not None else 0, num_warps=warps,
        num_stages=stages)


def fp16_math(cfg) -> bool:
    """FP8 weights dequantised to fp16 and multiplied with the activations cast to fp16 (cfg.fp8_fp16_math, or
    WARPFORGE_MOE_FP8_FP16=1 / 0 for the GPU sessions' A/B). Activations past fp16's range (65504) would
    overflow: on only where a table entry says so, after its GPU test."""
    switch = os.environ.get("WARPFORGE_MOE_FP8_FP16", "")
    return switch == "1" or (switch != "0" and cfg.fp8_fp16_math)


def fused_experts(hidden, w13, w2, topk_weights, sorted_ids, expert_ids, num_post, topk, cfg, save_pre=False,
                  scales=None):
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; the aligned schedule from align(); cfg a configs.MoECfg whose
    block_m is align's. Returns (out [T, H] in hidden's dtype, act [T·k, I], pre [T·k, 2I] or None): the
    last two are what the backward needs. scales: (s13, s2) when
    w13 / w2 are FP8 (e4m3 as uint8) with fp32 scales per 128 x 128 block."""
    t, h = hidden.shape
    inter_dim = w2.shape[2]
    n_slots = t * topk
    act = torch.empty((n_slots, inter_dim), device=hidden.device, dtype=hidden.dtype)
    pre = torch.empty((n_slots, 2 * inter_dim), device=hidden.device, dtype=hidden.dtype) if save_pre else None
    # the down GEMM's scatter target, zeroed by the gate/up launch (one launch fewer at decode)
    out = torch.empty((t, h), device=hidden.device, dtype=torch.float32)
    if t == 0 or sorted_ids.numel() == 0:
        return out.zero_().to(hidden.dtype), act, pre
    schedule = (sorted_ids, expert_ids, num_post)
    weights = topk_weights.reshape(-1).float().contiguous()
    # gate_up: B[e][k=h, n] = w13[e, n, h]
    s13, s2 = scales if scales is not None else (None, None)
    _moe_gemm(hidden, w13, act, (w13.stride(2), w13.stride(1)), schedule, topk, inter_dim, h, cfg,
              a_by_token=True, swiglu=True, pre=pre, scale=s13, zero=out)
    # down: B[e][k=i, n=h] = w2[e, h, i]
    _moe_gemm(act, w2, out, (w2.stride(2), w2.stride(1)), schedule, topk, h, inter_dim, cfg, a_by_token=False,
              scatter=True, row_w=weights, scale=s2)
    return out.to(hidden.dtype), act, pre


def expert_blocks(expert_ids, num_experts):
    """Per expert: its first row block and how many it has (from align's expert_ids), without a host sync."""
    used = expert_ids >= 0
    count = torch.zeros(num_experts, dtype=torch.long, device=expert_ids.device).scatter_add_(
        0, expert_ids.long().clamp(min=0), used.long())
    return (count.cumsum(0) - count).to(torch.int32), count.to(torch.int32)


def _weight_grad(g, a, dw, sorted_ids, blocks, topk, cfg, *, g_by_token):
    """dw [E, N, K] = per expert Σ over its slots of g[row]ᵀ a[row]; g and a are read by token or slot,
    whichever the other is not (a routing weight is already in one of them: the backward passes w · act)."""
    first, count = blocks
    e_count, n, k = dw.shape
    bm = cfg.block_m
    bn, bk, warps, stages = cfg.wgrad or cfg.up
    moe_weight_grad_kernel[(triton.cdiv(n, bn) * triton.cdiv(k, bk), e_count)](
        g, a, dw, sorted_ids, first, count, g.stride(0), a.stride(0),
        dw.stride(0), dw.stride(1), (a if g_by_token else g).shape[0], n, k,
        TOPK=topk, G_BY_TOKEN=g_by_token, A_BY_TOKEN=not g_by_token, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return dw


def fused_experts_backward(d_out, hidden, w13, w2, topk_weights, act, pre, sorted_ids, expert_ids, num_post, topk,
                           cfg):
    """Gradients of fused_experts: (d_hidden, d_w13, d_w2, d_topk_weights [T, k] fp32)."""
    t, h = hidden.shape
    e_count, two_i, _ = w13.shape
    inter_dim = two_i // 2
    n_slots = t * topk
    schedule = (sorted_ids, expert_ids, num_post)
    weights = topk_weights.reshape(-1).float().contiguous()
    d_out = d_out.contiguous()
    # d act[slot] = d_out[token] · w2[e] (B[e][k=h, n=i] = w2[e, h, i]), consumed in the epilogue: router-weight
    # gradient partials per column tile, then d_pre = [d gate | d up] of the routed weight times it
    # every scheduled slot is in one used block, whose programs write all its column tiles: d_pre needs no zero
    # fill; dw_part does (a small one), for slots that trusted ids out of range left out of the schedule
    # (experts(check_ids=False)): their routing-weight gradient is 0, as the reference's
    d_pre = torch.empty((n_slots, two_i), device=hidden.device, dtype=hidden.dtype)
    dw_part = torch.zeros((n_slots, triton.cdiv(inter_dim, cfg.up[0])), device=hidden.device, dtype=torch.float32)
    act_w = torch.empty_like(act)
    d_hidden = torch.empty((t, h), device=hidden.device, dtype=torch.float32)  # zeroed by the d act launch
    _moe_gemm(d_out, w2, d_pre, (w2.stride(1), w2.stride(2)), schedule, topk, inter_dim, h, cfg, a_by_token=True,
              row_w=weights, swiglu_bwd=(act, act_w, pre, dw_part), zero=d_hidden)
    d_weights = dw_part.sum(1).view(t, topk)
    # d_hidden[token] += d_pre[slot] · w13[e]  (B[e][k=n2, n=h] = w13[e, n2, h])
    _moe_gemm(d_pre, w13, d_hidden, (w13.stride(1), w13.stride(2)), schedule, topk, h, two_i, cfg,
              a_by_token=False, scatter=True)
    blocks = expert_blocks(expert_ids, e_count)
    # d_w13[e] = Σ d_pre[slot]ᵀ hidden[token];  d_w2[e] = Σ d_out[token]ᵀ (w · act)[slot]
    d_w13 = _weight_grad(d_pre, hidden, torch.empty_like(w13), sorted_ids, blocks, topk, cfg, g_by_token=False)
    d_w2 = _weight_grad(d_out, act_w, torch.empty_like(w2), sorted_ids, blocks, topk, cfg, g_by_token=True)
    return d_hidden.to(hidden.dtype), d_w13, d_w2, d_weights
