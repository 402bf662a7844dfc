"""Monarch linear layers in Triton: y = x Mᵀ with M = P_out · L · P_mid · R (reference.py has the convention),
as two launches of one block-diagonal GEMM and a shuffle pass, and the backward as two more of the GEMM, two
shuffles and a per-block weight-gradient GEMM over tokens.

Each operand's columns are named per block b and position i within the block, in one of four ways (MODE):
  0  contiguous:  b·BLK + i                    (x, dx; the intermediate in R's order; L's outputs block by block)
  1  shuffled:    i·NB + b                     (y: P_out; dh, the intermediate's gradient in R's order)
  2  shuffling:   n = b·BLK + i stored at (n mod NB)·BLK + n div NB   (R's output written in L's order)
  3  runs first:  (i div R)·BLK + b·R + i mod R, R = BLK / NB  (mode 2's columns, the positions renumbered so that
                  R consecutive ones are R consecutive columns; the GEMM's w_right rows renumbered to match:
                  `runs_first`)
The intermediate [T, d_mid] is written once, by the first GEMM, already in the order the second reads (mode 3 where
`runs_apply` holds: each run of d_mid / nb² columns whole tiles, stored through a tensor descriptor; else mode 2,
regrouped in registers into runs when nb is a power of two dividing the block), and kept for the backward with
the renumbered weight (mode 3). A GEMM's loads are contiguous runs (mode 0, or 3): a tile is loaded once per output tile,
streams through shared memory (tensor descriptors where the block's K is whole tiles) and uses every byte it
fetches. Mode 1 is never a GEMM's store: one block's outputs are nb columns apart, so every 2-byte store lands in
its own sector and the GEMM ran 5x slower on the H200 (benchmarks/NOTES.md); joining 2-4 blocks' tiles in
registers to store runs ran 2x slower than a shuffle pass (NOTES "Monarch interleaved stores"). Those outputs are
written block by block and moved by `shuffle` (one pass: contiguous runs on both sides, the transpose in
registers):

    forward   g   = R-GEMM(x)              A mode 0 (x),    out mode 3 / 2 (g in L's block order)
              yb  = L-GEMM(g) (+ bias)     A mode 0 (g),    out mode 0;   y = P_out(yb)
    backward  dyb = P_outᵀ(dy)             dy in L's block order
              dhb = Lᵀ-GEMM(dyb)           A mode 0,        out mode 0 (dh in L's block order)
              dx  = Rᵀ-GEMM(dh)            A mode 3 (dhb)   or, without runs, dh = P_out(dhb) then A mode 0
              dL[l] = Σ_t dyb_lᵀ g_l,  dR[k] = Σ_t dh_kᵀ x_k   (dh as the Rᵀ-GEMM reads it; dbias = Σ_t dy, in dL's
              programs)
Weight gradients walk their tokens in order in fp32 (no atomics); when (blocks × tiles) would leave SMs idle
the tokens are cut into a few ranges whose fp32 partials are summed in a fixed order: deterministic.
Row offsets are int64 (T · d passes 2^31 at 16k tokens · 128k columns).

Floors on an H200 (cuBLAS bf16 GEMM ~790 TFLOP/s, HBM copy ~4.25 TB/s), d_in = d_mid = d_out = 4096, 16k tokens,
bf16; forward FLOPs 2·T·(d_mid·d_in + d_out·d_mid)/nb, fwd+bwd 3x that; forward bytes x + intermediate written
and read + y + weights; the backward adds dy read twice, the intermediate read, dh written and read twice, x
read, dx written, weights read and their gradients written (plus the shuffles, 2 · T · d · 2 bytes each,
0.063 ms at copy speed: one forward, one backward (two without runs), not in the floors below):
  nblocks 4:  fwd 2.75e11 FLOP -> 0.348 ms, 554 MB -> 0.130 ms (compute bound: 0.35 ms);
              fwd+bwd 8.25e11 FLOP -> 1.044 ms, 1.66 GB -> 0.391 ms (floor 1.04 ms)
  nblocks 16: fwd 6.87e10 FLOP -> 0.087 ms, 541 MB -> 0.127 ms (memory bound: 0.13 ms);
              fwd+bwd 2.06e11 FLOP -> 0.261 ms, 1.62 GB -> 0.382 ms (floor 0.38 ms)
The bar (dense nn.Linear d 4096 at 16k tokens: fwd 0.70 ms, fwd+bwd 2.39 ms): fwd+bwd <= 1.33 ms at nblocks 4
(1.8x dense; 78% of the compute floor's rate) and <= 0.60 ms at nblocks 16 (4x dense; 64% of copy rate).
"""
import torch
import triton
import triton.language as tl

