"""Training under CUDA graphs (compile "graphs": torch.compile(mode="reduce-overhead")) at head dim 64, where the
attention backward takes the Hopper Gluon kernel on sm_90: a device tensor an op caches on its first call would be
made inside the graphs' private pool during their warm-up and fail the pool check ("tensor(s) in the cudagraph pool
not tracked as outputs"; the Gluon backward's index table did, session 12)."""
import math

import pytest
import torch

from warpforge.models.gpt.train import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_graphed_training_steps_at_head_dim_64(tmp_path):
    res = train("tiny", str(tmp_path / "run"), n_head=2, n_kv_head=2, data="random", compile="graphs",
                max_steps=4, max_minutes=None, eval_every=10**9, ckpt_every=10**9)
    assert res["step"] == 4
    assert all(math.isfinite(h["loss"]) for h in res["history"] if "loss" in h)
