"""The GPT: shapes and gradients, KV-cache decoding, resume, data preparation, bad input."""
import numpy as np
import pytest
import torch

from warpforge.models.gpt import GPT, GPTConfig
from warpforge.models.gpt import data as gdata
from warpforge.models.gpt.model import sample_next
from warpforge.models.gpt.train import TrainError, train

from .conftest import SMALL, read_ckpt, twins


def test_forward_loss_and_gradients():
    model = GPT(SMALL)
    x = torch.randint(0, 256, (3, 32))
    loss = model(x, x.roll(-1, 1))
    assert 5.0 < loss.item() < 6.0  # about ln(256) at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model(x).shape == (3, 32, 256)


@pytest.mark.parametrize("kind", ["mha", "moe", "sparse"])
def test_checkpointed_activations_give_the_same_loss_and_gradients(kind):
    """checkpoint_blocks (gpt train --checkpoint-activations) recomputes each block in the backward: the same loss and
    gradients, MoE balance and sparse index losses included."""
    extra = {"moe": dict(moe_experts=4, moe_topk=2, moe_ffn_dim=64),
             "sparse": dict(attention="sparse", sparse_block=16, sparse_topk=2, sparse_index_dim=8)}.get(kind, {})
    cfg = GPTConfig(**{**SMALL.__dict__, **extra})
    torch.manual_seed(0)
    model = GPT(cfg, backend="reference")
    x = torch.randint(0, 256, (2, 32))
    grads = []
    for recompute in (False, True):
        model.checkpoint_blocks = recompute
        model.zero_grad()
        loss = model(x, x.roll(-1, 1))
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l1, l0)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-6, rtol=1e-5, msg=n)


def test_kv_cache_decoding_equals_full_recompute():
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    prompt = torch.randint(0, 256, (2, 5))
    fast = model.generate(prompt, 20, temperature=0)  # greedy with the KV cache
    slow = prompt
    with torch.no_grad():
        for _ in range(20):
            slow = torch.cat([slow, model(slow)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(fast, slow)


def test_generation_under_autocast_keeps_the_cache_in_its_dtype():
    """Under autocast (how `gpt sample` runs on a GPU) the KV cache takes the activations' dtype, so cached
    k/v match the new queries; the model's own weights stay as they were."""
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(torch.randint(0, 256, (2, 5)), 8, temperature=0)
    assert out.shape == (2, 13)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_top_k_top_p_keep_only_allowed_tokens():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0, -1.0]])
    gen = torch.Generator().manual_seed(0)
    picks = {int(sample_next(logits, 1.0, top_k=2, generator=gen)) for _ in range(200)}
    assert picks <= {0, 1}
    picks = {int(sample_next(logits, 1.0, top_p=0.5, generator=gen)) for _ in range(200)}
    assert picks == {0}


def test_resume_continues_with_the_same_data_and_loss(tmp_path, small_tiny):
    full = train("tiny", str(tmp_path / "a"))
    train("tiny", str(tmp_path / "b"), stop_at_step=6)        # a run killed at step 6 ...
    resumed = train("tiny", str(tmp_path / "b"), resume=True)  # ... and continued
    losses = lambda r: [h["loss"] for h in r["history"] if "loss" in h]  # noqa: E731
    assert resumed["step"] == full["step"] == 12
    assert losses(resumed)[-1] == pytest.approx(losses(full)[-1], rel=1e-5)


def test_bad_runs_fail_clearly_and_overwrite_nothing(tmp_path, small_tiny):
    with pytest.raises(TrainError, match="unknown preset"):
        train("nope", str(tmp_path))
    train("tiny", str(tmp_path / "run"), stop_at_step=6)
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    with pytest.raises(TrainError, match="exists"):
        train("tiny", str(tmp_path / "run"))
    with pytest.raises(TrainError, match="another model config"):
        train("shakespeare", str(tmp_path / "run"), resume=True)
    with pytest.raises(TrainError, match="nothing to resume"):
        train("tiny", str(tmp_path / "other"), resume=True)
    with pytest.raises(TrainError, match="compile"):
        train("tiny", str(tmp_path / "third"), compile="maybe")
    with pytest.raises(TrainError, match="max_steps"):
        train("tiny", str(tmp_path / "fourth"), max_steps=-5)
    with pytest.raises(TrainError, match="max_minutes"):
        train("tiny", str(tmp_path / "fifth"), max_minutes=float("nan"))
    assert ckpt.read_bytes() == before
    assert not (tmp_path / "fourth").exists()


