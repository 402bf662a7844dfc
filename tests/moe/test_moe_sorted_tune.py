"""`warpforge tune moe-sorted` end to end at a tiny shape through the interpreter: every candidate config runs a
forward and backward (the timer replaced by one call: the sweep's own timer needs a GPU)."""

import pytest
import torch

from warpforge.bench import baselines
from warpforge.ops.moe import configs, experts_reference
from warpforge.tune import moe_sorted


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter smoke test; on a GPU `warpforge tune "
                    "moe-sorted` itself runs every candidate")
def test_every_candidate_runs(monkeypatch, capsys):
    ran = []

    def once(fn, **kw):
        fn()
        ran.append(1)
        return 1.0
    cpu_cfg = configs.SORTED.lookup(torch.device("cpu"), "any", 4096)

    class Table:
        @staticmethod
        def lookup(device, shape, tokens):
            return cpu_cfg
    monkeypatch.setattr(moe_sorted, "time_candidate", once)
    monkeypatch.setattr(moe_sorted, "MODELS", {"tiny": (4, 2, 32, 48, {})})
    monkeypatch.setattr(moe_sorted.configs, "SORTED", Table)
    monkeypatch.setattr(baselines, "grouped_mm_experts", experts_reference)
    moe_sorted.main(["--models", "tiny", "--tokens", "12", "--device", "cpu"])
    out = capsys.readouterr().out
    assert len(ran) == len(moe_sorted.candidates(cpu_cfg)) + 2  # the candidates, the gathered path, grouped_mm
    assert "tiny T12 ws" in out and "tiny T12 dact4" in out and "x grouped_mm" in out
