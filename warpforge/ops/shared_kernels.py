"""Triton helpers that more than one family's kernels use (kernel files import them from here, never from another
family): the fp32-exact dot, a precise tanh (softcap), the online-softmax step, packed sequences' bounds, the
attention backward's delta pass, the SwiGLU gradient, the e2m1 decode of FP4 caches, and split-KV decode's combine;
and `triton_launch`, the launch the kernel files' helpers take by default."""
import triton
import triton.language as tl


def triton_launch(kernel, grid, *args, **meta):
    """Triton's own launch. Kernel files' launch helpers take a `launch` of this form; the ops pass one that keeps
    the compiled kernels (ops/_op.py's cached_launch: microseconds of host time a launch, not Triton's binding)."""
    kernel[grid](*args, **meta)


@triton.jit
def swiglu_grads(d_out, gate, up):
    """(d gate, d up) of out = SiLU(gate) · up, all fp32: the SwiGLU backward and the MoE backward's GEMM
    epilogue."""
    sig = tl.sigmoid(gate)
    return d_out * up * sig * (1.0 + gate * (1.0 - sig)), d_out * gate * sig


@triton.jit
def dot(a, b, acc=None):
    """tl.dot, in full fp32 precision when the operands are fp32 (tl.dot's default for them is TF32, ~1e-3 off)."""
    if a.dtype == tl.float32:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def e4m3_pair(x):
    """x [rows, k] as two e4m3 operands with one fp32 scale per row: x ≈ (hi + lo) · scale, hi = x / scale rounded to
    e4m3 (|hi| <= 448), lo its rounding error rounded again (~7 mantissa bits together, bf16's 8 nearly). Feeds fp8
    tensor-core dots on unquantised activations: dot(w, hi) + dot(w, lo) keeps bf16-like accuracy. Rows of zeros get
    scale 1."""
    xf = x.to(tl.float32)
    amax = tl.max(tl.abs(xf), 1)
    scale = tl.where(amax > 0.0, amax / 448.0, 1.0)
    xf = xf / scale[:, None]
    hi = xf.to(tl.float8e4nv)
    return hi, (xf - hi.to(tl.float32)).to(tl.float8e4nv), scale


@triton.jit
def tanh(x):
    """tanh from exp2 (portable: no libdevice), saturating to ±1. Near 0 the exp2 form keeps only absolute
    precision (~1e-7), which a large softcap multiplies back up, so small |x| takes tanh's odd series (relative
    error < 1e-9 below 0.05)."""
    x2 = x * x
    series = x * (1.0 - x2 * (0.3333333333333333 - x2 * 0.13333333333333333))
    return tl.where(tl.abs(x) < 0.05, series, 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0))


@triton.jit
def online_softmax(s, m_i, l_i):
    """One step of the online softmax over a tile of log2-unit scores s [rows, cols] (masked entries -inf):
    (p = 2^(s - new max), alpha = the rescale of what came before, new row sums, new row maxima). A row that has
    seen nothing yet keeps max -inf and gets p 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def seq_bounds(cu_ptr, b, seqlen, total, VARLEN: tl.constexpr):
    """(start, length) of sequence b. Varlen offsets are clamped into [0, total] and lengths to seqlen (the
    max_seqlen the grid covers): offsets the host could not check (under graph capture, or changed behind
    torch's back) can give wrong rows, never a read or write outside the tensors."""
    if VARLEN:
        start = tl.minimum(tl.maximum(tl.load(cu_ptr + b), 0), total)
        end = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1), start), total)
        length = tl.minimum(end - start, seqlen)
    else:
        start = seqlen * 0  # a tensor, not a Python 0, so .to() works in both compiler and interpreter
        length = seqlen
    return start, length


@triton.jit
def softmax_delta_kernel(
    O, DO, DELTA, cu_q,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh,
    seqlen_q, total_q,
    H_Q: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, VARLEN: tl.constexpr,
):
    """delta = rowsum(o · do), the softmax gradient's correction term, fp32, laid out as lse ([b, h, s_q], or
    [h, total] packed: stride_lb 0). Attention backwards (dense and sparse) run it first. Grid (b · H_Q, row tiles):
    the heads on axis 0, which takes 2^31 programs where axis 1 stops at 65535."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    q_start, s_q = seq_bounds(cu_q, b, seqlen_q, total_q, VARLEN)
    m_lo = pid_m * BLOCK_M
    if m_lo >= s_q:
        return
    b64 = b.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask = ((m_lo + offs_m) < s_q)[:, None] & (offs_dv < DV)[None, :]
    row0 = (q_start + m_lo).to(tl.int64)
    o = tl.load(O + b64 * stride_ob + row0 * stride_os + h * stride_oh
                + offs_m[:, None] * stride_os + offs_dv[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b64 * stride_dob + row0 * stride_dos + h * stride_doh
                 + offs_m[:, None] * stride_dos + offs_dv[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start + m_lo + offs_m, delta,
             mask=(m_lo + offs_m) < s_q)


@triton.jit
def e2m1_to_float(code):
    """e2m1 code (sign in bit 3) -> fp32: 0, 0.5, 1, 1.5, 2, 3, 4, 6. The three magnitude bits placed at fp16's
    exponent/mantissa boundary (<< 9) read as 2^(e-15)(1 + m/2), or m·2^-15 for e = 0; times 2^14 that is e2m1."""
    c = code.to(tl.uint16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _e2m1_nibble_pair(w, N: tl.constexpr, OUT: tl.constexpr):
    """Nibbles N and N + 4 of uint32 words w (values 8j + N and 8j + N + 4) -> their values · 2^-14 in OUT (fp32,
    or fp16 itself): each nibble's magnitude bits at fp16's exponent / mantissa boundary (bits 9-11) and its sign at
    bit 15, nibble N in the word's low half and N + 4 in its high half, by two shift-and-mask pairs for the two."""
    if N == 3:
        mag = w >> 3
    else:
        mag = w << (9 - 4 * N)
    h = (mag & 0x0E000E00) | ((w << (12 - 4 * N)) & 0x80008000)
    return ((h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(OUT),
            (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(OUT))


@triton.jit
def _e2m1_word_values(w, OUT: tl.constexpr = tl.float32):
    """The eight values of each word (v0 .. v7: value 8j + n of word j), · 2^-14 in OUT."""
    v0, v4 = _e2m1_nibble_pair(w, 0, OUT)
    v1, v5 = _e2m1_nibble_pair(w, 1, OUT)
    v2, v6 = _e2m1_nibble_pair(w, 2, OUT)
    v3, v7 = _e2m1_nibble_pair(w, 3, OUT)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def e2m1_words_to_float(w, OUT: tl.constexpr = tl.float32):
    """uint32 words [R, W] of packed e2m1 (byte i of a word: values 2i, low nibble, and 2i + 1; the bytes of a
    row in memory order) -> [R, 8 W] values · 2^-14 in OUT (fp32, or fp16: exact either way) in the row's order
    (the caller folds 2^14 into its scales). ~4.5 instructions a value on sm_90 against e2m1_to_float's ~9.5 on
    bytes (benchmarks/NOTES.md, session 43)."""
    R: tl.constexpr = w.shape[0]
    W: tl.constexpr = w.shape[1]
    v0, v1, v2, v3, v4, v5, v6, v7 = _e2m1_word_values(w, OUT)
    # join appends its pair as the last dim: [R, W, b0, b1, b2] for value 4 b2 + 2 b1 + b0
    x = tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7)))
    return tl.reshape(tl.permute(x, [0, 1, 4, 3, 2]), [R, W * 8])


