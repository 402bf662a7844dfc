"""Low-precision block formats in plain PyTorch: what the kernels' caches and weights hold, written to be read.

- FP4 (e2m1) values 0, 0.5, 1, 1.5, 2, 3, 4, 6 with a sign bit, two per byte (low nibble = even element), one
  scale per block of values: NVFP4 blocks of 16 with an e4m3 scale times one fp32 tensor scale, MXFP4 blocks of
  32 with an e8m0 (power-of-two) scale.
- FP8 (e4m3) values with a power-of-two fp32 scale per block, so that dequantising is an exact exponent shift.
The families (mla, paged) lay these out in their own cache rows; the kernels decode them with
ops/shared_kernels.py.
"""
from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_GROUP = {"nvfp4": 16, "mxfp4": 32}
E4M3_MAX, E2M1_MAX = 448.0, 6.0


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """A tensor-wide fp32 scale for NVFP4 that maps amax to the largest e2m1 (6) times the largest e4m3 (448)."""
    return (x.float().abs().amax() / (E2M1_MAX * E4M3_MAX)).clamp(min=1e-30).reshape(())


_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # the rounding boundaries between E2M1's magnitudes
_TABLES: dict[tuple[tuple, torch.device], torch.Tensor] = {}


def _table(values: tuple, device: torch.device) -> torch.Tensor:
    """values as an fp32 tensor on device, made once per device: torch.tensor(list, device=cuda) is a host-to-device
    copy, which a CUDA-graph capture (an FP4 append_kv in a captured step) refuses; the first call comes outside it."""
    key = (values, device)
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return table


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (sign in bit 3) of each value of x (already scaled into [-6, 6])."""
    mag = (x.abs()[..., None] > _table(_E2M1_MIDS, x.device)).sum(-1)
    return (mag | ((x < 0).long() << 3)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    table = _table(E2M1, codes.device)
    vals = table[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -vals, vals)


def _block_error(blocks: torch.Tensor, eff: torch.Tensor, unit=1.0) -> torch.Tensor:
    """Squared error of each block [..., blocks, group] rounded to e2m1 under block scales eff [..., blocks, 1], in
    units of `unit` (a power of two: the same choices, without the square overflowing fp32 near its largest
    values); inf where a dequantised value overflows fp32."""
    deq = e2m1_values(e2m1_codes((blocks / eff).clamp(-6, 6))) * eff
    return ((deq - blocks) / unit).square().sum(-1, keepdim=True)


def quantize_fp4(x: torch.Tensor, fmt: str, tensor_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (n a multiple of the block) -> (packed codes uint8 [..., n/2], scale bytes uint8 [..., n/block]).
    nvfp4 needs the fp32 tensor scale (see nvfp4_tensor_scale)."""
    group = FP4_GROUP[fmt]
    blocks = x.float().unflatten(-1, (x.shape[-1] // group, group))
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    if fmt == "nvfp4":  # of amax / 6's e4m3 scale and the e4m3 either side of it, the smallest block error
        # (about 18% less squared error than amax / 6 alone on Gaussian values: benchmarks/NOTES.md, session 20)
        ts = torch.as_tensor(tensor_scale, dtype=torch.float32, device=x.device)
        base = (amax / E2M1_MAX / ts).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8).long()

        def eff_of(code):
            return (code.to(torch.uint8).view(torch.float8_e4m3fn).float() * ts).clamp(min=1e-30)
        code, err = base, _block_error(blocks, eff_of(base))
        for step in (-1, 1):   # taken only if strictly better (ties keep the earlier), as the append kernels
            cand = (base + step).clamp(0, 126)
            cand_err = _block_error(blocks, eff_of(cand))
            take = cand_err < err
            code, err = torch.where(take, cand, code), torch.where(take, cand_err, err)
        scale_bytes = code.squeeze(-1).to(torch.uint8)
        eff = scale_bytes.unsqueeze(-1).view(torch.float8_e4m3fn).float() * ts
    else:  # mxfp4: of the two powers of two around amax / 6, the one with the smaller block error
        hi = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-126, 127)
        # errors in units of 2^hi: near fp32's largest values 2^hi's 4 or 6 overflows (inf error: 2^(hi - 1) taken)
        p_hi = torch.exp2(hi)
        take_lo = _block_error(blocks, torch.exp2(hi - 1), p_hi) < _block_error(blocks, p_hi, p_hi)
        exp = torch.where(take_lo, hi - 1, hi)
        eff = torch.exp2(exp)
        scale_bytes = (exp.squeeze(-1) + 127).to(torch.uint8)
    codes = e2m1_codes((blocks / eff.clamp(min=1e-30)).clamp(-6, 6)).flatten(-2)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale_bytes


def dequantize_fp4(packed: torch.Tensor, scale_bytes: torch.Tensor, fmt: str, tensor_scale=None) -> torch.Tensor:
    """The inverse of quantize_fp4, in float32: [..., n]."""
    vals = e2m1_values(torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2))
    scale_bytes = scale_bytes.contiguous()
    if fmt == "nvfp4":
        scale = scale_bytes.view(torch.float8_e4m3fn).float() * torch.as_tensor(
            tensor_scale, dtype=torch.float32, device=packed.device)
    else:
        scale = torch.exp2(scale_bytes.float() - 127)
    return (vals.unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]).flatten(-2)


def quantize_fp8_pow2(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (e4m3 codes [..., n], fp32 power-of-two scales [..., n / block])."""
    blocks = x.float().unflatten(-1, (x.shape[-1] // block, block))
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    codes = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).flatten(-2)
    return codes, scale.squeeze(-1)
