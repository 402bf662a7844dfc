"""quantize_qkv in Triton: one pass over q and over k (per-token scales), and one over v after its channel amax
(per-channel scales, stored channel-major), producing exactly fp8_quantize.py's format."""
import torch
import triton
import triton.language as tl


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_scale(x, fmt_max: tl.constexpr):
    """amax over the last dim / fmt_max, floored at 1e-20 (an all-zero row). NaN is kept: tl.max and a plain
    tl.maximum drop it (maxnum), which would quantise a NaN row as finite codes with a finite scale; a NaN scale
    instead carries the NaN into the scores, as fp8_quantize.py's torch amax does."""
    amax = tl.reduce(tl.abs(x), 1, _max_keep_nan)
    return tl.maximum(amax, 1e-20, propagate_nan=tl.PropagateNan.ALL) / fmt_max


@triton.jit
def quantize_rows_kernel(X, MEAN, OUT, LO, SCALE, SHIFT, n_rows, seq_heads, seq, stride_sb, stride_ss, stride_sh,
                         stride_ob, stride_os, stride_oh, H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_D: tl.constexpr, INT8: tl.constexpr, SMOOTH: tl.constexpr, WITH_SHIFT: tl.constexpr,
                         RESIDUAL: tl.constexpr):
    """Rows of a contiguous [b, s, h, d] tensor: scale = amax / (127 or 448), codes = x / scale (SMOOTH: x minus
    its (batch, head)'s mean first). The scales go to SCALE [b, s, h] at its strides. WITH_SHIFT (int8 q): also
    x · mean of the row's kv head (head // GROUP of MEAN [b, h / GROUP, d]) into SHIFT [b, h, s] contiguous, the
    smoothing's lse shift, in the same pass (no fp32 copy of q). RESIDUAL (e4m3): x / scale - codes, in e4m3, to LO
    at OUT's strides."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(X + rows[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if SMOOTH:
        head_row = (rows // seq_heads) * H + rows % H
        x = tl.where(ok, x - tl.load(MEAN + head_row[:, None] * D + cols[None, :], mask=ok, other=0.0), 0.0)
    if WITH_SHIFT:
        bat = rows // seq_heads
        head = rows % H
        kv_row = bat * (H // GROUP) + head // GROUP
        shift = tl.sum(x * tl.load(MEAN + kv_row[:, None] * D + cols[None, :], mask=ok, other=0.0), 1)
        tl.store(SHIFT + (bat * H + head) * seq + (rows % seq_heads) // H, shift, mask=rows < n_rows)
    if INT8:
        scale = _row_scale(x, 127.0)
        y = tl.floor(x / scale[:, None] + 0.5)
        codes = tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)
    else:
        scale = _row_scale(x, 448.0)
        scaled = x / scale[:, None]
        codes = scaled.to(tl.float8e4nv)
    o_off = (rows // seq_heads) * stride_ob + ((rows % seq_heads) // H) * stride_os + (rows % H) * stride_oh
    tl.store(OUT + o_off[:, None] + cols[None, :], codes, mask=ok)
    if RESIDUAL:
        tl.store(LO + o_off[:, None] + cols[None, :], (scaled - codes.to(tl.float32)).to(tl.float8e4nv), mask=ok)
    s_off = (rows // seq_heads) * stride_sb + ((rows % seq_heads) // H) * stride_ss + (rows % H) * stride_sh
    tl.store(SCALE + s_off, scale, mask=rows < n_rows)


@triton.jit
def quantize_key_blocks_kernel(K, OUT, SCALE, s_k, stride_kb, stride_ks, stride_kh, stride_ob, stride_os, stride_oh,
                               stride_sb, stride_ss, stride_sh, H: tl.constexpr, D: tl.constexpr,
                               BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """One aligned block of BLOCK_K keys of one head: scale = amax over the block / 448 (NaN kept), e4m3 codes to OUT
    and the scale to SCALE at each of the block's keys (both at their strides). K's head dim has stride 1."""
    b = (tl.program_id(0) // H).to(tl.int64)  # grid (b · H, key blocks): axis 1 stops at 65535, axis 0 doesn't
    h = (tl.program_id(0) % H).to(tl.int64)
    keys = (tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = (keys < s_k)[:, None] & (cols < D)[None, :]
    x = tl.load(K + b * stride_kb + h * stride_kh + keys[:, None] * stride_ks + cols[None, :], mask=ok,
                other=0.0).to(tl.float32)
    amax = tl.reduce(tl.reduce(tl.abs(x), 1, _max_keep_nan), 0, _max_keep_nan)
    scale = tl.maximum(amax, 1e-20, propagate_nan=tl.PropagateNan.ALL) / 448.0
    tl.store(OUT + b * stride_ob + h * stride_oh + keys[:, None] * stride_os + cols[None, :],
             (x / scale).to(tl.float8e4nv), mask=ok)
    tl.store(SCALE + b * stride_sb + h * stride_sh + keys * stride_ss, tl.zeros([BLOCK_K], tl.float32) + scale,
             mask=keys < s_k)


@triton.jit
def quantize_v_kernel(V, VS, VT, s_k, s_pad, stride_vb, stride_vs, stride_vh, stride_tb, stride_th, stride_td,
                      H: tl.constexpr, DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """A [BLOCK_S tokens, d_v] tile of one head divided by its channel scales, written channel-major (zeros for the
    padding tokens past s_k). V's channel stride is 1 (quantize_v sees to it); VS is contiguous [b, h, d_v]."""
    b = (tl.program_id(0) // H).to(tl.int64)  # grid (b · H, token tiles): axis 1 stops at 65535, axis 0 doesn't
    h = (tl.program_id(0) % H).to(tl.int64)
    toks = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    ch = tl.arange(0, BLOCK_D)
    ch_ok = ch < DV
    v = tl.load(V + b * stride_vb + h * stride_vh + toks[:, None].to(tl.int64) * stride_vs + ch[None, :],
                mask=(toks < s_k)[:, None] & ch_ok[None, :], other=0.0).to(tl.float32)
    scale = tl.load(VS + (b * H + h) * DV + ch, mask=ch_ok, other=1.0)
    codes = tl.trans((v / scale[None, :]).to(tl.float8e4nv))
    tl.store(VT + b * stride_tb + h * stride_th + ch[:, None] * stride_td + toks[None, :], codes,
             mask=ch_ok[:, None] & (toks < s_pad)[None, :])


def quantize_rows(x, mean, fmt, scale=None, shift_mean=None, codes=None, residual=False):
    """(codes like x, scale [b, s, h] fp32) of a contiguous [b, s, h, d] tensor; mean [b, h, d] smooths (int8 k).
    scale: where the scales go, any [b, s, h] fp32 view (e.g. of [b, h, s] memory, keys contiguous); by default a
    new contiguous tensor. shift_mean [b, h_kv, d] fp32 contiguous (int8 q): returns (codes, scale, lse_shift
    [b, h, s] = x · shift_mean of each row's kv head), computed in the same pass. codes: where the codes go, any
    [b, s, h, d] view with unit stride along d (e.g. of [b, h, s_pad, d] memory); by default a new contiguous tensor.
    residual (e4m3, no shift): returns (codes, scale, residual codes like codes), written in the same pass."""
    b, s, h, d = x.shape
    if codes is None:
        codes = torch.empty(x.shape, device=x.device, dtype=torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
    lo = torch.empty_like(codes) if residual else None
    if scale is None:
        scale = torch.empty((b, s, h), device=x.device, dtype=torch.float32)
    shift = None
    if shift_mean is not None:
        shift_mean = shift_mean.contiguous()
        shift = torch.empty((b, h, s), device=x.device, dtype=torch.float32)
    n_rows = b * s * h
    block_r = 16
    if n_rows:
        means = mean if mean is not None else shift_mean
        quantize_rows_kernel[(triton.cdiv(n_rows, block_r),)](
            x, means if means is not None else scale, codes, lo if residual else codes, scale,
            shift if shift is not None else scale, n_rows,
            s * h, s, *scale.stride(), *codes.stride()[:3], H=h, GROUP=h // shift_mean.shape[1] if shift_mean is not None else 1, D=d,
            BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d), INT8=fmt == "int8", SMOOTH=mean is not None,
            WITH_SHIFT=shift is not None, RESIDUAL=residual, num_warps=4)
    if residual:
        return codes, scale, lo
    return (codes, scale) if shift is None else (codes, scale, shift)


def quantize_key_blocks(k, block, codes=None):
    """(e4m3 codes like k, scale [b, s, h] fp32 contiguous) of k [b, s, h, d] with one scale per aligned block of
    `block` keys of a head (fp8_quantize._per_key_block's format). codes: where the codes go, any [b, s, h, d] view
    with unit stride along d; by default a new contiguous tensor."""
    b, s, h, d = k.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    if codes is None:
        codes = torch.empty(k.shape, device=k.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty((b, s, h), device=k.device, dtype=torch.float32)
    if k.numel():
        quantize_key_blocks_kernel[(b * h, triton.cdiv(s, block))](
            k, codes, scale, s, k.stride(0), k.stride(1), k.stride(2), *codes.stride()[:3], *scale.stride(), H=h,
            D=d, BLOCK_K=block, BLOCK_D=triton.next_power_of_2(d), num_warps=8 if d > 128 else 4)
    return codes, scale


def quantize_v(v, v_scale, s_pad):
    """v [b, s_k, h, d_v] (any strides) -> v_t [b, h, d_v, s_pad] e4m3 by the channel scales v_scale [b, h, d_v]."""
    b, s_k, h, dv = v.shape
    if v.stride(-1) != 1:  # the kernel reads a token's channels at stride 1; other strides it takes as given
        v = v.contiguous()
    v_scale = v_scale.contiguous()  # indexed flat; a no-op for v_channel_scale's
    v_t = torch.empty((b, h, dv, s_pad), device=v.device, dtype=torch.float8_e4m3fn)
    block_s = 64
    if v_t.numel():
        quantize_v_kernel[(b * h, triton.cdiv(s_pad, block_s))](
            v, v_scale, v_t, s_k, s_pad, v.stride(0), v.stride(1), v.stride(2), *v_t.stride()[:3], H=h, DV=dv,
            BLOCK_S=block_s, BLOCK_D=triton.next_power_of_2(dv), num_warps=4)
    return v_t
