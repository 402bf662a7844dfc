"""Speculative decoding is lossless: greedy outputs identical to plain greedy decoding (prompt lookup, a draft model
equal to the target, a smaller draft model), and rejection sampling follows the target's distribution."""
from __future__ import annotations

import pytest
import torch

from warpforge.serve import LLM, SamplingParams
from warpforge.serve import speculative

from conftest import PROMPTS, paged_plan_calls

# prompts that repeat themselves, so that prompt lookup finds n-grams to draft from
REPEATS = ["the quick brown fox the quick brown fox the quick", "hello world, hello world, hello",
           PROMPTS[2], "a b a b a b a b"]


def _greedy(folder, **kw):
    llm = LLM(folder, page_size=8, num_pages=96, max_num_batched_tokens=24, **kw)
    ids = [llm.tokenizer.encode(p) for p in REPEATS]
    outs = llm.generate(ids, SamplingParams(max_tokens=14, temperature=0))
    assert llm.cache.allocator.pages_in_use == 0 and llm.cache.allocator.check_no_leaks()
    return [o.token_ids for o in outs], llm


@pytest.fixture(scope="module")
def plain(llama_dir):
    return _greedy(llama_dir)[0]


def test_ngram_greedy_is_plain_greedy(llama_dir, plain):
    got, llm = _greedy(llama_dir, speculative="ngram", num_speculative_tokens=3)
    assert got == plain
    assert llm.metrics.drafted > 0 and llm.metrics.accepted > 0  # it did speculate, and some drafts held


def test_draft_model_equal_to_target_accepts_everything(llama_dir, plain):
    got, llm = _greedy(llama_dir, speculative=str(llama_dir), num_speculative_tokens=4)
    assert got == plain
    assert llm.metrics.drafted > 0 and llm.metrics.acceptance_rate == 1.0
    drafter = llm.engine.drafter
    assert drafter.cache.allocator.pages_in_use == 0 and drafter.cache.allocator.check_no_leaks()


def test_smaller_draft_model_greedy_is_plain_greedy(llama_dir, small_llama_dir, plain):
    got, llm = _greedy(llama_dir, speculative=str(small_llama_dir), num_speculative_tokens=3)
    assert got == plain
    assert llm.metrics.drafted > 0
    assert llm.metrics.acceptance_rate < 1.0  # a different model: some drafts were rejected and rolled back


def test_fifteen_drafts_verify_through_paged_decode(llama_dir, plain, monkeypatch):
    """k up to 15 drafts: verification steps of s_q = k + 1 <= 16 attend through paged_decode (causal among the
    new tokens), still lossless."""
    from warpforge.ops import paged
    seen = paged_plan_calls(monkeypatch)
    got, llm = _greedy(llama_dir, speculative=str(llama_dir), num_speculative_tokens=15)
    assert got == plain
    assert llm.metrics.drafted > 0 and llm.metrics.acceptance_rate == 1.0
    assert max(seen) > 8  # verification steps of more than 8 new tokens went the paged way
    assert max(seen) <= paged.MAX_S_Q == 16


def _markov(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, vocab, generator=g) * 1.5  # logits of the next token given the last one


def _chi2_tv(counts: torch.Tensor, p: torch.Tensor):
    n = counts.sum()
    expected = p * n
    keep = expected > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return chi2, 0.5 * float((counts / n - p).abs().sum())


@pytest.mark.parametrize("drafter", ["model", "deterministic"])
def test_rejection_sampling_follows_the_target(drafter):
    """A Markov chain over 6 tokens as the target and another as the drafter: the first two tokens emitted by
    speculative rounds (k = 3) must be distributed as the target's chain says: chi-square and total variation
    against the exact joint distribution, fixed seeds."""
    vocab, k, n = 6, 3, 12000
    target, draft = _markov(vocab, 0), _markov(vocab, 1)
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=2)
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(vocab * vocab)
    start = 2
    for _ in range(n):
        seq = [start]
        while len(seq) < 3:
            drafts, qs, last = [], [], seq[-1]
            for _ in range(k):
                if drafter == "model":
                    q = speculative.sampling.probs(draft[last], params)
                    tok = int(torch.multinomial(q, 1, generator=gen))
                    qs.append(q)
                else:  # prompt lookup: always proposes (last + 1) % vocab
                    tok = (last + 1) % vocab
                drafts.append(tok)
                last = tok
            logits = torch.stack([target[t] for t in [seq[-1]] + drafts])
            emitted = speculative.verify(logits, drafts, torch.stack(qs) if qs else None, params, gen)
            assert all(a == b for a, b in zip(emitted[:-1], drafts))  # accepted drafts are a prefix
            seq.extend(emitted)
        counts[seq[1] * vocab + seq[2]] += 1
    p1 = speculative.sampling.probs(target[start], params)
    p2 = speculative.sampling.probs(target, params)  # row t: next-token distribution after t
    exact = (p1[:, None] * p2).reshape(-1)
    chi2, tv = _chi2_tv(counts, exact)
    dof = int((exact > 0).sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)  # far beyond chance for a wrong distribution
    assert tv < 0.03