from ...runtime import ensure_tma_allocator, sm_count, tma_compatible
from ..shared_kernels import dot

CONTIGUOUS, SHUFFLED, SHUFFLING, RUNS_FIRST = 0, 1, 2, 3


@triton.jit
def _cols(b, idx, NB, BLK, MODE: tl.constexpr):
    """The columns (int64) of positions idx of block b, addressed as MODE says (module docstring)."""
    if MODE == 0:
        col = b * BLK + idx
    elif MODE == 1:
        col = idx * NB + b
    elif MODE == 2:
        n = b * BLK + idx
        col = (n % NB) * BLK + n // NB
    else:
        col = _run_col(b, idx, NB, BLK)
    return col.to(tl.int64)


@triton.jit
def _run_col(b, idx, NB, BLK):
    """Mode 3: position idx of block b at (idx div R)·BLK + b·R + idx mod R, R = BLK / NB: mode 2's columns with
    the positions renumbered run by run (idx = l·R + r stands for mode 2's r·NB + l), so that R consecutive
    positions are R consecutive columns. Scalar or tensor idx."""
    run = BLK // NB
    return (idx // run) * BLK + b * run + idx % run


@triton.jit
def _gemm_tile(tile, num_n, NB):
    """Tile id -> (token tile, output tile, block), blocks varying fastest so that the programs sharing a token
    tile (its A rows, and the output sectors that shuffled stores of neighbouring blocks fill) run together."""
    per_m = num_n * NB
    return tile // per_m, (tile % per_m) // NB, tile % NB


@triton.jit
def _ab_tiles(A, W, a_desc, w_desc, rows, m_ok, offs_n, n_ok, pid_m, pid_n, b, k0, stride_a, stride_wb, stride_wk,
              stride_wn, K, N, NB, A_BLK, A_MODE: tl.constexpr, USE_TMA: tl.constexpr,
              W_KMAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Block b's operand tiles at k0: A [BLOCK_M, BLOCK_K] (columns a(b, k0 ..)) and W[b] [BLOCK_K, BLOCK_N], through
    the tensor descriptors (USE_TMA) or masked pointer loads."""
    if USE_TMA:  # (mode 3: the K tile is a piece of one run)
        a = a_desc.load([pid_m * BLOCK_M, _run_col(b, k0, NB, A_BLK) if A_MODE == 3 else b * A_BLK + k0])
        if W_KMAJOR:
            w = tl.trans(w_desc.load([b * N + pid_n * BLOCK_N, k0]))
        else:
            w = w_desc.load([b * K + k0, pid_n * BLOCK_N])
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(A + rows[:, None] * stride_a + _cols(b, offs_k, NB, A_BLK, A_MODE)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + b.to(tl.int64) * stride_wb + offs_n[None, :].to(tl.int64) * stride_wn
                    + offs_k[:, None].to(tl.int64) * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    return a, w


@triton.jit
def _block_acc(A, W, a_desc, w_desc, rows, m_ok, offs_n, n_ok, pid_m, pid_n, b, stride_a, stride_wb, stride_wk,
               stride_wn, K, N, NB, A_BLK, A_MODE: tl.constexpr, USE_TMA: tl.constexpr,
               W_KMAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Block b's [BLOCK_M, BLOCK_N] output tile, fp32: the sum over its K of A's tiles times W[b]'s."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a, w = _ab_tiles(A, W, a_desc, w_desc, rows, m_ok, offs_n, n_ok, pid_m, pid_n, b, k0, stride_a, stride_wb,
                         stride_wk, stride_wn, K, N, NB, A_BLK, A_MODE, USE_TMA, W_KMAJOR, BLOCK_M, BLOCK_N,
                         BLOCK_K)
        acc = dot(a, w, acc)
    return acc


@triton.jit
def _store_tile(acc, OUT, o_desc, BIAS, rows, m_ok, offs_n, n_ok, pid_m, pid_n, b, stride_o, N, NB, O_BLK, O_RUN,
                O_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_MODE: tl.constexpr, RUNS: tl.constexpr,
                TMA_STORE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One block's output tile into OUT, its columns addressed as O_MODE says (RUNS, TMA_STORE: see the kernel)."""
    if HAS_BIAS:  # the bias in the layer's output order (BIAS_MODE), wherever this tile is written
        b_cols = _cols(b, offs_n, NB, O_BLK, BIAS_MODE)
        acc += tl.load(BIAS + b_cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if TMA_STORE:  # (mode 3: the tile is a piece of one run)
        col = _run_col(b, pid_n * BLOCK_N, NB, O_BLK) if O_MODE == 3 else b * O_BLK + pid_n * BLOCK_N
        o_desc.store([pid_m * BLOCK_M, col], acc.to(OUT.dtype.element_ty))
    elif RUNS:
        # position n of block b is column (n mod NB)·O_BLK + n div NB; the tile starts at a multiple of NB
        lb = tl.arange(0, RUNS)
        ii = tl.arange(0, BLOCK_N // RUNS)
        first = b * O_RUN + pid_n * (BLOCK_N // RUNS)
        cols = (lb[:, None] * O_BLK + first + ii[None, :]).to(tl.int64)
        ok = m_ok[:, None, None] & (pid_n * (BLOCK_N // RUNS) + ii < O_RUN)[None, None, :]  # N = O_BLK
        out = tl.permute(tl.reshape(acc.to(OUT.dtype.element_ty), (BLOCK_M, BLOCK_N // RUNS, RUNS)), (0, 2, 1))
        tl.store(OUT + rows[:, None, None] * stride_o + cols[None, :, :], out, mask=ok)
    else:
        o_cols = _cols(b, offs_n, NB, O_BLK, O_MODE)
        tl.store(OUT + rows[:, None] * stride_o + o_cols[None, :], acc.to(OUT.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def blockdiag_gemm_kernel(A, W, OUT, BIAS, stride_a, stride_o, stride_wb, stride_wk, stride_wn,
                          T, K, N, NB, A_BLK, O_BLK, O_RUN, num_tiles,
                          A_MODE: tl.constexpr, O_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BIAS_MODE: tl.constexpr, RUNS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr, W_KMAJOR: tl.constexpr,
                          TMA_STORE: tl.constexpr, PROGRAMS: tl.constexpr):
    """OUT[t, o(b, n)] = Σ_kk A[t, a(b, kk)] · W[b][kk, n] (+ BIAS[bias(b, n)]) for every block b. Persistent: each
    of PROGRAMS programs walks tiles pid, pid + PROGRAMS, ... (`_gemm_tile` orders them), so the next tile's
    loads run under this one's epilogue (the blocks' K is short: 256 at nblocks 16).

    USE_TMA (A_MODE 0 or 3, K a multiple of BLOCK_K, so no tile crosses a block's edge along K): A and W through
    tensor descriptors (W_KMAJOR: W[b][kk, n] at w[b, n, kk], else at w[b, kk, n]); a W tile past its block's N
    reads the next block's rows, whose output columns the store masks. In mode 3 a K tile is a piece of one run.
    TMA_STORE (O_MODE 0 or 3, N a multiple of BLOCK_N; in mode 3 BLOCK_N dividing a run): the tile leaves through a
    tensor descriptor, an asynchronous copy the next tile's loads and MMAs run under.
    RUNS (O_MODE 2 with NB a power of two dividing BLOCK_N and O_BLK; O_RUN = O_BLK / NB): the tile's columns
    n = l + NB·i are regrouped in registers to [NB, BLOCK_N / NB], so that each l's stores are one run."""
    num_n = tl.cdiv(N, BLOCK_N)
    a_desc, w_desc, o_desc = A, W, OUT  # stand-ins where the loads / stores take pointers
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(A, shape=[T, NB * A_BLK], strides=[stride_a, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        if W_KMAJOR:
            w_desc = tl.make_tensor_descriptor(W, shape=[NB * N, K], strides=[stride_wn, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
        else:
            w_desc = tl.make_tensor_descriptor(W, shape=[NB * K, N], strides=[stride_wk, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
    if TMA_STORE:
        o_desc = tl.make_tensor_descriptor(OUT, shape=[T, NB * O_BLK], strides=[stride_o, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])
    for tile in tl.range(tl.program_id(0), num_tiles, PROGRAMS, flatten=True):
        pid_m, pid_n, b = _gemm_tile(tile, num_n, NB)
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rows < T
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        acc = _block_acc(A, W, a_desc, w_desc, rows, m_ok, offs_n, n_ok, pid_m, pid_n, b, stride_a, stride_wb,
                         stride_wk, stride_wn, K, N, NB, A_BLK, A_MODE, USE_TMA, W_KMAJOR, BLOCK_M, BLOCK_N,
                         BLOCK_K)
        _store_tile(acc, OUT, o_desc, BIAS, rows, m_ok, offs_n, n_ok, pid_m, pid_n, b, stride_o, N, NB, O_BLK, O_RUN,
                    O_MODE, HAS_BIAS, BIAS_MODE, RUNS, TMA_STORE, BLOCK_M, BLOCK_N)


@triton.jit
def shuffle_kernel(SRC, DST, stride_s, stride_d, T, S, NB: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_S: tl.constexpr, NB_P2: tl.constexpr, TO_BLOCKS: tl.constexpr):
    """TO_BLOCKS: DST[t, l·S + si] = SRC[t, si·NB + l] (P_outᵀ: dy's columns in L's block order); else the
    inverse, DST[t, si·NB + l] = SRC[t, l·S + si] (P_out: L's block outputs into y's order). The interleaved side
    is one contiguous [BLOCK_M, BLOCK_S · NB] run (NB a power of two) and is transposed in registers; the block
    side moves in runs of BLOCK_S."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    si = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    lb = tl.arange(0, NB_P2)
    ok = (rows < T)[:, None, None] & (si < S)[None, :, None] & (lb < NB)[None, None, :]  # [BLOCK_M, BLOCK_S, NB]
    inter = rows[:, None, None] * stride_s + (si[None, :, None] * NB + lb[None, None, :]).to(tl.int64)
    blocks = (lb[None, :, None] * S + si[None, None, :]).to(tl.int64)  # [1, NB, BLOCK_S]
    if TO_BLOCKS:
        if NB == NB_P2:  # one 2-d contiguous load, split into (si, l) by a reshape
            cols = tl.program_id(1) * (BLOCK_S * NB) + tl.arange(0, BLOCK_S * NB)
            run_ok = (rows < T)[:, None] & (cols < S * NB)[None, :]
            v = tl.load(SRC + rows[:, None] * stride_s + cols[None, :].to(tl.int64), mask=run_ok, other=0.0)
            v = tl.reshape(v, (BLOCK_M, BLOCK_S, NB_P2))
        else:
            v = tl.load(SRC + inter, mask=ok, other=0.0)
        tl.store(DST + rows[:, None, None] * stride_d + blocks, tl.permute(v, (0, 2, 1)),
                 mask=tl.permute(ok, (0, 2, 1)))
    else:
        v = tl.permute(tl.load(SRC + rows[:, None, None] * stride_s + blocks, mask=tl.permute(ok, (0, 2, 1)),
                               other=0.0), (0, 2, 1))
        if NB == NB_P2:  # one 2-d contiguous store of the (si, l) pairs
            cols = tl.program_id(1) * (BLOCK_S * NB) + tl.arange(0, BLOCK_S * NB)
            run_ok = (rows < T)[:, None] & (cols < S * NB)[None, :]
            tl.store(DST + rows[:, None] * stride_d + cols[None, :].to(tl.int64),
                     tl.reshape(v, (BLOCK_M, BLOCK_S * NB_P2)), mask=run_ok)
        else:
            tl.store(DST + rows[:, None, None] * stride_d + (inter - rows[:, None, None] * stride_s), v, mask=ok)


@triton.jit
def blockdiag_wgrad_kernel(G, A, DW, DBIAS, stride_g, stride_a, stride_dws, stride_dwb, stride_dwn, stride_dbs,
                           T, N, K, NB, G_BLK, A_BLK, tokens_per_split,
                           G_MODE: tl.constexpr, A_MODE: tl.constexpr, HAS_DBIAS: tl.constexpr, DB_MODE: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           USE_TMA: tl.constexpr):
    """DW[split, b][n, kk] = Σ over the split's tokens t of G[t, g(b, n)] · A[t, a(b, kk)], in order, fp32: one
    program per (tile, block, token range). With HAS_DBIAS the programs of the first kk tile also sum G's
    columns into DBIAS[split, column], the column addressed as DB_MODE says.

    G_MODE 3 numbers DW's rows as the columns (position l·R + r is row r·NB + l, R = G_BLK / NB): DW comes out in
    w's own row order.

    USE_TMA (A mode 0, G mode 0 or 3 (then BLOCK_N dividing a run), tokens_per_split a multiple of BLOCK_T, so no
    tile crosses into another split's tokens): G and A through tensor descriptors; a tile past its block's N or K
    reads the next block's columns, whose rows / columns of DW the store masks (and whose column sums go
    nowhere)."""
    pid_n = tl.program_id(0) // tl.cdiv(K, BLOCK_K)
    pid_k = tl.program_id(0) % tl.cdiv(K, BLOCK_K)
    b = tl.program_id(1)
    split = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    g_cols = _cols(b, offs_n, NB, G_BLK, G_MODE)
    a_cols = _cols(b, offs_k, NB, A_BLK, A_MODE)
    if USE_TMA:
        g_desc = tl.make_tensor_descriptor(G, shape=[T, NB * G_BLK], strides=[stride_g, 1],
                                           block_shape=[BLOCK_T, BLOCK_N])
        a_desc = tl.make_tensor_descriptor(A, shape=[T, NB * A_BLK], strides=[stride_a, 1],
                                           block_shape=[BLOCK_T, BLOCK_K])
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    col_sum = tl.zeros([BLOCK_N], tl.float32)
    t_lo = split * tokens_per_split  # token indices fit int32; row offsets below are int64
    t_hi = tl.minimum(t_lo + tokens_per_split, T)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        if USE_TMA:
            g = g_desc.load([t0, _run_col(b, pid_n * BLOCK_N, NB, G_BLK) if G_MODE == 3
                             else b * G_BLK + pid_n * BLOCK_N])
            a = a_desc.load([t0, b * A_BLK + pid_k * BLOCK_K])
        else:
            rows = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
            t_ok = rows < t_hi
            g = tl.load(G + rows[:, None] * stride_g + g_cols[None, :], mask=t_ok[:, None] & n_ok[None, :],
                        other=0.0)
            a = tl.load(A + rows[:, None] * stride_a + a_cols[None, :], mask=t_ok[:, None] & k_ok[None, :],
                        other=0.0)
        acc = dot(tl.trans(g), a, acc)
        if HAS_DBIAS:
            col_sum += tl.sum(g.to(tl.float32), 0)
    dw = DW + split.to(tl.int64) * stride_dws + b.to(tl.int64) * stride_dwb
    dw_rows = offs_n
    if G_MODE == 3:
        run = G_BLK // NB
        dw_rows = (offs_n % run) * NB + offs_n // run
    tl.store(dw + dw_rows[:, None].to(tl.int64) * stride_dwn + offs_k[None, :], acc.to(DW.dtype.element_ty),
             mask=n_ok[:, None] & k_ok[None, :])
    if HAS_DBIAS:
        if pid_k == 0:
            tl.store(DBIAS + split.to(tl.int64) * stride_dbs + _cols(b, offs_n, NB, G_BLK, DB_MODE), col_sum,
                     mask=n_ok)


# ------------------------------------------------------------------------------------------ launch
def _tile(want, size):
    """A tile edge: the config's, shrunk (to a power of two, at least 16) where the dimension is smaller."""
    return max(16, min(want, triton.next_power_of_2(max(size, 1))))


def runs_apply(nb: int, q: int, cfg) -> bool:
    """Whether R's GEMMs take w_right's rows run by run (mode 3): the forward stores whole runs of the intermediate,
    the backward reads its gradient straight from L's block order (no shuffle pass). Only with cfg.runs, tiles
    through descriptors both ways, and each run (d_mid / nb² columns) whole tiles of the GEMMs' K and N and of the
    weight gradient's rows: on an H100 (session 38) K tiles of one short run, 3-d store boxes, mode 3's pointer
    stores and its weight gradient's pointer loads all ran slower than mode 2 and the shuffle (nb 16's dR 6x)."""
    run = q // nb if q % nb == 0 else 0  # (nb 1: mode 3 is mode 0, and runs_first a view of the weight)
    return cfg.runs and nb > 1 and cfg.gemm.tma and cfg.gemm.tma_store and cfg.wgrad.tma and run > 0 and \
        all(run % _tile(edge, q) == 0 for edge in (cfg.gemm.block_k, cfg.gemm.block_n, cfg.wgrad.block_n))


def runs_first(w_right: torch.Tensor) -> torch.Tensor:
    """w_right [nb, q, p] with its rows renumbered as mode 3 numbers positions: row l·R + r holds row r·nb + l
    (R = q / nb). A copy of the weight (q · p · nb elements), not of an activation."""
    nb, q, p = w_right.shape
    return w_right.view(nb, q // nb, nb, p).transpose(1, 2).reshape(nb, q, p)


def _gemm(a, w, w_strides, out, k, n, nb, a_mode, a_blk, o_mode, o_blk, cfg, bias=None, bias_mode=None):
    """out[t, o(b, ·)] = a[t, a(b, ·)] @ w[b] (+ bias[bias_mode(b, ·)]) for every block b; w[b][kk, n] at w_strides
    (kk, n)."""
    t = a.shape[0]
    bm, bn, bk = _tile(cfg.block_m, t), _tile(cfg.block_n, n), _tile(cfg.block_k, k)
    tiles = triton.cdiv(t, bm) * triton.cdiv(n, bn) * nb
    pow2 = nb & (nb - 1) == 0
    runs = nb if o_mode == SHUFFLING and bias is None and pow2 and 1 < nb < bn and o_blk % nb == 0 else 0
    w_kmajor = w_strides[0] == 1
    # a W tile is one 2-d descriptor box over the blocks stacked: [nb · n, k] (k-major) or [nb · k, n]
    stacked = w.stride(0) == (n * w_strides[1] if w_kmajor else k * w_strides[0])
    # a box's innermost coordinate (b · a_blk + k0, or a run's start in mode 3) must fall on 16 bytes
    run = a_blk // nb
    use_tma = cfg.tma and (a_mode == CONTIGUOUS or a_mode == RUNS_FIRST and run % bk == 0) and k % bk == 0 and \
        stacked and tma_compatible(a, w) and a_blk * a.element_size() % 16 == 0
    tma_store = cfg.tma_store and o_mode in (CONTIGUOUS, RUNS_FIRST) and n % bn == 0 and tma_compatible(out) and \
        o_blk * out.element_size() % 16 == 0 and (o_mode == CONTIGUOUS or (o_blk // nb) % bn == 0)
    if use_tma or tma_store:
        ensure_tma_allocator(a.device)
    programs = min(tiles, cfg.programs_per_sm * sm_count(a.device))
    blockdiag_gemm_kernel[(programs,)](
        a, w, out, bias if bias is not None else out, a.stride(0), out.stride(0), w.stride(0), *w_strides,
        t, k, n, nb, a_blk, o_blk, o_blk // nb, tiles, A_MODE=a_mode, O_MODE=o_mode, HAS_BIAS=bias is not None,
        BIAS_MODE=o_mode if bias_mode is None else bias_mode,
        RUNS=runs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, USE_TMA=use_tma, W_KMAJOR=w_kmajor, TMA_STORE=tma_store,
        PROGRAMS=programs, num_warps=cfg.warps, num_stages=cfg.stages)


def _splits(t, tiles, cfg, device):
    """Token ranges for the weight gradients: enough programs to fill the SMs twice, each range at least four
    token tiles long (cfg.splits > 0 forces a count)."""
    if cfg.splits:
        return max(1, min(cfg.splits, triton.cdiv(t, cfg.block_t)))
    want = triton.cdiv(2 * sm_count(device), max(tiles, 1))
    return max(1, min(want, t // (4 * cfg.block_t)))


def _wgrad(g, a, dw, n, k, nb, g_mode, g_blk, a_mode, a_blk, cfg, dbias=None, db_mode=CONTIGUOUS):
    """dw [nb, n, k] (weight dtype) = per block Σ_t g[t, g(b, ·)]ᵀ a[t, a(b, ·)]; dbias (fp32 [d]) = Σ_t g, its
    columns addressed by db_mode."""
    t = g.shape[0]
    bn, bk, bt = _tile(cfg.block_n, n), _tile(cfg.block_k, k), _tile(cfg.block_t, t)
    tiles = triton.cdiv(n, bn) * triton.cdiv(k, bk)
    splits = _splits(t, tiles * nb, cfg, g.device)
    per_split = triton.cdiv(triton.cdiv(t, splits), bt) * bt  # whole token tiles: no tile spans two splits
    splits = triton.cdiv(t, per_split) if t else 1
    if dbias is not None and g_mode == RUNS_FIRST:
        raise ValueError("the bias gradient sums columns in their own order, not mode 3's")
    g_box = g_blk if g_mode == CONTIGUOUS else g_blk // nb
    use_tma = cfg.tma and a_mode == CONTIGUOUS and (g_mode == CONTIGUOUS or g_mode == RUNS_FIRST and g_box % bn == 0) and \
        tma_compatible(g, a) and \
        all(blk * t.element_size() % 16 == 0 for blk, t in ((g_box, g), (a_blk, a)))  # boxes start on 16 bytes
    if use_tma:
        ensure_tma_allocator(g.device)
    part = dw.unsqueeze(0) if splits == 1 else torch.empty((splits, *dw.shape), device=dw.device,
                                                           dtype=torch.float32)
    bias_part = None
    if dbias is not None:
        bias_part = torch.empty((splits, dbias.shape[0]), device=dw.device, dtype=torch.float32)
    blockdiag_wgrad_kernel[(tiles, nb, splits)](
        g, a, part, bias_part if bias_part is not None else part, g.stride(0), a.stride(0), part.stride(0),
        part.stride(1), part.stride(2), bias_part.stride(0) if bias_part is not None else 0,
        t, n, k, nb, g_blk, a_blk, per_split, G_MODE=g_mode, A_MODE=a_mode, HAS_DBIAS=dbias is not None, DB_MODE=db_mode,
        BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk, USE_TMA=use_tma, num_warps=cfg.warps, num_stages=cfg.stages)
    if splits > 1:
        dw.copy_(part.sum(0))  # a fixed-order sum: deterministic
    if dbias is not None:
        dbias.copy_(bias_part.sum(0))


def _wgrad_blas(g, a, dw, nb, g_mode):
    """_wgrad's dw (no bias) by the vendor's batched GEMM on views of the same tensors, no copies: dw[b] = g_bᵀ a_b
    over all tokens, g's blocks contiguous (mode 0), or, mode 3, g = dhb with w_right's rows run by run (dw's rows
    r·nb + l of block k are dhb's columns l·q + k·R + r: one batched GEMM per l, writing every nb-th row of dw)."""
    n, k = dw.shape[1:]
    a_b = a.unflatten(1, (nb, k)).transpose(0, 1)               # [nb, T, k]
    if g_mode == CONTIGUOUS:
        torch.bmm(g.unflatten(1, (nb, n)).permute(1, 2, 0), a_b, out=dw)
        return
    run = n // nb
    g_runs = g.unflatten(1, (nb, nb, run))                      # [T, l, k, r]
    dw_rows = dw.view(nb, run, nb, k)                           # [k, r, l, ·]: row r·nb + l
    for l in range(nb):
        torch.bmm(g_runs[:, l].permute(1, 2, 0), a_b, out=dw_rows[:, :, l])


def shuffle(src, nb, cfg, to_blocks, dst=None):
    """src [T, nb · S] -> dst [T, nb · S] (new unless given): to_blocks, column si·nb + l moved to l·S + si
    (P_outᵀ); else back."""
    t, d = src.shape
    s = d // nb
    dst = torch.empty_like(src) if dst is None else dst
    nb_p2 = triton.next_power_of_2(nb)
    bs = max(1, min(triton.next_power_of_2(s), cfg.shuffle_elements // nb_p2))
    bm = max(1, min(triton.next_power_of_2(t), cfg.shuffle_elements // (bs * nb_p2)))
    if t:
        shuffle_kernel[(triton.cdiv(t, bm), triton.cdiv(s, bs))](src, dst, src.stride(0), dst.stride(0), t, s, nb,
                                                                  BLOCK_M=bm, BLOCK_S=bs, NB_P2=nb_p2,
                                                                  TO_BLOCKS=to_blocks)
    return dst


def monarch_fwd(x, w_left, w_right, bias, cfg):
    """x [T, d_in] -> (y [T, d_out], g [T, d_mid]: the intermediate in L's block order, w_runs: runs_first(w_right)
    where mode 3 applies, else empty; both kept for the backward)."""
    t = x.shape[0]
    nb, q, p = w_right.shape
    s = w_left.shape[1]
    g = torch.empty((t, nb * q), device=x.device, dtype=x.dtype)
    y = torch.empty((t, nb * s), device=x.device, dtype=x.dtype)
    w_runs = runs_first(w_right) if runs_apply(nb, q, cfg) else w_right.new_empty(0)
    if t == 0:
        return y, g, w_runs
    # R: B[k][kk = pp, n = j] = w_right[k, j, pp], its outputs into L's block order: with the rows run by run
    # (mode 3: a tile's columns are runs of g), else mode 2 (RUNS regroups them in registers)
    if w_runs.numel():
        _gemm(x, w_runs, (w_runs.stride(2), w_runs.stride(1)), g, p, q, nb, CONTIGUOUS, p, RUNS_FIRST, q, cfg.gemm)
    else:
        _gemm(x, w_right, (w_right.stride(2), w_right.stride(1)), g, p, q, nb, CONTIGUOUS, p, SHUFFLING, q,
              cfg.gemm)
    # L: B[l][kk = ri, n = si] = w_left[l, si, ri], written block by block, then shuffled into P_out's order
    yb = torch.empty_like(y)
    _gemm(g, w_left, (w_left.stride(2), w_left.stride(1)), yb, q, s, nb, CONTIGUOUS, q, CONTIGUOUS, s, cfg.gemm,
          bias=bias, bias_mode=SHUFFLED)
    shuffle(yb, nb, cfg, to_blocks=False, dst=y)
    return y, g, w_runs


def monarch_bwd(dy, x, w_left, w_right, g, has_bias, cfg, w_runs=None):
    """Gradients of monarch_fwd: (dx, d w_left, d w_right, dbias [d_out] fp32, or empty without a bias). w_runs: the
    forward's runs_first(w_right), where it made one (renumbering the weight again costs ~1% of a step at nb 4)."""
    t = x.shape[0]
    nb, q, p = w_right.shape
    s = w_left.shape[1]
    dx = torch.empty_like(x)
    dwl, dwr = torch.empty_like(w_left), torch.empty_like(w_right)
    dbias = torch.empty((nb * s if has_bias else 0,), device=x.device, dtype=torch.float32)
    if t == 0:
        return dx, dwl.zero_(), dwr.zero_(), dbias.zero_()
    # dyb[t, l·s + si] = dy[t, si·nb + l]; dhb[t, l·q + ri] = Σ_si dy[t, si·nb + l] · w_left[l, si, ri]: the
    # intermediate's gradient in L's block order
    dyb = shuffle(dy, nb, cfg, to_blocks=True)
    dhb = torch.empty((t, nb * q), device=x.device, dtype=x.dtype)
    _gemm(dyb, w_left, (w_left.stride(1), w_left.stride(2)), dhb, s, q, nb, CONTIGUOUS, s, CONTIGUOUS, q, cfg.gemm)
    blas = cfg.wgrad_blas and dwl.is_contiguous() and dwr.is_contiguous()
    if blas:
        _wgrad_blas(dyb, g, dwl, nb, CONTIGUOUS)
        if has_bias:
            torch.sum(dy, 0, dtype=torch.float32, out=dbias)
    else:
        _wgrad(dyb, g, dwl, s, q, nb, CONTIGUOUS, s, CONTIGUOUS, q, cfg.wgrad, dbias if has_bias else None,
               SHUFFLED)
    # dx[t, k·p + pp] = Σ_j dh[t, k·q + j] · w_right[k, j, pp] and dR[k][j, pp] = Σ_t dh[t, k·q + j] · x[t, k·p + pp],
    # dh (R's order) read from dhb in mode 3 against w_right's rows run by run; else shuffled into R's order first
    if runs_apply(nb, q, cfg):
        w_r = w_runs if w_runs is not None and w_runs.numel() else runs_first(w_right)
        _gemm(dhb, w_r, (w_r.stride(1), w_r.stride(2)), dx, q, p, nb, RUNS_FIRST, q, CONTIGUOUS, p, cfg.gemm)
        if blas:
            _wgrad_blas(dhb, x, dwr, nb, RUNS_FIRST)
        else:
            _wgrad(dhb, x, dwr, q, p, nb, RUNS_FIRST, q, CONTIGUOUS, p, cfg.wgrad)
    else:
        dh = shuffle(dhb, nb, cfg, to_blocks=False)
        _gemm(dh, w_right, (w_right.stride(1), w_right.stride(2)), dx, q, p, nb, CONTIGUOUS, q, CONTIGUOUS, p,
              cfg.gemm)
        if blas:
            _wgrad_blas(dh, x, dwr, nb, CONTIGUOUS)
        else:
            _wgrad(dh, x, dwr, q, p, nb, CONTIGUOUS, q, CONTIGUOUS, p, cfg.wgrad)
    return dx, dwl, dwr, dbias
