"""Text <-> token ids for served models: a Hugging Face tokenizer.json through the `tokenizers` library, or a
warpforge GPT's vocabulary (UTF-8 bytes; GPT-2's BPE through tiktoken). `Detokenizer` turns a growing list of
ids into text deltas without re-decoding everything each token and without splitting a multi-byte character."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..errors import WarpforgeInputError


class HFTokenizer:
    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise WarpforgeInputError("tokenizer: reading tokenizer.json needs the `tokenizers` library: "
                                      "pip install tokenizers") from None
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        config = path / "tokenizer_config.json"
        self.config = json.loads(config.read_text()) if config.exists() else {}
        self.chat_template: Optional[str] = self.config.get("chat_template")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)


class ByteTokenizer:
    """The GPT's default vocabulary: one id per UTF-8 byte."""
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_id(self, token: str) -> Optional[int]:
        return None


class TiktokenGPT2:
    chat_template = None

    def __init__(self):
        try:
            import tiktoken
        except ImportError:
            raise WarpforgeInputError("tokenizer: this GPT was trained with --tokenizer gpt2, which needs tiktoken: "
                                      "pip install tiktoken") from None
        self._enc = tiktoken.get_encoding("gpt2")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._enc.decode([i for i in ids if i < self._enc.n_vocab])

    def token_id(self, token: str) -> Optional[int]:
        return None


def load_tokenizer(path, kind: str = "tokenizer.json"):
    path = Path(path)
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "gpt2":
        return TiktokenGPT2()
    if not (path / "tokenizer.json").exists():
        raise WarpforgeInputError(f"path: expected a tokenizer.json in {path} (or pass token ids instead of text)")
    return HFTokenizer(path)


class Detokenizer:
    """Text deltas of a growing id list: each call decodes only a short window of ids (vLLM's prefix/read offsets)
    and holds text back while it ends in an incomplete UTF-8 sequence (U+FFFD)."""

    def __init__(self, tokenizer, prompt_ids=()):
        self.tokenizer = tokenizer
        # a few prompt ids as context, so that a tokenizer that drops or adds a leading space per call decodes
        # the first output ids as they continue the prompt
        self.ids = list(prompt_ids[-4:])
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, new_ids) -> str:
        self.ids.extend(new_ids)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """What is held back (an incomplete character at the end), once the sequence is finished."""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if after.startswith(before) else ""
