"""RMSNorm and LayerNorm forward and backward in Triton, one pass over memory each way: a tile of rows per program
forward; the backward walks row tiles in persistent programs whose dw (and db) partial sums are added in a fixed
order (deterministic). All math in fp32 registers; row offsets in int64 (rows × width can pass 2^31)."""
import torch
import triton
import triton.language as tl


@triton.jit
def norm_fwd_kernel(X, RES, SUM, W, Bias, Y, MEAN, RSTD, stride_x, stride_res, stride_sum, stride_y, n_rows, n_cols,
                    eps, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, LAYER: tl.constexpr, ADD: tl.constexpr):
    """RMSNorm: y = x · rstd · w. LAYER (LayerNorm): y = (x − mean) · rstd · w + b. ADD: x is first replaced by
    SUM = x + RES, stored in SUM's dtype and normalised as stored (a pre-norm block's residual add). BLOCK_R rows
    per program (narrow rows: more bytes in flight per program than one row gives)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK)
    r_ok = rows < n_rows
    ok = r_ok[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if ADD:
        s = (x + tl.load(RES + rows[:, None] * stride_res + cols[None, :], mask=ok, other=0.0).to(tl.float32)).to(
            SUM.dtype.element_ty)
        tl.store(SUM + rows[:, None] * stride_sum + cols[None, :], s, mask=ok)
        x = s.to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    if LAYER:
        mean = tl.sum(x, 1) / n_cols
        x = tl.where(ok, x - mean[:, None], 0.0)
        tl.store(MEAN + rows, mean, mask=r_ok)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / n_cols + eps)
    y = x * rstd[:, None] * w
    if LAYER:
        y += tl.load(Bias + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + rows, rstd, mask=r_ok)


@triton.jit
def norm_bwd_kernel(X, W, DY, DSUM, MEAN, RSTD, DX, DW_PART, DB_PART, stride_x, stride_dy, stride_dsum, stride_dx,
                    n_rows, n_cols, rows_per_prog, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, LAYER: tl.constexpr,
                    HAS_DSUM: tl.constexpr):
    """dx = rstd · (g − [mean(g)] − x̂ · mean(g · x̂)) with g = dy · w, x̂ the normalised x (the bracket is
    LayerNorm's), plus DSUM when the normalised x was a residual sum that is also used downstream (its gradient
    from there); dw (and db) as partial sums per program, summed on the host side in a fixed order. A program walks
    its rows_per_prog rows (a multiple of BLOCK_R) BLOCK_R at a time, the rows past n_rows masked (no branch in the
    loop, so the loads of one tile can be issued while the last is reduced)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    c_ok = cols < n_cols
    w = tl.load(W + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_R, BLOCK], tl.float32)
    db = tl.zeros([BLOCK_R, BLOCK], tl.float32)
    first = pid.to(tl.int64) * rows_per_prog
    for i in range(0, rows_per_prog, BLOCK_R):
        rows = first + i + tl.arange(0, BLOCK_R)
        r_ok = rows < n_rows
        ok = r_ok[:, None] & c_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=r_ok, other=0.0)[:, None]
        if LAYER:
            x = tl.where(ok, x - tl.load(MEAN + rows, mask=r_ok, other=0.0)[:, None], 0.0)
        xhat = x * rstd
        g = dy * w
        dx = g - xhat * (tl.sum(g * xhat, 1) / n_cols)[:, None]
        if LAYER:
            dx -= (tl.sum(g, 1) / n_cols)[:, None]
            db += dy
        dx = rstd * dx
        if HAS_DSUM:
            dx += tl.load(DSUM + rows[:, None] * stride_dsum + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=ok)
        dw += dy * xhat
    tl.store(DW_PART + pid.to(tl.int64) * n_cols + cols, tl.sum(dw, 0), mask=c_ok)
    if LAYER:
        tl.store(DB_PART + pid.to(tl.int64) * n_cols + cols, tl.sum(db, 0), mask=c_ok)


# ------------------------------------------------------------------------------------------ launch
def _rows(t):
    return t.reshape(-1, t.shape[-1])


def norm_fwd(x, weight, bias, eps, layer, out_dtype, residual, cfg):
    """Returns (y like x, in out_dtype if given; mean or None; rstd; x + residual or None), statistics fp32 per
    row. With a residual, y normalises x + residual (stored in their promoted dtype)."""
    x2 = _rows(x)
    y = torch.empty_like(x2, dtype=out_dtype)
    rstd = torch.empty(x2.shape[0], device=x.device, dtype=torch.float32)
    mean = torch.empty_like(rstd) if layer else None
    res2 = _rows(residual) if residual is not None else x2
    total = torch.empty_like(x2, dtype=torch.result_type(x, residual)) if residual is not None else None
    n = x2.shape[1]
    if x2.shape[0]:
        norm_fwd_kernel[(triton.cdiv(x2.shape[0], cfg.block_rows),)](
            x2, res2, total if total is not None else y, weight, bias if layer else weight, y,
            mean if layer else rstd, rstd, x2.stride(0), res2.stride(0), total.stride(0) if total is not None else 0,
            y.stride(0), x2.shape[0], n, eps, BLOCK_R=cfg.block_rows, BLOCK=triton.next_power_of_2(n), LAYER=layer,
            ADD=residual is not None, num_warps=cfg.warps)
    return y.view(x.shape), mean, rstd, total.view(x.shape) if total is not None else None


def norm_bwd(dy, x, weight, mean, rstd, programs, layer, d_sum, cfg):
    """Returns (dx, dw, db or None); d_sum (x's gradient from elsewhere, when x was a residual sum) is added
    into dx."""
    x2, dy2 = _rows(x), _rows(dy)
    ds2 = _rows(d_sum) if d_sum is not None else dy2
    dx = torch.empty_like(x2)
    rows, n = x2.shape
    per = triton.cdiv(max(1, triton.cdiv(rows, programs)), cfg.block_rows) * cfg.block_rows
    grid = triton.cdiv(rows, per) if rows else 0
    alloc = torch.empty if rows else torch.zeros  # every program writes its row; no rows: sums of nothing
    dw_part = alloc((max(grid, 1), n), device=x.device, dtype=torch.float32)
    db_part = alloc((max(grid, 1), n), device=x.device, dtype=torch.float32) if layer else dw_part
    if rows:
        norm_bwd_kernel[(grid,)](x2, weight, dy2, ds2, mean if layer else rstd, rstd, dx, dw_part, db_part,
                                 x2.stride(0), dy2.stride(0), ds2.stride(0), dx.stride(0), rows, n, per,
                                 BLOCK_R=cfg.block_rows, BLOCK=triton.next_power_of_2(n), LAYER=layer,
                                 HAS_DSUM=d_sum is not None, num_warps=cfg.warps)
    db = db_part.sum(0).to(weight.dtype) if layer else None
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype), db
