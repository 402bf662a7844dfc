"""A request's life in the engine: its tokens (prompt, then output), how many of them its KV pages hold, its
text so far, and when it stops (EOS, a stop token or string, max_tokens, the model's length).

`tokens[-1]` of a running request past its prefill is the last token picked, not yet in the cache: the next step
feeds it (with any drafted tokens after it). So a decoding request always has num_computed == len(tokens) - 1.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from .sampling import SamplingParams
from .tokenizer import Detokenizer


@dataclass
class RequestOutput:
    """A request's state after a step: everything so far, and what this step added (for streaming)."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    token_ids: list
    text: str
    new_token_ids: list
    new_text: str
    finished: bool
    finish_reason: Optional[str]   # "stop" (EOS, stop token or string), "length" (max_tokens / model length), "abort"
    time_to_first_token: Optional[float] = None


class Request:
    def __init__(self, request_id: str, prompt: Optional[str], prompt_ids: list, params: SamplingParams,
                 generator, tokenizer, eos_ids: tuple, max_model_len: int,
                 on_output: Optional[Callable[[RequestOutput], None]] = None):
        self.id, self.prompt, self.params = request_id, prompt, params
        self.prompt_ids = list(prompt_ids)
        self.tokens = list(prompt_ids)
        self.num_computed = 0            # tokens whose K/V the target cache holds
        self.generator = generator
        self.detok = Detokenizer(tokenizer, self.prompt_ids) if tokenizer is not None else None
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.max_model_len = max_model_len
        self.text = ""                   # released text (what outputs and streams have shown)
        self._decoded = ""               # decoded text, the stop buffer beyond self.text included
        self._stop_len = max((len(x) for x in params.stop), default=1)
        self.finish_reason: Optional[str] = None
        self.on_output = on_output
        self.arrival = time.perf_counter()
        self.first_token_time: Optional[float] = None
        self.drafted = self.accepted = 0  # speculative tokens proposed for it and accepted

    @property
    def output_ids(self) -> list:
        return self.tokens[len(self.prompt_ids):]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def decoding(self) -> bool:
        """Past its prefill: only the newest token is not in the cache."""
        return self.num_computed == len(self.tokens) - 1

    def room(self) -> int:
        """Tokens it may still produce."""
        return min(self.params.max_tokens - len(self.output_ids), self.max_model_len - len(self.tokens))

    def append(self, token: int) -> str:
        """Adds one output token and checks the stop conditions; returns the text it releases (cut at a stop string).

        While unfinished, the last max(len(stop)) - 1 characters are held back (vLLM's stop buffer): they may be
        the start of a stop string, which must never reach a stream. They are released when the request finishes."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.tokens.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        if self.finish_reason is None and self.room() <= 0:
            self.finish_reason = "length"
        if self.detok is not None:
            searched = len(self._decoded)
            self._decoded += self.detok.add([token])
            if self.finished:  # an incomplete character held at the end: the stop check sees it too
                self._decoded += self.detok.flush()
            if self.params.stop and len(self._decoded) > searched:
                start = max(0, searched - self._stop_len + 1)
                hits = [i for i in (self._decoded.find(s, start) for s in self.params.stop) if i >= 0]
                if hits:
                    self._decoded = self._decoded[:min(hits)]
                    self.finish_reason = "stop"
        release = len(self._decoded) if self.finished else max(len(self.text),
                                                                 len(self._decoded) - self._stop_len + 1)
        delta = self._decoded[len(self.text):release]
        self.text = self._decoded[:release]
        return delta

    def output(self, new_ids: list, new_text: str) -> RequestOutput:
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
        return RequestOutput(self.id, self.prompt, self.prompt_ids, list(self.output_ids), self.text, list(new_ids),
                             new_text, self.finished, self.finish_reason, ttft)
