"""The softmax-cross-entropy step of the chunked linear + cross-entropy in Triton: per row of a logits chunk, the
loss and, in place, the gradient of the mean loss (two passes over the row, no copy of it)."""
import torch
import triton
import triton.language as tl


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
    bad = (target != ignore_index) & ((target < 0) | (target >= n_cols))  # the door checks but under capture: NaN
    z_t = tl.load(base + tl.where(ignored | bad, 0, target)).to(tl.float32)
    tl.store(LOSS + row, tl.where(ignored, 0.0, tl.where(bad, float("nan"), lse - z_t)))
    scale = tl.where(ignored, 0.0, tl.where(bad, float("nan"), tl.load(GRAD_SCALE)))
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < n_cols
        z = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        grad = (tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(base + cols, grad.to(LOGITS.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------ launch
def ce_loss_and_grad_(logits, targets, ignore_index, grad_scale, cfg):
    """In place: logits [rows, vocab] become grad_scale (a one-element fp32 tensor) · d(summed loss)/d logits;
    returns per-row losses (fp32)."""
    if logits.shape[1] == 0:  # no vocabulary: every target was ignored (checked at the door)
        return torch.zeros(logits.shape[0], device=logits.device, dtype=torch.float32)
    losses = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    if logits.shape[0]:
        ce_grad_kernel[(logits.shape[0],)](logits, targets, losses, grad_scale, logits.stride(0), logits.shape[1],
                                           ignore_index, BLOCK=min(cfg.block, triton.next_power_of_2(logits.shape[1])))
    return losses
