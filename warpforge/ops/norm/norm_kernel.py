"""RMSNorm and LayerNorm forward and backward in Triton, one pass over memory each way: a tile of rows per program
forward; the backward walks row tiles in persistent programs that keep their dw (and db) partial sums in registers
and write them once, and a small second kernel adds the programs' partials in a fixed order (deterministic). All math
in fp32 registers; row offsets in int64 (rows × width can pass 2^31). Inputs are contiguous (the ops make them so):
row r starts at r · n_cols."""
import torch
import triton
import triton.language as tl

from ...runtime import next_pow2
from ..shared_kernels import triton_launch  # the helpers' default launch


@triton.jit
def norm_fwd_kernel(X, RES, SUM, W, Bias, Y, MEAN, RSTD, n_rows, n_cols, eps, BLOCK_R: tl.constexpr,
                    BLOCK: tl.constexpr, LAYER: tl.constexpr, ADD: tl.constexpr):
    """RMSNorm: y = x · rstd · w. LAYER (LayerNorm): y = (x − mean) · rstd · w + b. ADD: x is first replaced by
    SUM = x + RES, stored in SUM's dtype and normalised as stored (a pre-norm block's residual add). BLOCK_R rows
    per program (narrow rows: more bytes in flight per program than one row gives)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK)
    r_ok = rows < n_rows
    ok = r_ok[:, None] & (cols < n_cols)[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        s = (x + tl.load(RES + offs, mask=ok, other=0.0).to(tl.float32)).to(SUM.dtype.element_ty)
        tl.store(SUM + offs, s, mask=ok)
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
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + rows, rstd, mask=r_ok)


@triton.jit
def _bwd_tile(X, DY, DSUM, MEAN, RSTD, rows, end, cols, c_ok, n_cols, LAYER: tl.constexpr, HAS_DSUM: tl.constexpr):
    """A tile's loads, in the tensors' dtypes: (x, dy, d_sum or x, mean or rstd, rstd); rows at or past end masked."""
    r_ok = rows < end
    ok = r_ok[:, None] & c_ok[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offs, mask=ok, other=0.0)
    dy = tl.load(DY + offs, mask=ok, other=0.0)
    rstd = tl.load(RSTD + rows, mask=r_ok, other=0.0)
    mean = rstd
    if LAYER:
        mean = tl.load(MEAN + rows, mask=r_ok, other=0.0)
    ds = x
    if HAS_DSUM:
        ds = tl.load(DSUM + offs, mask=ok, other=0.0)
    return x, dy, ds, mean, rstd


@triton.jit
def norm_bwd_kernel(X, W, DY, DSUM, MEAN, RSTD, DX, DX2, PART, n_rows, n_cols, rows_per_prog, BLOCK_R: tl.constexpr,
                    BLOCK: tl.constexpr, LAYER: tl.constexpr, HAS_DSUM: tl.constexpr, TWO_DX: tl.constexpr,
                    PREFETCH: tl.constexpr):
    """dx = rstd · (g − [mean(g)] − x̂ · mean(g · x̂)) with g = dy · w, x̂ the normalised x (the bracket is
    LayerNorm's), plus DSUM when the normalised x was a residual sum that is also used downstream (its gradient
    from there); TWO_DX: dx is also stored to DX2 in DX2's dtype (the residual sum's two inputs of different dtypes
    each get theirs without another pass). A program walks its rows_per_prog rows BLOCK_R at a time; PREFETCH: it
    loads the next tile before it works on this one, so that those loads are in flight while this tile's row sums
    and stores run (a program then has twice the bytes in flight, for the registers the next tile takes). dw (and
    db) accumulate as [BLOCK] sums over each tile's rows, so their registers do not grow with BLOCK_R; PART[p] (and
    PART[programs + p]) gets them once, at the end."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    c_ok = cols < n_cols
    w = tl.load(W + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK], tl.float32)
    db = tl.zeros([BLOCK], tl.float32)
    first = pid.to(tl.int64) * rows_per_prog
    end = tl.minimum(first + rows_per_prog, n_rows)
    rows = first + tl.arange(0, BLOCK_R)
    if PREFETCH:
        x_n, dy_n, ds_n, mean_n, rstd_n = _bwd_tile(X, DY, DSUM, MEAN, RSTD, rows, end, cols, c_ok, n_cols, LAYER,
                                                    HAS_DSUM)
    for _ in range(0, rows_per_prog, BLOCK_R):
        ok = (rows < end)[:, None] & c_ok[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        if PREFETCH:
            x, dy, ds, mean, rstd = x_n, dy_n, ds_n, mean_n, rstd_n
            x_n, dy_n, ds_n, mean_n, rstd_n = _bwd_tile(X, DY, DSUM, MEAN, RSTD, rows + BLOCK_R, end, cols, c_ok,
                                                        n_cols, LAYER, HAS_DSUM)
        else:
            x, dy, ds, mean, rstd = _bwd_tile(X, DY, DSUM, MEAN, RSTD, rows, end, cols, c_ok, n_cols, LAYER,
                                              HAS_DSUM)
        x = x.to(tl.float32)
        dy = dy.to(tl.float32)
        if LAYER:
            x = tl.where(ok, x - mean[:, None], 0.0)
        xhat = x * rstd[:, None]
        g = dy * w
        dx = g - xhat * (tl.sum(g * xhat, 1) / n_cols)[:, None]
        if LAYER:
            dx -= (tl.sum(g, 1) / n_cols)[:, None]
            db += tl.sum(dy, 0)
        dx = rstd[:, None] * dx
        if HAS_DSUM:
            dx += ds.to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=ok)
        if TWO_DX:
            tl.store(DX2 + offs, dx.to(DX2.dtype.element_ty), mask=ok)
        dw += tl.sum(dy * xhat, 0)
        rows += BLOCK_R
    tl.store(PART + pid.to(tl.int64) * n_cols + cols, dw, mask=c_ok)
    if LAYER:
        tl.store(PART + (tl.num_programs(0) + pid).to(tl.int64) * n_cols + cols, db, mask=c_ok)


