"""Gluon helpers for the Hopper kernels that decode low-precision codes in registers (paged decode, MLA decode of
few rows): e4m3 codes to fp16 by integer shifts and masks instead of conversion instructions.

Why: Hopper runs conversion instructions at a fraction of the integer pipes' rate (Triton replaced its s8 -> bf16
cvt by bit operations for that reason: triton-lang/triton#4563), and a decode kernel that converts every cache byte
in registers is bound by them (benchmarks/NOTES.md, session 21). An e4m3 code s|eeee|mmm placed as s|0eeee|mmm0000000
in 16 bits is an fp16 worth the code's value times 2^-8, subnormals included (fp16's exponent bias is 8 more than
e4m3's); the 2^8 goes into a scale the caller applies anyway. A 32-bit word of four codes becomes two f16x2 words
with four shifts and four masks (bytes 0 and 2 in one word, bytes 1 and 3 in the other), so the decoded columns come
out in the order 0, 2, 1, 3 of each word (perm_e4m3): the callers relabel q's and the output's columns to match, as
they already do for their MMA fragments. The e4m3 NaN code decodes to a finite value (the kernels zero-fill what
they must not read).

Built lazily (`build()`): Gluon is imported on first use only.
"""
from __future__ import annotations

import functools

E4M3_F16_SCALE = 256.0   # an e4m3 code's value over its decoded fp16's


def perm_e4m3(c: int) -> int:
    """The cache column (within its word of four) that decoded column c holds: bits 0 and 1 swapped."""
    return (c & ~3) | ((c & 1) << 1) | ((c >> 1) & 1)


@functools.lru_cache(maxsize=None)
def build():
    """(e4m3_words_to_f16, perm_e4m3 as a Gluon function)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def e4m3_words_to_f16(w):
        """[a, b, n] uint32 words of four e4m3 codes (byte i: column 4j + i) -> [a, b, 4n] fp16 worth value · 2^-8,
        decoded column 4j + t holding column 4j + perm_e4m3(t); each pair of decoded columns (t = 0, 1 and 2, 3) is
        one of the two f16x2 words, so no register is repacked."""
        even = ((w << 8) & 0x80008000) | ((w << 7) & 0x3F803F80)   # bytes 0 (low half) and 2 (high half)
        odd = (w & 0x80008000) | ((w >> 1) & 0x3F803F80)          # bytes 1 and 3
        # the last joined dim is the innermost register: the low and high halves of one word side by side, so
        # [..., n, word, half] flattens to decoded column 4j + 2 · word + half
        x = gl.join(gl.join((even & 0xFFFF).to(gl.uint16), (odd & 0xFFFF).to(gl.uint16)),
                    gl.join((even >> 16).to(gl.uint16), (odd >> 16).to(gl.uint16)))
        x = x.to(gl.float16, bitcast=True)
        return gl.reshape(x, [w.shape[0], w.shape[1], 4 * w.shape[2]])

    @gluon.jit
    def perm_e4m3_gl(c):
        """perm_e4m3 on a tensor of columns."""
        return (c & ~3) | ((c & 1) << 1) | ((c >> 1) & 1)

    return e4m3_words_to_f16, perm_e4m3_gl
