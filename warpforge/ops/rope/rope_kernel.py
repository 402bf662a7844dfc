"""Rotary embedding in Triton: one program per (batch, position) rotates every head's pairs (x_i, x_{i+d/2}) by
that position's angles; the backward is the inverse rotation."""
import torch
import triton
import triton.language as tl


@triton.jit
def rope_kernel(X, COS, SIN, Y, stride_xb, stride_xs, stride_xh, stride_yb, stride_ys, stride_yh, stride_c,
                n_heads, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                BACKWARD: tl.constexpr):
    """One program per (s, b) position: all heads rotated by that position's angles. The backward is the
    inverse rotation (sin negated). HALF_PAD: HALF rounded up to a power of two (any even head dim works). Positions
    on the grid's first axis: the others stop at 65535, and a serving batch packs 64 x 1k tokens into s."""
    s = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
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


# ------------------------------------------------------------------------------------------ launch
def rope(x, cos, sin, backward, cfg):
    b, s, h, d = x.shape
    y = torch.empty_like(x)
    if x.numel():
        block_h = min(triton.next_power_of_2(h), cfg.max_block_h)
        rope_kernel[(s, b)](x, cos, sin, y, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1),
                            y.stride(2), cos.stride(0), h, HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2),
                            BLOCK_H=block_h, BACKWARD=backward)
    return y
