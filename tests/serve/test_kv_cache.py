"""The paged KV block allocator, and the engine's use of it: pages freed on finish and abort, none leaked after a
batch, preemption when pages run out (outputs unchanged)."""
from __future__ import annotations

import pytest
import torch

from warpforge import WarpforgeInputError
from warpforge.serve import LLM, PageAllocator, SamplingParams
from warpforge.serve.kv_cache import OutOfPages

from conftest import PROMPTS


def test_allocator_reserve_truncate_release():
    a = PageAllocator(num_pages=6, page_size=4)
    assert a.reserve("x", 5) == [0, 1]
    assert a.reserve("x", 8) == [0, 1]  # still fits
    a.set_length("x", 8)
    assert a.reserve("y", 9) == [2, 3, 4]
    with pytest.raises(OutOfPages):
        a.reserve("z", 8)  # 2 wanted, 1 free: nothing taken
    assert a.free_pages == 1 and "z" not in a.tables
    a.truncate("x", 3)  # a rollback to 3 tokens keeps one page
    assert a.tables["x"] == [0] and a.lengths["x"] == 3 and a.free_pages == 2
    a.release("y")
    a.release("never-seen")
    assert a.pages_in_use == 1 and a.check_no_leaks()
    a.release("x")
    assert a.free_pages == 6 and a.check_no_leaks()


def test_pages_freed_on_finish_and_abort(llama_dir):
    llm = LLM(llama_dir, page_size=8, num_pages=64)
    eng, alloc = llm.engine, llm.cache.allocator
    short = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0))
    long = eng.add_request(PROMPTS[2], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    done = {}
    for _ in range(3):
        for out in eng.step():
            done[out.request_id] = out
    assert done[short].finished and short not in alloc.tables  # finished: its pages are back
    assert long in alloc.tables and alloc.pages_in_use > 0
    assert eng.abort(long) and not eng.abort(long)
    assert alloc.pages_in_use == 0 and alloc.check_no_leaks() and not eng.has_unfinished()


def test_closing_a_stream_aborts_and_frees(llama_dir):
    llm = LLM(llama_dir, page_size=8, num_pages=64)
    it = llm.stream(PROMPTS[1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    first = [next(it) for _ in range(3)]
    assert all(len(o.new_token_ids) == 1 for o in first) and llm.cache.allocator.pages_in_use > 0
    it.close()
    assert llm.cache.allocator.pages_in_use == 0 and not llm.engine.has_unfinished()


def test_preemption_when_pages_run_out_keeps_greedy_outputs(llama_dir):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    roomy = LLM(llama_dir, page_size=8, num_pages=64)
    want = [o.token_ids for o in roomy.generate(PROMPTS, params)]
    tight = LLM(llama_dir, page_size=8, num_pages=14, max_num_batched_tokens=32)  # too few pages for all four
    got = [o.token_ids for o in tight.generate(PROMPTS, params)]
    assert got == want
    assert tight.metrics.preemptions > 0 and tight.metrics.peak_pages_in_use <= 14
    assert tight.cache.allocator.pages_in_use == 0 and tight.cache.allocator.check_no_leaks()


def test_prompt_longer_than_the_cache_is_refused(llama_dir):
    llm = LLM(llama_dir, page_size=8, num_pages=2)
    with pytest.raises(WarpforgeInputError, match="prompt"):
        llm.generate([list(range(3, 30))])
    assert llm.cache.allocator.pages_in_use == 0


@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
def test_low_precision_caches_run(llama_dir, kv_format):
    # fp32 model, bf16 / fp8 pages: attention reads the cache's precision; outputs stay close to the fp32 cache's
    llm = LLM(llama_dir, page_size=8, num_pages=64, kv_format=kv_format)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))
    assert all(len(o.token_ids) >= 1 for o in outs) and llm.cache.allocator.pages_in_use == 0
    assert llm.cache.k.dtype == {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}[kv_format]


def _run_capped(eng, steps=200):
    """Steps until nothing is left, at most `steps` times (a hang fails the test instead of stalling it)."""
    outs = {}
    for _ in range(steps):
        if not eng.has_unfinished():
            return outs
        for o in eng.step():
            outs[o.request_id] = o
    raise AssertionError(f"still unfinished after {steps} steps")


def test_request_outgrowing_the_cache_finishes_by_length(llama_dir):
    llm = LLM(llama_dir, page_size=8, num_pages=2, max_model_len=64)  # 16 tokens of cache < the model length 64
    eng = llm.engine
    rid = eng.add_request(prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=40, temperature=0,
                                                                            ignore_eos=True))
    out = _run_capped(eng)[rid]
    assert out.finished and out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 16
    assert llm.cache.allocator.pages_in_use == 0 and llm.cache.allocator.check_no_leaks()


