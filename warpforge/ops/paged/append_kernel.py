"""The slot-mapping cache write in Triton (vLLM's reshape_and_cache): new K and V tokens [T, h_kv, d] into their
slots of the paged caches, quantised to the cache's format, in one launch for K and V.

A program owns BLOCK_T tokens of one kv head. Token t goes to slot s = slot_mapping[t] (page s // PAGE, row
s % PAGE); a slot < 0 (vLLM's padding) or past the cache is skipped, so no value of slot_mapping writes outside
the caches. Quantisation follows reference.quantize_kv_reference (quant.py) step for step in fp32 with
round-to-nearest divisions: fp8 x / scale clamped to ±448; NVFP4 per block of 16 the best of three e4m3 scales
(amax / 6 / tensor scale and its two neighbours); MXFP4 per block of 32 the better of the two powers of two around
amax / 6. FP4 tiles are the even and the odd elements of a row, loaded apart, so the two nibbles of a byte need
no interleave.
"""
import triton
import triton.language as tl


@triton.jit
def _e2m1(y):
    """Nearest e2m1 code (int32, sign in bit 3) and its value of y (fp32, in [-6, 6]), as quant.e2m1_codes."""
    a = tl.abs(y)
    mag = ((a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a > 1.75).to(tl.int32)
           + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    magf = mag.to(tl.float32)
    val = tl.where(mag < 4, magf * 0.5, tl.where(mag < 6, magf - 2.0, magf * 2.0 - 8.0))
    neg = y < 0
    return mag | (neg.to(tl.int32) << 3), tl.where(neg, -val, val)


@triton.jit
def _e4m3_magnitude(a):
    """a (fp32, in [0, 448]) rounded to the nearest e4m3 magnitude (ties to even), in fp32. The rounding is done in
    fp32 (adding and taking away 2^23 quanta rounds to a quantum) and the cast then only changes the type: the
    Triton interpreter's fp32 -> fp8 cast drops the carry when rounding up crosses a power of two (127.2 -> 64)."""
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)  # the binade (subnormals: e4m3's 2^-6 one)
    magic = ((e - 3 + 23 + 127) << 23).to(tl.float32, bitcast=True)  # 2^23 quanta of 2^(e - 3)
    return (a + magic) - magic


@triton.jit
def _e4m3(y):
    """y (fp32, within ±448) as the nearest e4m3 (ties to even), float8e4nv; a negative y that rounds to zero gives
    +0 (Triton lowers -r as 0 - r). NVFP4's block scales (y >= 0) use this form as it is: on the H200 the sign-exact
    forms below changed their bytes (benchmarks/NOTES.md, session 20, not understood)."""
    r = _e4m3_magnitude(tl.abs(y))
    return tl.where(y < 0, -r, r).to(tl.float8e4nv)


@triton.jit
def _e4m3_signed(y):
    """_e4m3 keeping -0 as torch does: r · -1 is LLVM's fneg, where -r is 0 - r (and Triton folds -0.0 to +0.0)."""
    r = _e4m3_magnitude(tl.abs(y))
    return tl.where(y < 0, r * -1.0, r).to(tl.float8e4nv)


@triton.jit
def _pow2(e):
    """2^e as fp32 for integer e in [-126, 127] (exact, from the exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_try(e, o, code, ts):
    """Even / odd elements [BLOCK_T, NB, PER] under e4m3 block-scale codes [BLOCK_T, NB] (int32) times ts: their
    e2m1 codes and each block's squared error, as quant.quantize_fp4."""
    eff = tl.maximum(code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * ts, 1e-30)
    eff3 = tl.broadcast_to(eff[:, :, None], e.shape)
    ce, ve = _e2m1(tl.minimum(tl.maximum(tl.math.div_rn(e, eff3), -6.0), 6.0))
    co, vo = _e2m1(tl.minimum(tl.maximum(tl.math.div_rn(o, eff3), -6.0), 6.0))
    de, do = ve * eff3 - e, vo * eff3 - o
    return ce, co, tl.sum(de * de, axis=2) + tl.sum(do * do, axis=2)


