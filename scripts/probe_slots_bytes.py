"""Where append_kv_slots' compiled bytes differ from the torch reference writer's (the GPU-only failure of
tests/paged/test_paged_slots.py::test_gpu_slots_bytes_equal_the_reference, benchmarks/NOTES.md session 20): for
each differing fp8 byte, the token value, the fp32 quotient, its float64 quotient and both encodings.

    python scripts/probe_slots_bytes.py [--fmt fp8] [--d 128]
"""
import argparse

import torch

import warpforge as wf


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="fp8")
    ap.add_argument("--d", type=int, default=128)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    page, h_kv, pages, n, d = 16, 8, 700, 8192, args.d
    kv = wf.paged.KV_FORMATS[args.fmt]
    kc = torch.full((pages, page, h_kv, kv.width(d)), 0x7F, device="cuda", dtype=torch.uint8).view(kv.storage)
    ref = kc.clone()
    k = torch.randn(n, h_kv, d, device="cuda", dtype=torch.bfloat16) * 3
    slots = torch.randperm(pages * page, device="cuda")[:n]
    scale = torch.full((1,), 0.03, device="cuda")
    wf.paged.append_kv_slots(kc, kc.clone(), k, k, slots, kv_format=args.fmt, k_scale=scale, v_scale=scale)
    wf.paged.append_kv_slots(ref, ref.clone(), k, k, slots, kv_format=args.fmt, k_scale=scale, v_scale=scale,
                             backend="reference")
    got, want = kc.view(torch.uint8).flatten(0, 1)[slots], ref.view(torch.uint8).flatten(0, 1)[slots]
    bad = (got != want).nonzero().tolist()
    print(f"{args.fmt} d {d}: {len(bad)} bytes differ")
    for t, h, c in bad[:12]:
        x = k[t, h].float()
        if args.fmt == "fp8":
            x32 = (x[c] / scale[0]).item()
            x64 = (x[c].double() / scale[0].double()).item()
            print(f"  token {t} head {h} col {c}: x {x[c].item()!r} x/s fp32 {x32!r} fp64 {x64!r} "
                  f"kernel {got[t, h, c].view(torch.float8_e4m3fn).float().item()} "
                  f"reference {want[t, h, c].view(torch.float8_e4m3fn).float().item()} "
                  f"torch cast {torch.tensor(x32, device='cuda').to(torch.float8_e4m3fn).float().item()} "
                  f"cpu cast {torch.tensor(x32).to(torch.float8_e4m3fn).float().item()}")
        else:
            print(f"  token {t} head {h} byte {c}: kernel {got[t, h, c].item():#04x} "
                  f"reference {want[t, h, c].item():#04x}")


if __name__ == "__main__":
    main()
