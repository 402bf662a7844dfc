"""Distillation (`gpt train --teacher=RUN`): a draft model trained to its target's next-token distributions."""
import pytest
import torch

from warpforge import cli
from warpforge.models.gpt.train import distill_loss

from .test_cli import _one_line_error


def test_distill_loss_is_the_per_token_kl():
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 7), torch.randn(2, 5, 7)
    want = (t.softmax(-1) * (t.log_softmax(-1) - s.log_softmax(-1))).sum(-1).mean()
    torch.testing.assert_close(distill_loss(s, t), want)
    assert float(distill_loss(t, t)) == pytest.approx(0, abs=1e-6)
    assert float(distill_loss(t + 3.0, t)) == pytest.approx(0, abs=1e-6)  # logits, not probabilities


@pytest.fixture
def teacher(tmp_path, small_tiny):
    run = tmp_path / "teacher"
    assert cli.main(["gpt", "train", "--out", str(run), "--max-steps", "6", "--max_minutes=none"]) == 0
    # trained on random tokens its distributions are near uniform, as a fresh student's: sharpen them (logits x 20)
    ckpt = torch.load(run / "ckpt.pt", weights_only=True)
    ckpt["model"]["norm.weight"] *= 20
    torch.save(ckpt, run / "ckpt.pt")
    return run / "ckpt.pt"


def test_a_distilled_run_learns_its_teachers_distributions(tmp_path, teacher):
    """The student's KL to the teacher falls as it trains, and its checkpoint is a run like any other."""
    from warpforge.models.gpt.sample import load
    student = tmp_path / "student"
    argv = ["gpt", "train", "--out", str(student), "--n_layer=1", f"--teacher={teacher}", "--max_minutes=none",
            "--lr=0.01"]
    assert cli.main(argv + ["--max-steps", "1"]) == 0
    t = load(ckpt=str(teacher), device="cpu")
    x = torch.randint(0, t.cfg.vocab_size, (4, t.cfg.seq_len))

    def kl():
        with torch.no_grad():
            return float(distill_loss(load(ckpt=str(student), device="cpu")(x), t(x)))
    before = kl()
    assert cli.main(argv + ["--max-steps", "12", "--resume"]) == 0
    assert kl() < 0.85 * before
    ckpt = torch.load(student / "ckpt.pt", weights_only=True)
    assert ckpt["train_cfg"]["teacher"] == str(teacher) and ckpt["model_cfg"]["n_layer"] == 1


@pytest.mark.parametrize("args,match", [(["--vocab_size=300"], "vocabulary"), (["--seq_len=64"], "seq_len"),
                                        (["--moe_experts=4"], "MoE")])
def test_a_teacher_that_does_not_fit_is_a_one_line_error(args, match, tmp_path, teacher, capsys):
    _one_line_error(["gpt", "train", "--out", str(tmp_path / "s"), f"--teacher={teacher}", *args], capsys, match)


def test_a_missing_teacher_is_a_one_line_error(tmp_path, small_tiny, capsys):
    _one_line_error(["gpt", "train", "--out", str(tmp_path / "s"), f"--teacher={tmp_path / 'none'}"], capsys,
                    "teacher")
