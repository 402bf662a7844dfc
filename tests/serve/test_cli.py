"""`warpforge generate`: streams the continuation to stdout; bad input is one line on stderr and exit code 2."""
from __future__ import annotations

from warpforge import cli
from warpforge.serve import LLM, SamplingParams


def test_generate_prints_the_greedy_continuation(llama_dir, capsys):
    want = LLM(llama_dir, num_pages=32).generate("hello", SamplingParams(max_tokens=6, temperature=0))[0].text
    assert cli.main(["generate", "--model", str(llama_dir), "--prompt", "hello", "--max-tokens", "6",
                     "--speculative", "ngram"]) == 0
    out = capsys.readouterr()
    assert out.out == want + "\n" and "tokens/s" in out.err


def test_generate_bad_model_dir(tmp_path, capsys):
    assert cli.main(["generate", "--model", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.startswith("warpforge generate: path:")