@triton.jit
def part_sum_kernel(PART, DW, DB, n_parts, n_cols, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """DW (program_id(1) 0) or DB (1) = the sum over n_parts rows of PART's first or second [n_parts, n_cols] half,
    in a fixed order, cast to the output's dtype."""
    which = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < n_cols
    base = PART + which.to(tl.int64) * n_parts * n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for p in range(0, n_parts, BLOCK_P):
        parts = p + tl.arange(0, BLOCK_P)
        acc += tl.load(base + parts[:, None].to(tl.int64) * n_cols + cols[None, :],
                       mask=(parts < n_parts)[:, None] & c_ok[None, :], other=0.0)
    total = tl.sum(acc, 0)
    if which == 0:
        tl.store(DW + cols, total.to(DW.dtype.element_ty), mask=c_ok)
    else:
        tl.store(DB + cols, total.to(DB.dtype.element_ty), mask=c_ok)


# ------------------------------------------------------------------------------------------ launch
_SUM_N = 32  # columns per program of the dw/db sum: 24 programs at 768, 128 at 4096


def norm_fwd(x, weight, bias, eps, layer, out_dtype, residual, cfg, launch=triton_launch):
    """Returns (y like x, in out_dtype if given; mean or None; rstd; x + residual or None), statistics fp32 per
    row. With a residual, y normalises x + residual (stored in their promoted dtype). x, weight, bias and residual
    are contiguous."""
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    y = torch.empty_like(x, dtype=out_dtype)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    mean = torch.empty_like(rstd) if layer else None
    add = residual is not None
    total = torch.empty_like(x, dtype=torch.promote_types(x.dtype, residual.dtype)) if add else None
    if rows:
        br = cfg.block_rows
        launch(norm_fwd_kernel, ((rows + br - 1) // br,), x, residual if add else x, total if add else y, weight,
               bias if layer else weight, y, mean if layer else rstd, rstd, rows, n, eps, BLOCK_R=br,
               BLOCK=next_pow2(n), LAYER=layer, ADD=add, num_warps=cfg.warps)
    return y, mean, rstd, total


def bwd_programs(rows: int, programs: int, block_rows: int) -> tuple[int, int]:
    """(grid, rows per program): at most `programs` programs, each a run of whole row tiles."""
    per = max(1, -(-rows // programs))
    per = -(-per // block_rows) * block_rows
    return -(-rows // per), per


def norm_bwd(dy, x, weight, mean, rstd, programs, layer, d_sum, cfg, dx_dtype=None, dx2_dtype=None,
             launch=triton_launch):
    """Returns (dx, dx2 or None, dw, db or None); d_sum (x's gradient from elsewhere, when x was a residual sum) is
    added into dx. dx in dx_dtype (default x's); dx2_dtype: the same gradient once more in that dtype. dy, x and d_sum
    are contiguous."""
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    dx = torch.empty_like(x, dtype=dx_dtype)
    dx2 = torch.empty_like(x, dtype=dx2_dtype) if dx2_dtype is not None else None
    dw = torch.empty_like(weight)
    db = torch.empty_like(weight) if layer else None
    if not rows:  # sums of nothing
        return dx, dx2, dw.zero_(), db.zero_() if layer else None
    grid, per = bwd_programs(rows, programs, cfg.block_rows)
    part = torch.empty((2 if layer else 1) * grid * n, device=x.device, dtype=torch.float32)
    two = dx2 is not None
    launch(norm_bwd_kernel, (grid,), x, weight, dy, d_sum if d_sum is not None else dy, mean if layer else rstd, rstd,
           dx, dx2 if two else dx, part, rows, n, per, BLOCK_R=cfg.block_rows, BLOCK=next_pow2(n), LAYER=layer,
           HAS_DSUM=d_sum is not None, TWO_DX=two, PREFETCH=cfg.prefetch, num_warps=cfg.warps)
    # all partials of a column block in one tile where they fit (<= 512: one round trip to memory, not several)
    block_p = min(next_pow2(grid), 512)
    launch(part_sum_kernel, ((n + _SUM_N - 1) // _SUM_N, 2 if layer else 1), part, dw, db if layer else dw, grid, n,
           BLOCK_P=block_p, BLOCK_N=_SUM_N, num_warps=8 if block_p >= 256 else 4)
    return dx, dx2, dw, db
