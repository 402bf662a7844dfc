"""The command line: bad input is one line on stderr and exit code 2, never a traceback; every option is
documented."""
import argparse

import pytest

import warpforge
from warpforge import cli
from warpforge.models.gpt.train import train


def _exit_code(argv, capsys):
    """(exit code, stderr) of `warpforge argv`, whether argparse exits or the command returns."""
    try:
        rc = cli.main(argv)
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def _one_line_error(argv, capsys, match=None):
    rc, err = _exit_code(argv, capsys)
    assert rc == 2, (argv, rc, err)
    assert err.strip() and "\n" not in err.strip() and "Traceback" not in err, err
    if match:
        assert match in err, err
    return err


@pytest.mark.parametrize("args", [["--top-k", "0"], ["--top-k", "-1"], ["--top-p", "2"], ["--top-p", "0"],
                                  ["--temperature", "nan"], ["--temperature", "-1"], ["--num", "0"],
                                  ["--tokens", "-3"], ["--tokens", "many"]])
def test_bad_sampling_settings_are_one_line_errors(args, capsys):
    _one_line_error(["gpt", "sample", *args], capsys, match=args[0])


@pytest.mark.parametrize("args", [["--max-steps", "-5"], ["--max-steps", "0"], ["--max-minutes", "-1"],
                                  ["--max-minutes", "inf"], ["--ckpt-every", "0"], ["--ddp-bucket-mb", "0"]])
def test_bad_training_settings_are_one_line_errors(args, capsys, tmp_path):
    _one_line_error(["gpt", "train", "--data", "random", "--out", str(tmp_path / "run"), *args], capsys,
                    match=args[0])
    assert not (tmp_path / "run").exists()  # nothing written


def test_bad_bench_regex_is_a_one_line_error(capsys):
    _one_line_error(["bench", "--match", "("], capsys, match="--match")


def test_unknown_preset_is_a_one_line_error(capsys, tmp_path):
    _one_line_error(["gpt", "train", "--preset", "nope", "--out", str(tmp_path)], capsys, match="unknown preset")


@pytest.fixture
def truncated_checkpoint(tmp_path, small_tiny):
    """A run directory whose ckpt.pt lost its second half (a full disk, a copy cut short)."""
    train("tiny", str(tmp_path / "run"), max_steps=1)
    ckpt = tmp_path / "run" / "ckpt.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:ckpt.stat().st_size // 2])
    return ckpt


def test_truncated_checkpoint_is_a_one_line_error_for_resume_and_sample(truncated_checkpoint, capsys):
    run = truncated_checkpoint.parent
    _one_line_error(["gpt", "train", "--resume", "--out", str(run)], capsys, match="ckpt.pt")
    _one_line_error(["gpt", "sample", "--ckpt", str(truncated_checkpoint)], capsys, match="ckpt.pt")


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all", b"PK\x03\x04garbage"])
def test_corrupt_checkpoint_is_a_one_line_error(tmp_path, capsys, content, small_tiny):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_bytes(content)
    _one_line_error(["gpt", "train", "--resume", "--out", str(tmp_path / "run")], capsys, match="ckpt.pt")
    _one_line_error(["gpt", "sample", "--ckpt", str(tmp_path / "run" / "ckpt.pt")], capsys, match="ckpt.pt")


def test_foreign_checkpoint_is_a_one_line_error(tmp_path, capsys):
    import torch
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other.pt")
    _one_line_error(["gpt", "sample", "--ckpt", str(tmp_path / "other.pt")], capsys, match="not a warpforge")


def test_missing_checkpoint_is_a_one_line_error(tmp_path, capsys):
    _one_line_error(["gpt", "sample", "--ckpt", str(tmp_path / "none.pt")], capsys, match="no checkpoint")


