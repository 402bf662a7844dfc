"""The fused MoE's training-size path: the activations laid out once in align's sorted order, so that every GEMM
reads contiguous rows of one expert per row block.

moe_kernel.py gathers A's rows by token or slot inside the GEMM (pointer loads: cp.async at best, and Triton
cannot warp-specialize over them). At training sizes one permuted copy of the activations costs little next to
the GEMMs (benchmarks/NOTES.md, "Fused MoE training path"), and with it:
- every operand is a row range of a plain 2-d tensor (A, the intermediates) or one expert's slab of a 3-d weight,
  read through tensor descriptors (TMA on Hopper), in persistent tile loops that can be warp-specialized;
- the intermediates (act, pre, d_pre, w·act, the down GEMM's and d_hidden's per-slot outputs) live in the sorted
  order [P, ·], P align's capacity; padding rows are zero in every operand (the permute writes zeros there, and
  a zero row stays zero through SwiGLU and its gradient), so the weight gradient may sum whole row blocks;
- the top-k combine is a gather-sum over each token's k sorted rows (no atomics: deterministic).
Rows past align's used length are never read nor written. Expert offsets are int64 inside the descriptors.
"""
import torch
import triton
import triton.language as tl

from ...runtime import ensure_tma_allocator, sm_count, tma_compatible
from ..shared_kernels import dot, swiglu_grads
from .moe_kernel import _grouped_tile, or_stand_in, row_stride, swiglu_fwd_epilogue


@triton.jit
def _sorted_rows(SORTED_IDS, r0, cap, n_slots, BLOCK_R: tl.constexpr):
    """Sorted rows [r0, r0 + BLOCK_R): (rows, which are within cap, their slots (n_slots past cap), which are real
    slots rather than padding)."""
    rows = r0 + tl.arange(0, BLOCK_R)
    r_ok = rows < cap
    slots = tl.load(SORTED_IDS + rows, mask=r_ok, other=n_slots)
    return rows, r_ok, slots, slots < n_slots


