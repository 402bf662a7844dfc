"""Speculative decoding's speedup at batch 1, greedy: the same prompt decoded plainly and with a drafter (prompt
lookup, or a draft model's checkpoint), in one process, tokens/s of each, the acceptance rate, and whether the two
outputs are token-identical (they must be: speculation is lossless).

    python -m warpforge.serve.spec_bench --model DIR --speculative ngram|DRAFT_DIR [--prompt TEXT] [--tokens 256]

A target and draft that can be made here (issue 19): a gpt2-124m-shaped GPT trained on the Shakespeare data as target
and the tiny preset as draft (`warpforge gpt train` writes both as checkpoint directories); for prompt lookup, a prompt
that repeats itself.
"""
from __future__ import annotations

import argparse
import time

import torch

from .bench import report
from .llm import LLM
from .sampling import SamplingParams

REPEATING = ("ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. " * 6)


def _timed(llm, prompt, tokens, device):
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))  # warm-up: graph captures
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m warpforge.serve.spec_bench")
    p.add_argument("--model", required=True)
    p.add_argument("--speculative", required=True, help="'ngram' or a draft model's checkpoint directory")
    p.add_argument("--k", type=int, default=4, help="tokens drafted a step")
    p.add_argument("--prompt", default=REPEATING)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    plain = LLM(a.model, device=device)
    base, base_s = _timed(plain, a.prompt, a.tokens, device)
    del plain
    spec = LLM(a.model, device=device, speculative=a.speculative, num_speculative_tokens=a.k)
    fast, fast_s = _timed(spec, a.prompt, a.tokens, device)
    out = {"model": str(a.model), "speculative": str(a.speculative), "k": a.k, "tokens": len(fast.token_ids),
           "plain_tok_s": len(base.token_ids) / base_s, "speculative_tok_s": len(fast.token_ids) / fast_s,
           "speedup": base_s / fast_s * len(fast.token_ids) / max(len(base.token_ids), 1),
           "acceptance_rate": spec.metrics.acceptance_rate, "identical": base.token_ids == fast.token_ids,
           "device": str(device)}
    return report(out, a.json)


if __name__ == "__main__":
    main()
