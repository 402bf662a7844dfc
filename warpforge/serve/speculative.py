"""Lossless speculative decoding: a drafter proposes k tokens per decoding request, the target model scores the
request's pending token and the k drafts in one step (s_q = k + 1 through paged_decode, causal among them), and
`verify` keeps what the target's own distribution allows.

Up to paged.MAX_S_Q - 1 drafts (15) a verification step attends through paged_decode; more go the varlen way.

- greedy (temperature 0): the longest prefix of drafts equal to the target's argmax, then the target's argmax
  after it: token for token what plain greedy decoding gives.
- sampling: standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft x_i, drawn
  from q_i, is kept with probability min(1, p_i(x_i) / q_i(x_i)); the first rejected one is replaced by a draw from
  norm(max(0, p_i − q_i)); when all are kept a bonus token is drawn from p_{k+1}. Each emitted token then follows
  the target's distribution p exactly. A deterministic drafter (prompt lookup) has q_i = one-hot(x_i).

The engine rolls back the K/V of rejected drafts (their pages are truncated off the sequence).

Drafters:
- NgramDrafter: prompt lookup. The longest recent n-gram (max_ngram down to min_ngram tokens) that occurred before
  in the request's tokens proposes the tokens that followed it then. No model, no cache.
- DraftModelDrafter: a smaller model of the same vocabulary, with its own paged cache, run k batched steps.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import check_int
from . import sampling
from .batch import SeqWork
from .cuda_graphs import forward_step
from .kv_cache import OutOfPages


def verify(target_logits: torch.Tensor, drafts: list, draft_probs: Optional[torch.Tensor], params, generator,
           best: Optional[list] = None) -> list:
    """The tokens a verification step emits: accepted drafts, then one token of the target's. target_logits
    [len(drafts) + 1, vocab]: row i is the target's logits after the pending token and drafts[:i]. draft_probs
    [len(drafts), vocab] (the drafter's distributions) or None for a deterministic drafter. best: the rows' argmax
    when the caller has read it back already (greedy)."""
    k = len(drafts)
    if params.greedy:
        if best is None:
            best = target_logits.argmax(-1).tolist()
        out = []
        for i in range(k):
            if drafts[i] != best[i]:
                break
            out.append(drafts[i])
        return out + [best[len(out)]]
    p = sampling.probs(target_logits, params)  # [k + 1, vocab]
    out = []
    device = target_logits.device
    for i, x in enumerate(drafts):
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        keep = 1.0 if q_x <= 0 else min(1.0, float(p[i, x]) / q_x)
        u = float(torch.rand((), generator=generator, device=device))
        if u < keep:
            out.append(x)
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[x] = 0
        else:
            residual = (p[i] - draft_probs[i]).clamp(min=0)
        total = float(residual.sum())
        # p == q leaves nothing to draw from (and then a rejection has probability 0): p itself is the answer
        residual = residual / total if total > 0 else p[i]
        return out + [sampling.sample(residual, generator)]
    return out + [sampling.sample(p[k], generator)]


class NgramDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        check_int("max_ngram", max_ngram, lo=1)
        check_int("min_ngram", min_ngram, lo=1, hi=max_ngram)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, requests: list, ks: list) -> list:
        return [(self.lookup(r.tokens, k), None) if k > 0 else ([], None) for r, k in zip(requests, ks)]

    def lookup(self, tokens: list, k: int) -> list:
        n_tok = len(tokens)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            suffix = tokens[n_tok - n:]
            # the most recent earlier occurrence (ending before the suffix itself)
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        return follow
        return []

    def rollback(self, request, kept: int) -> None:
        pass

    def release(self, request) -> None:
        pass


class DraftModelDrafter:
    """Drafts with a second model (its own weights, cache and allocator; the same vocabulary as the target's).
    Its cache holds a prefix of each request's tokens (plus drafts); `fed[request id]` counts them. Each round
    feeds what it has not seen (the tokens accepted since, and the pending one), then its own drafts one at a time,
    all requests batched."""

    def __init__(self, model, cache, vocab_size: int, graphs=None, max_feed: int = 1, chain=None):
        self.model, self.cache, self.vocab_size = model, cache, vocab_size
        self.graphs, self.max_feed = graphs, max_feed  # a DecodeGraphs of the draft model; tokens a graph feeds
        self.chain = chain  # a DraftChain: a greedy round's k steps in one replay
        self.fed: dict = {}

    def _unseen(self, r) -> int:
        """How many of r's tokens the draft cache holds, at most all but the pending one (a cache ahead of the
        request holds drafts it never took: it feeds its pending token again at least)."""
        if self.fed.get(r.id, 0) >= len(r.tokens):
            self.rollback(r, len(r.tokens) - 1)
        return self.fed.get(r.id, 0)

    def _draft_ids(self, tokens: list) -> list:
        """tokens as the draft model's embedding takes them: a target id past the draft's vocabulary (a larger
        padded vocabulary, or a prompt's id there) becomes 0. The draft never proposes such ids; feeding 0 instead
        only makes its next guesses worse, which verification rejects, where the raw id would index past its
        embedding (a device-side assert under CUDA)."""
        n = self.model.spec.vocab_size
        return [t if t < n else 0 for t in tokens]

    def _chained(self, requests: list, ks: list):
        """The round through the DraftChain (every request greedy, drafting its k), or None."""
        k = self.chain.k
        if not self.chain.usable or not all(r.params.greedy for r in requests) or any(x != k for x in ks):
            return None
        alloc = self.cache.allocator
        works = []
        for r in requests:
            fed = self._unseen(r)
            try:
                alloc.reserve(r.id, len(r.tokens) + k - 1)  # the round writes up to the (k - 1)-th draft
            except OutOfPages:
                return self._unreserve(works)
            works.append(SeqWork(r.id, self._draft_ids(r.tokens[fed:]), fed, "last"))
        drafts = self.chain.run(works, alloc)
        if drafts is None:
            return self._unreserve(works)
        for r, w in zip(requests, works):
            self.fed[r.id] = w.start + len(w.tokens) + k - 1
            alloc.set_length(r.id, self.fed[r.id])
        return [(d, None) for d in drafts]

    def _unreserve(self, works: list) -> None:
        """Gives back the pages a chain round reserved past what each sequence holds, before the step-by-step
        round takes over: kept, they would starve the requests after them of drafts (each step reserves only its
        own token)."""
        alloc = self.cache.allocator
        for w in works:
            if alloc.lengths[w.seq_id]:
                alloc.truncate(w.seq_id, alloc.lengths[w.seq_id])
            else:  # a sequence new to the draft cache: as before the round
                alloc.release(w.seq_id)
        return None

    def propose(self, requests: list, ks: list) -> list:
        if self.chain is not None:
            got = self._chained(requests, ks)
            if got is not None:
                return got
        alloc = self.cache.allocator
        out = [([], None if r.params.greedy else []) for r in requests]
        active = [i for i, k in enumerate(ks) if k > 0]
        step = 0
        while active:
            works, live = [], []
            for i in active:
                r = requests[i]
                fed = self._unseen(r) if step == 0 else self.fed.get(r.id, 0)
                seq = r.tokens + out[i][0]
                new = self._draft_ids(seq[fed:])
                try:
                    alloc.reserve(r.id, len(seq))
                except OutOfPages:
                    continue  # this request drafts fewer tokens this round
                works.append(SeqWork(r.id, new, fed, "last"))
                live.append(i)
            if not works:
                break
            logits, slices = forward_step(self.model, self.cache, works, self.graphs, self.max_feed)
            last = _fit_vocab(logits[[sl.stop - 1 for sl in slices]], self.vocab_size)
            # the greedy requests' drafts in one read back for the round
            best = last.argmax(-1).tolist() if any(requests[i].params.greedy for i in live) else None
            next_active = []
            for row, (i, w) in enumerate(zip(live, works)):
                r = requests[i]
                self.fed[r.id] = w.start + len(w.tokens)
                alloc.set_length(r.id, self.fed[r.id])
                lg = last[row]
                if r.params.greedy:
                    tok = best[row]
                else:
                    q = sampling.probs(lg, r.params)
                    tok = sampling.sample(q, r.generator)
                    out[i][1].append(q)
                out[i][0].append(tok)
                if len(out[i][0]) < ks[i]:
                    next_active.append(i)
            active = next_active
            step += 1
        return [(toks, torch.stack(qs) if qs else None) if qs is not None else (toks, None) for toks, qs in out]

    def rollback(self, request, kept: int) -> None:
        """After verification `kept` of the request's tokens are settled: drafts past them leave the cache."""
        fed = self.fed.get(request.id, 0)
        if fed > kept:
            self.fed[request.id] = kept
            self.cache.allocator.truncate(request.id, kept)

    def release(self, request) -> None:
        self.fed.pop(request.id, None)
        self.cache.allocator.release(request.id)


def _fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """A drafter's logits over the target's vocabulary (padded embedding rows differ between model sizes)."""
    if logits.shape[-1] == vocab:
        return logits
    if logits.shape[-1] > vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], -1)