def test_missing_data_says_run_prepare(tmp_path, monkeypatch):
    monkeypatch.setenv("WARPFORGE_CACHE", str(tmp_path))
    with pytest.raises(gdata.DataMissing, match="warpforge gpt prepare"):
        gdata.load_split("train")


def test_play_selection_and_holdout(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    sections = {"macbeth_gut": "Macbeth", "macbeth_gut_f": "Macbeth", "sonnets_gut": "Sonnets",
                "titus_andronicus_gut": "Titus Andronicus",
                "tragedy_of_titus_andronicus_gut": "The Tragedy of Titus Andronicus", "lear_gut": "King Lear"}
    meta = "".join(f"[{k}]\ntitle = {v}\n\n" for k, v in sections.items())
    (texts / "metadata.txt").write_text(meta)
    for k in sections:
        (texts / f"{k}.txt").write_text(k)
    plays = gdata._plays(texts)
    assert [name for _, name in plays] == ["lear_gut.txt", "macbeth_gut.txt", "titus_andronicus_gut.txt"]


def test_batches_are_reproducible():
    data = np.arange(1000, dtype=np.uint8)
    a, b = gdata.Batches(data, 16, 4, seed=3), gdata.Batches(data, 16, 4, seed=3)
    a.next()
    state = a.state()
    x1, _ = a.next()
    b.restore(state)
    x2, _ = b.next()
    assert torch.equal(x1, x2)
    x, y = x1, _
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_generation_runs_past_the_context():
    model = GPT(SMALL).eval()
    out = model.generate(torch.randint(0, 256, (1, 10)), 100, temperature=0)
    assert out.shape == (1, 110)


def test_triton_path_matches_reference_path(monkeypatch):
    """The GPU path (flash_attention + fused ops) against the references, same weights, fp16."""
    from warpforge.testing import device_under_test, rel_l2
    dev = device_under_test()
    torch.manual_seed(0)
    model = GPT(SMALL).to(dev, torch.float16)
    x = torch.randint(0, 256, (2, 32), device=dev)
    results = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("WARPFORGE_BACKEND", backend)
        model.zero_grad()
        loss = model(x, x.roll(-1, 1))
        loss.backward()
        results[backend] = (loss.detach().float(), [p.grad.float().clone() for p in model.parameters()])
    assert abs(results["triton"][0] - results["reference"][0]) < 1e-2
    for g_t, g_r in zip(results["triton"][1], results["reference"][1]):
        assert rel_l2(g_t, g_r) < 2e-2


def test_pytorch_backend_baseline_matches():
    """backend="torch" (the benchmark baseline: SDPA, F.rms_norm, ...) computes the same model."""
    ours, plain = twins(SMALL)
    x = torch.randint(0, 256, (2, 32))
    assert torch.allclose(ours(x, x), plain(x, x), rtol=1e-4)
    assert torch.equal(ours.generate(x[:, :4], 12, temperature=0), plain.generate(x[:, :4], 12, temperature=0))


def test_deepseek_mini_blocks_train_and_decode():
    """MLA attention + MoE feed-forward: loss includes the balance loss, gradients reach the experts, and
    cached decoding equals full recompute."""
    cfg = GPTConfig(seq_len=32, n_layer=2, n_head=16, n_kv_head=16, d_model=64, attention="mla", mla_head_dim=16,
                    moe_experts=4, moe_topk=2, moe_ffn_dim=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, 256, (2, 32))
    loss = model(x, x.roll(-1, 1))
    loss.backward()
    moe = model.blocks[1].mlp
    assert moe.w13.grad is not None and model.blocks[0].attn.wkv_b.weight.grad is not None
    assert model.num_params(active=True) < model.num_params()
    model.eval()
    fast = model.generate(x[:, :5], 8, temperature=0)
    slow = x[:, :5]
    with torch.no_grad():
        for _ in range(8):
            slow = torch.cat([slow, model(slow)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(fast, slow)


TORCHRUN_2 = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# the tiny preset at 2 of its 4 layers, 32-token sequences and 8 of them a step (its widths, vocabulary and settings
# as they are): the same code runs, in a fraction of the time
SHRUNK_BATCH, SHRUNK_SEQ = 8, 32
SHRUNK = ["--n_layer=2", f"--seq_len={SHRUNK_SEQ}", f"--batch_size={SHRUNK_BATCH}"]


def _gpt_train(tmp_path, runs, *, procs=2, backend=None):
    """`warpforge gpt train --preset tiny --data random ARGS` (random tokens) for each ARGS in runs, one run after
    another in one finished subprocess (train_runs.py: starting the processes is most of a small run's time), under
    torchrun with 2 CPU processes (gloo) or, procs=1, one process; returns each run's output (rank 0's). CPU even on
    a GPU machine (which may have fewer GPUs than ranks): this checks the logic. --standalone: a free rendezvous
    port, not the fixed 29500 a lingering process may hold."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from .train_runs import MARK
    env = dict(os.environ, WARPFORGE_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    if backend:
        env["WARPFORGE_BACKEND"] = backend
    launch = TORCHRUN_2 if procs == 2 else []
    runs = [["--preset", "tiny", "--data", "random", *args] for args in runs]
    done = subprocess.run([sys.executable, *launch, str(Path(__file__).with_name("train_runs.py")), json.dumps(runs)],
                          env=env, capture_output=True, text=True, timeout=300 * len(runs))
    assert done.returncode == 0, done.stderr[-3000:]
    outs, rest = [], done.stdout
    for i in range(len(runs)):
        out, mark, rest = rest.partition(f"{MARK} {i}\n")
        assert mark, (i, done.stdout[-3000:])
        outs.append(out)
    return outs


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """The shrunk tiny preset under torchrun with 2 CPU processes: one launch trains DDP, ZeRO-2 and FSDP2 runs to
    step 4 (each in its own process group, one after another) and a ZeRO-2 run with --batch-scaling weak for 2
    steps; a second launch resumes the first three to step 8. Returns the folder of the runs and the weak run's
    output."""
    tmp = tmp_path_factory.mktemp("sharded")
    modes = ("ddp", "zero2", "fsdp")
    base = {parallel: SHRUNK + ["--parallel", parallel, "--out", str(tmp / parallel)] for parallel in modes}
    weak = SHRUNK + ["--max-steps", "2", "--batch-scaling", "weak", "--parallel", "zero2", "--out", str(tmp / "weak")]
    outs = _gpt_train(tmp, [base[parallel] + ["--max-steps", "4"] for parallel in modes] + [weak])
    _gpt_train(tmp, [base[parallel] + ["--max-steps", "8", "--resume"] for parallel in modes])
    return tmp, outs[-1]


def test_ddp_zero2_and_fsdp_two_processes_train_and_resume(sharded_runs):
    """torchrun with 2 CPU processes (gloo), DDP, ZeRO-2 and FSDP2: each trains, checkpoints every rank's data
    position with full weights, resumes (in a later launch); all give the same losses (the same averaged gradients,
    sharded or not)."""
    tmp, _ = sharded_runs
    runs = {}
    for parallel in ("ddp", "zero2", "fsdp"):
        ckpt = read_ckpt(tmp / parallel)
        assert ckpt["step"] == 8 and len(ckpt["data_state"]) == 2
        assert not torch.equal(ckpt["data_state"][0], ckpt["data_state"][1])
        assert all(not hasattr(v, "device_mesh") for v in ckpt["model"].values())  # full tensors, not shards
        runs[parallel] = [h["loss"] for h in ckpt["history"] if "loss" in h]
    assert len(runs["ddp"]) == len(runs["zero2"]) == len(runs["fsdp"]) == 2
    assert runs["ddp"] == pytest.approx(runs["fsdp"], rel=1e-4)
    assert runs["ddp"] == pytest.approx(runs["zero2"], rel=1e-4)


def test_weak_scaling_keeps_each_process_batch(sharded_runs):
    """--batch-scaling weak: each of 2 processes takes the whole configured batch (--batch_size), so a step is
    twice its tokens."""
    _, weak_out = sharded_runs
    assert f"{2 * SHRUNK_BATCH * SHRUNK_SEQ} tokens/step" in weak_out


def test_expert_parallel_matches_ddp(tmp_path):
    """--expert-parallel over 2 CPU processes (each keeps 2 of an MoE model's 4 experts per layer, tokens exchanged
    by all-to-all) trains as plain DDP does: the same losses and weights; its checkpoint holds every expert and a
    resumed run (a later launch) continues."""
    import re
    moe = ["--moe_experts=4", "--moe_topk=2", "--moe_ffn_dim=64", "--n_layer=2", "--seq_len=32", "--batch_size=8"]

    def args(name, *flags, steps=3, resume=False):
        return (["--max-steps", str(steps), "--out", str(tmp_path / name), *moe, *flags]
                + (["--resume"] if resume else []))

    def check(name, out, *flags):
        assert ("each process holds 2 of every MoE layer's 4 experts" in out) == ("--expert-parallel" in flags)
        params[name] = re.search(r"([0-9.]+)M parameters", out).group(1)  # the whole model's, sharded or not
        return read_ckpt(tmp_path / name)

    params = {}
    outs = _gpt_train(tmp_path, [args("ddp"), args("ep", "--expert-parallel")], backend="reference")
    ddp, ep = check("ddp", outs[0]), check("ep", outs[1], "--expert-parallel")
    assert params["ddp"] == params["ep"]
    losses = [[h["loss"] for h in c["history"] if "loss" in h] for c in (ddp, ep)]
    assert losses[0] and losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert ddp["model"].keys() == ep["model"].keys()
    for k, w in ddp["model"].items():
        assert ep["model"][k].shape == w.shape, k  # every expert, gathered
        torch.testing.assert_close(ep["model"][k], w, atol=1e-5, rtol=0, msg=k)
    (out,) = _gpt_train(tmp_path, [args("ep", "--expert-parallel", steps=5, resume=True)], backend="reference")
    again = check("ep", out, "--expert-parallel")
    assert again["step"] == 5


CONTEXT_PARALLEL = {"mha": ("mha", []), "sparse": ("sparse", []),
                    "sparse-recompute": ("sparse", ["--checkpoint-activations"])}


@pytest.fixture(scope="module")
def context_parallel_runs(tmp_path_factory):
    """Each case of CONTEXT_PARALLEL trained 3 steps in one process on whole sequences (one process runs the three,
    one after another) and with --context-parallel under torchrun with 2 CPU processes (one launch for the three).
    Returns the folder: CASE/one and CASE/cp."""
    tmp = tmp_path_factory.mktemp("cp")
    args = {case: ["--max-steps", "3", "--n_layer=2", "--seq_len=64", "--batch_size=4", "--n_kv_head=2", "--compile",
                   "off", f"--attention={attention}", "--sparse_block=16", "--sparse_topk=2", "--sparse_index_dim=8",
                   *flags] for case, (attention, flags) in CONTEXT_PARALLEL.items()}
    _gpt_train(tmp, [args[case] + ["--out", str(tmp / case / "one")] for case in args], procs=1, backend="reference")
    _gpt_train(tmp, [args[case] + ["--context-parallel", "--out", str(tmp / case / "cp")] for case in args],
               backend="reference")
    return tmp


@pytest.mark.parametrize("case", list(CONTEXT_PARALLEL))
def test_context_parallel_matches_one_process(context_parallel_runs, case):
    """--context-parallel over 2 CPU processes (dense: each sequence in zigzag shards and ring attention; sparse:
    contiguous chunks, sparse_attention_cp and its index loss, with and without --checkpoint-activations; the same
    sequences on both) trains as one process on whole sequences does: the same losses and weights."""
    runs = {name: read_ckpt(context_parallel_runs / case / name) for name in ("one", "cp")}
    losses = [[h["loss"] for h in runs[n]["history"] if "loss" in h] for n in ("one", "cp")]
    assert losses[0] and losses[0] == pytest.approx(losses[1], rel=1e-5)
    for k, w in runs["one"]["model"].items():
        torch.testing.assert_close(runs["cp"]["model"][k], w, atol=1e-5, rtol=0, msg=k)
