"""Evoformer attention in Triton: FlashAttention over the residues of each (batch, MSA row, head) with up to two
additive biases broadcast from [B, N_seq, H, N_res, N_res] (read through strides, 0 where broadcast, so the pair
bias is never expanded), forward and backward.

The backward is three deterministic passes: dk/dv (a program owns a key block and walks the queries), dq (a query
block walks the keys), and the pair bias's gradient, a sum over the MSA rows: a program owns a [queries, keys] tile
of one (batch, head) and walks the rows in order, recomputing the probabilities, so no [N_seq, H, N_res, N_res]
tensor and no float atomics (bitwise reproducible).

Layouts: q, k, v, out, do and the gradients contiguous [B, N_seq, N_res, H, D] (one set of strides); lse and delta
[B, N_seq, H, N_res], indexed by the program's (b, s, h) row bsh = (b · N_seq + s) · H + h.
"""
import torch
import triton
import triton.language as tl

from ..shared_kernels import dot, online_softmax

LOG2E = 1.4426950408889634


@triton.jit
def _bias_tile(BIAS, b, s, h, rows, cols, stride_b, stride_s, stride_h, stride_i, stride_j, R, HAS: tl.constexpr):
    """The [rows, cols] tile of one bias for (b, s, h) in fp32 (0 past the residues), or 0 without one."""
    if HAS:
        ptrs = BIAS + b * stride_b + s * stride_s + h * stride_h + rows[:, None].to(tl.int64) * stride_i + \
            cols[None, :].to(tl.int64) * stride_j
        tile = tl.load(ptrs, mask=(rows < R)[:, None] & (cols < R)[None, :], other=0.0).to(tl.float32)
    else:
        tile = 0.0
    return tile


@triton.jit
def _scores(q, k, b, s, h, rows, cols, R, scale, B1, b1_b, b1_s, b1_h, b1_i, b1_j, B2, b2_b, b2_s, b2_h, b2_i, b2_j,
            HAS1: tl.constexpr, HAS2: tl.constexpr):
    """(q · kᵀ · scale + biases) in log2 units, [rows, cols], -inf past the residues."""
    x = dot(q, tl.trans(k)) * scale
    x += _bias_tile(B1, b, s, h, rows, cols, b1_b, b1_s, b1_h, b1_i, b1_j, R, HAS1)
    x += _bias_tile(B2, b, s, h, rows, cols, b2_b, b2_s, b2_h, b2_i, b2_j, R, HAS2)
    return tl.where((cols < R)[None, :], x * 1.4426950408889634, float("-inf"))


@triton.jit
def _rows_tile(X, base, rows, offs_d, stride_r, R, D: tl.constexpr):
    return tl.load(X + base + rows[:, None].to(tl.int64) * stride_r + offs_d[None, :],
                   mask=(rows < R)[:, None] & (offs_d < D)[None, :], other=0.0)


@triton.jit
def _program_bsh(bsh, S, H: tl.constexpr):
    """(b, s, h) in int64 of the row bsh = (b · S + s) · H + h."""
    bsh = bsh.to(tl.int64)
    return bsh // H // S, (bsh // H) % S, bsh % H


@triton.jit
def evo_fwd_kernel(
    Q, K, V, OUT, LSE, B1, B2,
    stride_b, stride_s, stride_r, stride_h,
    b1_b, b1_s, b1_h, b1_i, b1_j, b2_b, b2_s, b2_h, b2_i, b2_j,
    S, R, scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS1: tl.constexpr, HAS2: tl.constexpr,
):
    bsh = tl.program_id(1)
    b, s, h = _program_bsh(bsh, S, H)
    base = b * stride_b + s * stride_s + h * stride_h
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _rows_tile(Q, base, rows, offs_d, stride_r, R, D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, R, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = _rows_tile(K, base, cols, offs_d, stride_r, R, D)
        v = _rows_tile(V, base, cols, offs_d, stride_r, R, D)
        x = _scores(q, k, b, s, h, rows, cols, R, scale, B1, b1_b, b1_s, b1_h, b1_i, b1_j, B2, b2_b, b2_s, b2_h,
                    b2_i, b2_j, HAS1, HAS2)
        p, alpha, l_i, m_i = online_softmax(x, m_i, l_i)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    tl.store(LSE + bsh.to(tl.int64) * R + rows, tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe))
                                                         * 0.6931471805599453), mask=rows < R)
    tl.store(OUT + base + rows[:, None].to(tl.int64) * stride_r + offs_d[None, :],
             (acc / l_safe[:, None]).to(OUT.dtype.element_ty), mask=(rows < R)[:, None] & (offs_d < D)[None, :])


