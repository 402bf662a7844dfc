"""The experts at decode sizes in one launch: gate/up, SiLU(gate) ⊙ up, the down GEMM and the top-k combine.

The gathered path (moe_kernel.py) takes five launches at T 1 (route, align, gate/up, down, the cast), and at
Qwen3-30B-A3B's size those launches' gaps and ramps cost as much as its expert GEMMs (benchmarks/NOTES.md, MoE
decode). Here, after the router, one launch does the rest. A program owns one (slot, I-column tile): it computes
its BLOCK_N columns of act = SiLU(x · W13_gate) ⊙ (x · W13_up) for the slot's token over the whole of H, then at
once their share of the down GEMM, act[:, tile] · W2[tile, :], and adds it, times the routed weight, into an fp32
workspace row of the token (atomics: split-K over I, each slot a summand). No align: a slot names its expert, and
two slots of one expert read its weights twice, which costs nothing at T ≤ a few tokens (they run together, the
second read comes from L2). Rows of the MMA past the first are zero (16 is the smallest MMA tile).

The workspace then has to become the output and be zero again for the next call without a launch of its own: every
program counts itself done on its token's counter once its threads' atomics are performed (each thread's last one
acq_rel, then a barrier, then the count, acq_rel), and the token's last program converts its row into OUT, zeroes it
and resets the counter. Workspace and counters are kept per (device, stream, T, H) by the launcher, made zero once;
calls on one stream run in order, so they never overlap. A slot whose expert id is out of range adds nothing (the
gathered path's rule), but still counts.
"""
import torch
import triton
import triton.language as tl

from .moe_kernel import _dot_b, _scale_args, fp16_math


@triton.jit
def _down_share(act, w2_cols, offs_h, n_ok, row0, S2, e, k0, stride_2h, stride_s2e, stride_s2k, stride_s2n, H,
                FP8_B: tl.constexpr):
    """The token's row of act · B over columns offs_h, B[k, n] = w2[e, offs_h[n], k0 + k] (FP8: times its scale,
    applied to the product)."""
    h_ok = offs_h < H
    y = _dot_b(act, tl.zeros([act.shape[0], offs_h.shape[0]], tl.float32),
               w2_cols + offs_h[None, :].to(tl.int64) * stride_2h, n_ok[:, None] & h_ok[None, :], h_ok, S2, e, k0,
               offs_h, stride_s2e, stride_s2k, stride_s2n, FP8_B, True)
    return tl.sum(tl.where(row0[:, None], y, 0.0), 0)  # row 0, the token's


@triton.jit
def _add_share(work_row, h0, y, H, SEM: tl.constexpr):
    """work_row[h0 + j] += y[j] atomically; columns past H add 0 to column H - 1 (no mask: every owner thread
    issues the atomic, which matters for the acq_rel one)."""
    offs_h = h0 + tl.arange(0, y.shape[0])
    tl.atomic_add(work_row + tl.minimum(offs_h, H - 1), tl.where(offs_h < H, y, 0.0), sem=SEM)


