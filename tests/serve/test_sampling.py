"""Sampling settings: stop strings and stop tokens, max_tokens, seeded reproducibility, top-k / top-p, streaming
deltas, and bad settings refused with WarpforgeInputError."""
from __future__ import annotations

import pytest
import torch

from warpforge import WarpforgeInputError
from warpforge.serve import LLM, SamplingParams
from warpforge.serve.sampling import probs

from conftest import PROMPTS


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, page_size=8, num_pages=96)


def test_stop_string_cuts_the_text(llm):
    base = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:5]
    got = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert got.finish_reason == "stop"
    assert got.text == text[:text.find(stop)] and stop not in got.text
    assert got.token_ids == base.token_ids[:len(got.token_ids)] and len(got.token_ids) < 12


def test_stop_token_and_max_tokens(llm):
    base = llm.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 8
    stop_id = base.token_ids[4]
    got = llm.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[stop_id]))[0]
    cut = base.token_ids.index(stop_id) + 1
    assert got.finish_reason == "stop" and got.token_ids == base.token_ids[:cut]  # the stop token is kept


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    a = [o.token_ids for o in llm.generate(PROMPTS, p)]
    b = [o.token_ids for o in llm.generate(PROMPTS[::-1], p)][::-1]  # another batch order: the same draws
    assert a == b
    c = llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=1.0, seed=8, ignore_eos=True))[0]
    assert c.token_ids != a[0]


def test_stream_deltas_add_up(llm):
    outs = list(llm.stream(PROMPTS[3], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)))
    final = outs[-1]
    assert final.finished and sum(len(o.new_token_ids) for o in outs) == len(final.token_ids) == 9
    assert "".join(o.new_text for o in outs) == final.text
    assert final.time_to_first_token is not None and final.time_to_first_token >= 0


def test_probs_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.allclose(p[:2].sum(), torch.tensor(1.0))
    full = logits.softmax(-1)
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    keep = int((full.cumsum(-1) - full < 0.8).sum())
    assert (p[keep:] == 0).all() and (p[:keep] > 0).all()
    assert probs(logits, SamplingParams(temperature=0)).tolist() == [1, 0, 0, 0, 0]


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(top_k=-3), dict(stop=[""]), dict(stop_token_ids=[-1]), dict(seed=-1),
                                 dict(seed=2**64)])   # past manual_seed: was a 500 from the server
def test_bad_sampling_params(bad):
    with pytest.raises(WarpforgeInputError):
        SamplingParams(**bad)


def test_bad_prompts_and_paths(llm, tmp_path):
    with pytest.raises(WarpforgeInputError, match="prompt_token_ids"):
        llm.generate([[1, 2, 10**6]])
    with pytest.raises(WarpforgeInputError, match="prompts"):
        llm.generate([])
    with pytest.raises(WarpforgeInputError, match="sampling_params"):
        llm.generate(PROMPTS[:2], [SamplingParams()] * 3)
    with pytest.raises(WarpforgeInputError, match="path"):
        LLM(tmp_path / "missing")
    (tmp_path / "config.json").write_text('{"model_type": "gpt_neox"}')
    with pytest.raises(WarpforgeInputError, match="gpt_neox"):
        LLM(tmp_path)
    assert not llm.engine.has_unfinished() and llm.cache.allocator.pages_in_use == 0


def _feed(out: str, **kw):
    from warpforge.serve.request import Request
    from warpforge.serve.tokenizer import ByteTokenizer
    r = Request("x", "ab", list(b"ab"), SamplingParams(**kw), None, ByteTokenizer(), (), 1000)
    deltas = []
    for b in out.encode():
        deltas.append(r.append(b))
        if r.finished:
            break
    return r, deltas


def test_streamed_deltas_never_show_part_of_a_stop_string():
    r, deltas = _feed("xyz STOP more", stop=["STOP", "no"], max_tokens=50)
    assert r.finish_reason == "stop" and r.text == "xyz " and "".join(deltas) == "xyz "
    assert not any(c in d for d in deltas for c in "STOP")  # "S", "ST", "STO" were held back, then cut
    r, deltas = _feed("hello", stop=["lo!"], max_tokens=5)  # held back (len("lo!") - 1 = 2 characters), released at the finish
    assert r.finish_reason == "length" and "".join(deltas) == r.text == "hello" and deltas[-1] == "llo"


def test_stop_string_completed_by_the_final_flush_is_cut():
    r, deltas = _feed("xx\u00e9", stop=["\u00e9"], max_tokens=4)  # é's second byte is the last token
    assert r.finish_reason == "stop" and r.text == "xx" and "".join(deltas) == "xx"
