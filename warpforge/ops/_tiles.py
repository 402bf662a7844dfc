"""The tile table: kernel configs by architecture, shape class and size, one type for every family.

    FWD = TileTable({
        "cpu":     {"any": Cfg(16, 16, 1, 1)},                      # the Triton interpreter (required)
        "default": {"any": {0: Cfg(64, 64, 4, 2), 256: Cfg(...)}},  # an arch without a row (required)
        "sm90":    {128: Cfg(128, 128, 8, 3), (8, 28672, 4096): {0: ..., 64: ...}},
    })
    cfg = FWD.lookup(device, kind=128, size=tokens)

`lookup` takes the arch's row (runtime.arch_key: "sm90", "sm80", ..., "cpu"; "default" when the table has
no row for it), then the kind's entries (an exact key, e.g. a padded head dim or a model shape; "any" when
the row has none for that kind), then among those the one with the largest size threshold <= size. A kind
given a single config instead of a {threshold: config} dict means {0: config}. Configs are NamedTuples
defined in the family's configs.py; the tuned entries' measurements live in benchmarks/NOTES.md.
"""
from __future__ import annotations

from typing import Generic, Hashable, Mapping, TypeVar, Union

import torch

from ..runtime import arch_key

Cfg = TypeVar("Cfg")
ANY = "any"


class TileTable(Generic[Cfg]):
    def __init__(self, rows: Mapping[str, Mapping[Hashable, Union[Cfg, Mapping[int, Cfg]]]]):
        for arch in ("cpu", "default"):
            if arch not in rows:
                raise ValueError(f"a TileTable needs a {arch!r} row")
        self.rows = {arch: {kind: dict(entry) if isinstance(entry, Mapping) else {0: entry}
                            for kind, entry in row.items()} for arch, row in rows.items()}

    def lookup(self, device: Union[torch.device, str], kind: Hashable = ANY, size: int = 0) -> Cfg:
        arch = device if isinstance(device, str) else arch_key(device)
        row = self.rows.get(arch, self.rows["default"])
        by_size = row.get(kind, row.get(ANY))
        fits = [s for s in by_size or () if s <= size]
        if not fits:
            raise KeyError(f"no tile config for kind {kind!r} at size {size} on {arch}")
        return by_size[max(fits)]

    def arches(self) -> list[str]:
        return list(self.rows)

    def map(self, fn) -> "TileTable[Cfg]":
        """The same table with fn applied to every config (tests force a variant: `FWD.map(lambda c:
        c._replace(tma=True))`)."""
        return TileTable({arch: {kind: {s: fn(cfg) for s, cfg in entry.items()} for kind, entry in row.items()}
                          for arch, row in self.rows.items()})
