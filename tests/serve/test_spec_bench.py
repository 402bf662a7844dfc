"""The speculative-decoding bench (issue 19's speedup line) runs end to end on CPU, and its outputs agree."""
from warpforge.serve import spec_bench


def test_spec_bench_ngram_is_lossless(llama_dir, tmp_path):
    out = spec_bench.main(["--model", str(llama_dir), "--speculative", "ngram", "--tokens", "24", "--device", "cpu",
                           "--prompt", "abc abc abc abc abc", "--json", str(tmp_path / "s.json")])
    assert out["identical"] and out["plain_tok_s"] > 0 and out["speculative_tok_s"] > 0
    assert out["repeats"] == 3 and len(out["speedup_runs"]) == 3 and out["acceptance_rate"] > 0