@triton.jit
def _fp4_rows(xe, xo, SCALE, KV_FMT: tl.constexpr, GROUP: tl.constexpr):
    """Even / odd elements [BLOCK_T, HALF] (fp32) -> (packed bytes [BLOCK_T, HALF], block-scale bytes [BLOCK_T,
    HALF * 2 / GROUP]), as quant.quantize_fp4."""
    BLOCK_T: tl.constexpr = xe.shape[0]
    HALF: tl.constexpr = xe.shape[1]
    PER: tl.constexpr = GROUP // 2
    NB: tl.constexpr = HALF // PER
    e = tl.reshape(xe, [BLOCK_T, NB, PER])
    o = tl.reshape(xo, [BLOCK_T, NB, PER])
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(e), axis=2), tl.max(tl.abs(o), axis=2)), 1e-30)
    if KV_FMT == 2:  # nvfp4: of amax / 6's e4m3 block scale (under the fp32 tensor scale) and the e4m3 either side
        ts = tl.load(SCALE)
        s = tl.minimum(tl.math.div_rn(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)),
                                      tl.full(amax.shape, 1.0, tl.float32) * ts), 448.0)
        base = _e4m3(s).to(tl.uint8, bitcast=True).to(tl.int32)
        code = base
        ce, co, err = _nvfp4_try(e, o, code, ts)
        for step in tl.static_range(-1, 2, 2):   # -1, then +1: taken only if strictly better, as quant.py
            cand = tl.minimum(tl.maximum(base + step, 0), 126)
            ce_c, co_c, err_c = _nvfp4_try(e, o, cand, ts)
            take = err_c < err
            take3 = tl.broadcast_to(take[:, :, None], [BLOCK_T, NB, PER])
            ce = tl.where(take3, ce_c, ce)
            co = tl.where(take3, co_c, co)
            code = tl.where(take, cand, code)
            err = tl.where(take, err_c, err)
        sbytes = code.to(tl.uint8)
    else:  # mxfp4: of 2^hi (hi = ceil(log2(amax / 6)), from the bits) and 2^(hi - 1), the smaller block error
        y = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
        bits = y.to(tl.int32, bitcast=True)
        hi = ((bits >> 23) & 255) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        hi = tl.minimum(tl.maximum(hi, -126), 127)
        p_hi = tl.broadcast_to(_pow2(hi)[:, :, None], [BLOCK_T, NB, PER])
        p_lo = tl.broadcast_to(_pow2(hi - 1)[:, :, None], [BLOCK_T, NB, PER])
        ce_hi, ve_hi = _e2m1(tl.minimum(tl.maximum(tl.math.div_rn(e, p_hi), -6.0), 6.0))
        co_hi, vo_hi = _e2m1(tl.minimum(tl.maximum(tl.math.div_rn(o, p_hi), -6.0), 6.0))
        ce_lo, ve_lo = _e2m1(tl.minimum(tl.maximum(tl.math.div_rn(e, p_lo), -6.0), 6.0))
        co_lo, vo_lo = _e2m1(tl.minimum(tl.maximum(tl.math.div_rn(o, p_lo), -6.0), 6.0))
        # errors in units of 2^hi, as quant.quantize_fp4 (an overflowing 2^hi candidate: inf, so 2^(hi - 1) taken)
        de_hi = tl.math.div_rn(ve_hi * p_hi - e, p_hi)
        do_hi = tl.math.div_rn(vo_hi * p_hi - o, p_hi)
        de_lo = tl.math.div_rn(ve_lo * p_lo - e, p_hi)
        do_lo = tl.math.div_rn(vo_lo * p_lo - o, p_hi)
        err_hi = tl.sum(de_hi * de_hi, axis=2) + tl.sum(do_hi * do_hi, axis=2)
        err_lo = tl.sum(de_lo * de_lo, axis=2) + tl.sum(do_lo * do_lo, axis=2)
        take_lo = err_lo < err_hi
        sbytes = (tl.where(take_lo, hi - 1, hi) + 127).to(tl.uint8)
        lo3 = tl.broadcast_to(take_lo[:, :, None], [BLOCK_T, NB, PER])
        ce = tl.where(lo3, ce_lo, ce_hi)
        co = tl.where(lo3, co_lo, co_hi)
    packed = tl.reshape(ce | (co << 4), [BLOCK_T, HALF]).to(tl.uint8)
    return packed, sbytes


