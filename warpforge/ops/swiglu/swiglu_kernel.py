"""SwiGLU in Triton: out = SiLU(gate) · up from gate_up [..., 2I] (gate first), and its backward, one pass over
memory each way (fp32 math)."""
import math

import torch
import triton
import triton.language as tl

from ..shared_kernels import swiglu_grads


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


# ------------------------------------------------------------------------------------------ launch
def _rows(t):
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # not -1: a last dim of 0 leaves -1 undefined


def swiglu_fwd(gate_up, cfg):
    gu = _rows(gate_up)
    n = gu.shape[1] // 2
    out = torch.empty((gu.shape[0], n), device=gu.device, dtype=gu.dtype)
    block = min(cfg.block, triton.next_power_of_2(n))
    if gu.numel():
        swiglu_fwd_kernel[(gu.shape[0], triton.cdiv(n, block))](gu, out, gu.stride(0), out.stride(0), n,
                                                               BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


def swiglu_bwd(dout, gate_up, cfg):
    gu, do = _rows(gate_up), _rows(dout)
    n = gu.shape[1] // 2
    dgu = torch.empty_like(gu)
    block = min(cfg.block, triton.next_power_of_2(n))
    if gu.numel():
        swiglu_bwd_kernel[(gu.shape[0], triton.cdiv(n, block))](gu, do, dgu, gu.stride(0), do.stride(0),
                                                               dgu.stride(0), n, BLOCK=block)
    return dgu.view(gate_up.shape)
