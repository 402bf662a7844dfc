"""The engine's CUDA-graph paths (cuda_graphs.py: decode and verification steps padded to s_q; draft_chain.py: a
greedy draft round) driven on the CPU, at their edges: the model length, small pages, short prefill chunks, sampled
requests beside greedy ones, a draft model of another vocabulary, draft pages running out, k past paged_decode's
s_q. `graph_paths` makes LLM(cuda_graphs=True) take the graph code: a "capture" runs the real one's warm-up (every
row padding) and a "replay" runs the static batch eagerly; the draft chain runs uncaptured."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from warpforge.serve import LLM, SamplingParams
from warpforge.serve.batch import SeqWork, StepBatch
from warpforge.serve.cuda_graphs import _SCRATCH, DecodeGraphs
from warpforge.serve.draft_chain import DraftChain

from conftest import make_checkpoint

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10, 9], [11, 12], [13]]


@pytest.fixture
def graph_paths(monkeypatch):
    seen = SimpleNamespace(captured=[], eager_fallbacks=0, chain_rounds=[])
    monkeypatch.setattr(DecodeGraphs, "supported", staticmethod(lambda device: True))

    def _static(self, b, s_q):
        st = self.static_batch(b, s_q)
        self.model.forward(st, self.cache)  # the capture's warm-up (its rows padding, their lengths s_q)
        st.graph = SimpleNamespace(replay=lambda: setattr(st, "logits", self.model.forward(st, self.cache)))
        seen.captured.append((b, s_q))
        return st
    monkeypatch.setattr(DecodeGraphs, "_static", _static)
    run = DecodeGraphs.run

    def graph_run(self, works, alloc, s_q=1):
        got = run(self, works, alloc, s_q)
        seen.eager_fallbacks += got is None
        return got
    monkeypatch.setattr(DecodeGraphs, "run", graph_run)
    init, chain_run = DraftChain.__init__, DraftChain.run

    def chain_init(self, *args, **kw):
        init(self, *args, **dict(kw, capture=False))

    def _chain(self, b):
        ch = self._buffers(b)
        self._steps(ch)  # the capture's warm-up
        return ch

    def chained(self, works, alloc):
        got = chain_run(self, works, alloc)
        seen.chain_rounds.append(len(works) if got is not None else 0)
        return got
    monkeypatch.setattr(DraftChain, "__init__", chain_init)
    monkeypatch.setattr(DraftChain, "_chain", _chain)
    monkeypatch.setattr(DraftChain, "run", chained)
    return seen


def _generate(folder, prompts, params, **kw):
    llm = LLM(folder, **kw)
    outs = llm.generate(prompts, params)
    m = llm.metrics
    return [o.token_ids for o in outs], (m.drafted, m.accepted, m.preemptions), llm


def _only_scratch_left(llm):
    """Every request's pages (the target's and the draft model's) freed: only the graphs' scratch pages remain."""
    allocs = [llm.cache.allocator]
    if hasattr(llm.engine.drafter, "cache"):
        allocs.append(llm.engine.drafter.cache.allocator)
    return all(a.check_no_leaks() and list(a.tables) == [_SCRATCH] and a.pages_in_use == 1 for a in allocs)


@pytest.fixture(scope="module")
def near_dir(llama_dir, tmp_path_factory):
    """A draft model close to the target (its weights plus noise): some drafts accepted, some rejected."""
    import shutil
    import transformers
    d = tmp_path_factory.mktemp("llama_near")
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
    model.save_pretrained(d)
    shutil.copy(llama_dir / "tokenizer.json", d / "tokenizer.json")
    return d


def test_graph_steps_at_the_model_length_with_short_chunks_and_sampling(llama_dir, graph_paths):
    """Prompt lookup (k 4) at page size 1 up to the model length: verification steps mixing drafted and undrafted
    sequences and short prefill chunks (start 0, logits "none" or "last") padded to s_q 5, drafts cut by the room
    left, steps whose padded lengths pass the block table falling back to eager; greedy and seeded sampled requests
    together. Tokens and speculation counts are the eager engine's."""
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, seed=1, ignore_eos=True)] * 2
    kw = dict(page_size=1, num_pages=200, max_model_len=24, max_num_batched_tokens=6, speculative="ngram",
              num_speculative_tokens=4)
    eager = _generate(llama_dir, PROMPTS, params, cuda_graphs=False, **kw)
    got = _generate(llama_dir, PROMPTS, params, cuda_graphs=True, **kw)
    assert got[:2] == eager[:2] and eager[1][0] > 0
    assert all(len(p) + len(t) == 24 for p, t in zip(PROMPTS, got[0]))  # every request ran to the model length
    assert {s for _, s in graph_paths.captured} == {1, 5} and graph_paths.eager_fallbacks > 0
    assert _only_scratch_left(got[2])