@triton.jit
def moe_permute_kernel(X, XS, SORTED_IDS, NUM_POST, stride_x, stride_xs, cap, n_slots, H, TOPK: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """XS[r] = X[token of sorted slot r], zero for padding rows; rows past the used length are left alone."""
    r0 = tl.program_id(0) * BLOCK_R
    if r0 >= tl.load(NUM_POST):
        return
    rows, r_ok, slots, ok = _sorted_rows(SORTED_IDS, r0, cap, n_slots, BLOCK_R)
    tokens = tl.where(ok, slots // TOPK, 0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    x = tl.load(X + tokens[:, None] * stride_x + offs_h[None, :], mask=ok[:, None] & h_ok[None, :], other=0.0)
    tl.store(XS + rows.to(tl.int64)[:, None] * stride_xs + offs_h[None, :], x, mask=r_ok[:, None] & h_ok[None, :])


@triton.jit
def moe_combine_kernel(Y, OUT, POS, stride_y, stride_o, T, H, TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    """OUT[t] = Σ_j Y[POS[t·k + j]] in fp32 (a slot that align left out of the schedule has POS -1: adds 0)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < T
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    for j in tl.static_range(TOPK):
        pos = tl.load(POS + tokens.to(tl.int64) * TOPK + j, mask=t_ok, other=-1)
        ok = pos >= 0
        y = tl.load(Y + pos.to(tl.int64)[:, None] * stride_y + offs_h[None, :], mask=ok[:, None] & h_ok[None, :],
                    other=0.0)
        acc += y.to(tl.float32)
    tl.store(OUT + tokens.to(tl.int64)[:, None] * stride_o + offs_h[None, :], acc.to(OUT.dtype.element_ty),
             mask=t_ok[:, None] & h_ok[None, :])


@triton.jit
def _b_tile(b_desc, e, off_n, k0, B_KMAJOR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Expert e's [BLOCK_K, BLOCK_N] tile of B at (k0, off_n), from the 3-d weight's descriptor: [E, N, K] when
    B_KMAJOR (B = Wᵀ, as the forward reads w13 and w2), else [E, K, N]. 3-d, so that a tile past the expert's
    last row is zero-filled rather than read from the next expert (that would corrupt a K tail's sums)."""
    if B_KMAJOR:
        b = tl.trans(b_desc.load([e, off_n, k0]).reshape(BLOCK_N, BLOCK_K))
    else:
        b = b_desc.load([e, k0, off_n]).reshape(BLOCK_K, BLOCK_N)
    return b


@triton.jit
def moe_sorted_gemm_kernel(A, B, OUT, PRE, ROW_W, SORTED_IDS, EXPERT_IDS, NUM_POST,
                           cap, num_e, NB, stride_o, stride_pre, n_slots, K, N,
                           B_KMAJOR: tl.constexpr, SWIGLU: tl.constexpr, SAVE_PRE: tl.constexpr,
                           HAS_W: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROGRAMS: tl.constexpr,
                           WS: tl.constexpr):
    """acc[r, n] = Σ_k A[r, k] · B[e][k, n] for the sorted rows r of each used row block (expert e), A [cap, K]
    contiguous, B's weight [E, NB, K] (B_KMAJOR) or [E, K, NB]. Persistent: PROGRAMS programs walk the tiles of
    the used blocks. Epilogue, rows in sorted order: OUT[r] = (ROW_W[slot] ·) acc; SWIGLU: B's columns n and N + n
    are gate and up, OUT = SiLU(gate) ⊙ up, PRE keeps [gate | up] (forward). The backward's SwiGLU gradient is a
    kernel of its own (moe_swiglu_grad_kernel), not this epilogue."""
    a_desc = tl.make_tensor_descriptor(A, shape=[cap, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_KMAJOR:
        b_desc = tl.make_tensor_descriptor(B, shape=[num_e, NB, K], strides=[NB * K, K, 1],
                                           block_shape=[1, BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(B, shape=[num_e, K, NB], strides=[K * NB, NB, 1],
                                           block_shape=[1, BLOCK_K, BLOCK_N])
    if SWIGLU:
        # w13 [E, 2N, K] seen as [E, 2, N, K]: one box holds the gate rows and the up rows of the same n range, so
        # one MMA [BLOCK_M, 2 · BLOCK_N] serves both, and a box past N's end is zero-filled in each half rather than
        # read from the other. With two accumulators (one MMA each) ptxas serialized the wgmma pipeline (C7515):
        # 482 -> 700 TFLOP/s at Mixtral T 8192 (benchmarks/NOTES.md, session 16)
        gu_desc = tl.make_tensor_descriptor(B, shape=[num_e, 2, N, K], strides=[NB * K, N * K, K, 1],
                                            block_shape=[1, 2, BLOCK_N, BLOCK_K])
    used = tl.cdiv(tl.load(NUM_POST), BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # flatten (one software pipeline over every tile's k steps, the next tile's loads under this one's epilogue)
    # without specialization; with it the probe's best was flatten off (shared/HOPPER-PIPELINE.md)
    for tile in tl.range(tl.program_id(0), used * num_n, PROGRAMS, flatten=not WS, warp_specialize=WS):
        pid_m, pid_n = _grouped_tile(tile, used, num_n, 8)
        e = tl.load(EXPERT_IDS + pid_m)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if SWIGLU:
            acc_gu = tl.zeros([BLOCK_M, 2 * BLOCK_N], tl.float32)
            for kk in range(k_tiles):
                a = a_desc.load([off_m, kk * BLOCK_K])
                b = tl.trans(gu_desc.load([e, 0, off_n, kk * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K))
                acc_gu = dot(a, b, acc_gu)
            # columns [0, BLOCK_N) are gate, [BLOCK_N, 2 · BLOCK_N) up
            acc, acc_up = tl.split(tl.permute(tl.reshape(acc_gu, [BLOCK_M, 2, BLOCK_N]), (0, 2, 1)))
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for kk in range(k_tiles):
                a = a_desc.load([off_m, kk * BLOCK_K])
                acc = dot(a, _b_tile(b_desc, e, off_n, kk * BLOCK_K, B_KMAJOR, BLOCK_N, BLOCK_K), acc)
        rows = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        omask = (rows < cap)[:, None] & n_ok[None, :]
        if SWIGLU:
            acc = swiglu_fwd_epilogue(acc, acc_up, rows, omask, offs_n, PRE, stride_pre, N, SAVE_PRE)
        if HAS_W:
            slots = tl.load(SORTED_IDS + rows)
            acc = acc * tl.load(ROW_W + slots, mask=slots < n_slots, other=0.0)[:, None]  # 0 on padding rows
        tl.store(OUT + rows[:, None] * stride_o + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=omask)


@triton.jit
def moe_swiglu_grad_kernel(DACT, ACT, PRE, ROW_W, SORTED_IDS, NUM_POST, D_PRE, ACT_W, D_W, cap, n_slots, I,
                           BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """The backward through SwiGLU and the routed weight, rows in sorted order (all [cap, ·] contiguous): D_PRE =
    [d gate | d up] of w · DACT through PRE's [gate | up], ACT_W = w · ACT (the w2 gradient's operand), and
    D_W[slot] = Σ_i ACT · DACT (the routed weight's gradient), w the row's routed weight (0 on padding rows, whose
    outputs are then zero as the weight gradient needs). Rows past the used length are left alone."""
    r0 = tl.program_id(0) * BLOCK_R
    if r0 >= tl.load(NUM_POST):
        return
    rows, r_ok, slots, ok = _sorted_rows(SORTED_IDS, r0, cap, n_slots, BLOCK_R)
    w = tl.load(ROW_W + slots, mask=ok, other=0.0)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    dw = tl.zeros([BLOCK_R], tl.float32)
    for i0 in range(0, I, BLOCK_I):
        cols = i0 + tl.arange(0, BLOCK_I)
        m = r_ok[:, None] & (cols < I)[None, :]
        dact = tl.load(DACT + rows64 * I + cols[None, :], mask=m, other=0.0).to(tl.float32)
        act = tl.load(ACT + rows64 * I + cols[None, :], mask=m, other=0.0).to(tl.float32)
        pre = PRE + rows64 * (2 * I) + cols[None, :]
        d_gate, d_up = swiglu_grads(dact * w, tl.load(pre, mask=m, other=0.0).to(tl.float32),
                                    tl.load(pre + I, mask=m, other=0.0).to(tl.float32))
        dw += tl.sum(act * dact, 1)
        tl.store(ACT_W + rows64 * I + cols[None, :], (w * act).to(ACT_W.dtype.element_ty), mask=m)
        d_pre = D_PRE + rows64 * (2 * I) + cols[None, :]
        tl.store(d_pre, d_gate.to(D_PRE.dtype.element_ty), mask=m)
        tl.store(d_pre + I, d_up.to(D_PRE.dtype.element_ty), mask=m)
    tl.store(D_W + slots, dw, mask=ok)


@triton.jit
def moe_sorted_wgrad_kernel(G, A, DW, BLOCK_START, BLOCK_COUNT, cap, num_e, N, K, stride_de, stride_dn,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PROGRAMS: tl.constexpr, WS: tl.constexpr):
    """DW[e][n, k] = Σ over expert e's sorted rows r of G[r, n] · A[r, k], G [cap, N] and A [cap, K] contiguous
    (padding rows zero). Persistent over (expert, n tile, k tile); each tile walks its expert's row blocks in
    order (deterministic, no atomics); an expert without rows gets zeros."""
    g_desc = tl.make_tensor_descriptor(G, shape=[cap, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    a_desc = tl.make_tensor_descriptor(A, shape=[cap, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    per_e = num_n * num_k
    for tile in tl.range(tl.program_id(0), num_e * per_e, PROGRAMS, flatten=not WS, warp_specialize=WS):
        e = tile // per_e
        pid_n, pid_k = _grouped_tile(tile % per_e, num_n, num_k, 8)
        first = tl.load(BLOCK_START + e)
        count = tl.load(BLOCK_COUNT + e)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for blk in range(first, first + count):
            g = g_desc.load([blk * BLOCK_M, pid_n * BLOCK_N])
            a = a_desc.load([blk * BLOCK_M, pid_k * BLOCK_K])
            acc = dot(tl.trans(g), a, acc)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(DW + e.to(tl.int64) * stride_de + offs_n[:, None].to(tl.int64) * stride_dn + offs_k[None, :],
                 acc.to(DW.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])


# ------------------------------------------------------------------------------------------ launch
def dims_fit(h: int, inter_dim: int, dtype: torch.dtype) -> bool:
    """Whether tensor descriptors can address this model's rows: every row length (H, I, 2I) a multiple of 16
    bytes. A shape question only, so that the forward, its fake and the backward agree on the path."""
    size = dtype.itemsize
    return h * size % 16 == 0 and inter_dim * size % 16 == 0


def _aligned(w: torch.Tensor) -> torch.Tensor:
    """w, or a 16-byte aligned copy when its storage offset is not (a view into a larger buffer: rare)."""
    return w if tma_compatible(w) else w.clone()


def _programs(device, tiles: int) -> int:
    return max(1, min(sm_count(device), tiles))


def _gemm(a, w, out, schedule, n, k, tile, cfg, *, b_kmajor, swiglu=False, pre=None, row_w=None, n_slots):
    """One persistent launch of moe_sorted_gemm_kernel over the sorted rows a [cap, k]; w the 3-d weight."""
    if swiglu and tile.ws:
        # Triton 3.6's specialization aborts on the split of the gate/up accumulator (WSDataPartition: tt.split
        # unsupported); the old two-accumulator gate/up gave inf gradients
        raise ValueError("moe sorted path: the gate/up GEMM cannot be warp-specialized (configs.SortedCfg.up.ws)")
    sorted_ids, expert_ids, num_post = schedule
    cap = a.shape[0]
    w = _aligned(w)
    ensure_tma_allocator(a.device)
    programs = _programs(a.device, cap // cfg.block_m * triton.cdiv(n, tile.block_n))
    nb = w.shape[1] if b_kmajor else w.shape[2]

    def ptr(t):
        return or_stand_in(t, out)
    moe_sorted_gemm_kernel[(programs,)](
        a, w, out, ptr(pre), ptr(row_w), sorted_ids, expert_ids, num_post,
        cap, w.shape[0], nb, out.stride(0), row_stride(pre), n_slots, k, n,
        B_KMAJOR=b_kmajor, SWIGLU=swiglu, SAVE_PRE=pre is not None, HAS_W=row_w is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, PROGRAMS=programs, WS=tile.ws, num_warps=tile.warps,
        num_stages=tile.stages)


def _permute(x, schedule, topk, n_slots):
    """x [T, H] -> [cap, H] in the sorted order (zero padding rows)."""
    sorted_ids, _, num_post = schedule
    cap = sorted_ids.numel()
    xs = torch.empty((cap, x.shape[1]), device=x.device, dtype=x.dtype)
    block_r, block_h = 16, min(256, triton.next_power_of_2(x.shape[1]))
    moe_permute_kernel[(triton.cdiv(cap, block_r), triton.cdiv(x.shape[1], block_h))](
        x, xs, sorted_ids, num_post, x.stride(0), xs.stride(0), cap, n_slots, x.shape[1], TOPK=topk,
        BLOCK_R=block_r, BLOCK_H=block_h)
    return xs


def _positions(sorted_ids, n_slots):
    """pos[slot] = the slot's sorted row, -1 for a slot not in the schedule. Length n_slots + 1: every padding
    entry (slot id n_slots) lands on the last one, which nothing reads."""
    pos = torch.full((n_slots + 1,), -1, dtype=torch.int32, device=sorted_ids.device)
    return pos.scatter_(0, sorted_ids.long(), torch.arange(sorted_ids.numel(), dtype=torch.int32,
                                                           device=sorted_ids.device))


def _combine(y, pos, t, topk, dtype):
    out = torch.empty((t, y.shape[1]), device=y.device, dtype=dtype)
    if t:
        block_t, block_h = 16, min(256, triton.next_power_of_2(y.shape[1]))
        moe_combine_kernel[(triton.cdiv(t, block_t), triton.cdiv(y.shape[1], block_h))](
            y, out, pos, y.stride(0), out.stride(0), t, y.shape[1], TOPK=topk, BLOCK_T=block_t, BLOCK_H=block_h)
    return out


def fused_experts_sorted(hidden, w13, w2, topk_weights, sorted_ids, expert_ids, num_post, topk, cfg,
                         save_pre=False):
    """fused_experts (moe_kernel.py) on the sorted layout; cfg a configs.SortedCfg whose block_m is align's.
    Returns (out [T, H], act [cap, I], pre [cap, 2I] or None), act and pre in sorted row order."""
    t, h = hidden.shape
    inter_dim = w2.shape[2]
    n_slots = t * topk
    cap = sorted_ids.numel()
    act = torch.empty((cap, inter_dim), device=hidden.device, dtype=hidden.dtype)
    pre = torch.empty((cap, 2 * inter_dim), device=hidden.device, dtype=hidden.dtype) if save_pre else None
    if t == 0 or cap == 0:
        return torch.zeros_like(hidden), act, pre
    schedule = (sorted_ids, expert_ids, num_post)
    weights = topk_weights.reshape(-1).float().contiguous()
    xs = _permute(hidden, schedule, topk, n_slots)
    # gate_up: B[e][k=h, n] = w13[e, n, h]  (K-major)
    _gemm(xs, w13, act, schedule, inter_dim, h, cfg.up, cfg, b_kmajor=True, swiglu=True, pre=pre, n_slots=n_slots)
    # down: B[e][k=i, n=h] = w2[e, h, i]  (K-major); the routed weight in the epilogue, then the top-k combine
    y = torch.empty((cap, h), device=hidden.device, dtype=hidden.dtype)
    _gemm(act, w2, y, schedule, h, inter_dim, cfg.down, cfg, b_kmajor=True, row_w=weights, n_slots=n_slots)
    return _combine(y, _positions(sorted_ids, n_slots), t, topk, hidden.dtype), act, pre


def swiglu_grad(dact, act, pre, weights, schedule, d_weights):
    """(d_pre [cap, 2I], act_w [cap, I]) from d act, sorted rows; d_weights [n_slots] fp32 gets Σ_i act · d act per
    scheduled slot (moe_swiglu_grad_kernel)."""
    sorted_ids, _, num_post = schedule
    cap, inter_dim = act.shape
    d_pre = torch.empty((cap, 2 * inter_dim), device=act.device, dtype=act.dtype)
    act_w = torch.empty_like(act)
    block_r, block_i = 16, min(256, triton.next_power_of_2(inter_dim))
    moe_swiglu_grad_kernel[(triton.cdiv(cap, block_r),)](
        dact, act, pre, weights, sorted_ids, num_post, d_pre, act_w, d_weights, cap, d_weights.numel(), inter_dim,
        BLOCK_R=block_r, BLOCK_I=block_i)
    return d_pre, act_w


def _weight_grad(g, a, dw, blocks, cfg):
    first, count = blocks
    e_count, n, k = dw.shape
    tile = cfg.wgrad
    ensure_tma_allocator(g.device)
    programs = _programs(g.device, e_count * triton.cdiv(n, tile.block_n) * triton.cdiv(k, tile.block_k))
    moe_sorted_wgrad_kernel[(programs,)](
        g, a, dw, first, count, g.shape[0], e_count, n, k, dw.stride(0), dw.stride(1), BLOCK_M=cfg.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, PROGRAMS=programs, WS=tile.ws, num_warps=tile.warps,
        num_stages=tile.stages)
    return dw


def fused_experts_sorted_backward(d_out, hidden, w13, w2, topk_weights, act, pre, sorted_ids, expert_ids, num_post,
                                  topk, cfg):
    """Gradients of fused_experts_sorted: (d_hidden, d_w13, d_w2, d_topk_weights [T, k] fp32)."""
    from .moe_kernel import expert_blocks
    t, h = hidden.shape
    e_count, two_i, _ = w13.shape
    inter_dim = two_i // 2
    n_slots = t * topk
    cap = sorted_ids.numel()
    schedule = (sorted_ids, expert_ids, num_post)
    weights = topk_weights.reshape(-1).float().contiguous()
    # zero for slots that trusted ids out of range left out of the schedule (experts(check_ids=False))
    d_weights = torch.zeros(n_slots, device=hidden.device, dtype=torch.float32)
    if t == 0 or cap == 0:
        return torch.zeros_like(hidden), torch.zeros_like(w13), torch.zeros_like(w2), d_weights.view(t, topk)
    # the permuted copies again (cheaper than keeping them from the forward: bandwidth, not memory)
    xs = _permute(hidden, schedule, topk, n_slots)
    dos = _permute(d_out.contiguous(), schedule, topk, n_slots)
    # d act = d_out · w2[e] (B[e][k=h, n=i] = w2[e, h, i]) as a plain GEMM, then the SwiGLU and routed-weight
    # gradients in a pass of their own: in the GEMM's epilogue they held it at 415 TFLOP/s against ~700 for the
    # path's other GEMMs (benchmarks/NOTES.md, session 16)
    dact = torch.empty_like(act)
    _gemm(dos, w2, dact, schedule, inter_dim, h, cfg.dact or cfg.up, cfg, b_kmajor=False, n_slots=n_slots)
    d_pre, act_w = swiglu_grad(dact, act, pre, weights, schedule, d_weights)
    del dact
    # d_hidden = Σ over the token's rows of d_pre · w13[e] (B[e][k=n2, n=h] = w13[e, n2, h])
    dx = torch.empty((cap, h), device=hidden.device, dtype=hidden.dtype)
    _gemm(d_pre, w13, dx, schedule, h, two_i, cfg.down, cfg, b_kmajor=False, n_slots=n_slots)
    d_hidden = _combine(dx, _positions(sorted_ids, n_slots), t, topk, hidden.dtype)
    blocks = expert_blocks(expert_ids, e_count)
    d_w13 = _weight_grad(d_pre, xs, torch.empty_like(w13), blocks, cfg)
    d_w2 = _weight_grad(dos, act_w, torch.empty_like(w2), blocks, cfg)
    return d_hidden, d_w13, d_w2, d_weights.view(t, topk)