def test_sample_from_a_checkpoint(tmp_path, capsys, small_tiny):
    train("tiny", str(tmp_path / "run"), max_steps=1)
    rc = cli.main(["gpt", "sample", "--ckpt", str(tmp_path / "run" / "ckpt.pt"), "--prompt", "ab", "--tokens", "5",
                   "--num", "2", "--top-p", "0.9"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("ab") >= 2


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"warpforge {warpforge.__version__}"


def _all_actions(parser):
    for action in parser._actions:
        yield parser.prog, action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_actions(sub)


def test_every_option_has_help_text():
    missing = [f"{prog} {action.option_strings or action.dest}" for prog, action in _all_actions(cli.build_parser())
               if not isinstance(action, argparse._SubParsersAction) and not action.help]
    assert not missing, missing


def test_bench_match_that_selects_nothing_is_a_one_line_error(capsys):
    _one_line_error(["bench", "--match", "zzz-no-such-case", "--list"], capsys, match="no case matches")


def test_bench_match_takes_the_family_name(capsys):
    rc, err = _exit_code(["bench", "--list", "--match", "^monarch fwd "], capsys)
    assert rc == 0, err


def test_monarch_blocks_needs_the_monarch_mlp(capsys, tmp_path):
    _one_line_error(["gpt", "train", "--data", "random", "--out", str(tmp_path / "run"), "--monarch-blocks", "4"],
                    capsys, match="--mlp monarch")


def test_monarch_blocks_that_do_not_divide_the_model_are_one_line_errors(capsys, tmp_path):
    _one_line_error(["gpt", "train", "--data", "random", "--out", str(tmp_path / "run"), "--mlp", "monarch",
                     "--monarch-blocks", "3"], capsys, match="monarch_blocks")
    assert not (tmp_path / "run").exists()


def test_checkpoints_in_standard_formats(tmp_path, capsys, small_tiny):
    """Beside ckpt.pt (which torch.load reads with weights_only=True) a run writes model.safetensors and config.json;
    the tied output head is stored once; `gpt sample` reads the folder or the safetensors file."""
    import json

    import torch
    from safetensors.torch import load_file

    from warpforge.models.gpt.sample import load

    run = tmp_path / "run"
    train("tiny", str(run), max_steps=2)
    ckpt = torch.load(run / "ckpt.pt", map_location="cpu", weights_only=True)
    weights = load_file(str(run / "model.safetensors"))
    meta = json.loads((run / "config.json").read_text())
    assert meta["step"] == 2 and meta["model_cfg"] == ckpt["model_cfg"]
    assert meta["tied"] == {"head.weight": "embed.weight"}
    assert set(weights) | set(meta["tied"]) == set(ckpt["model"])
    for name, t in weights.items():
        assert torch.equal(t, ckpt["model"][name]), name
    from_pt, from_folder = load(ckpt=str(run / "ckpt.pt")), load(ckpt=str(run))
    for a, b in zip(from_pt.state_dict().values(), from_folder.state_dict().values()):
        assert torch.equal(a, b)
    rc = cli.main(["gpt", "sample", "--ckpt", str(run / "model.safetensors"), "--prompt", "ab", "--tokens", "3"])
    assert rc == 0 and "ab" in capsys.readouterr().out
    (run / "config.json").write_text("{")
    _one_line_error(["gpt", "sample", "--ckpt", str(run)], capsys, match="not a readable warpforge export")


def test_any_config_field_as_a_setting(tmp_path, small_tiny):
    """nanoGPT-style --field=value for any GPTConfig / TrainConfig field."""
    import torch
    run = tmp_path / "run"
    assert cli.main(["gpt", "train", "--out", str(run), "--n_layer=1", "--batch-size=2", "--lr=0.002",
                     "--max_minutes=none", "--max-steps", "1"]) == 0
    ckpt = torch.load(run / "ckpt.pt", weights_only=True)
    assert ckpt["model_cfg"]["n_layer"] == 1
    assert ckpt["train_cfg"]["batch_size"] == 2 and ckpt["train_cfg"]["lr"] == 0.002
    assert ckpt["train_cfg"]["max_minutes"] is None


@pytest.mark.parametrize("args,match", [(["--n_layer=abc"], "--n_layer"), (["--nope=1"], "unrecognized"),
                                        (["--n_layer"], "unrecognized"), (["--tie_embeddings=maybe"], "bool"),
                                        (["--max_steps=3", "--max-steps", "3"], "twice")])
def test_bad_config_settings_are_one_line_errors(args, match, capsys, tmp_path):
    _one_line_error(["gpt", "train", "--data", "random", "--out", str(tmp_path / "run"), *args], capsys, match=match)
    assert not (tmp_path / "run").exists()


def test_settings_only_for_train(capsys):
    rc, err = _exit_code(["bench", "--list", "--n_layer=1"], capsys)
    assert rc == 2 and "unrecognized" in err


def _token_folder(folder, top):
    import numpy as np
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, top + 1, 5000).astype(np.uint16).tofile(folder / f"{split}.bin")
    return folder


def test_a_users_token_files(tmp_path, small_tiny):
    """--data DIR: nanoGPT's train.bin / val.bin of uint16 token ids, with the model's vocab_size set to fit."""
    import torch
    data = _token_folder(tmp_path / "tokens", 299)
    run = tmp_path / "run"
    assert cli.main(["gpt", "train", "--out", str(run), "--data", str(data), "--vocab_size=300", "--max-steps",
                     "1"]) == 0
    assert torch.load(run / "ckpt.pt", weights_only=True)["model_cfg"]["vocab_size"] == 300


def test_bad_token_files_are_one_line_errors(tmp_path, capsys, small_tiny):
    data = _token_folder(tmp_path / "tokens", 299)
    _one_line_error(["gpt", "train", "--out", str(tmp_path / "run"), "--data", str(data)], capsys,
                    match="vocab_size")
    (data / "val.bin").write_bytes(b"123")
    _one_line_error(["gpt", "train", "--out", str(tmp_path / "run"), "--data", str(data), "--vocab_size=300"], capsys,
                    match="uint16")
    _one_line_error(["gpt", "train", "--out", str(tmp_path / "run"), "--data", str(tmp_path / "nope")], capsys,
                    match="data")
    assert not (tmp_path / "run").exists()


def test_version_matches_the_package_metadata():
    import pathlib
    import re
    text = (pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', text, re.M).group(1) == warpforge.__version__


class _FakeWandb:
    """What --wandb calls of the wandb package, recorded."""

    def __init__(self):
        self.logged, self.inits, self.finished = [], [], False

    def init(self, **kw):
        self.inits.append(kw)
        return self

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


def test_wandb_logs_the_history(tmp_path, small_tiny, monkeypatch):
    import sys
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    assert cli.main(["gpt", "train", "--out", str(tmp_path / "run"), "--wandb", "proj", "--max-steps", "3"]) == 0
    assert fake.inits[0]["project"] == "proj" and fake.inits[0]["config"]["model"]["n_layer"] == 2
    assert [s for s, d in fake.logged if "loss" in d] and fake.finished


def test_wandb_missing_is_a_one_line_error(tmp_path, capsys, small_tiny, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    _one_line_error(["gpt", "train", "--out", str(tmp_path / "run"), "--wandb", "proj"], capsys,
                    match="pip install wandb")


class _FakeEncoding:
    """A stand-in for tiktoken's gpt2 encoding (its merges file is not reachable here): bytes shifted by 1000."""

    def encode_ordinary(self, text):
        return [b + 1000 for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(i - 1000 for i in ids if 1000 <= i < 1256).decode("utf-8", errors="replace")


def test_gpt2_tokenizer_trains_and_samples(tmp_path, capsys, small_tiny, monkeypatch):
    """--tokenizer gpt2: the plays tokenized once into the cache, vocab_size 50304, samples decoded."""
    import numpy as np
    import torch

    from warpforge.models.gpt import tokenizer
    cache = tmp_path / "cache"
    (cache / "shakespeare").mkdir(parents=True)
    text = np.frombuffer(("To be, or not to be: that is the question.\n" * 40).encode(), dtype=np.uint8)
    for split in ("train", "val"):
        text.tofile(cache / "shakespeare" / f"{split}.bin")
    monkeypatch.setenv("WARPFORGE_CACHE", str(cache))
    monkeypatch.setattr(tokenizer, "_tiktoken_encoding", lambda name: _FakeEncoding())
    tokenizer.get.cache_clear()
    run = tmp_path / "run"
    try:
        assert cli.main(["gpt", "train", "--out", str(run), "--data", "shakespeare", "--tokenizer", "gpt2",
                         "--max-steps", "1"]) == 0
        cfg = torch.load(run / "ckpt.pt", weights_only=True)["model_cfg"]
        assert cfg["tokenizer"] == "gpt2" and cfg["vocab_size"] == 50304
        ids = np.fromfile(cache / "shakespeare-gpt2" / "train.bin", dtype=np.uint16)
        assert len(ids) == len(text) and ids.min() >= 1000
        capsys.readouterr()
        assert cli.main(["gpt", "sample", "--ckpt", str(run), "--prompt", "To be", "--tokens", "4"]) == 0
        assert "To be" in capsys.readouterr().out
    finally:
        tokenizer.get.cache_clear()


def test_gpt2_tokenizer_without_tiktoken_is_a_one_line_error(tmp_path, capsys, small_tiny, monkeypatch):
    import sys

    from warpforge.models.gpt import tokenizer
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    monkeypatch.setenv("WARPFORGE_CACHE", str(tmp_path / "cache"))
    tokenizer.get.cache_clear()
    (tmp_path / "cache" / "shakespeare").mkdir(parents=True)
    for split in ("train", "val"):
        (tmp_path / "cache" / "shakespeare" / f"{split}.bin").write_bytes(b"hello world " * 50)
    try:
        _one_line_error(["gpt", "train", "--out", str(tmp_path / "run"), "--data", "shakespeare", "--tokenizer",
                         "gpt2"], capsys, match="tiktoken")
    finally:
        tokenizer.get.cache_clear()


def test_tune_sweeps_are_in_the_package(capsys):
    """`warpforge tune NAME`: every sweep module imports and takes its options as argv; without a GPU the command
    says so in one line."""
    import importlib

    import torch

    from warpforge.tune import SWEEPS
    for module in SWEEPS.values():
        assert callable(importlib.import_module(f"warpforge.tune.{module}").main)
    if not torch.cuda.is_available():
        _one_line_error(["tune", "mla", "--L", "1024"], capsys, match="CUDA GPU")
    _one_line_error(["tune", "nope"], capsys, match="invalid choice")
