"""`gpt train --controller monarch`: one controller process driving a torchmonarch mesh of 2 CPU trainer processes
(DDP over gloo). Its run matches torchrun's (the same seed, steps and global batch), and a trainer process that dies
mid-run is restarted from the last checkpoint without anyone rerunning anything. Skipped where torchmonarch does
not import (pip install -e '.[monarch]')."""
import os
import re
import subprocess
import sys

import pytest

from warpforge import cli
from warpforge.models.gpt.controller import INSTALL_HINT, monarch_missing

from .conftest import read_ckpt

MISSING = monarch_missing()
needs_monarch = pytest.mark.skipif(MISSING is not None, reason=f"torchmonarch unavailable: {MISSING}")
STEPS, CKPT_EVERY = 6, 2
# the tiny preset at 2 of its 4 layers, 32-token sequences and 8 of them a step: the same run, in a fraction of the time
TRAIN = ["-m", "warpforge", "gpt", "train", "--preset", "tiny", "--data", "random", "--max-steps", str(STEPS),
         "--ckpt-every", str(CKPT_EVERY), "--compile", "off", "--n_layer=2", "--seq_len=32", "--batch_size=8"]


def _env(tmp):
    # CPU processes even on a GPU machine, one thread each (the same reductions in every run)
    return dict(os.environ, WARPFORGE_BACKEND="reference", WARPFORGE_CACHE=str(tmp / "cache"), OMP_NUM_THREADS="1",
                CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")


def _run(args, tmp):
    done = subprocess.run([sys.executable] + args, env=_env(tmp), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout


def _assert_close_runs(a, b):
    assert a["step"] == b["step"] == STEPS
    assert a["model"].keys() == b["model"].keys()
    worst = max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])
    assert worst <= 1e-4, f"weights differ by {worst}"
    la = [h["loss"] for h in a["history"] if "loss" in h]
    lb = [h["loss"] for h in b["history"] if "loss" in h]
    assert la and la == pytest.approx(lb, abs=1e-4)
    assert len(a["data_state"]) == len(b["data_state"]) == 2


def _streamed_losses(stdout):
    """{step: loss} from the controller's progress lines (`step S/N | loss L`)."""
    return {int(s): float(v) for s, v in re.findall(r"step (\d+)/\d+ \| loss ([0-9.]+)", stdout)}


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    """The reference: the same run under torchrun (2 CPU processes, DDP over gloo)."""
    tmp = tmp_path_factory.mktemp("torchrun")
    _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] + TRAIN + ["--out", str(tmp / "run")],
         tmp)
    return read_ckpt(tmp / "run")


@needs_monarch
def test_controller_run_matches_torchrun(tmp_path, torchrun_run):
    out = _run(TRAIN + ["--controller", "monarch", "--procs", "2", "--out", str(tmp_path / "run")], tmp_path)
    _assert_close_runs(read_ckpt(tmp_path / "run"), torchrun_run)
    assert sorted(_streamed_losses(out)) == list(range(1, STEPS + 1))  # every step's loss reached the controller
    assert out.strip().splitlines()[-1] == f"done: step {STEPS} of {STEPS}"


@needs_monarch
def test_a_dead_trainer_is_restarted_from_the_last_checkpoint(tmp_path, torchrun_run):
    """Rank 1's process exits after step 3 (once): the controller restarts the mesh from the checkpoint of step 2
    and the run ends as an uninterrupted one does."""
    out = _run(TRAIN + ["--controller", "monarch", "--procs", "2", "--fail-at", "1:3", "--out",
                        str(tmp_path / "run")], tmp_path)
    assert "restarting the mesh from the checkpoint at step 2 (restart 1 of at most 3)" in out
    assert "restarted 1 time(s)" in out
    assert out.strip().splitlines()[-1] == f"done: step {STEPS} of {STEPS}"
    _assert_close_runs(read_ckpt(tmp_path / "run"), torchrun_run)
    assert sorted(_streamed_losses(out)) == list(range(1, STEPS + 1))


def test_without_torchmonarch_the_flag_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "monarch", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "monarch.actor", None)
    rc = cli.main(["gpt", "train", "--controller", "monarch", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and INSTALL_HINT in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args", [["--procs", "2"], ["--max-restarts", "1"]])
def test_controller_flags_need_the_controller(args, capsys):
    assert cli.main(["gpt", "train"] + args) == 2
    assert "need --controller monarch" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--procs", "0"], ["--max-restarts", "-1"], ["--fail-at", "1"],
                                  ["--controller", "ray"]])
def test_bad_controller_flags_are_one_line_errors(args, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["gpt", "train", "--controller", "monarch"] + args)
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
