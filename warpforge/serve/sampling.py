"""What to generate (SamplingParams) and how a token is picked from logits: greedy at temperature 0, else a draw
from the distribution that temperature, top-k and top-p leave, with a per-request seeded generator.

`probs` is the one place that distribution is made: plain sampling draws from it, and speculative verification
compares the target's and the drafter's (rejection sampling needs both as probabilities, not samples).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..errors import WarpforgeInputError, check_bool, check_int, check_positive_float, fail


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: Optional[int] = None          # None or 0/-1: all tokens
    top_p: float = 1.0
    seed: Optional[int] = None           # None: a fresh generator from torch's global RNG
    stop: list = field(default_factory=list)          # strings that end the output (not included in its text)
    stop_token_ids: list = field(default_factory=list)  # ids that end it (included in its ids), beside EOS
    ignore_eos: bool = False

    def __post_init__(self):
        check_int("max_tokens", self.max_tokens, lo=1)
        check_positive_float("temperature", self.temperature, allow_none=False, allow_zero=True)
        if self.top_k in (0, -1):
            self.top_k = None
        if self.top_k is not None:
            check_int("top_k", self.top_k, lo=1, what="None, 0 / -1 (off) or an int >= 1")
        if not (isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool) and 0 < self.top_p <= 1):
            fail("top_p", "a probability in (0, 1]", repr(self.top_p))
        if self.seed is not None:
            check_int("seed", self.seed, lo=0, hi=2**64 - 1)   # what torch.Generator.manual_seed takes
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "a string or a list of non-empty strings", repr(self.stop))
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.stop_token_ids):
            fail("stop_token_ids", "a list of token ids (ints >= 0)", repr(self.stop_token_ids))
        check_bool("ignore_eos", self.ignore_eos)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device) -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is not None:
            g.manual_seed(self.seed)
        else:
            g.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        return g


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution (fp32 [..., vocab]) of logits under params' temperature / top-k / top-p; greedy
    (temperature 0) gives the one-hot of the argmax."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # shifted so that the largest logit is 0 before dividing: a tiny temperature sends the rest to -inf, not NaN
    x = logits.float()
    x = (x - x.max(-1, keepdim=True).values) / params.temperature
    if params.top_k is not None and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True, dim=-1)
        p = sorted_x.softmax(-1)
        drop = p.cumsum(-1) - p > params.top_p  # keep the smallest prefix whose mass reaches top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def sample(p: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a distribution p [vocab] (fp32)."""
    return int(torch.multinomial(p, 1, generator=generator))


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from logits [vocab]."""
    if params.greedy:
        return int(logits.argmax())
    return sample(probs(logits, params), generator)


def check_params(params) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise WarpforgeInputError(f"sampling_params: expected a SamplingParams, got {type(params).__name__}")
    return params
