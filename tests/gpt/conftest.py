import pytest
import torch

from warpforge.models.gpt import GPT, GPTConfig
from warpforge.models.gpt import config

SMALL = GPTConfig(seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=128)


@pytest.fixture
def small_tiny(monkeypatch):
    """The "tiny" preset shrunk to SMALL on random tokens (12 steps, a checkpoint every 6): runs in seconds."""
    small = config.Preset(SMALL, config.TrainConfig(batch_size=4, max_steps=12, lr=1e-3, warmup_steps=2,
                                                    eval_every=10**9, ckpt_every=6, data="random"))
    monkeypatch.setitem(config.PRESETS, "tiny", small)
    return small


def twins(cfg):
    """The model on warpforge's ops and the same weights on plain PyTorch ops (backend "torch")."""
    torch.manual_seed(0)
    ours = GPT(cfg)
    plain = GPT(cfg, backend="torch")
    plain.load_state_dict(ours.state_dict())
    return ours, plain


def read_ckpt(run_dir):
    """A finished run's ckpt.pt (onto the CPU, as the training processes wrote it)."""
    return torch.load(run_dir / "ckpt.pt", weights_only=False)