@triton.jit
def _grad_rows(Q, DO, LSE, DELTA, base, bsh, rows, offs_d, stride_r, R, D: tl.constexpr):
    """A query block's q, do, lse (log2; +inf for rows that saw nothing, so their p is 0) and delta."""
    q = _rows_tile(Q, base, rows, offs_d, stride_r, R, D)
    do = _rows_tile(DO, base, rows, offs_d, stride_r, R, D)
    lse = tl.load(LSE + bsh * R + rows, mask=rows < R, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + bsh * R + rows, mask=rows < R, other=0.0)
    return q, do, lse2, delta


@triton.jit
def _dscores(q, k, v, do, lse2, delta, b, s, h, rows, cols, R, scale, B1, b1_b, b1_s, b1_h, b1_i, b1_j, B2, b2_b,
             b2_s, b2_h, b2_i, b2_j, HAS1: tl.constexpr, HAS2: tl.constexpr):
    """(p, ds = p · (do · vᵀ − delta)) of a [rows, cols] tile: the softmax's gradient w.r.t. the scores."""
    x = _scores(q, k, b, s, h, rows, cols, R, scale, B1, b1_b, b1_s, b1_h, b1_i, b1_j, B2, b2_b, b2_s, b2_h, b2_i,
                b2_j, HAS1, HAS2)
    p = tl.math.exp2(x - lse2[:, None])
    return p, p * (dot(do, tl.trans(v)) - delta[:, None])