def test_pages_reserved_outside_requests_shorten_the_max_length(llama_dir):
    llm = LLM(llama_dir, page_size=8, num_pages=3, max_model_len=64)
    eng, alloc = llm.engine, llm.cache.allocator
    alloc.reserve("__cuda_graph_scratch__", 1)  # as DecodeGraphs does: one page no request can have
    assert eng.max_len == 16
    with pytest.raises(WarpforgeInputError, match="prompt"):
        eng.add_request(prompt_token_ids=list(range(3, 20)))
    rid = eng.add_request(prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=40, temperature=0,
                                                                            ignore_eos=True))
    out = _run_capped(eng)[rid]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 16


def test_step_refuses_to_spin_when_nothing_can_be_scheduled(llama_dir):
    llm = LLM(llama_dir, page_size=8, num_pages=2)
    eng = llm.engine
    eng.add_request(prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=4))
    llm.cache.allocator.reserve("someone-else", 16)  # every page taken after admission
    with pytest.raises(RuntimeError, match="cannot be scheduled"):
        eng.step()


def test_unsupported_head_dim_is_refused_at_construction(tmp_path):
    from conftest import make_checkpoint

    from warpforge.serve import PagedKVCache
    with pytest.raises(WarpforgeInputError, match="head_dim"):
        PagedKVCache(1, 4, 8, 1, 12, "fp32", torch.float32, "cpu")
    make_checkpoint(tmp_path, "llama", layers=1, hidden=24, heads=2, kv_heads=1, head_dim=12)
    with pytest.raises(WarpforgeInputError, match="head_dim: .*got 12"):
        LLM(tmp_path, page_size=8, num_pages=8)  # not at the first step


def test_generated_request_ids_skip_user_supplied_ones(llama_dir):
    eng = LLM(llama_dir, page_size=8, num_pages=16).engine
    eng.add_request(prompt_token_ids=[5, 6], request_id="0")
    eng.add_request(prompt_token_ids=[5, 6], request_id="1")
    auto = eng.add_request(prompt_token_ids=[5, 6])
    assert auto not in ("0", "1") and len(eng.requests) == 3


@pytest.mark.parametrize("kv_format", ["nvfp4", "mxfp4"])
def test_fp4_pair_layout_writes_and_gathers_the_rows_bytes(kv_format):
    from warpforge.serve import PagedKVCache
    from warpforge.serve.kv_cache import PairLayers
    caches = {layout: PagedKVCache(2, 4, 8, 2, 64, kv_format, torch.float32, "cpu", fp4_layout=layout)
              for layout in ("rows", "pair")}
    assert isinstance(caches["pair"].k, PairLayers) and len(caches["pair"].k) == 2
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(5, 2, 64, generator=g) for _ in range(2))
    slots = torch.tensor([3, 9, -1, 17, 30])
    for cache in caches.values():
        cache.write(1, k, v, slots)
    for side in ("k", "v"):
        rows, (values, scales) = getattr(caches["rows"], side)[1], getattr(caches["pair"], side)[1]
        assert torch.equal(rows[..., :32], values) and torch.equal(rows[..., 32:], scales)
    keep = torch.tensor([0, 1, 3, 4])
    got = [caches[layout].gather(1, slots[keep]) for layout in ("rows", "pair")]
    assert all(torch.equal(a, b) for a, b in zip(*got))
    assert (got[0][0] - k[keep]).norm() / k[keep].norm() < 0.2   # FP4's own rounding


@pytest.mark.parametrize("kv_format", ["nvfp4", "mxfp4"])
def test_fp4_pair_layout_generates_the_rows_tokens(llama_dir, kv_format, monkeypatch):
    from warpforge.serve import kv_cache
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = {}
    for layout in kv_cache.FP4_LAYOUTS:
        monkeypatch.setattr(kv_cache, "FP4_LAYOUT", layout)
        llm = LLM(llama_dir, page_size=8, num_pages=64, kv_format=kv_format)
        assert isinstance(llm.cache.k, kv_cache.PairLayers) == (layout == "pair")
        outs[layout] = [o.token_ids for o in llm.generate(PROMPTS[:2], params)]
        assert llm.cache.allocator.pages_in_use == 0
    assert outs["pair"] == outs["rows"]


def test_fp4_layout_is_checked():
    from warpforge.serve import PagedKVCache
    with pytest.raises(WarpforgeInputError, match="fp4_layout"):
        PagedKVCache(1, 4, 8, 1, 64, "nvfp4", torch.float32, "cpu", fp4_layout="planar")
    assert not PagedKVCache(1, 4, 8, 1, 64, "fp8", torch.float32, "cpu", fp4_layout="pair").pair  # FP4 only
