"""The prefill bench (issue 19's prefill line) runs end to end at a tiny shape on CPU: both sides time a prompt."""
from warpforge.serve import prefill_bench


def test_prefill_bench_runs_tiny_on_cpu(tmp_path):
    out = prefill_bench.main(["--shape", "tiny", "--tokens", "64", "--device", "cpu", "--reps", "1",
                              "--json", str(tmp_path / "p.json")])
    assert out["warpforge_ms"] > 0 and out["transformers_ms"] > 0 and (tmp_path / "p.json").exists()
