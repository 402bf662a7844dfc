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