@triton.jit
def e2m1_words_to_halves(w):
    """e2m1_words_to_float's values split into the row's even and odd elements ([R, 4 W] fp32 each, · 2^-14): the
    halves paged decode's portable kernel works on."""
    R: tl.constexpr = w.shape[0]
    W: tl.constexpr = w.shape[1]
    v0, v1, v2, v3, v4, v5, v6, v7 = _e2m1_word_values(w)
    evens = tl.reshape(tl.permute(tl.join(tl.join(v0, v2), tl.join(v4, v6)), [0, 1, 3, 2]), [R, W * 4])
    odds = tl.reshape(tl.permute(tl.join(tl.join(v1, v3), tl.join(v5, v7)), [0, 1, 3, 2]), [R, W * 4])
    return evens, odds


@triton.jit
def combine_splits_kernel(
    O_PART, LSE_PART, OUT, LSE,
    stride_ps, stride_pb, stride_ls, stride_lb,
    stride_ob, stride_lse_b,
    rows_total, n_splits,
    H_Q: tl.constexpr, S_Q: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Split-KV decode's combine: out = Σ_i w_i o_i / Σ_i w_i with w_i = 2^(lse_i - max), lse = ln(Σ_i 2^lse_i)
    (partials' lse in log2 units). Rows r = j · H_Q + h of a request; out [b, s_q, h_q, DV], lse [b, h_q, s_q]."""
    b = tl.program_id(0)
    tile = tl.program_id(1)
    b64 = b.to(tl.int64)
    r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows_total
    offs_v = tl.arange(0, BLOCK_DV)
    v_ok = offs_v < DV
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for i in range(n_splits):
        lse_i = tl.load(LSE_PART + i * stride_ls + b64 * stride_lb + r, mask=r_ok, other=float("-inf"))
        m = tl.maximum(m, lse_i)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for i in range(n_splits):
        lse_i = tl.load(LSE_PART + i * stride_ls + b64 * stride_lb + r, mask=r_ok, other=float("-inf"))
        w = tl.math.exp2(lse_i - m_use)
        o_i = tl.load(O_PART + i * stride_ps + b64 * stride_pb + r[:, None].to(tl.int64) * DV + offs_v[None, :],
                      mask=(r_ok & (w > 0))[:, None] & v_ok[None, :], other=0.0)
        acc += w[:, None] * o_i
        total += w
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)[:, None]
    lse = tl.where(empty, float("-inf"), (m_use + tl.math.log2(tl.where(empty, 1.0, total))) * 0.6931471805599453)
    tl.store(OUT + b64 * stride_ob + r[:, None].to(tl.int64) * DV + offs_v[None, :], out.to(OUT.dtype.element_ty),
             mask=r_ok[:, None] & v_ok[None, :])
    tl.store(LSE + b64 * stride_lse_b + (r % H_Q) * S_Q + r // H_Q, lse, mask=r_ok)


def combine_splits(o_part, lse_part, out, lse, h_q, s_q):
    """o_part fp32 [splits, b, s_q · h_q, d_v], lse_part [splits, b, s_q · h_q] (log2) -> out [b, s_q, h_q, d_v]
    (contiguous), lse [b, h_q, s_q] (natural log)."""
    b, rows, dv = o_part.shape[1], o_part.shape[2], o_part.shape[3]
    block_r = 16
    combine_splits_kernel[(b, triton.cdiv(rows, block_r))](
        o_part, lse_part, out, lse, o_part.stride(0), o_part.stride(1), lse_part.stride(0), lse_part.stride(1),
        out.stride(0), lse.stride(0), rows, o_part.shape[0],
        H_Q=h_q, S_Q=s_q, DV=dv, BLOCK_DV=triton.next_power_of_2(dv), BLOCK_R=block_r, num_warps=4,
    )
