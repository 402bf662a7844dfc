"""FP8 attention forward for Hopper (sm_90) in Gluon: e4m3 (or int8) Q·Kᵀ and e4m3 P·V on wgmma (QGMMA / IGMMA), on
the schedule of flash_gluon_kernel.py (the bf16 Gluon forward), whose mbarrier protocol it keeps unchanged.

The same problem and outputs as fp8_kernel.flash_fp8_fwd for a QuantizedQKV (fp8_quantize.py) of batched inputs
(head dim 64 or 128, d_v = d, causal bottom-right aligned or no mask, GQA/MQA): out [b, s_q, h_q, d] in the
inputs' dtype, lse fp32 [b, h_q, s_q] in natural log (-inf and out 0 for a query that sees no key); api adds int8's
smoothing shift to lse, as for the portable kernel.

Operands (FP8 wgmma takes both shared-memory operands K-major, i.e. contiguous along the reduction):
- S = Q·Kᵀ: Q [64 rows, d] and K [BLOCK_N, d] tiles of the [b, s, h, d] codes, contiguous along d: K-major for both.
  Q_LO (q_residual): q's residual codes come with Q (two more tiles an item) and a second wgmma adds their product
  into the same accumulator, issued right after the first.
- K_BLOCK (k_block 128, e4m3): k's scale is one per aligned 128 keys, so a tile's is one number, loaded from k_scale
  while S runs and folded into the row factor (qs2 · ks): the per-score MUL below goes (its smem copy is not read).
- O += P·V: V comes channel-major, v_t [b, h_kv, d, s_pad], so a [d, BLOCK_N] tile is contiguous along the keys,
  the reduction: its permuted view [BLOCK_N, d] is the K-major B operand. P is the register A operand.
- scores: s_ij = (q̂_i · k̂_j) · qs_i · ks_j. Per tile: t = s · ks_j (one MUL; the tile's BLOCK_N key scales arrive
  in the ring slot with K, by TMA from a [b, h_kv, s] copy of k_scale whose keys are contiguous, and are read from
  shared memory before K's slot is freed), then exp2(t · qs2_i - m'_i) (one FMA; qs2 = q_scale · softmax scale ·
  log2 e, loaded once per item), with m'_i = m_i - log2 448 so that the probabilities come out already scaled into
  e4m3's range (P · 448 <= 448; probabilities down to 2^-15 stay normal numbers): the row sum l carries the same
  448, and out = acc / l · vs_c cancels it. (Per-token q and k scales cannot fold into a single FMA: their product
  differs per score. A per-128-key-block k scale would; see benchmarks/NOTES.md.)
- int8 (INT8_QK): s8 wgmma with int32 accumulators; the integer scores (|s| <= 127² · 256 < 2^22) become fp32 by
  the exponent trick (bits of s + 0x4B400000 as a float = 12582912 + s exactly) instead of I2F, which issues on
  the same narrow pipe as ex2; the 12582912 comes off inside the key-scale MUL, made an FMA.
- P into the P·V operand: the accumulator gives a thread column pairs {2c, 2c+1} per 8 columns, the 8-bit A operand
  wants {4c..4c+3} per 16; Triton moves the bytes (shuffles, byte permutes). PERMUTE_K (a knob, off by default): K's
  rows are TMA-loaded permuted within 16-key groups (a 5-D box over K laid out [b, h_kv, s_pad16, d]), so S's column
  16g + 8i + 2c + e holds key 16g + 4c + 2i + e; relabelling P's columns accordingly is then free (assert_trivial)
  and puts every probability at its key's index for the unpermuted V. The key scales are permuted the same way and
  the mask compares the permuted key index.
- epilogue: out = acc · (vs_c / l) into a [64, d] staging buffer per warpgroup (bf16/fp16 out needs twice Q's fp8
  bytes: not Q's slot, unlike the bf16 kernel), one TMA store per warpgroup (rows past s_q clipped); lse by pointer.

Schedule (one program per (128 query rows, batch · head) work item, or persistent): a 1-warp TMA producer
(setmaxnreg PRODUCER_REGS) loading Q once and K_j / V_j into a STAGES-slot ring (k_ready / v_ready / k_empty /
v_empty, K's slot freed after S_j, V's after P·V_j), two 64-row consumer warpgroups (CONSUMER_REGS) that issue S_j
together with P_{j-1}·V_{j-1} and run tile j's softmax while P·V_{j-1} is on the tensor cores, and ping-pong between
the warpgroups through two `turn` barriers. Every barrier, count and parity is flash_gluon_kernel's; the additions
are the key scales (a second TMA copy on K's k_ready, counted in its expected bytes, read before K's k_empty
arrive), per-warpgroup output staging buffers (each warpgroup waits for its own TMA store before it writes its
buffer again) and pointer loads of q / v scales, which need no barrier. The protocol, op for op, is modelled in
tests/attention/test_attention_fp8_gluon.py (random interleavings of the three partitions and the copies in flight:
no deadlock, no read of a slot before its tile lands, no copy into a slot still read, strict ping-pong alternation;
mutations of a parity, a wait or a release order are caught).

Gluon's API changes between Triton releases: everything is imported lazily (`_build()`); fp8_api gates on sm_90
and a Triton in GLUON_TRITON_VERSIONS.
"""
import functools