@triton.jit
def moe_decode_kernel(HIDDEN, W13, W2, S13, S2, ROW_W, IDS, WORK, COUNT, OUT,
                      stride_h, stride_13e, stride_13n, stride_2e, stride_2h,
                      stride_s13e, stride_s13k, stride_s13n, stride_s2e, stride_s2k, stride_s2n,
                      stride_o, n_slots, E, H, I,
                      TOPK: tl.constexpr, FP8_B: tl.constexpr, FP16_MATH: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, OUT_BLOCK: tl.constexpr):
    """Program pid: slot pid % n_slots, I columns [BLOCK_N · (pid // n_slots), + BLOCK_N). w13 [E, 2I, H] and w2
    [E, H, I] with unit stride along H and I; FP8_B: e4m3 bytes and fp32 scales per 128 x 128 block (BLOCK_N then
    divides 128: a tile's I range lies in one scale block). WORK [T · H] fp32 and COUNT [T] int32, zero on entry
    and again on exit; OUT [T, H] in hidden's dtype."""
    ROWS: tl.constexpr = 16
    pid = tl.program_id(0)
    slot = pid % n_slots
    pid_n = pid // n_slots
    token = (slot // TOPK).to(tl.int64)
    e = tl.load(IDS + slot)
    if (e >= 0) & (e < E):
        w = tl.load(ROW_W + slot)
        row0 = tl.arange(0, ROWS) == 0
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        # gate/up: B[k=h, n] = w13[e, n, h] (gate rows, then up rows I further)
        b_cols = W13 + e.to(tl.int64) * stride_13e + offs_n[None, :].to(tl.int64) * stride_13n
        a_row = HIDDEN + token * stride_h + tl.zeros([ROWS, 1], tl.int32)
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        acc_up = tl.zeros([ROWS, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < H
            a = tl.load(a_row + offs_k[None, :], mask=row0[:, None] & k_ok[None, :], other=0.0)
            if FP16_MATH:  # FP8 weights dequantised to fp16 (moe_kernel.fp16_math)
                a = a.to(tl.float16)
            b_ptrs = b_cols + offs_k[:, None]
            bmask = k_ok[:, None] & n_ok[None, :]
            # FP8: the scales on the [16, BLOCK_N] products, not the [BLOCK_K, BLOCK_N] tiles (_dot_b)
            acc = _dot_b(a, acc, b_ptrs, bmask, n_ok, S13, e, k0, offs_n, stride_s13e, stride_s13k, stride_s13n,
                         FP8_B, True)
            acc_up = _dot_b(a, acc_up, b_ptrs + I * stride_13n, bmask, n_ok, S13, e, k0, offs_n + I, stride_s13e,
                            stride_s13k, stride_s13n, FP8_B, True)
        act = (acc * tl.sigmoid(acc) * acc_up).to(HIDDEN.dtype.element_ty)  # as the gathered path stores it
        if FP16_MATH:
            act = act.to(tl.float16)
        # down, this tile's share: B[k=i, n=h] = w2[e, h, i] over the program's I columns
        w2_cols = W2 + e.to(tl.int64) * stride_2e + offs_n[:, None]
        last_h0 = (tl.cdiv(H, BLOCK_H) - 1) * BLOCK_H
        for h0 in range(0, last_h0, BLOCK_H):
            y = _down_share(act, w2_cols, h0 + tl.arange(0, BLOCK_H), n_ok, row0, S2, e, pid_n * BLOCK_N, stride_2h,
                            stride_s2e, stride_s2k, stride_s2n, H, FP8_B)
            _add_share(WORK + token * H, h0, y * w, H, "relaxed")
        # The last share acq_rel: its release fence waits until the thread's earlier atomics are performed, its
        # acquire until this one is. A barrier waits for no memory operation, and the count below is one thread's.
        # The same _add_share form every time, so that the same threads (the layout's owners of y, duplicates
        # masked) issue every share, the last one included.
        y = _down_share(act, w2_cols, last_h0 + tl.arange(0, BLOCK_H), n_ok, row0, S2, e, pid_n * BLOCK_N,
                        stride_2h, stride_s2e, stride_s2k, stride_s2n, H, FP8_B)
        _add_share(WORK + token * H, last_h0, y * w, H, "acq_rel")
    # every thread's atomics performed before the count (above, then the barrier), the count released to the token's
    # last program (acq_rel), which converts the token's row: T rows finish in parallel, each in one step at the
    # model shapes (H <= OUT_BLOCK)
    tl.debug_barrier()
    contributors = TOPK * (tl.num_programs(0) // n_slots)  # the token's slots times the I tiles
    if tl.atomic_add(COUNT + token, 1, sem="acq_rel") == contributors - 1:
        # not software-pipelined (num_stages 1): nothing to overlap, and the loads must not move
        for h0 in tl.range(0, H, OUT_BLOCK, num_stages=1):
            offs = h0 + tl.arange(0, OUT_BLOCK)
            ok = offs < H
            # from L2, where the atomics landed
            v = tl.load(WORK + token * H + offs, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(OUT + token * stride_o + offs, v.to(OUT.dtype.element_ty), mask=ok)
            tl.store(WORK + token * H + offs, tl.zeros([OUT_BLOCK], tl.float32), mask=ok)
        tl.atomic_xchg(COUNT + token, 0, sem="relaxed")


# ------------------------------------------------------------------------------------------ launch
_WORKSPACES = {}  # (device, stream, T, H) -> (fp32 workspace [T · H], int32 counters [T]), zero between calls


def _workspace(device: torch.device, t: int, h: int):
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, stream, t, h)
    if key not in _WORKSPACES:  # never freed: a captured CUDA graph may hold its address
        _WORKSPACES[key] = (torch.zeros(t * h, device=device, dtype=torch.float32),
                            torch.zeros(t, device=device, dtype=torch.int32))
    return _WORKSPACES[key]


def fused_experts_decode(hidden, w13, w2, topk_weights, topk_ids, tile, scales=None):
    """out [T, H] in hidden's dtype = Σ_k topk_weights[t, k] · expert topk_ids[t, k] (hidden[t]), one launch.
    hidden [T, H] and the weights contiguous (w13 / w2 e4m3 as uint8 when scales = (s13, s2) are given);
    topk_weights fp32 and topk_ids int32, both [T, k] contiguous; tile a configs.DecodeTile."""
    t, h = hidden.shape
    e_count, two_i, _ = w13.shape
    inter_dim = two_i // 2
    out = torch.empty_like(hidden)
    n_slots = topk_ids.numel()
    if n_slots == 0:
        return out.zero_()
    work, count = _workspace(hidden.device, t, h)
    s13, s2 = scales if scales is not None else (None, None)
    fp8 = scales is not None
    block_n = min(tile.block_n, 128) if fp8 else tile.block_n
    # scales by (expert, k block, n block) of B's orientation: B = w13ᵀ and w2ᵀ, k along the stored columns
    sc13, *sc13_strides = _scale_args(w13, s13, (1, w13.stride(1)))
    sc2, *sc2_strides = _scale_args(w2, s2, (1, w2.stride(1)))
    moe_decode_kernel[(n_slots * triton.cdiv(inter_dim, block_n),)](
        hidden, w13, w2, sc13, sc2, topk_weights, topk_ids, work, count, out,
        hidden.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), *sc13_strides, *sc2_strides,
        out.stride(0), n_slots, e_count, h, inter_dim,
        TOPK=topk_ids.shape[1], FP8_B=fp8, FP16_MATH=fp8 and fp16_math(tile), BLOCK_N=block_n,
        BLOCK_K=min(tile.block_k, 128) if fp8 else tile.block_k, BLOCK_H=tile.block_h,
        OUT_BLOCK=min(8192, triton.next_power_of_2(h)), num_warps=tile.warps, num_stages=tile.stages)
    return out