@triton.jit
def _write_rows(SRC, DST, BS, t64, h64, ok, dst_row, bs_row, stride_st, stride_sh, stride_dh, stride_bh, SCALE,
                D: tl.constexpr, BLOCK_D: tl.constexpr, KV_FMT: tl.constexpr, GROUP: tl.constexpr):
    """Tokens t64 of head h64 of SRC [T, h_kv, d] quantised into the cache rows at element offsets dst_row
    (int64) of DST (FP4: the packed values; their block scales at bs_row of BS); rows where ok is False untouched."""
    src = SRC + t64[:, None] * stride_st + h64 * stride_sh
    dst = DST + dst_row[:, None] + h64 * stride_dh
    if KV_FMT < 2:
        offs = tl.arange(0, BLOCK_D)
        m = ok[:, None] & (offs < D)[None, :]
        x = tl.load(src + offs[None, :], mask=m, other=0.0)
        if KV_FMT == 1:  # fp8: x / scale, clamped into e4m3's range
            xf = x.to(tl.float32)
            y = tl.math.div_rn(xf, tl.full(xf.shape, 1.0, tl.float32) * tl.load(SCALE))
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
            tl.store(dst + offs[None, :], _e4m3_signed(y), mask=m)
        else:
            tl.store(dst + offs[None, :], x.to(DST.dtype.element_ty), mask=m)
    else:
        HALF: tl.constexpr = BLOCK_D // 2
        cols = tl.arange(0, HALF)
        m = ok[:, None] & (cols < D // 2)[None, :]
        xe = tl.load(src + 2 * cols[None, :], mask=m, other=0.0).to(tl.float32)
        xo = tl.load(src + 2 * cols[None, :] + 1, mask=m, other=0.0).to(tl.float32)
        packed, sbytes = _fp4_rows(xe, xo, SCALE, KV_FMT, GROUP)
        tl.store(dst + cols[None, :], packed, mask=m)
        NB: tl.constexpr = BLOCK_D // GROUP
        offs_s = tl.arange(0, NB)
        bs = BS + bs_row[:, None] + h64 * stride_bh
        tl.store(bs + offs_s[None, :], sbytes, mask=ok[:, None] & (offs_s < D // GROUP)[None, :])


@triton.jit
def append_slots_kernel(
    K, V, K_CACHE, V_CACHE, K_BS, V_BS, SLOTS, K_SCALE, V_SCALE, num_tokens, capacity,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
    stride_kbp, stride_kbt, stride_kbh, stride_vbp, stride_vbt, stride_vbh,   # FP4: the block scales'
    PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, KV_FMT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Program (token block, kv head): K and V of BLOCK_T tokens into their slots."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h64 = tl.program_id(1).to(tl.int64)
    t_ok = t < num_tokens
    slot = tl.load(SLOTS + t, mask=t_ok, other=-1).to(tl.int64)
    ok = t_ok & (slot >= 0) & (slot < capacity)
    slot = tl.where(ok, slot, 0)
    page = slot // PAGE
    row = slot % PAGE
    t64 = t.to(tl.int64)
    _write_rows(K, K_CACHE, K_BS, t64, h64, ok, page * stride_kcp + row * stride_kct, page * stride_kbp +
                row * stride_kbt, stride_kt, stride_kh, stride_kch, stride_kbh, K_SCALE, D, BLOCK_D, KV_FMT, GROUP)
    _write_rows(V, V_CACHE, V_BS, t64, h64, ok, page * stride_vcp + row * stride_vct, page * stride_vbp +
                row * stride_vbt, stride_vt, stride_vh, stride_vch, stride_vbh, V_SCALE, D, BLOCK_D, KV_FMT, GROUP)


def append_slots_fwd(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale, fmt, cfg, k_bs=None, v_bs=None):
    """Launches append_slots_kernel: k / v [T, h_kv, d], slot_mapping [T] (int32 or int64), scales fp32 one-element
    tensors (fp8 / nvfp4) or None. FP4: the caches are the packed values and k_bs / v_bs the block scales
    (kv_format.split_fp4)."""
    t, h_kv, d = k.shape
    if t == 0 or k_cache.shape[0] == 0:
        return
    group = max(fmt.group, 1)
    block_d = max(32 if fmt.fp4 else 16, triton.next_power_of_2(d))
    dummy = slot_mapping
    if k_bs is None:   # no block scales: pointers the kernel does not read
        k_bs, v_bs = k_cache, v_cache
    grid = (triton.cdiv(t, cfg.block_t), h_kv)
    append_slots_kernel[grid](
        k, v, k_cache, v_cache, k_bs, v_bs, slot_mapping, k_scale if k_scale is not None else dummy,
        v_scale if v_scale is not None else dummy, t, k_cache.shape[0] * k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), *k_bs.stride()[:3], *v_bs.stride()[:3],
        PAGE=k_cache.shape[1], D=d, BLOCK_D=block_d, KV_FMT=fmt.code, GROUP=group, BLOCK_T=cfg.block_t,
        num_warps=cfg.warps,
    )
