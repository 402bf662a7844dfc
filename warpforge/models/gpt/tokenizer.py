"""The GPT's vocabularies: "bytes" (256 ids, the default: UTF-8 bytes) and "gpt2" (GPT-2's BPE through tiktoken, an
optional dependency: `pip install tiktoken`; its merges file comes from OpenAI's public store on first use, or from
TIKTOKEN_CACHE_DIR)."""
from __future__ import annotations

from functools import lru_cache

TOKENIZERS = ("bytes", "gpt2")
GPT2_VOCAB = 50257      # ids GPT-2's BPE produces
GPT2_MODEL_VOCAB = 50304  # the embedding's rows with --tokenizer gpt2: 50257 rounded up to a multiple of 64


class TokenizerError(RuntimeError):
    """A one-line reason the tokenizer cannot be had here."""


class ByteTokenizer:
    name, vocab = "bytes", 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    name, vocab = "gpt2", GPT2_VOCAB

    def __init__(self, encoding):
        self.encoding = encoding

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self.encoding.decode([i for i in ids if i < GPT2_VOCAB])  # the padding rows are never real text


def _tiktoken_encoding(name: str):
    try:
        import tiktoken
    except ImportError:
        raise TokenizerError("--tokenizer gpt2 needs tiktoken: pip install tiktoken") from None
    try:
        return tiktoken.get_encoding(name)
    except Exception as exc:  # noqa: BLE001 (no network, a proxy, a torn cache: each its own kind)
        raise TokenizerError(f"tiktoken could not load the {name!r} encoding ({type(exc).__name__}: "
                             f"{str(exc)[:120]}); put its file in TIKTOKEN_CACHE_DIR on a machine without "
                             "network") from None


@lru_cache(maxsize=None)
def get(name: str):
    """The tokenizer of that name (TOKENIZERS)."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer(_tiktoken_encoding("gpt2"))
    raise TokenizerError(f"unknown tokenizer {name!r}; known: {', '.join(TOKENIZERS)}")