def test_draft_chain_under_page_pressure_is_the_step_by_step_round(llama_dir, near_dir, graph_paths):
    """A near draft model (k 3) through the chain, with so few pages that requests are preempted and draft rounds
    run out of pages midway: outputs are plain greedy decoding's, and drafts, acceptances and preemptions are the
    eager engine's (given the same usable pages: the graphs hold a scratch page of each cache). A chain round that
    cannot run gives back the pages it reserved first, so the step-by-step round it falls back to drafts as ever."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kw = dict(page_size=8, max_num_batched_tokens=24, speculative=str(near_dir), num_speculative_tokens=3)
    plain = _generate(llama_dir, PROMPTS, params, page_size=8, num_pages=64)[0]
    eager = _generate(llama_dir, PROMPTS, params, num_pages=8, cuda_graphs=False, **kw)
    got = _generate(llama_dir, PROMPTS, params, num_pages=9, cuda_graphs=True, **kw)
    assert got[0] == eager[0] == plain
    assert got[1] == eager[1]
    drafted, accepted, preemptions = got[1]
    assert 0 < accepted < drafted and preemptions > 0
    assert max(graph_paths.chain_rounds) > 1 and 0 in graph_paths.chain_rounds  # batched rounds, and fallbacks
    assert _only_scratch_left(got[2])


def test_chain_fallback_gives_back_its_pages(llama_dir, small_llama_dir):
    """Page size 1: the chain reserves each request's round (len + k - 1 tokens) up front; when the second
    request's reservation fails the first one's must be given back, or the step-by-step round that follows
    starves the second request of drafts."""
    k = 3
    llm = LLM(llama_dir, page_size=1, num_pages=64, speculative=str(small_llama_dir), num_speculative_tokens=k)
    d = llm.engine.drafter
    alloc = d.cache.allocator
    d.chain = DraftChain(d.model, d.cache, DecodeGraphs(d.model, d.cache, 4, 64), k, llm.spec.vocab_size,
                         capture=False)
    reqs = [SimpleNamespace(id=i, tokens=[5 + i, 6, 7, 8, 9], params=SamplingParams(temperature=0), generator=None)
            for i in range(2)]

    def propose():
        alloc.reserve("others", alloc.free_pages - 10)  # room for 10 tokens: one round of 5 + 2 but not two
        got = d.propose(reqs, [k, k])
        assert alloc.lengths == {_SCRATCH: 0, "others": 0, 0: 5, 1: 5} and alloc.free_pages == 0
        for r in reqs:
            d.release(r)
        alloc.release("others")
        return got
    got = propose()
    assert [len(x) for x, _ in got] == [1, 1]  # each fed its 5 tokens, then no page for a second draft
    d.chain = None
    assert propose() == got  # what the step-by-step round proposes
    assert alloc.check_no_leaks()


def test_draft_chain_steps_aside_past_paged_decode(llama_dir, small_llama_dir, graph_paths):
    """k 16: a chain's first step would be s_q 17, more than paged_decode takes; the step-by-step loop drafts."""
    llm = LLM(llama_dir, page_size=8, num_pages=32, speculative=str(small_llama_dir), num_speculative_tokens=16,
              cuda_graphs=True)
    d = llm.engine.drafter
    r = SimpleNamespace(id="r", tokens=[5, 6, 7], params=SamplingParams(temperature=0), generator=None)
    drafts = d.propose([r], [16])[0][0]
    assert len(drafts) == 16 and graph_paths.chain_rounds == [] and not d.chain.usable


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_graph_steps_longer_than_the_block_table_run_eagerly(llama_dir, spec, graph_paths):
    """A model length (8) shorter than k + 1 (11): a graph of s_q 11 cannot be warmed up over 8-token block
    tables, so those steps run eagerly (they raised in the capture's warm-up)."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    kw = dict(page_size=8, num_pages=16, max_model_len=8)
    plain = _generate(llama_dir, [[5, 6, 5, 6], [7, 8]], params, **kw)[0]
    got, _, llm = _generate(llama_dir, [[5, 6, 5, 6], [7, 8]], params, cuda_graphs=True, num_speculative_tokens=10,
                            speculative="ngram" if spec == "ngram" else str(llama_dir), **kw)
    assert got == plain and all(s != 11 for _, s in graph_paths.captured) and _only_scratch_left(llm)


@pytest.fixture(scope="module")
def narrow_draft_dir(tmp_path_factory):
    """A draft model with a smaller vocabulary (300 ids) than the target's (320)."""
    d = tmp_path_factory.mktemp("llama_narrow")
    mp = pytest.MonkeyPatch()
    mp.setitem(make_checkpoint.__globals__, "VOCAB", 300)
    try:
        make_checkpoint(d, "llama", layers=1, heads=2, kv_heads=1, seed=5)
    finally:
        mp.undo()
    return d


