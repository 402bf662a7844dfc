"""Continuous batching: requests join and leave between steps, and each step runs every scheduled sequence's new
tokens through the model in one forward.

A step schedules, in order:
1. every decoding request: its pending token, and with a drafter its k drafted tokens after it (verified in the
   same forward, s_q = k + 1);
2. prefill chunks, oldest request first: partly prefilled requests, then waiting ones while there are fewer than
   max_num_seqs running, each cut to what is left of max_num_batched_tokens (chunked prefill: a long prompt takes
   several steps and never stalls the decoding requests for long).
Each sequence's pages are reserved before the forward. When the pages run out a decoding request preempts the
youngest running one (its pages are freed and it is prefilled again later from its prompt and output so far:
recompute, as vLLM does). Finished and aborted requests free their pages at once.

Outputs stream: `step()` returns a RequestOutput per request it advanced and calls the request's on_output
callback with it; `stream()` iterates one request's outputs while the others keep running.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Callable, Iterator, Optional


from ..errors import WarpforgeInputError, check_int
from . import sampling
from .batch import SeqWork
from .cuda_graphs import forward_step
from .kv_cache import OutOfPages, PagedKVCache
from .metrics import EngineMetrics
from .request import Request, RequestOutput
from .speculative import verify


class Engine:
    def __init__(self, model, cache: PagedKVCache, tokenizer=None, *, eos_token_ids=(), max_model_len: int,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, drafter=None,
                 num_speculative_tokens: int = 4, graphs=None):
        check_int("max_num_seqs", max_num_seqs, lo=1)
        check_int("max_num_batched_tokens", max_num_batched_tokens, lo=1)
        check_int("num_speculative_tokens", num_speculative_tokens, lo=1)
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.alloc = cache.allocator
        self.eos_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_num_seqs, self.max_batched = max_num_seqs, max_num_batched_tokens
        self.drafter, self.k = drafter, num_speculative_tokens
        self.graphs = graphs  # cuda_graphs.DecodeGraphs or None: replays decode and verification steps
        self.waiting: deque = deque()
        self.running: list = []
        self.requests: dict = {}
        self.metrics = EngineMetrics()
        self._ids = itertools.count()

    # -------------------------------------------------------------------------------- requests
    def _free_capacity(self) -> int:
        """Tokens one sequence can hold: the cache less the pages reserved outside requests (the CUDA graphs'
        scratch page)."""
        reserved = sum(len(t) for sid, t in self.alloc.tables.items() if sid not in self.requests)
        return (self.alloc.num_pages - reserved) * self.alloc.page_size

    @property
    def max_len(self) -> int:
        """The longest a request may grow (prompt + output): the model length or what one sequence can hold."""
        return min(self.max_model_len, self._free_capacity())

    def add_request(self, prompt: Optional[str] = None, params: Optional[sampling.SamplingParams] = None, *,
                    prompt_token_ids=None, request_id: Optional[str] = None,
                    on_output: Optional[Callable[[RequestOutput], None]] = None) -> str:
        params = sampling.check_params(params)
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise WarpforgeInputError(f"prompt: expected a string (or prompt_token_ids), got "
                                          f"{type(prompt).__name__}")
            if self.tokenizer is None:
                raise WarpforgeInputError("prompt: this engine has no tokenizer; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = list(prompt_token_ids)
        vocab = self.model.spec.vocab_size
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise WarpforgeInputError(f"prompt_token_ids: expected a non-empty list of ids in [0, {vocab}), got "
                                      f"{ids[:8]}{'...' if len(ids) > 8 else ''}")
        max_len = self.max_len
        if len(ids) >= max_len:
            raise WarpforgeInputError(f"prompt: expected fewer than {max_len} tokens (the model length "
                                      f"{self.max_model_len} / the KV cache's {self._free_capacity()} tokens), got "
                                      f"{len(ids)}")
        if request_id is None:  # the next number no request (a user-named one included) holds
            request_id = str(next(self._ids))
            while request_id in self.requests:
                request_id = str(next(self._ids))
        request_id = str(request_id)
        if request_id in self.requests:
            raise WarpforgeInputError(f"request_id: expected a new id, got {request_id!r} (in use)")
        r = Request(request_id, prompt, ids, params, params.generator(self.model.device), self.tokenizer,
                    self.eos_ids, max_len, on_output)
        self.requests[request_id] = r
        self.waiting.append(r)
        self.metrics.prompt_tokens += len(ids)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its pages; False if it is unknown or already finished."""
        r = self.requests.get(str(request_id))
        if r is None or r.finished:
            return False
        r.finish_reason = "abort"
        self.metrics.aborted += 1
        self._finish(r)
        if r.on_output is not None:
            r.on_output(r.output([], ""))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _finish(self, r: Request) -> None:
        self.alloc.release(r.id)
        if self.drafter is not None:
            self.drafter.release(r)
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        self.requests.pop(r.id, None)
        self.metrics.finished(r)

    def _preempt(self, r: Request) -> None:
        self.alloc.release(r.id)
        if self.drafter is not None:
            self.drafter.release(r)
        r.num_computed = 0
        self.running.remove(r)
        self.waiting.appendleft(r)
        self.metrics.preemptions += 1

    def _reserve(self, r: Request, tokens: int, protect: list) -> bool:
        """Pages for r's first `tokens` tokens, preempting the youngest running requests not in protect."""
        while True:
            try:
                self.alloc.reserve(r.id, tokens)
                return True
            except OutOfPages:
                victims = [v for v in reversed(self.running) if v is not r and v not in protect]
                if not victims:
                    return False
                self._preempt(victims[0])

    # ------------------------------------------------------------------------------------ step
    def _schedule(self) -> list:
        plan, budget = [], self.max_batched
        decoding = [r for r in self.running if r.decoding]
        drafts = [([], None)] * len(decoding)
        if self.drafter is not None and decoding:
            ks = [max(0, min(self.k, r.room() - 1)) for r in decoding]
            drafts = self.drafter.propose(decoding, ks)
        for r, (d, q) in zip(decoding, drafts):
            if r not in self.running:  # preempted by an earlier request of this loop
                continue
            if not self._reserve(r, r.num_computed + 1 + len(d), [p[0] for p in plan]):
                if d:  # no room for the drafts: they are dropped, and leave the drafter's cache with them
                    self.drafter.rollback(r, len(r.tokens))
                d, q = [], None
                if not self._reserve(r, r.num_computed + 1, [p[0] for p in plan]):
                    self._preempt(r)
                    continue
            plan.append((r, SeqWork(r.id, [r.tokens[-1]] + d, r.num_computed, "all" if d else "last"), d, q))
            budget -= 1 + len(d)
        prefilling = [r for r in self.running if not r.decoding]
        candidates = prefilling + list(self.waiting)
        for r in candidates:
            if budget <= 0:
                break
            admitted = r in self.running
            if not admitted and len(self.running) >= self.max_num_seqs:
                break
            n = min(len(r.tokens) - r.num_computed, budget)
            try:  # a prefill never preempts: it waits for pages
                self.alloc.reserve(r.id, r.num_computed + n)
            except OutOfPages:
                if not admitted:
                    break
                continue
            if not admitted:
                self.waiting.remove(r)
                self.running.append(r)
            last = r.num_computed + n == len(r.tokens)
            plan.append((r, SeqWork(r.id, r.tokens[r.num_computed:r.num_computed + n], r.num_computed,
                                    "last" if last else "none"), [], None))
            budget -= n
        if not plan and self.running:
            # every running request waits on pages that only a preemption can free: restart the youngest
            self._preempt(self.running[-1])
        return plan

    def step(self) -> list:
        """One forward over every scheduled sequence; returns the RequestOutputs of the requests it advanced."""
        t0 = time.perf_counter()
        plan = self._schedule()
        if not plan:
            if self.waiting and not self.running:  # nothing holds pages, yet nothing fits: it would never change
                r = self.waiting[0]
                raise RuntimeError(f"engine: request {r.id!r} ({len(r.tokens)} tokens) cannot be scheduled: "
                                   f"{self.alloc.free_pages} of {self.alloc.num_pages} KV pages are free")
            return []
        works = [w for _, w, _, _ in plan]
        logits, slices = self._forward(works)
        # every greedy request's choice in one read back (not one device sync per request)
        best = logits.argmax(-1).tolist() if any(r.params.greedy for r, *_ in plan) else None
        outputs = []
        for (r, w, d, q), sl in zip(plan, slices):
            r.num_computed = w.start + len(w.tokens)
            if w.logits == "none":
                self.alloc.set_length(r.id, r.num_computed)
                continue
            rows = logits[sl]
            if d:
                new = verify(rows, d, q, r.params, r.generator, best[sl] if best is not None else None)
                accepted = len(new) - 1
                r.drafted += len(d)
                r.accepted += accepted
                self.metrics.drafted += len(d)
                self.metrics.accepted += accepted
                r.num_computed -= len(d) - accepted  # the rejected drafts' K/V: rolled back below
                self.alloc.truncate(r.id, r.num_computed)
                self.drafter.rollback(r, r.num_computed)
            elif r.params.greedy:
                new = [best[sl.stop - 1]]
            else:
                new = [sampling.pick(rows[-1], r.params, r.generator)]
            self.alloc.set_length(r.id, r.num_computed)
            emitted, text = [], ""
            for tok in new:
                emitted.append(tok)
                text += r.append(tok)
                if r.finished:
                    break
            self.metrics.generated_tokens += len(emitted)
            if r.finished:
                self._finish(r)
            out = r.output(emitted, text)
            outputs.append(out)
            if r.on_output is not None:
                r.on_output(out)
        self.metrics.step_done(time.perf_counter() - t0, self.alloc.pages_in_use, len(works),
                               sum(len(w.tokens) for w in works))
        return outputs

    def _forward(self, works: list):
        """(logits, each work's rows in them): replayed from a CUDA graph when every sequence feeds one token
        (plain decode) or at most k + 1 (verification: the pending token and its drafts; the graph pads to k + 1),
        else one eager forward."""
        return forward_step(self.model, self.cache, works, self.graphs, self.k + 1 if self.drafter is not None else 1)

    # ---------------------------------------------------------------------------- conveniences
    def run(self) -> None:
        """Steps until no request is left."""
        while self.has_unfinished():
            self.step()

    def stream(self, prompt=None, params=None, *, prompt_token_ids=None) -> Iterator[RequestOutput]:
        """One request's outputs as they come (the engine's other requests advance in the same steps). Closing the
        iterator early aborts the request and frees its pages."""
        got: deque = deque()
        rid = self.add_request(prompt, params, prompt_token_ids=prompt_token_ids, on_output=got.append)
        done = False
        try:
            while not done:
                if not got:
                    self.step()
                while got:
                    out = got.popleft()
                    done = out.finished
                    yield out
        finally:
            if not done:
                self.abort(rid)
