"""The backend switch, the error type, and `warpforge bench` end to end on this machine."""
import json

import pytest
import torch

from warpforge import WarpforgeInputError
from warpforge.runtime import resolve_backend


def test_backend_resolution(monkeypatch):
    monkeypatch.delenv("WARPFORGE_BACKEND", raising=False)
    assert resolve_backend(None, torch.device("cpu")) == "reference"
    assert resolve_backend("reference", torch.device("cpu")) == "reference"
    monkeypatch.setenv("WARPFORGE_BACKEND", "reference")
    assert resolve_backend(None, torch.device("cpu")) == "reference"
    with pytest.raises(WarpforgeInputError, match="^backend"):
        resolve_backend("cuda", torch.device("cpu"))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(WarpforgeInputError, match="TRITON_INTERPRET"):
        resolve_backend("triton", torch.device("cpu"))


def test_tma_compatible_refuses_expanded_rows():
    """Tensor descriptors need 16-byte multiples between distinct rows: a row-contiguous bf16 matrix of 8-multiple
    width passes; a stride-0 (expanded) row, a transposed view and an odd width do not."""
    from warpforge.runtime import tma_compatible
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert tma_compatible(x)
    assert not tma_compatible(x[:1].expand(4, 64))
    assert not tma_compatible(x.t())
    assert not tma_compatible(torch.zeros(4, 60, dtype=torch.bfloat16)[:, :30])


def test_error_is_a_value_error():
    assert issubclass(WarpforgeInputError, ValueError)


def test_bench_quick_writes_json(tmp_path, capsys):
    from warpforge.cli import main
    path = tmp_path / "attention.json"
    rc = main(["bench", "--family", "attention", "--quick", "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    machine = result["machine"]
    for key in ("gpu", "driver", "torch", "triton", "git_commit", "copy_tbps", "gemm_tflops"):
        assert key in machine
    ours = [r for r in result["rows"] if r["impl"] == "warpforge"]
    assert ours and all(r["family"] == "attention" and r["ms"] > 0 for r in ours)
    assert all(r["err"] < 1e-2 for r in ours)
    out = capsys.readouterr().out
    if not torch.cuda.is_available():
        assert "not GPU times" in out


def test_bench_unknown_family():
    from warpforge.cli import main
    assert main(["bench", "--family", "nope"]) == 2


def test_tile_table_lookup():
    from typing import NamedTuple

    from warpforge.ops._tiles import TileTable

    class Cfg(NamedTuple):
        tile: int

    table = TileTable({"cpu": {"any": Cfg(1)}, "default": {"any": {0: Cfg(2), 100: Cfg(3)}},
                       "sm90": {"any": Cfg(4), "big": {0: Cfg(5), 64: Cfg(6)}}})
    assert table.lookup("cpu", "big", 10**6) == Cfg(1)
    assert table.lookup("sm80", "big", 99) == Cfg(2) and table.lookup("sm80", "x", 100) == Cfg(3)  # default row
    assert table.lookup("sm90", "big", 63) == Cfg(5) and table.lookup("sm90", "big", 64) == Cfg(6)
    assert table.lookup("sm90", "other", 7) == Cfg(4)  # a kind without entries takes "any"
    assert table.map(lambda c: c._replace(tile=0)).lookup("sm90", "big", 64) == Cfg(0)
    with pytest.raises(ValueError, match="default"):
        TileTable({"cpu": {"any": Cfg(1)}})


def test_device_specs_cover_the_gpus_users_have():
    from warpforge.runtime import DEVICE_SPECS
    names = " ".join(key for key, _ in DEVICE_SPECS)
    for gpu in ("H100", "H200", "A100", "B200", "MI300X"):
        assert gpu in names
    for _, spec in DEVICE_SPECS:
        assert spec.bf16_flops > 1e14 and spec.cache_bytes >= 2**20


def test_bench_finds_a_new_cases_module(tmp_path, monkeypatch):
    """A *_cases.py dropped into warpforge/bench is listed by the bench without any other edit."""
    import pathlib
    import sys

    from warpforge.bench import cases
    bench_dir = pathlib.Path(cases.__file__).parent
    path = bench_dir / "zz_probe_cases.py"
    path.write_text('from .cases import Setup, register\n'
                    'register("zzprobe", "probe case")(lambda dev, tiny: Setup(0, 0, {"warpforge": lambda: None}))\n')
    try:
        assert "zzprobe" in cases.families()
        assert [c.name for c in cases.select("zzprobe")] == ["probe case"]
    finally:
        path.unlink()
        sys.modules.pop("warpforge.bench.zz_probe_cases", None)
        cases.REGISTRY[:] = [c for c in cases.REGISTRY if c.family != "zzprobe"]


def test_a_step_that_cannot_be_captured_is_timed_eagerly_and_labelled(monkeypatch):
    """graphed() falls back to eager calls when a capture raises, and its label says so (the runner writes it into
    the row): an eager row must not pass for a graph-replayed one beside the others."""
    import contextlib
    from types import SimpleNamespace

    from warpforge.bench import cases

    class Stream:
        def wait_stream(self, other):
            pass

    def graph(g, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    rot = cases.Rotation(lambda: torch.ones(2), 8, torch.device("cpu"))
    calls = []
    fn = cases.graphed(lambda x: calls.append(1) or x * 2, rot, torch.device("cuda"))
    assert fn.timer.startswith("eager (capture failed: RuntimeError: operation not permitted")
    assert torch.equal(fn(), torch.full((2,), 2.0)) and calls
    assert cases.graphed(lambda x: x, rot, torch.device("cpu")).timer == "eager (no CUDA)"
