"""Sweep linear_cross_entropy's chunk size on this GPU, for ops/linear_ce/configs.py's LINEAR_CE table.

    warpforge tune lce [--rows 16384] [--width 768] [--vocab 50304] [--out tune_lce.json]

Times forward + backward (the op computes both gradients in its forward, a chunk of rows at a time) with
do_bench, and the peak memory of one call, for chunks of 2^25 ... 2^30 logits; gpt2-124m's shape by default.
"""
import argparse

import torch
import triton.testing

import warpforge as wf
from warpforge.bench.report import write_json
from warpforge.ops.linear_ce import api, configs


def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune lce")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    hidden = torch.randn(args.rows, args.width, device=dev, dtype=torch.bfloat16, requires_grad=True)
    weight = (0.02 * torch.randn(args.vocab, args.width, device=dev, dtype=torch.bfloat16)).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.rows,), device=dev)
    flops = 3 * 2 * args.rows * args.width * args.vocab
    results = []
    saved = configs.LINEAR_CE
    for log2 in range(25, 31):
        configs.LINEAR_CE = saved.map(lambda c: c._replace(chunk_elements=1 << log2))

        def step():
            hidden.grad = weight.grad = None
            wf.linear_cross_entropy(hidden, weight, targets).backward()
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak_gb = (torch.cuda.max_memory_allocated() - base) / 1e9
        ms = triton.testing.do_bench(step, rep=100, return_mode="median")
        rows = api.ce_chunk_rows(args.rows, args.vocab, 1 << log2)
        print(f"chunk 2^{log2} ({rows} rows): {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s, peak +{peak_gb:.2f} GB",
              flush=True)
        results.append(dict(chunk_elements=1 << log2, chunk_rows=rows, ms=ms, peak_gb=peak_gb))
    configs.LINEAR_CE = saved
    if args.out:
        write_json(results, args.out)


if __name__ == "__main__":
    main()