@pytest.mark.parametrize("graphs", [False, True])
def test_draft_model_with_a_smaller_vocabulary(llama_dir, narrow_draft_dir, graphs, request):
    """Target ids past the draft's vocabulary (a prompt's 310 here) are fed to the draft as an id it has: they
    indexed past its embedding (IndexError; a device-side assert under CUDA). Step by step and through the chain."""
    seen = request.getfixturevalue("graph_paths") if graphs else None
    prompts = [[5, 310, 7, 5, 310], [315, 9]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = _generate(llama_dir, prompts, params, page_size=8, num_pages=32)[0]
    got, _, llm = _generate(llama_dir, prompts, params, page_size=8, num_pages=32, speculative=str(narrow_draft_dir),
                            num_speculative_tokens=2, cuda_graphs=graphs)
    assert got == plain and llm.metrics.drafted > 0
    assert seen is None or max(seen.chain_rounds) > 0


def test_a_request_named_like_the_scratch_page_gets_its_own_pages(llama_dir):
    llm = LLM(llama_dir, page_size=8, num_pages=8)
    alloc = llm.cache.allocator
    scratch = DecodeGraphs(llm.model, llm.cache, 4, 8).scratch
    llm.engine.add_request(prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=3, temperature=0),
                           request_id="__cuda_graph_scratch__")
    llm.engine.step()
    assert scratch not in alloc.tables["__cuda_graph_scratch__"]
    llm.engine.run()
    assert alloc.tables == {_SCRATCH: [scratch]} and alloc.check_no_leaks()


def test_padded_step_at_page_size_one_matches_eager(llama_dir):
    """Page size 1, s_q 4 (k 3): a sequence with 3 drafts, one with none, a prefill chunk from position 0 whose
    logits are not read and one whose last row is, in one static batch of bucket 8; padding tokens span pages past
    each sequence's own (the scratch page). Real rows give the eager step's logits; nothing else is written."""
    llm = LLM(llama_dir, page_size=1, num_pages=64, cuda_graphs=False)
    model, cache, alloc = llm.model, llm.cache, llm.cache.allocator
    graphs = DecodeGraphs(model, cache, max_batch=8, max_pages_per_seq=16)
    eager_prefill = [SeqWork("a", [5, 6, 7, 8, 9], 0, "none"), SeqWork("b", [9, 10, 11], 0, "none")]
    for w in eager_prefill:
        alloc.reserve(w.seq_id, len(w.tokens))
    model.forward(StepBatch(eager_prefill, alloc, model.device), cache)
    works = [SeqWork("a", [4, 3, 2, 1], 5, "all"), SeqWork("b", [12], 3, "last"),
             SeqWork("c", [13, 14], 0, "none"), SeqWork("d", [15, 16, 17], 0, "last")]
    for w in works:
        alloc.reserve(w.seq_id, w.start + len(w.tokens))
    before = cache.k.clone(), cache.v.clone()
    eager = model.forward(StepBatch(works, alloc, model.device), cache)  # rows: a's 4, b's 1, d's last
    written = cache.k.clone(), cache.v.clone()
    cache.k.copy_(before[0])
    cache.v.copy_(before[1])
    st = graphs.static_batch(8, 4)
    assert graphs.fill(st, works, alloc)
    assert st.slots.tolist().count(-1) == 32 - 10  # 10 real tokens among the bucket's 8 x 4
    replayed = model.forward(st, cache)
    torch.testing.assert_close(replayed[[0, 1, 2, 3, 4, 14]], eager)
    # the real tokens' K/V as the eager step wrote them, and nothing at any other slot (the scratch page's neither)
    torch.testing.assert_close((cache.k, cache.v), written, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.k[:, graphs.scratch], before[0][:, graphs.scratch])