@triton.jit
def evo_bwd_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DK, DV, B1, B2,
    stride_b, stride_s, stride_r, stride_h,
    b1_b, b1_s, b1_h, b1_i, b1_j, b2_b, b2_s, b2_h, b2_i, b2_j,
    S, R, scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS1: tl.constexpr, HAS2: tl.constexpr, DQ_PASS: tl.constexpr,
):
    """Program (block, b · s · h). DQ_PASS False: a key block walks the query blocks for its dk and dv; True: a
    query block walks the key blocks for its dq. Each gradient has one writer: deterministic, no atomics."""
    bsh = tl.program_id(1).to(tl.int64)
    b, s, h = _program_bsh(bsh, S, H)
    base = b * stride_b + s * stride_s + h * stride_h
    offs_d = tl.arange(0, BLOCK_D)
    if DQ_PASS:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        q, do, lse2, delta = _grad_rows(Q, DO, LSE, DELTA, base, bsh, rows, offs_d, stride_r, R, D)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(0, R, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            k = _rows_tile(K, base, cols, offs_d, stride_r, R, D)
            v = _rows_tile(V, base, cols, offs_d, stride_r, R, D)
            p, ds = _dscores(q, k, v, do, lse2, delta, b, s, h, rows, cols, R, scale, B1, b1_b, b1_s, b1_h, b1_i,
                             b1_j, B2, b2_b, b2_s, b2_h, b2_i, b2_j, HAS1, HAS2)
            dq = dot(ds.to(k.dtype), k, dq)
        tl.store(DQ + base + rows[:, None].to(tl.int64) * stride_r + offs_d[None, :],
                 (dq * scale).to(DQ.dtype.element_ty), mask=(rows < R)[:, None] & (offs_d < D)[None, :])
    else:
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = _rows_tile(K, base, cols, offs_d, stride_r, R, D)
        v = _rows_tile(V, base, cols, offs_d, stride_r, R, D)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for m0 in range(0, R, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            q, do, lse2, delta = _grad_rows(Q, DO, LSE, DELTA, base, bsh, rows, offs_d, stride_r, R, D)
            p, ds = _dscores(q, k, v, do, lse2, delta, b, s, h, rows, cols, R, scale, B1, b1_b, b1_s, b1_h, b1_i,
                             b1_j, B2, b2_b, b2_s, b2_h, b2_i, b2_j, HAS1, HAS2)
            dv = dot(tl.trans(p.to(do.dtype)), do, dv)
            dk = dot(tl.trans(ds.to(q.dtype)), q, dk)
        ok = (cols < R)[:, None] & (offs_d < D)[None, :]
        ptrs = base + cols[:, None].to(tl.int64) * stride_r + offs_d[None, :]
        tl.store(DK + ptrs, (dk * scale).to(DK.dtype.element_ty), mask=ok)
        tl.store(DV + ptrs, dv.to(DV.dtype.element_ty), mask=ok)


@triton.jit
def evo_bwd_dbias_kernel(
    Q, K, V, DO, LSE, DELTA, DBIAS, B1, B2,
    stride_b, stride_s, stride_r, stride_h,
    b1_b, b1_s, b1_h, b1_i, b1_j, b2_b, b2_s, b2_h, b2_i, b2_j,
    db_b, db_h, db_i,
    S, R, scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS1: tl.constexpr, HAS2: tl.constexpr,
):
    """d(pair bias)[b, h, i, j] = Σ_s ds[b, s, h, i, j], the rows walked in order (deterministic)."""
    b = (tl.program_id(2) // H).to(tl.int64)
    h = (tl.program_id(2) % H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in range(0, S):
        s64 = s + b * 0  # an int64 tensor in both the compiler and the interpreter
        bsh = (b * S + s64) * H + h
        base = b * stride_b + s64 * stride_s + h * stride_h
        q, do, lse2, delta = _grad_rows(Q, DO, LSE, DELTA, base, bsh, rows, offs_d, stride_r, R, D)
        k = _rows_tile(K, base, cols, offs_d, stride_r, R, D)
        v = _rows_tile(V, base, cols, offs_d, stride_r, R, D)
        p, ds = _dscores(q, k, v, do, lse2, delta, b, s64, h, rows, cols, R, scale, B1, b1_b, b1_s, b1_h, b1_i,
                         b1_j, B2, b2_b, b2_s, b2_h, b2_i, b2_j, HAS1, HAS2)
        acc += ds
    tl.store(DBIAS + b * db_b + h * db_h + rows[:, None].to(tl.int64) * db_i + cols[None, :],
             acc.to(DBIAS.dtype.element_ty), mask=(rows < R)[:, None] & (cols < R)[None, :])


# ------------------------------------------------------------------------------------------ launch
def _block(d):
    return max(16, triton.next_power_of_2(d))


def _bias_args(biases, dummy):
    """(pointer, 5 strides, present) per bias slot, broadcast dims at stride 0; `dummy` stands in for no bias."""
    args, present = [], []
    for i in range(2):
        bias = biases[i] if i < len(biases) else None
        if bias is None:
            args += [dummy, 0, 0, 0, 0, 0]
            present.append(False)
        else:
            args += [bias, *bias.stride()]
            present.append(True)
    return args, present


def evoformer_fwd(q, k, v, biases, scale, cfg):
    """(out like q, lse [B, S, H, R] fp32). biases: expanded views [B, S, H, R, R] (stride 0 where broadcast)."""
    B, S, R, H, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((B, S, H, R), device=q.device, dtype=torch.float32)
    if q.numel():
        bias_args, (has1, has2) = _bias_args(biases, q)
        b1, b2 = bias_args[:6], bias_args[6:]
        evo_fwd_kernel[(triton.cdiv(R, cfg.block_m), B * S * H)](
            q, k, v, out, lse, b1[0], b2[0], q.stride(0), q.stride(1), q.stride(2), q.stride(3), *b1[1:], *b2[1:],
            S, R, scale, H=H, D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_block(D), HAS1=has1, HAS2=has2,
            num_warps=cfg.warps, num_stages=cfg.stages)
    return out, lse


def evoformer_bwd(do, q, k, v, out, lse, biases, scale, want_dbias, tiles):
    """(dq, dk, dv, and with want_dbias the scores' gradient summed over N_seq, [B, H, R, R] fp32: the gradient of
    a pair bias [B, 1, H, R, R], else None)."""
    B, S, R, H, D = q.shape
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dbias = torch.zeros((B, H, R, R), device=q.device, dtype=torch.float32) if want_dbias else None
    if not q.numel():
        return dq.zero_(), dk.zero_(), dv.zero_(), dbias
    delta = (out.float() * do.float()).sum(-1).permute(0, 1, 3, 2).contiguous()  # [B, S, H, R]
    strides = (q.stride(0), q.stride(1), q.stride(2), q.stride(3))
    bias_args, (has1, has2) = _bias_args(biases, q)
    b1, b2 = bias_args[:6], bias_args[6:]
    for cfg, dq_pass in ((tiles.dkdv, False), (tiles.dq, True)):
        evo_bwd_kernel[(triton.cdiv(R, cfg.block_m if dq_pass else cfg.block_n), B * S * H)](
            q, k, v, do, lse, delta, dq, dk, dv, b1[0], b2[0], *strides, *b1[1:], *b2[1:], S, R, scale,
            H=H, D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_block(D), HAS1=has1, HAS2=has2,
            DQ_PASS=dq_pass, num_warps=cfg.warps, num_stages=cfg.stages)
    cfg = tiles.dbias
    if want_dbias:
        db = dbias
        evo_bwd_dbias_kernel[(triton.cdiv(R, cfg.block_m), triton.cdiv(R, cfg.block_n), B * H)](
            q, k, v, do, lse, delta, db, b1[0], b2[0], *strides, *b1[1:], *b2[1:],
            db.stride(0), db.stride(1), db.stride(2), S, R, scale,
            H=H, D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_block(D), HAS1=has1, HAS2=has2,
            num_warps=cfg.warps, num_stages=cfg.stages)
    return dq, dk, dv, dbias
