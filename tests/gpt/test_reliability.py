"""`gpt train` when a run is cut short: Ctrl-C, a kill, the time limit; and its output going through logging.
Each compares weights bitwise against an uninterrupted run of the tiny preset on random tokens."""
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from warpforge import cli
from warpforge.models.gpt import data as gdata
from warpforge.models.gpt.train import train

# the same weights bit for bit needs the same kernels: the CPU's (a GPU machine runs these on the CPU as well
# where they start processes; the in-process ones are skipped there)
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="bitwise comparison of CPU training")
TINY = dict(data="random", max_steps=6)


@pytest.fixture(autouse=True)
def _ctrl_c_not_ignored():
    """A process started in the background by a non-interactive shell (`cmd &`) inherits SIGINT ignored, and train
    then rightly leaves Ctrl-C alone; these tests need the interactive default, so they set it for themselves."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _weights(run_dir):
    return torch.load(run_dir / "ckpt.pt", weights_only=True)["model"]


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"weights differ: {differ[:4]}"


@cpu_only
def test_ctrl_c_saves_the_step_under_way_and_resume_matches(tmp_path, monkeypatch):
    """Ctrl-C while a step runs (its batch already drawn) finishes that step and saves it, so the checkpoint's
    data position matches its weights and --resume trains what an uninterrupted run trains."""
    monkeypatch.setenv("WARPFORGE_BACKEND", "reference")
    train("tiny", str(tmp_path / "full"), **TINY)
    draw = gdata.Batches.next
    drawn = []

    def draw_then_ctrl_c(self, device=None):
        batch = draw(self, device)
        drawn.append(1)
        if len(drawn) == 3:  # the third step's batch is out: Ctrl-C now
            os.kill(os.getpid(), signal.SIGINT)
        return batch

    monkeypatch.setattr(gdata.Batches, "next", draw_then_ctrl_c)
    result = None
    with contextlib.suppress(KeyboardInterrupt):
        result = train("tiny", str(tmp_path / "cut"), **TINY)
    monkeypatch.setattr(gdata.Batches, "next", draw)
    saved_step = torch.load(tmp_path / "cut" / "ckpt.pt", weights_only=True)["step"]
    train("tiny", str(tmp_path / "cut"), resume=True)
    _assert_same_weights(_weights(tmp_path / "full"), _weights(tmp_path / "cut"))
    assert saved_step == 3 and result["stopped"] == "interrupted" and result["step"] == 3


def test_kill_after_a_checkpoint_resumes_bitwise(tmp_path):
    """A `gpt train` process killed (SIGKILL) after a periodic checkpoint, resumed, ends with the weights of a
    run that was never interrupted."""
    env = dict(os.environ, WARPFORGE_BACKEND="reference", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
               WARPFORGE_CACHE=str(tmp_path / "cache"))
    base = [sys.executable, "-m", "warpforge", "gpt", "train", "--preset", "tiny", "--data", "random",
            "--max-steps", "6", "--ckpt-every", "2", "--out"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(base + [str(killed)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while not (killed / "ckpt.pt").exists():  # written atomically: once there, it is whole
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.time() < deadline, "no checkpoint within 120 s"
        time.sleep(0.01)
    proc.kill()
    proc.communicate()
    step = torch.load(killed / "ckpt.pt", weights_only=True)["step"]
    assert 2 <= step < 6
    for cmd in (base + [str(killed), "--resume"], base + [str(tmp_path / "full")]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    _assert_same_weights(_weights(tmp_path / "full"), _weights(killed))


def test_time_limit_is_announced_and_the_summary_says_it_stopped_early(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WARPFORGE_BACKEND", "reference")
    rc = cli.main(["gpt", "train", "--preset", "tiny", "--data", "random", "--compile", "off", "--max-minutes",
                   "0.001", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "time limit 0.001 min (--max-minutes)" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("stopped early at the time limit of 0.001 min") and "of 400" in summary
    assert "done" not in summary
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    assert 1 <= ckpt["step"] < 400


def test_max_minutes_help_names_the_presets_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["gpt", "train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--max-minutes" in help_text and "tiny: 4.5" in help_text


def test_train_logs_through_logging_not_print(tmp_path, capsys, caplog, small_tiny):
    with caplog.at_level(logging.INFO, logger="warpforge"):
        train("tiny", str(tmp_path / "run"), max_steps=2)
    assert capsys.readouterr().out == ""
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("warpforge")]
    assert any("checkpoint (end) at step 2" in m for m in messages)


@cpu_only
def test_second_ctrl_c_stops_at_once_without_saving(tmp_path, monkeypatch, small_tiny):
    draw = gdata.Batches.next
    drawn = []

    def draw_then_ctrl_c_twice(self, device=None):
        batch = draw(self, device)
        drawn.append(1)
        if len(drawn) == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return batch

    monkeypatch.setattr(gdata.Batches, "next", draw_then_ctrl_c_twice)
    with pytest.raises(KeyboardInterrupt):
        train("tiny", str(tmp_path / "run"))
    assert not (tmp_path / "run" / "ckpt.pt").exists()  # no checkpoint of a step cut in the middle
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
