"""Where speculative decoding loses its acceptance or its identity with plain decoding: one target and draft,
decoded greedily every way the engine can (plain with and without CUDA graphs; the draft model through the chain,
step by step on graphs, and eagerly; the target as its own draft), each against plain graph decoding.

    python scripts/spec_diag.py --model TARGET_DIR --draft DRAFT_DIR [--k 4,6] [--json OUT]

A drafter bug lowers the acceptance but not the identity (verification is lossless); a verification bug, or numerics
that differ between a step of 1 token and one of k + 1, breaks the identity. The target drafting for itself must
accept (nearly) every draft.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from warpforge.serve import draft_chain
from warpforge.serve.llm import LLM
from warpforge.serve.sampling import SamplingParams
from warpforge.serve.spec_bench import REPEATING


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _run(name, want, tokens, **kw):
    llm = LLM(kw.pop("model"), **kw)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(REPEATING, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    _sync()
    t = time.perf_counter()
    got = llm.generate(REPEATING, params)[0].token_ids
    _sync()
    row = {"name": name, "tok_s": len(got) / (time.perf_counter() - t),
           "acceptance": llm.metrics.acceptance_rate, "drafted": llm.metrics.drafted}
    if want is not None:
        diff = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        row.update(identical=got == want, first_diff=diff[0] if diff else None, n_diff=len(diff))
    print(json.dumps(row), flush=True)
    return got, row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--k", default="4,6")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    want, r = _run("plain graphs", None, a.tokens, model=a.model)
    rows.append(r)
    rows.append(_run("plain eager", want, a.tokens, model=a.model, cuda_graphs=False)[1])
    for k in map(int, a.k.split(",")):
        spec = dict(model=a.model, speculative=a.draft, num_speculative_tokens=k)
        rows.append(_run(f"draft chain k{k}", want, a.tokens, **spec)[1])
        rows.append(_run(f"draft eager k{k}", want, a.tokens, cuda_graphs=False, **spec)[1])
        usable = draft_chain.DraftChain.__init__

        def no_chain(self, *args, **kw):
            usable(self, *args, **kw)
            self.usable = False
        draft_chain.DraftChain.__init__ = no_chain
        try:
            rows.append(_run(f"draft steps on graphs k{k}", want, a.tokens, **spec)[1])
        finally:
            draft_chain.DraftChain.__init__ = usable
        rows.append(_run(f"self-draft chain k{k}", want, a.tokens, model=a.model, speculative=a.model,
                         num_speculative_tokens=k)[1])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