import torch

from .._gluon import SMEM_MAX, check_smem, tma_addressable  # noqa: F401 - SMEM_MAX: the tests' bound


LOG2E = 1.4426950408889634
LOG2_448 = 8.807354922057604  # log2(448): e4m3's largest finite value
BLOCK_M = 128           # query rows per work item: two consumer warpgroups of 64 rows
WG_ROWS = 64
GLUON_TRITON_VERSIONS = ("3.6",)
HEAD_DIMS = (64, 128)
PRODUCER_REGS = 24
CONSUMER_REGS = 240
# P's conversion into the register operand (_p_operand): 0 = cast to e4m3 in the accumulator layout, then move the
# bytes (Triton: shuffles + byte permutes); 1 = move fp32, then cast; 2 = via fp16. Whole-kernel SASS at d128,
# 3 stages (Triton 3.6): 7376 / 7928 / 7664 instructions, so 0.
P_CONVERT = 0
MAXNREG = 168           # 12 warps x 168 registers = 64K: what setmaxnreg redistributes


def smem_bytes(d: int, block_n: int, stages: int, persistent: bool = False, out_bytes: int = 2,
               q_lo: bool = False) -> int:
    """Shared memory of the schedule: Q codes (two slots when persistent; q's residual codes beside them), the K/V
    ring (1-byte codes), the two output staging buffers, barriers."""
    return ((2 if persistent else 1) * (2 if q_lo else 1) * BLOCK_M * d + stages * (2 * block_n * d + 4 * block_n)
            + BLOCK_M * d * out_bytes + 1024)


