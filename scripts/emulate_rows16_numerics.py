"""CPU emulation of two numerical choices in the h_q <= 16 FP8 MLA kernel (ops/mla/decode_rows16_gluon_kernel.py;
benchmarks/NOTES.md, session 22), on Gaussian data and FP8 caches as quantize_kv makes them (power-of-two scales per
128 values):
- q as 1 / 2 / 3 e4m3 terms (each the last one's rounding error x 16): 1 - cos of the output and the lse's relative
  error against exact q;
- P to fp16 times the raw chunk scale (the kernel on main) or times scale / the chunk's maximum scale x 2^8 (branch
  s22-rows16-pscale), at latent magnitudes 1, 1e-2, 1e-3, 1e2: 1 - cos and relative L2 of P·V alone.
    python scripts/emulate_rows16_numerics.py
"""
import torch


def e4m3(x):
    return x.to(torch.float8_e4m3fn).float()


def quantized_latent(n, mag):
    lat = torch.randn(n, 512) * mag
    sc = torch.exp2(torch.ceil(torch.log2(lat.view(n, 4, 128).abs().amax(-1) / 448)))   # [n, 4]
    codes = e4m3(lat.view(n, 4, 128) / sc[:, :, None])
    return codes, sc


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), 0).item()


def q_terms(L=4096, H=16):
    codes, sc = quantized_latent(L, 1.0)
    kv = torch.cat([(codes * sc[:, :, None]).view(L, 512), torch.randn(L, 64).bfloat16().float()], 1)
    q = torch.randn(H, 576).bfloat16().float()
    s_ref = q @ kv.T / 24
    ref = torch.softmax(s_ref, -1) @ kv[:, :512]
    for terms in (1, 2, 3):
        a = q[:, :512].abs().amax(1, keepdim=True) / 448
        x, tot = q[:, :512] / a, torch.zeros(H, 512)
        for j in range(terms):
            t = e4m3(x)
            tot, x = tot + t * 16.0 ** -j, (x - t) * 16
        s = torch.cat([tot * a, q[:, 512:]], 1) @ kv.T / 24
        out = torch.softmax(s, -1) @ kv[:, :512]
        lse_rel = ((torch.logsumexp(s, -1) - torch.logsumexp(s_ref, -1)).abs()
                   / torch.logsumexp(s_ref, -1).abs().clamp(min=1)).max().item()
        print(f"q as {terms} e4m3 term(s), L {L}: 1 - cos {1 - cos(out, ref):.1e}, lse rel {lse_rel:.1e}")


def p_scale(L=32768, H=16):
    for mag in (1.0, 1e-2, 1e-3, 1e2):
        codes, sc = quantized_latent(L, mag)
        v = (codes * sc[:, :, None]).view(L, 512)
        s = torch.randn(H, L) * 0.5
        p = torch.exp(s - s.max(1, keepdim=True).values)   # the kernel's P: at most 1
        ref = (p @ v) / p.sum(1, keepdim=True)

        def pv(pc, back):   # pc [H, L, 4]: P x a factor, rounded to fp16; the codes exact in fp16
            o = torch.einsum("hlc,lcd->hcd", pc.double(), codes.double()).reshape(H, 512).float()
            return o * back / p.sum(1, keepdim=True)
        r = sc.amax(0)
        old = pv((p[:, :, None] * sc[None]).half().float(), 1.0)
        new = pv((p[:, :, None] * (sc / r)[None] * 256).half().float(), (r / 256).repeat_interleave(128)[None])
        for name, o in (("raw scale", old), ("scale / max x 2^8", new)):
            print(f"P x {name}, magnitude {mag:g}, L {L}: 1 - cos {1 - cos(o, ref):.1e}, "
                  f"rel L2 {((o - ref).norm() / ref.norm()).item():.1e}")


if __name__ == "__main__":
    torch.manual_seed(0)
    q_terms()
    p_scale()
