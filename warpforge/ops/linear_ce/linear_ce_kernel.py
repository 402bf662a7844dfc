"""The softmax-cross-entropy step of the chunked linear + cross-entropy in Triton: per row of a logits chunk, the
loss and, in place, its gradient (two passes over the row, no copy of it)."""
import torch
import triton
import triton.language as tl

from ..shared_kernels import tanh


@triton.jit
def _logits(base, BIAS, cols, ok, cap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """The row's logits at cols: the GEMM's x (+ bias), capped as cap · tanh(z / cap) when SOFTCAP."""
    z = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(BIAS + cols, mask=ok, other=0.0).to(tl.float32)
    if SOFTCAP:
        z = cap * tanh(z / cap)
    return z


@triton.jit
def ce_grad_kernel(LOGITS, TARGETS, LOSS, GRAD_SCALE, BIAS, stride_l, stride_gs, n_cols, ignore_index, smoothing,
                   z_scale, cap, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
                   WRITE_GRAD: tl.constexpr):
    """Per row, with z its logits (x + bias, capped): loss = lse − (1 − ε) z_t − ε · mean(z) + z_scale · lse²
    (ε = smoothing), 0 for ignored rows. With WRITE_GRAD the row x is overwritten with
    GRAD_SCALE[row · stride_gs] · dloss/dx = scale · (softmax(z) (1 + 2 z_scale lse) − (1 − ε) onehot − ε / n)
    (times 1 − (z / cap)² when capped), 0 for ignored rows; GRAD_SCALE is read on the device (no host sync):
    1 / rows counted for the mean, 1 for the sum, or each row's upstream gradient (stride 1)."""
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    target = tl.load(TARGETS + row)
    m = float("-inf")
    d = 0.0
    z_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < n_cols
        z = _logits(base, BIAS, cols, ok, cap, HAS_BIAS, SOFTCAP)
        z_sum += tl.sum(tl.where(ok, z, 0.0), 0)
        z = tl.where(ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 0))
        # while every logit so far is -inf (a masked vocabulary's first blocks) subtract 0, not -inf (-inf - -inf
        # is NaN); d stays 0 there
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - m_use) + tl.sum(tl.exp(z - m_use), 0)
        m = m_new
    lse = m + tl.log(d)
    ignored = target == ignore_index
    bad = (target != ignore_index) & ((target < 0) | (target >= n_cols))  # the door checks but under capture: NaN
    t_col = tl.where(ignored | bad, 0, target)
    z_t = tl.sum(_logits(base, BIAS, t_col + tl.arange(0, 1), tl.arange(0, 1) < 1, cap, HAS_BIAS, SOFTCAP), 0)
    # without smoothing the logits' sum is not used: 0 · it would make a -inf logit (a masked vocabulary entry) NaN
    smooth = tl.where(smoothing == 0.0, 0.0, smoothing * z_sum / n_cols)
    loss = lse - (1.0 - smoothing) * z_t - smooth + z_scale * lse * lse
    tl.store(LOSS + row, tl.where(ignored, 0.0, tl.where(bad, float("nan"), loss)))
    if WRITE_GRAD:
        scale = tl.where(ignored, 0.0, tl.where(bad, float("nan"), tl.load(GRAD_SCALE + row * stride_gs)))
        p_scale = 1.0 + 2.0 * z_scale * lse
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < n_cols
            z = _logits(base, BIAS, cols, ok, cap, HAS_BIAS, SOFTCAP)
            grad = tl.exp(z - lse) * p_scale - tl.where(cols == target, 1.0 - smoothing, 0.0) - smoothing / n_cols
            if SOFTCAP:
                grad = grad * (1.0 - (z / cap) * (z / cap))
            tl.store(base + cols, (grad * scale).to(LOGITS.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------ launch
def ce_loss_and_grad_(logits, targets, ignore_index, grad_scale, cfg, bias=None, smoothing=0.0, z_scale=0.0,
                      softcap=None, write_grad=True):
    """Per-row losses (fp32) of a logits chunk [rows, vocab]; with write_grad the chunk becomes, in place,
    grad_scale · d(loss)/d logits, grad_scale an fp32 tensor of one element or one per row."""
    if logits.shape[1] == 0:  # no vocabulary: every target was ignored (checked at the door)
        return torch.zeros(logits.shape[0], device=logits.device, dtype=torch.float32)
    losses = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    if logits.shape[0]:
        ce_grad_kernel[(logits.shape[0],)](
            logits, targets, losses, grad_scale, bias if bias is not None else logits, logits.stride(0),
            1 if grad_scale.numel() > 1 else 0, logits.shape[1], ignore_index, float(smoothing), float(z_scale),
            float(softcap or 1.0), BLOCK=min(cfg.block, triton.next_power_of_2(logits.shape[1])),
            HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, WRITE_GRAD=write_grad)
    return losses
