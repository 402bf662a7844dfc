"""What an engine reports: throughput, time to first token, KV pages in use, speculative acceptance."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineMetrics:
    steps: int = 0
    step_time: float = 0.0          # seconds inside step(), summed
    prompt_tokens: int = 0
    generated_tokens: int = 0
    batched_tokens: int = 0         # tokens run through the model (prefill + decode + drafts)
    drafted: int = 0                # speculative tokens proposed
    accepted: int = 0               # of them, accepted by the target
    preemptions: int = 0
    aborted: int = 0                # requests aborted (a client gone, abort())
    pages_in_use: int = 0
    peak_pages_in_use: int = 0
    max_batch: int = 0              # most sequences in one step
    ttfts: list = field(default_factory=list)   # finished requests' times to first token (s)
    finished_requests: int = 0

    def step_done(self, seconds: float, pages: int, seqs: int, tokens: int) -> None:
        self.steps += 1
        self.step_time += seconds
        self.pages_in_use = pages
        self.peak_pages_in_use = max(self.peak_pages_in_use, pages)
        self.max_batch = max(self.max_batch, seqs)
        self.batched_tokens += tokens

    def finished(self, request) -> None:
        self.finished_requests += 1
        if request.first_token_time is not None:
            self.ttfts.append(request.first_token_time - request.arrival)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of step time."""
        return self.generated_tokens / self.step_time if self.step_time else 0.0

    @property
    def mean_ttft(self) -> float:
        return sum(self.ttfts) / len(self.ttfts) if self.ttfts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def summary(self) -> dict:
        return {"tokens_per_s": round(self.tokens_per_s, 2), "generated_tokens": self.generated_tokens,
                "prompt_tokens": self.prompt_tokens, "steps": self.steps, "mean_ttft_s": round(self.mean_ttft, 4),
                "pages_in_use": self.pages_in_use, "peak_pages_in_use": self.peak_pages_in_use,
                "speculative_acceptance_rate": round(self.acceptance_rate, 4), "preemptions": self.preemptions, "aborted": self.aborted}