@functools.lru_cache(maxsize=None)
def _build():
    """The Gluon kernel, built on first use (importing warpforge never touches Gluon)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    @gluon.jit
    def _item(k):
        """Work item of round k: k · P + pid, reversed on odd rounds (flash_gluon_kernel's snake)."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        t = k * nprog + pid
        if k % 2 == 1:
            t = k * nprog + (nprog - 1 - pid)
        return t

    @gluon.jit
    def _tile(t, n_m, H_Q, GROUP, s_q, s_k, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
        """Work item t: (b, h, kv head, first query row, key tiles to walk), head by head, heaviest row tile first."""
        bh = t // n_m
        pid_m = n_m - 1 - t % n_m
        b = bh // H_Q
        h = bh % H_Q
        m_lo = pid_m * 128
        if CAUSAL:
            hi = gl.minimum(gl.minimum(m_lo + 128, s_q) + (s_k - s_q), s_k)
        else:
            hi = s_k
        return b, h, h // GROUP, m_lo, gl.maximum(gl.cdiv(hi, BLOCK_N), 0)

    @gluon.jit
    def _producer(q_desc, ql_desc, k_desc, ks_desc, v_desc, q_bufs, k_bufs, ks_bufs, v_bufs, q_ready, q_empty,
                  k_ready, v_ready, k_empty,
                  v_empty, n_m, total, n_rounds, H_Q, GROUP, s_q, s_k, H_KV, S16, CAUSAL: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, QBUF: gl.constexpr, PERMUTE_K: gl.constexpr,
                  Q_LO: gl.constexpr):
        gl.static_assert(STAGES >= 2)  # S_j is issued before tile j-1's slot is freed: one slot would deadlock
        it = 0
        tc = 0
        for k in range(n_rounds):
            t = _item(k)
            if t < total:
                NQ: gl.constexpr = 4 if Q_LO else 2  # Q tiles an item: a warpgroup's codes (and residual codes)
                q_bytes: gl.constexpr = NQ * q_desc.block_type.nbytes
                b, h, kvh, m_lo, n_tiles = _tile(t, n_m, H_Q, GROUP, s_q, s_k, CAUSAL, BLOCK_N)
                qs = tc % QBUF
                mbarrier.wait(q_empty.index(qs), ((tc // QBUF) & 1) ^ 1)
                mbarrier.expect(q_ready.index(qs), q_bytes)
                tma.async_copy_global_to_shared(q_desc, [b, m_lo, h, 0], q_ready.index(qs), q_bufs.index(NQ * qs))
                tma.async_copy_global_to_shared(q_desc, [b, m_lo + 64, h, 0], q_ready.index(qs),
                                                q_bufs.index(NQ * qs + 1))
                if Q_LO:
                    tma.async_copy_global_to_shared(ql_desc, [b, m_lo, h, 0], q_ready.index(qs),
                                                    q_bufs.index(NQ * qs + 2))
                    tma.async_copy_global_to_shared(ql_desc, [b, m_lo + 64, h, 0], q_ready.index(qs),
                                                    q_bufs.index(NQ * qs + 3))
                for j in range(n_tiles):
                    slot = it % STAGES
                    phase = ((it // STAGES) & 1) ^ 1
                    mbarrier.wait(k_empty.index(slot), phase)
                    mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes + ks_desc.block_type.nbytes)
                    if PERMUTE_K:  # 16-key groups of K laid out [b, h_kv, s_pad, d]: group row of the tile's first
                        tma.async_copy_global_to_shared(k_desc, [(b * H_KV + kvh) * S16 + j * (BLOCK_N // 16), 0, 0,
                                                                 0, 0], k_ready.index(slot), k_bufs.index(slot))
                    else:
                        tma.async_copy_global_to_shared(k_desc, [b, j * BLOCK_N, kvh, 0], k_ready.index(slot),
                                                        k_bufs.index(slot))
                    tma.async_copy_global_to_shared(ks_desc, [b, kvh, j * BLOCK_N], k_ready.index(slot),
                                                    ks_bufs.index(slot))
                    mbarrier.wait(v_empty.index(slot), phase)
                    mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(v_desc, [b, kvh, 0, j * BLOCK_N], v_ready.index(slot),
                                                    v_bufs.index(slot))
                    it += 1
                tc += 1

    @gluon.jit
    def _qk(q, q_lo, k_t, s_zero, Q_LO):
        """S = Q·Kᵀ issued async (Q_LO: plus q's residual codes times K, into the same accumulator, issued next)."""
        s_tok = warpgroup_mma(q, k_t, s_zero, use_acc=False, is_async=True)
        if Q_LO:
            s_tok = warpgroup_mma(q_lo, k_t, s_tok, is_async=True)
        return s_tok

    @gluon.jit
    def _key_scales(ks_bufs, slot, col_layout, BLOCK_N):
        """The tile's key scales [BLOCK_N] from its ring slot (TMA fills 0 past the keys' end; masked anyway)."""
        return ks_bufs.index(slot).reshape([BLOCK_N]).load(col_layout)

    @gluon.jit
    def _scores(s, ks, INT8_QK: gl.constexpr):
        """Raw tile scores times the key scales: t = s · ks_j (int8: the int32 sums become fp32 through the bits of
        s + 0x4B400000 = 1.5 · 2^23 + s, exact for |s| < 2^22, and the 1.5 · 2^23 leaves inside one FMA)."""
        if INT8_QK:
            f = (s + 0x4B400000).to(gl.float32, bitcast=True)
            return f * ks[None, :] - (12582912.0 * ks)[None, :]
        else:
            return s * ks[None, :]

    @gluon.jit
    def _tile_scores(s, kb, ks_bufs, k_empty, slot, qs2, col_layout, BLOCK_N, INT8_QK, K_BLOCK):
        """(the tile's scores, the rows' factor) from S, K's slot released once its scales are read. K_BLOCK: S as is
        and qs2 times the tile's one key scale kb; else S times each key's scale (_scores), and qs2."""
        if K_BLOCK:
            mbarrier.arrive(k_empty.index(slot))
            return s, qs2 * kb
        else:
            ks = _key_scales(ks_bufs, slot, col_layout, BLOCK_N)
            mbarrier.arrive(k_empty.index(slot))  # K and its scales read
            return _scores(s, ks, INT8_QK), qs2

    @gluon.jit
    def _p_operand(p, p_layout: gl.constexpr, P_CONVERT: gl.constexpr, PERMUTE_K: gl.constexpr):
        """P · 448 (fp32, wgmma accumulator layout) -> e4m3 in the register A operand's layout. PERMUTE_K: S's column
        16g + 8i + 2c + e holds key 16g + 4c + 2i + e (K's rows were loaded so); relabelling the columns to
        16g + 4c + 2i + e puts every probability at its key's index, and in exactly the registers the A operand
        wants: no data moves (assert_trivial)."""
        if PERMUTE_K:
            BN: gl.constexpr = p.shape[1]
            pk = p.reshape([64, BN // 16, 2, 4, 2]).permute((0, 1, 3, 2, 4)).reshape([64, BN])
            return gl.convert_layout(pk.to(gl.float8e4nv), p_layout, assert_trivial=True)
        elif P_CONVERT == 0:
            return gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        elif P_CONVERT == 1:
            return gl.convert_layout(p, p_layout).to(gl.float8e4nv)
        else:
            return gl.convert_layout(p.to(gl.float16), p_layout).to(gl.float8e4nv)

    @gluon.jit
    def _softmax(t, n0, limit_row, s_k, m_i, l_i, qs2, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                 s_layout: gl.constexpr, BLOCK_N: gl.constexpr, PERMUTE_K: gl.constexpr):
        """One online-softmax step on t = scores · key scales of keys n0 .. n0+BLOCK_N-1: (p · 448 fp32, alpha, l,
        m), m in log2 units (the true running maximum; the 448 rides in the exp2's shift)."""
        if MASK:
            x_idx = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            if PERMUTE_K:  # column 16g + 8i + 2c + e holds key 16g + 4c + 2i + e
                x_idx = (x_idx & ~15) | (((x_idx >> 1) & 3) << 2) | (((x_idx >> 3) & 1) << 1) | (x_idx & 1)
            cols = n0 + x_idx
            ok = (cols < s_k)[None, :]
            if CAUSAL:
                ok = ok & (cols[None, :] <= limit_row[:, None])
            x = gl.where(ok, t * qs2[:, None], float("-inf"))
            m_new = gl.maximum(m_i, gl.max(x, axis=1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
            p = gl.exp2(x - (m_use - 8.807354922057604)[:, None])
        else:
            # qs2 > 0: the row's largest t · qs2 is its largest t times qs2 (one multiply per row, not per score)
            m_new = gl.maximum(m_i, gl.max(t, axis=1) * qs2)
            m_use = m_new
            p = gl.exp2(t * qs2[:, None] - (m_use - 8.807354922057604)[:, None])  # one FMA per score
        alpha = gl.exp2(m_i - m_use)
        return p, alpha, l_i * alpha + gl.sum(p, axis=1), m_new

    @gluon.jit
    def _consumer(q_bufs, k_bufs, ks_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
                  o_desc, QS, VS, LSE, KS, n_m, total, n_rounds, H_Q, GROUP, s_q, s_k, qk_scale,
                  stride_qsb, stride_qss, stride_qsh, stride_vsb, stride_vsh,
                  stride_lb, stride_lh, stride_ksb, stride_kss, stride_ksh, WG: gl.constexpr, D: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                  QBUF: gl.constexpr, INT8_QK: gl.constexpr, P_CONVERT: gl.constexpr, PERMUTE_K: gl.constexpr,
                  Q_LO: gl.constexpr, K_BLOCK: gl.constexpr):
        KINSTR: gl.constexpr = 32  # an 8-bit wgmma's K
        NQ: gl.constexpr = 4 if Q_LO else 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, KINSTR])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, KINSTR])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        if INT8_QK:
            s_zero = gl.zeros([64, BLOCK_N], gl.int32, s_layout)
        else:
            s_zero = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
        o_smem = o_bufs.index(WG)
        it = 0
        tn = 0
        tc = 0
        for k in range(n_rounds):
            t = _item(k)
            if t < total:
                b, h, kvh, m_lo, n_tiles = _tile(t, n_m, H_Q, GROUP, s_q, s_k, CAUSAL, BLOCK_N)
                qs = tc % QBUF
                q = q_bufs.index(NQ * qs + WG).reshape([64, D])
                q_lo = q_bufs.index(NQ * qs + 2 * Q_LO + WG).reshape([64, D])  # (q itself without Q_LO: unused)
                r0 = m_lo + WG * 64
                rows = r0 + gl.arange(0, 64, layout=row_s)
                limit_row = rows + (s_k - s_q)
                if CAUSAL:
                    first_masked = gl.minimum(s_k, r0 + (s_k - s_q) + 1) // BLOCK_N
                else:
                    first_masked = s_k // BLOCK_N
                b64 = b.to(gl.int64)
                qs2 = gl.load(QS + b64 * stride_qsb + h.to(gl.int64) * stride_qsh + rows.to(gl.int64) * stride_qss,
                              mask=rows < s_q, other=0.0) * qk_scale
                ks_row = KS + b64 * stride_ksb + kvh.to(gl.int64) * stride_ksh  # K_BLOCK: this head's key scales
                m_i = gl.full([64], float("-inf"), gl.float32, row_s)
                l_i = gl.zeros([64], gl.float32, row_s)
                acc = gl.zeros([64, D], gl.float32, o_layout)
                mbarrier.wait(q_ready.index(qs), (tc // QBUF) & 1)
                if n_tiles > 0:
                    # ---- key tile 0: S only
                    slot = it % STAGES
                    mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
                    if PINGPONG:
                        if WG == 0:
                            mbarrier.wait(turn.index(0), (tn + 1) & 1, pred=tn > 0)
                        else:
                            mbarrier.wait(turn.index(1), tn & 1)
                    s_tok = _qk(q, q_lo, k_bufs.index(slot).reshape([BLOCK_N, D]).permute((1, 0)), s_zero, Q_LO)
                    if PINGPONG:
                        mbarrier.arrive(turn.index(1 - WG))
                    kb = 1.0
                    if K_BLOCK:  # the tile's one key scale, loaded while S runs
                        kb = gl.load(ks_row)
                    s = warpgroup_mma_wait(0, deps=(s_tok, ))
                    x, qsx = _tile_scores(s, kb, ks_bufs, k_empty, slot, qs2, col_s, BLOCK_N, INT8_QK, K_BLOCK)
                    if first_masked <= 0:
                        p, alpha, l_i, m_i = _softmax(x, 0, limit_row, s_k, m_i, l_i, qsx, True, CAUSAL, s_layout,
                                                      BLOCK_N, PERMUTE_K)
                    else:
                        p, alpha, l_i, m_i = _softmax(x, 0, limit_row, s_k, m_i, l_i, qsx, False, CAUSAL, s_layout,
                                                      BLOCK_N, PERMUTE_K)
                    p_op = _p_operand(p, p_layout, P_CONVERT, PERMUTE_K)
                    # ---- key tiles 1 .. n-1: S_j and P_{j-1}·V_{j-1} in flight together
                    for j in range(1, n_tiles):
                        g = it + j
                        slot = g % STAGES
                        prev = (g - 1) % STAGES
                        mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
                        mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
                        if PINGPONG:
                            mbarrier.wait(turn.index(WG), (tn + j + 1 + WG) & 1)
                        s_tok = _qk(q, q_lo, k_bufs.index(slot).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                                    Q_LO)
                        acc_tok = warpgroup_mma(p_op, v_bufs.index(prev).reshape([D, BLOCK_N]).permute((1, 0)),
                                                acc, is_async=True)
                        if PINGPONG:
                            mbarrier.arrive(turn.index(1 - WG))
                        if K_BLOCK:  # a pointer stepped a tile at a time: an index from j widened the causal
                            ks_row += BLOCK_N * stride_kss  # mask's compares to 64 bits (ISETP pairs)
                            kb = gl.load(ks_row)
                        s = warpgroup_mma_wait(1, deps=(s_tok, ))  # S_j done (both halves); P·V_{j-1} may run
                        x, qsx = _tile_scores(s, kb, ks_bufs, k_empty, slot, qs2, col_s, BLOCK_N, INT8_QK, K_BLOCK)
                        if j >= first_masked:
                            p, alpha, l_i, m_i = _softmax(x, j * BLOCK_N, limit_row, s_k, m_i, l_i, qsx, True,
                                                          CAUSAL, s_layout, BLOCK_N, PERMUTE_K)
                        else:
                            p, alpha, l_i, m_i = _softmax(x, j * BLOCK_N, limit_row, s_k, m_i, l_i, qsx, False,
                                                          CAUSAL, s_layout, BLOCK_N, PERMUTE_K)
                        # P_{j-1} (e4m3 registers) is not passed as a dep: Triton 3.6 cannot lower an 8-bit dep
                        # ("Unexpected bitwidth in WGMMAWaitGroupOp: 8"); P is built again only after this wait, and
                        # ptxas keeps an in-flight wgmma's registers (no serialization warning in the compile test)
                        acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
                        gl.thread_barrier()
                        mbarrier.arrive(v_empty.index(prev))
                        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                        p_op = _p_operand(p, p_layout, P_CONVERT, PERMUTE_K)
                    # ---- the last P·V
                    g = it + n_tiles - 1
                    last = g % STAGES
                    mbarrier.wait(v_ready.index(last), (g // STAGES) & 1)
                    if PINGPONG:
                        mbarrier.wait(turn.index(WG), (tn + n_tiles + 1 + WG) & 1)
                    acc_tok = warpgroup_mma(p_op, v_bufs.index(last).reshape([D, BLOCK_N]).permute((1, 0)), acc,
                                            is_async=True)
                    if PINGPONG:
                        mbarrier.arrive(turn.index(1 - WG))
                    acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
                    gl.thread_barrier()
                    mbarrier.arrive(v_empty.index(last))
                    it += n_tiles
                    tn += n_tiles + 1

                # epilogue: out = acc · vs / l (l carries P's 448), staged in this warpgroup's buffer, one TMA store
                empty_row = l_i == 0.0
                l_safe = gl.where(empty_row, 1.0, l_i)
                lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(l_safe) - 8.807354922057604)
                               * 0.6931471805599453)
                vs = gl.load(VS + b64 * stride_vsb + kvh.to(gl.int64) * stride_vsh + gl.arange(0, D, layout=col_o))
                out = acc * gl.convert_layout(1.0 / l_safe, row_o)[:, None] * vs[None, :]
                o_smem.reshape([64, D]).store(out.to(o_desc.dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [b, r0, h, 0], o_smem)
                gl.store(LSE + b64 * stride_lb + h.to(gl.int64) * stride_lh + rows, lse, mask=rows < s_q)
                tma.store_wait(0)
                gl.thread_barrier()  # the whole warpgroup is past its store (and its last S) before Q's slot goes back
                mbarrier.arrive(q_empty.index(qs))
                tc += 1

    @gluon.jit
    def flash_fp8_fwd_gluon_kernel(q_desc, ql_desc, k_desc, ks_desc, v_desc, o_desc, QS, VS, LSE, KS, s_q, s_k, H_KV,
                                   S16, qk_scale, stride_qsb, stride_qss, stride_qsh, stride_vsb, stride_vsh,
                                   stride_lb, stride_lh, stride_ksb, stride_kss, stride_ksh, H_Q, GROUP, n_m, total,
                                   n_rounds, D: gl.constexpr,
                                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                   PINGPONG: gl.constexpr, QBUF: gl.constexpr, INT8_QK: gl.constexpr,
                                   P_CONVERT: gl.constexpr, PERMUTE_K: gl.constexpr, Q_LO: gl.constexpr,
                                   K_BLOCK: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        NQ: gl.constexpr = 4 if Q_LO else 2
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [NQ * QBUF] + q_desc.block_type.shape, q_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        ks_bufs = gl.allocate_shared_memory(ks_desc.dtype, [STAGES] + ks_desc.block_type.shape, ks_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        o_bufs = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(QBUF):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)

        gl.warp_specialize([
            (_consumer, (q_bufs, k_bufs, ks_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
                         v_empty, turn, o_desc, QS, VS, LSE, KS, n_m, total, n_rounds, H_Q, GROUP, s_q, s_k,
                         qk_scale, stride_qsb, stride_qss, stride_qsh, stride_vsb, stride_vsh,
                         stride_lb, stride_lh, stride_ksb, stride_kss, stride_ksh, 0, D, BLOCK_N, STAGES, CAUSAL,
                         PINGPONG, QBUF, INT8_QK, P_CONVERT, PERMUTE_K, Q_LO, K_BLOCK)),
            (_consumer, (q_bufs, k_bufs, ks_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
                         v_empty, turn, o_desc, QS, VS, LSE, KS, n_m, total, n_rounds, H_Q, GROUP, s_q, s_k,
                         qk_scale, stride_qsb, stride_qss, stride_qsh, stride_vsb, stride_vsh,
                         stride_lb, stride_lh, stride_ksb, stride_kss, stride_ksh, 1, D, BLOCK_N, STAGES, CAUSAL,
                         PINGPONG, QBUF, INT8_QK, P_CONVERT, PERMUTE_K, Q_LO, K_BLOCK)),
            (_producer, (q_desc, ql_desc, k_desc, ks_desc, v_desc, q_bufs, k_bufs, ks_bufs, v_bufs, q_ready,
                         q_empty, k_ready, v_ready, k_empty,
                         v_empty, n_m, total, n_rounds, H_Q, GROUP, s_q, s_k, H_KV, S16, CAUSAL, BLOCK_N, STAGES, QBUF,
                         PERMUTE_K, Q_LO)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    return flash_fp8_fwd_gluon_kernel, gl


def available() -> bool:
    """This Triton's Gluon is one the kernel was written for (and imports)."""
    from .._gluon import builds
    return builds(_build, GLUON_TRITON_VERSIONS)


def fits(qkv) -> bool:
    """A QuantizedQKV the kernel takes: head dim 64/128 for q, k and v (d_v = d), codes that TMA descriptors can
    address (16-byte aligned bases and strides, unit stride along the last dim), an fp16/bf16 output."""
    q, k, vt = qkv.q, qkv.k, qkv.v_t
    d = q.shape[-1]
    codes = (q, k, vt) if qkv.q_lo is None else (q, k, vt, qkv.q_lo)
    return (q.dim() == 4 and d in HEAD_DIMS and k.shape[-1] == d and vt.shape[2] == d
            and qkv.dtype in (torch.float16, torch.bfloat16) and all(tma_addressable(t) for t in codes))


def key_scales_by_head(k_scale: torch.Tensor) -> torch.Tensor:
    """k_scale [b, s_k, h_kv] as a view whose keys are contiguous and whose (batch, head) rows start 16-byte aligned
    ([b, h_kv, s_pad] memory, s_pad a multiple of 4), what a TMA descriptor needs: the Triton quantiser's own layout
    (fp8_quantize_kernel.quantize_rows, keys_inner) is taken as is, anything else is copied once."""
    if (k_scale.stride(1) == 1 and k_scale.data_ptr() % 16 == 0 and k_scale.stride(0) % 4 == 0
            and k_scale.stride(2) % 4 == 0):
        return k_scale
    b, s_k, h = k_scale.shape
    buf = torch.zeros((b, h, s_k + (-s_k % 4)), device=k_scale.device, dtype=torch.float32)
    buf[..., :s_k] = k_scale.transpose(1, 2)
    return buf.transpose(1, 2)[:, :s_k]


def _pad16(n: int) -> int:
    return n + (-n % 16)


def permuted_key(x):
    """PERMUTE_K: the key that S's column / K's smem row x holds within its tile: 16g + 8i + 2c + e -> 16g + 4c + 2i
    + e (ints or an integer tensor; the kernel's mask computes the same)."""
    return (x & ~15) | (((x >> 1) & 3) << 2) | (((x >> 3) & 1) << 1) | (x & 1)


def keys_by_head(k: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(K codes as [b, h_kv, S, d] memory with S = s_k padded to 16, S): what PERMUTE_K's 5-D descriptor walks. A k
    that already is a [b, s_k, h_kv, d] view of such memory is taken as is; anything else is copied once (zeros in
    the padding; its values are masked anyway)."""
    b, s_k, h, d = k.shape
    pad = _pad16(s_k)
    if k.stride() == (h * pad * d, d, pad * d, 1):
        return torch.as_strided(k, (b, h, pad, d), (h * pad * d, pad * d, d, 1)), pad
    buf = torch.zeros((b, h, pad, d), device=k.device, dtype=k.dtype)
    buf[:, :, :s_k] = k.transpose(1, 2)
    return buf, pad


def key_scales_permuted(k_scale: torch.Tensor, pad: int) -> torch.Tensor:
    """PERMUTE_K: k_scale [b, s_k, h_kv] as [b, h_kv, pad] fp32 with the scale of key permuted_key(x) at x (zeros
    past s_k), so that a tile's scales line up with S's columns."""
    b, s_k, h = k_scale.shape
    buf = torch.zeros((b, h, pad), device=k_scale.device, dtype=torch.float32)
    buf[..., :s_k] = k_scale.transpose(1, 2)
    # key 16g + 4c + 2i + e -> position 16g + 8i + 2c + e
    return buf.view(b, h, pad // 16, 4, 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(b, h, pad).contiguous()


def _descriptors(q, k, ks, vt, out, block_n, gl, permute_k=False):
    """TMA descriptors (q, k, key scales, v_t, out) and S16 (PERMUTE_K: K's padded length / 16, else 0). q may be
    q's residual codes too (the same shape and strides: the same descriptor over other memory)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    d = q.shape[-1]
    s_k = k.shape[1]
    code = gl.int8 if q.dtype == torch.int8 else gl.float8e4nv
    odt = gl.bfloat16 if out.dtype == torch.bfloat16 else gl.float16
    descs = []
    for t, block, dt in ((q, [1, WG_ROWS, 1, d], code), (k, [1, block_n, 1, d], code),
                         (vt[..., :s_k], [1, 1, d, block_n], gl.float8e4nv), (out, [1, WG_ROWS, 1, d], odt)):
        # v_t past s_k (its padding, or a longer cache) is never read: the descriptor ends at s_k and TMA fills zeros
        layout = gl.NVMMASharedLayout.get_default_for(block, dt)
        descs.append(TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout))
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    s16 = 0
    if permute_k:
        # K as [16-key groups of every (batch, head), i, c, e, d]: a box of BLOCK_N / 16 groups lands key
        # 16g + 4c + 2i + e at smem row 16g + 8i + 2c + e
        kbh, pad = keys_by_head(k)
        b, h = kbh.shape[:2]
        block = [block_n // 16, 2, 4, 2, d]
        descs[1] = TensorDescriptor(kbh, [b * h * pad // 16, 2, 4, 2, d], [16 * d, 2 * d, 4 * d, d, 1], block,
                                    gl.NVMMASharedLayout.get_default_for(block, code))
        ksp = key_scales_permuted(ks, pad)  # the whole padded length: position x >= s_k may hold a key < s_k
        descs.insert(2, TensorDescriptor(ksp, list(ksp.shape), list(ksp.stride()), [1, 1, block_n], layout))
        s16 = pad // 16
    else:
        # the key scales [b, h_kv, s_k] (keys contiguous, rows 16-byte aligned): BLOCK_N fp32 per slot, with K
        ks_bh = ks.transpose(1, 2)
        descs.insert(2, TensorDescriptor(ks_bh, list(ks_bh.shape), list(ks_bh.stride()), [1, 1, block_n], layout))
    return descs, s16


def launch_args(qkv, out, lse, sm_scale, causal, block_n, stages, pingpong, persistent=False, sms=132,
                permute_k=False):
    """(kernel, grid, args, constexpr kwargs) of one launch (the key scales, and with permute_k K, laid out here)."""
    if stages < 2:
        raise ValueError(f"flash_fp8_fwd_gluon: stages must be >= 2 (got {stages}): S_j is issued before the slot of "
                         "tile j-1 is freed")
    q, k, vt = qkv.q, qkv.k, qkv.v_t
    q_lo = qkv.q_lo
    d = q.shape[-1]
    check_smem("flash_fp8_fwd_gluon", smem_bytes(d, block_n, stages, persistent, q_lo=q_lo is not None),
               f"BLOCK_N {block_n} x {stages} stages at d {d} (persistent {persistent}, q residual "
               f"{q_lo is not None})")
    kernel, gl = _build()
    b, s_q, h_q, _ = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    ks = qkv.k_scale if permute_k else key_scales_by_head(qkv.k_scale)
    (q_desc, k_desc, ks_desc, v_desc, o_desc), s16 = _descriptors(q, k, ks, vt, out, block_n, gl, permute_k)
    ql_desc = q_desc
    if q_lo is not None:
        ql_desc = type(q_desc)(q_lo, list(q_lo.shape), list(q_lo.stride()), q_desc.block_shape, q_desc.layout)
    n_m = -(-s_q // BLOCK_M)
    total = n_m * b * h_q
    if persistent:
        progs = sms // n_m * n_m if causal and n_m <= sms else sms
        progs = max(1, min(progs, total))
    else:
        progs = total
    qsc, vsc = qkv.q_scale, qkv.v_scale
    if vsc.stride(-1) != 1:  # the epilogue reads a head's channel scales at unit stride
        vsc = vsc.contiguous()
    # k_block: the key scales are constant over aligned blocks that hold whole key tiles, read once a tile (the
    # block's first key) from k_scale as given
    k_block = qkv.k_block
    kblk = bool(k_block) and k_block % block_n == 0 and qkv.qk_format == "fp8"
    ksc = qkv.k_scale
    args = (q_desc, ql_desc, k_desc, ks_desc, v_desc, o_desc, qsc, vsc, lse, ksc, s_q, s_k, h_kv, s16,
            sm_scale * LOG2E, qsc.stride(0), qsc.stride(1), qsc.stride(2), vsc.stride(0), vsc.stride(1),
            lse.stride(0), lse.stride(1), ksc.stride(0), ksc.stride(1), ksc.stride(2), h_q, h_q // h_kv, n_m, total,
            -(-total // progs))
    meta = dict(D=d, BLOCK_N=block_n, STAGES=stages, CAUSAL=bool(causal), PINGPONG=bool(pingpong),
                QBUF=2 if persistent else 1, INT8_QK=qkv.qk_format == "int8", P_CONVERT=P_CONVERT,
                PERMUTE_K=bool(permute_k), Q_LO=q_lo is not None, K_BLOCK=kblk,
                CONSUMER_REGS=CONSUMER_REGS,
                PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG)
    return kernel, (progs, ), args, meta


def flash_fp8_fwd_gluon(qkv, sm_scale, causal, block_n=128, stages=2, pingpong=True, persistent=False,
                        permute_k=False):
    """(out [b, s_q, h_q, d] contiguous in qkv.dtype, lse fp32 [b, h_q, s_q], natural log, without int8's smoothing
    shift); the caller checked fits(qkv) and available(). permute_k: K's rows loaded permuted within 16-key groups
    so that P needs no data movement into the P·V operand (keys_by_head copies K once unless it already is laid out
    [b, h_kv, s_pad16, d])."""
    q = qkv.q
    b, s_q, h_q, d = q.shape
    out = torch.empty((b, s_q, h_q, d), device=q.device, dtype=qkv.dtype)
    lse = torch.empty((b, h_q, s_q), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    if qkv.k.shape[1] == 0:  # no keys (a descriptor cannot have an empty dimension)
        lse.fill_(float("-inf"))
        return out.zero_(), lse
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if persistent else 0
    kernel, grid, args, meta = launch_args(qkv, out, lse, sm_scale, causal, block_n, stages, pingpong, persistent,
                                           sms, permute_k)
    kernel[grid](*args, **meta)
    return out, lse


# ------------------------------------------------------------------------------------ compile-only check
def compile_sm90(d=128, causal=True, block_n=128, stages=2, pingpong=True, persistent=False, h_q=4, h_kv=2,
                 qk_format="fp8", dtype="bfloat16", s=300, permute_k=False, arch=90, q_lo=False, k_block=0):
    """Compile the kernel for sm_<arch> without a GPU (ops/_gluon.py's stub target; nothing is launched). Returns
    compile_report's dict (PTX features, warps, shared memory, the compiled kernel) plus the wgmma types and counts."""
    import re
    from types import SimpleNamespace

    from .._gluon import compile_report

    b = 2
    code = torch.int8 if qk_format == "int8" else torch.float8_e4m3fn
    s_pad = s + (-s % 16)  # fp8_quantize.padded_tokens
    qkv = SimpleNamespace(qk_format=qk_format, q=torch.empty(b, s, h_q, d, dtype=code), q_scale=torch.empty(b, s, h_q),
                          k=torch.empty(b, s, h_kv, d, dtype=code), k_scale=torch.empty(b, s, h_kv),
                          v_t=torch.empty(b, h_kv, d, s_pad, dtype=torch.float8_e4m3fn),
                          v_scale=torch.empty(b, h_kv, d), dtype=getattr(torch, dtype),
                          q_lo=torch.empty(b, s, h_q, d, dtype=code) if q_lo else None, k_block=k_block)
    out = torch.empty(b, s, h_q, d, dtype=qkv.dtype)
    lse = torch.empty(b, h_q, s)
    kernel, grid, args, meta = launch_args(qkv, out, lse, d ** -0.5, causal, block_n, stages, pingpong,
                                           persistent, permute_k=permute_k)
    report = compile_report(kernel, args, grid, meta, arch)
    ptx = report["kernel"].asm.get("ptx", "")
    wg = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+)\.(\w+)\.(\w+)\.(\w+)", ptx)
    report["wgmma_types"] = sorted(set(".".join(x) for x in wg))
    report["wgmma_count"] = len(re.findall(r"wgmma\.mma_async", ptx))
    report["wgmma_reg_a"] = len(re.findall(r"wgmma\.mma_async[^;]*\}, \{", ptx))
    return report


def sass(kern) -> str:
    """The SASS of a compiled kernel (cuobjdump from Triton's wheel), for QGMMA / IGMMA and shuffle counts."""
    import os
    import subprocess
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kern.asm["cubin"])
        res = subprocess.run([tool, "-sass", path], capture_output=True, text=True)
    return res.stdout + res.stderr
