"""RMSNorm and LayerNorm forward and backward in Triton, one pass over memory each way: a row per program
forward; the backward walks rows in persistent programs whose dw (and db) partial sums are added in a fixed
order (deterministic). All math in fp32 registers; row offsets in int64 (rows × width can pass 2^31)."""
import torch
import triton
import triton.language as tl


@triton.jit
def norm_fwd_kernel(X, RES, SUM, W, Bias, Y, MEAN, RSTD, stride_x, stride_res, stride_sum, stride_y, n_cols, eps,
                    BLOCK: tl.constexpr, LAYER: tl.constexpr, ADD: tl.constexpr):
    """RMSNorm: y = x · rstd · w. LAYER (LayerNorm): y = (x − mean) · rstd · w + b. ADD: x is first replaced by
    SUM = x + RES, stored in SUM's dtype and normalised as stored (a pre-norm block's residual add). One row per
    program."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        s = (x + tl.load(RES + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)).to(SUM.dtype.element_ty)
        tl.store(SUM + row * stride_sum + cols, s, mask=ok)
        x = s.to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    if LAYER:
        mean = tl.sum(x, 0) / n_cols
        x = tl.where(ok, x - mean, 0.0)
        tl.store(MEAN + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = x * rstd * w
    if LAYER:
        y += tl.load(Bias + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + row, rstd)


@triton.jit
def norm_bwd_kernel(X, W, DY, DSUM, MEAN, RSTD, DX, DW_PART, DB_PART, stride_x, stride_dy, stride_dsum, stride_dx,
                    n_rows, n_cols, rows_per_prog, BLOCK: tl.constexpr, LAYER: tl.constexpr, HAS_DSUM: tl.constexpr):
    """dx = rstd · (g − [mean(g)] − x̂ · mean(g · x̂)) with g = dy · w, x̂ the normalised x (the bracket is
    LayerNorm's), plus DSUM when the normalised x was a residual sum that is also used downstream (its gradient
    from there); dw (and db) as partial sums per program, summed on the host side in a fixed order."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    db = tl.zeros([BLOCK], tl.float32)
    first = pid * rows_per_prog
    for i in range(0, rows_per_prog):
        r = first + i
        if r < n_rows:
            row = r.to(tl.int64)
            x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            if LAYER:
                x = tl.where(ok, x - tl.load(MEAN + row), 0.0)
            xhat = x * rstd
            g = dy * w
            dx = g - xhat * (tl.sum(g * xhat, 0) / n_cols)
            if LAYER:
                dx -= tl.sum(g, 0) / n_cols
                db += dy
            dx = rstd * dx
            if HAS_DSUM:
                dx += tl.load(DSUM + row * stride_dsum + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=ok)
            dw += dy * xhat
    tl.store(DW_PART + pid.to(tl.int64) * n_cols + cols, dw, mask=ok)
    if LAYER:
        tl.store(DB_PART + pid.to(tl.int64) * n_cols + cols, db, mask=ok)


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
        norm_fwd_kernel[(x2.shape[0],)](x2, res2, total if total is not None else y, weight,
                                        bias if layer else weight, y, mean if layer else rstd, rstd,
                                        x2.stride(0), res2.stride(0), total.stride(0) if total is not None else 0,
                                        y.stride(0), n, eps, BLOCK=triton.next_power_of_2(n), LAYER=layer,
                                        ADD=residual is not None, num_warps=cfg.warps)
    return y.view(x.shape), mean, rstd, total.view(x.shape) if total is not None else None


def norm_bwd(dy, x, weight, mean, rstd, programs, layer, d_sum, cfg):
    """Returns (dx, dw, db or None); d_sum (x's gradient from elsewhere, when x was a residual sum) is added
    into dx."""
    x2, dy2 = _rows(x), _rows(dy)
    ds2 = _rows(d_sum) if d_sum is not None else dy2
    dx = torch.empty_like(x2)
    rows, n = x2.shape
    per = max(1, triton.cdiv(rows, programs))
    grid = triton.cdiv(rows, per) if rows else 0
    alloc = torch.empty if rows else torch.zeros  # every program writes its row; no rows: sums of nothing
    dw_part = alloc((max(grid, 1), n), device=x.device, dtype=torch.float32)
    db_part = alloc((max(grid, 1), n), device=x.device, dtype=torch.float32) if layer else dw_part
    if rows:
        norm_bwd_kernel[(grid,)](x2, weight, dy2, ds2, mean if layer else rstd, rstd, dx, dw_part, db_part,
                                 x2.stride(0), dy2.stride(0), ds2.stride(0), dx.stride(0), rows, n, per,
                                 BLOCK=triton.next_power_of_2(n), LAYER=layer, HAS_DSUM=d_sum is not None,
                                 num_warps=cfg.warps)
    db = db_part.sum(0).to(weight.dtype) if layer else None
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype), db