def test_verify_greedy_takes_the_longest_matching_prefix():
    logits = torch.full((4, 5), -1.0)
    for row, best in enumerate([2, 3, 0, 4]):
        logits[row, best] = 1.0
    greedy = SamplingParams(temperature=0)
    assert speculative.verify(logits, [2, 3, 1], None, greedy, None) == [2, 3, 0]  # 1 rejected: the target's 0
    assert speculative.verify(logits, [2, 3, 0], None, greedy, None) == [2, 3, 0, 4]  # all kept + bonus
    assert speculative.verify(logits, [1, 3, 0], None, greedy, None) == [2]


def test_ngram_lookup_proposes_what_followed():
    d = speculative.NgramDrafter(max_ngram=3)
    assert d.lookup([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]
    assert d.lookup([1, 2, 3], 2) == []
    assert d.lookup([4, 1, 4], 4) == [1, 4]


@pytest.mark.parametrize("which", ["ngram", "draft"])
def test_sampling_with_speculation_runs_and_frees(llama_dir, small_llama_dir, which):
    spec = "ngram" if which == "ngram" else str(small_llama_dir)
    llm = LLM(llama_dir, page_size=8, num_pages=96, speculative=spec, num_speculative_tokens=3)
    params = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.95, seed=3, ignore_eos=True)
    outs = llm.generate(REPEATS, params)
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)
    again = llm.generate(REPEATS, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # seeded: reproducible
    assert llm.metrics.drafted > 0 and 0.0 <= llm.metrics.acceptance_rate <= 1.0
    assert llm.cache.allocator.pages_in_use == 0 and llm.cache.allocator.check_no_leaks()


def test_drafts_dropped_for_want_of_pages_roll_the_drafter_back(llama_dir, small_llama_dir, plain, monkeypatch):
    """When the target cannot reserve pages for a request's drafts the engine drops them; the draft model's cache
    (which holds them already) must be rolled back too, or the next round feeds it nothing."""
    from warpforge.serve.engine import Engine
    reserve, dropped = Engine._reserve, []

    def stingy(self, r, tokens, protect):  # every third round of drafts finds no room
        if tokens > r.num_computed + 1 and len(r.tokens) % 3 == 0:
            dropped.append(r.id)
            return False
        return reserve(self, r, tokens, protect)
    monkeypatch.setattr(Engine, "_reserve", stingy)
    got, llm = _greedy(llama_dir, speculative=str(small_llama_dir), num_speculative_tokens=3)
    assert dropped and got == plain
    drafter = llm.engine.drafter
    assert drafter.cache.allocator.pages_in_use == 0 and drafter.cache.allocator.check_no_leaks()


def test_draft_model_ahead_of_the_request_refeeds_its_pending_token(llama_dir):
    llm = LLM(llama_dir, page_size=8, num_pages=16, speculative=str(llama_dir), num_speculative_tokens=2)
    drafter = llm.engine.drafter

    class R:
        id, tokens = "r", [5, 6, 7, 8]
        params = SamplingParams(temperature=0)
        generator = None
    r = R()
    first = drafter.propose([r], [2])[0][0]
    assert len(first) == 2 and drafter.fed["r"] == 5  # the 4 tokens and the first draft
    again = drafter.propose([r], [2])[0][0]  # the request never took them: fed (5) is past its 4 tokens
    assert again == first and drafter.fed["r"] == 5


@pytest.mark.parametrize("k", [1, 3, 4])
def test_draft_chain_gives_the_step_by_step_drafts(llama_dir, small_llama_dir, plain, k):
    """A greedy round's k draft steps as one chain (draft_chain.py; run eagerly here, replayed from one CUDA graph
    on a GPU) propose what the step-by-step loop proposes: same output, same acceptance, and the chain did run."""
    from warpforge.serve.cuda_graphs import DecodeGraphs
    from warpforge.serve.draft_chain import DraftChain
    _, stepwise = _greedy(llama_dir, speculative=str(small_llama_dir), num_speculative_tokens=k)
    llm = LLM(llama_dir, page_size=8, num_pages=96, max_num_batched_tokens=24, speculative=str(small_llama_dir),
              num_speculative_tokens=k)
    d = llm.engine.drafter
    chain = DraftChain(d.model, d.cache, DecodeGraphs(d.model, d.cache, 4, 12), k, llm.spec.vocab_size,
                       capture=False)
    rounds = []
    real = chain.run
    chain.run = lambda works, alloc: rounds.append(len(works)) or real(works, alloc)
    d.chain = chain
    outs = llm.generate([llm.tokenizer.encode(p) for p in REPEATS], SamplingParams(max_tokens=14, temperature=0))
    assert [o.token_ids for o in outs] == plain
    assert rounds and max(rounds) > 1  # batched rounds went through the chain
    assert llm.metrics.drafted == stepwise.metrics.drafted and llm.metrics.accepted == stepwise.metrics.accepted
    assert llm.cache.allocator.pages_in_use == 0 and llm.cache.allocator.check_no_leaks()
