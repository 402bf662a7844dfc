"""SwiGLU in Triton: out = SiLU(gate) · up from gate_up [..., 2I] (gate first), and its backward, one pass over
memory each way (fp32 math)."""
import torch
import triton
import triton.language as tl

from ..shared_kernels import swiglu_grads, triton_launch


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
# Inputs are contiguous (the ops make them so): a row's stride is its width, and the tensors are used as they come,
# without reshaping to 2-d and back (host time in an eager call).
def _plan(gate_up, cfg):
    """(rows, I, BLOCK, programs per row)."""
    two_i = gate_up.shape[-1]
    n = two_i // 2
    rows = gate_up.numel() // two_i if two_i else 0
    block = min(cfg.block, 1 << max(n - 1, 0).bit_length())
    return rows, n, block, -(-n // block)


def swiglu_fwd(gate_up, cfg, launch=triton_launch):
    rows, n, block, per_row = _plan(gate_up, cfg)
    out = torch.empty((*gate_up.shape[:-1], n), device=gate_up.device, dtype=gate_up.dtype)
    if rows and n:
        launch(swiglu_fwd_kernel, (rows, per_row), gate_up, out, 2 * n, n, n, BLOCK=block)
    return out


def swiglu_bwd(dout, gate_up, cfg, launch=triton_launch):
    rows, n, block, per_row = _plan(gate_up, cfg)
    dgu = torch.empty_like(gate_up)
    if rows and n:
        launch(swiglu_bwd_kernel, (rows, per_row), gate_up, dout, dgu, 2 * n, n, 2 * n, n, BLOCK=block)
    return dgu
