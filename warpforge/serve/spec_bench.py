"""Speculative decoding's speedup at batch 1, greedy: the same prompt decoded plainly and with a drafter (prompt
lookup, or a draft model's checkpoint), in one process, tokens/s of each (the median of --repeats timed runs, plain and
speculative alternating), the acceptance rate of the timed runs, and whether every output is token-identical (they
must be: speculation is lossless).

    python -m warpforge.serve.spec_bench --model DIR --speculative ngram|DRAFT_DIR [--prompt TEXT] [--tokens 256]
        [--k 4] [--repeats 3]

A target and draft that can be made here (issue 19): a gpt2-124m-shaped GPT trained on the Shakespeare data as target
and the tiny preset as draft (`warpforge gpt train` writes both as checkpoint directories); for prompt lookup, a prompt
that repeats itself.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from .bench import report
from .llm import LLM
from .sampling import SamplingParams

REPEATING = ("ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. " * 6)


def _timed(llm, prompt, tokens, device):
    """(output, seconds) of one greedy generation of `tokens` tokens."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
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
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each, alternating plain and speculative; the medians are reported")
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if a.repeats < 1:
        p.error(f"--repeats: expected at least 1, got {a.repeats}")
    # both engines live at once and their timed runs alternate: a clock or thermal drift during the run then
    # moves both medians alike (the plain rate moved +-10% between runs of one session on the H200)
    plain = LLM(a.model, device=device)
    spec = LLM(a.model, device=device, speculative=a.speculative, num_speculative_tokens=a.k)
    warm = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for llm in (plain, spec):
        llm.generate(a.prompt, warm)  # graph captures, compiles
    spec.metrics.drafted = spec.metrics.accepted = 0  # the acceptance of the timed runs only
    base_s, fast_s, outputs = [], [], set()
    for _ in range(a.repeats):
        base, t = _timed(plain, a.prompt, a.tokens, device)
        base_s.append(t)
        fast, t = _timed(spec, a.prompt, a.tokens, device)
        fast_s.append(t)
        outputs |= {tuple(base.token_ids), tuple(fast.token_ids)}
    base_t, fast_t = statistics.median(base_s), statistics.median(fast_s)
    out = {"model": str(a.model), "speculative": str(a.speculative), "k": a.k, "tokens": len(fast.token_ids),
           "repeats": a.repeats, "plain_tok_s": len(base.token_ids) / base_t,
           "speculative_tok_s": len(fast.token_ids) / fast_t,
           "speedup": base_t / fast_t * len(fast.token_ids) / max(len(base.token_ids), 1),
           "speedup_runs": [b / f for b, f in zip(base_s, fast_s)],
           "acceptance_rate": spec.metrics.acceptance_rate, "identical": len(outputs) == 1,
           "device": str(device)}
    return report(out, a.json)


if __name__ == "__main__":
    main()
