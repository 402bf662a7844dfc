"""Row-wise and element-wise training kernels: RMSNorm / LayerNorm, RoPE, SwiGLU, and the softmax-cross-entropy
step of the chunked linear + cross-entropy. Each is one pass over memory in each direction.

All work in fp32 registers whatever the storage dtype. Row offsets are int64 (rows × width can pass 2^31).
"""
import triton
import triton.language as tl


# ------------------------------------------------------------------------------ RMSNorm / LayerNorm
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


# --------------------------------------------------------------------------------------------- RoPE
@triton.jit
def rope_kernel(X, COS, SIN, Y, stride_xb, stride_xs, stride_xh, stride_yb, stride_ys, stride_yh, stride_c,
                n_heads, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                BACKWARD: tl.constexpr):
    """One program per (b, s) position: all heads rotated by that position's angles. The backward is the
    inverse rotation (sin negated). HALF_PAD: HALF rounded up to a power of two (any even head dim works)."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    col_ok = offs < HALF
    heads = tl.arange(0, BLOCK_H)
    c = tl.load(COS + s * stride_c + offs, mask=col_ok, other=0.0)[None, :].to(tl.float32)
    sn = tl.load(SIN + s * stride_c + offs, mask=col_ok, other=0.0)[None, :].to(tl.float32)
    if BACKWARD:
        sn = -sn
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + heads
        ok = (h < n_heads)[:, None] & col_ok[None, :]
        xp = X + b * stride_xb + s * stride_xs + h[:, None].to(tl.int64) * stride_xh + offs[None, :]
        x1 = tl.load(xp, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=ok, other=0.0).to(tl.float32)
        yp = Y + b * stride_yb + s * stride_ys + h[:, None].to(tl.int64) * stride_yh + offs[None, :]
        tl.store(yp, (x1 * c - x2 * sn).to(Y.dtype.element_ty), mask=ok)
        tl.store(yp + HALF, (x1 * sn + x2 * c).to(Y.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------- SwiGLU
@triton.jit
def swiglu_fwd_kernel(GU, OUT, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(GU + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (g * tl.sigmoid(g) * u).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def swiglu_bwd_kernel(GU, DOUT, DGU, stride_gu, stride_do, stride_dgu, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(GU + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DOUT + row * stride_do + cols, mask=ok, other=0.0).to(tl.float32)
    dg, du = swiglu_grads(do, g, u)
    tl.store(DGU + row * stride_dgu + cols, dg.to(DGU.dtype.element_ty), mask=ok)
    tl.store(DGU + row * stride_dgu + n_cols + cols, du.to(DGU.dtype.element_ty), mask=ok)


@triton.jit
def swiglu_grads(d_out, gate, up):
    """(d gate, d up) of out = SiLU(gate) · up, all fp32; shared with the MoE backward's GEMM epilogue."""
    sig = tl.sigmoid(gate)
    return d_out * up * sig * (1.0 + gate * (1.0 - sig)), d_out * gate * sig


# ------------------------------------------------------------------------------------ cross-entropy
@triton.jit
def ce_grad_kernel(LOGITS, TARGETS, LOSS, GRAD_SCALE, stride_l, n_cols, ignore_index, BLOCK: tl.constexpr):
    """Per row: loss = lse − logit[target]; the row is overwritten with grad_scale · (softmax − onehot), the
    gradient of the mean loss when GRAD_SCALE (read on the device: no host sync) holds 1 / (rows counted), and
    0 for ignored rows. Two passes over the row, no copy of it."""
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    target = tl.load(TARGETS + row)
    m = float("-inf")
    d = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    lse = m + tl.log(d)
    ignored = target == ignore_index
    z_t = tl.load(base + tl.where(ignored, 0, target)).to(tl.float32)
    tl.store(LOSS + row, tl.where(ignored, 0.0, lse - z_t))
    scale = tl.where(ignored, 0.0, tl.load(GRAD_SCALE))
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < n_cols
        z = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        grad = (tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(base + cols, grad.to(LOGITS.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------ launch
def _rows(t):
    return t.reshape(-1, t.shape[-1])


def norm_fwd(x, weight, bias, eps, layer, out_dtype=None, residual=None):
    """Returns (y like x, in out_dtype if given; mean or None; rstd; x + residual or None), statistics fp32 per
    row. With a residual, y normalises x + residual (stored in their promoted dtype)."""
    import torch
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
                                        ADD=residual is not None, num_warps=_warps(n))
    return y.view(x.shape), mean, rstd, total.view(x.shape) if total is not None else None


def norm_bwd(dy, x, weight, mean, rstd, programs, layer, d_sum=None):
    """Returns (dx, dw, db or None); d_sum (x's gradient from elsewhere, when x was a residual sum) is added
    into dx."""
    import torch
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
                                 num_warps=_warps(n))
    db = db_part.sum(0).to(weight.dtype) if layer else None
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype), db


def rope(x, cos, sin, backward=False):
    import torch
    b, s, h, d = x.shape
    y = torch.empty_like(x)
    if x.numel():
        block_h = min(triton.next_power_of_2(h), 16)
        rope_kernel[(b, s)](x, cos, sin, y, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1),
                            y.stride(2), cos.stride(0), h, HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2),
                            BLOCK_H=block_h, BACKWARD=backward)
    return y


def swiglu_fwd(gate_up):
    import torch
    gu = _rows(gate_up)
    n = gu.shape[1] // 2
    out = torch.empty((gu.shape[0], n), device=gu.device, dtype=gu.dtype)
    block = min(1024, triton.next_power_of_2(n))
    if gu.shape[0]:
        swiglu_fwd_kernel[(gu.shape[0], triton.cdiv(n, block))](gu, out, gu.stride(0), out.stride(0), n,
                                                               BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


def swiglu_bwd(dout, gate_up):
    import torch
    gu, do = _rows(gate_up), _rows(dout)
    n = gu.shape[1] // 2
    dgu = torch.empty_like(gu)
    block = min(1024, triton.next_power_of_2(n))
    if gu.shape[0]:
        swiglu_bwd_kernel[(gu.shape[0], triton.cdiv(n, block))](gu, do, dgu, gu.stride(0), do.stride(0),
                                                               dgu.stride(0), n, BLOCK=block)
    return dgu.view(gate_up.shape)


def ce_loss_and_grad_(logits, targets, ignore_index, grad_scale):
    """In place: logits [rows, vocab] become grad_scale (a one-element fp32 tensor) · d(summed loss)/d logits;
    returns per-row losses (fp32)."""
    import torch
    losses = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    if logits.shape[0]:
        ce_grad_kernel[(logits.shape[0],)](logits, targets, losses, grad_scale, logits.stride(0), logits.shape[1],
                                           ignore_index, BLOCK=min(4096, triton.next_power_of_2(logits.shape[1])))
    return losses


def _warps(n):
    return 1 if n <= 256 else 4 if n <= 2048 else 8
