"""Does a decode step of s_q tokens compute each token's row as a step of one token does, bit for bit? Speculative
verification (s_q = k + 1) is lossless only as far as it does: a near-tie in the target's logits can otherwise flip
between plain and speculative greedy decoding (seen twice in some 30 H200 runs, session 13). This times nothing; it
prints, per part of a decode step, the largest difference between row 0 computed among m rows and alone.

    PYTHONPATH=$PWD python3 scripts/row_invariance.py [--device cuda]

Parts: the linear layers (F.linear, cuBLAS picks kernels by row count), the same with the rows padded to 16 (one
kernel for every m <= 16: the fix if the linears differ), and paged_decode at s_q 1 vs s_q m (the newest token's
row, causal among the step's tokens).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from warpforge.ops import paged

SHAPES = {"gpt2-124m qkv": (768, 2304), "gpt2-124m mlp": (768, 3072), "gpt2-124m head (bytes)": (768, 256),
          "llama3-8b qkv": (4096, 6144), "llama3-8b down": (14336, 4096), "llama3-8b head": (4096, 128256)}


def linears(device, rows=(2, 5, 7, 9, 16)):
    for name, (k, n) in SHAPES.items():
        if device == "cpu" and "llama" in name:  # a syntax run off the GPU
            continue
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5
        x = torch.randn(16, k, device=device, dtype=torch.bfloat16)
        alone = F.linear(x[:1], w)

        def padded(m):  # m rows and 16 - m zero rows: one kernel whatever m
            return F.linear(torch.cat([x[:m], torch.zeros_like(x[m:])]), w)[:1]
        for m in rows:
            got = F.linear(x[:m], w)[:1]
            print(f"linear {name:24s} m {m:2d}: max |row0(m) - row0(1)| {float((got - alone).abs().max()):.3e}"
                  f"   padded to 16: {float((padded(m) - padded(1)).abs().max()):.1e}")


def attention(device, rows=(2, 5, 7, 9)):
    """The step's last token: alone (s_q 1, the cache holding it) vs as the last of m (s_q m, causal)."""
    b, h_q, h_kv, d, page, length = 1, 12, 12, 64, 16, 700
    pages = -(-length // page)
    k = torch.randn(pages, page, h_kv, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.arange(pages, device=device, dtype=torch.int32)[None]
    lens = torch.tensor([length], device=device, dtype=torch.int32)
    q = torch.randn(b, 16, h_q, d, device=device, dtype=torch.bfloat16)
    for m in rows:
        step = paged.paged_decode(q[:, 16 - m:], k, v, table, lens)[:, -1]
        alone = paged.paged_decode(q[:, 15:], k, v, table, lens)[:, -1]
        print(f"paged_decode h {h_q}/{h_kv} d {d} L {length} s_q {m:2d}: max |last row(m) - alone| "
              f"{float((step - alone).abs().max()):.3e}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    torch.manual_seed(0)
    linears(a.device)
    attention(a.device)


if __name__ == "__main__":
    main()
