"""The adversarial sweep's findings in the nn modules, the GPT and the command line: each test failed before its
fix. The contract: a bad argument is a WarpforgeInputError naming it (a CLI error: one line on stderr, exit code 2),
an input with no tokens gives an empty output where that is natural, and nothing wrong is accepted silently."""
import math

import pytest
import torch

import warpforge as wf
from warpforge.testing import device_under_test
from warpforge import WarpforgeInputError, cli
from warpforge.bench import runner
from warpforge.models.gpt import GPT, GPTConfig, config
from warpforge.models.gpt.model import sample_next
from warpforge.models.gpt.sample import sample
from warpforge.models.gpt.train import train

rn = torch.randn
I32 = torch.int32


def _raises(name, fn):
    with pytest.raises(WarpforgeInputError, match=rf"^{name}:"):
        fn()


def _cu(*offsets):
    return torch.tensor(offsets, dtype=I32)


def _mla(**kw):
    return wf.nn.MLAttention(128, 16, q_lora_rank=None, qk_nope_head_dim=32, v_head_dim=32, max_seq_len=64,
                             backend="reference", **kw)


# ------------------------------------------------------------------------------------ nn: construction
CONSTRUCTION = [
    ("n_heads", lambda: wf.nn.Attention(64, 0)),
    ("n_heads", lambda: wf.nn.Attention(64, -2)),
    ("n_kv_heads", lambda: wf.nn.Attention(64, 2, 0)),  # used to become n_heads silently
    ("dim", lambda: wf.nn.Attention(64.0, 2)),
    ("window", lambda: wf.nn.Attention(64, 2, window=None)),
    ("max_seq_len", lambda: wf.nn.Attention(64, 2, rotary=True, max_seq_len=-1)),
    ("rope_base", lambda: wf.nn.Attention(64, 2, rotary=True, rope_base=0.0)),  # used to give all-NaN outputs
    ("rope_base", lambda: wf.nn.Attention(64, 2, rotary=True, rope_base=math.inf)),
    ("n_heads", lambda: wf.nn.MLAttention(128, 0, q_lora_rank=None)),
    ("qk_nope_head_dim", lambda: wf.nn.MLAttention(128, 16, q_lora_rank=None, qk_nope_head_dim=256)),  # q/k 320
    ("qk_nope_head_dim", lambda: wf.nn.MLAttention(128, 16, q_lora_rank=None, qk_nope_head_dim=36)),
    ("v_head_dim", lambda: wf.nn.MLAttention(128, 16, q_lora_rank=None, v_head_dim=300)),
    ("mscale", lambda: wf.nn.MLAttention(128, 16, q_lora_rank=None, mscale=math.nan)),  # was named softmax_scale
    ("mscale", lambda: wf.nn.MLAttention(128, 16, q_lora_rank=None, mscale=0.0)),
    ("q_lora_rank", lambda: wf.nn.MLAttention(128, 16, q_lora_rank=0)),
    ("aux_loss_coef", lambda: wf.nn.MoE(16, 8, 4, 2, aux_loss_coef=math.nan)),  # used to give a NaN aux loss
    ("scoring", lambda: wf.nn.MoE(16, 8, 4, 2, scoring="relu")),  # used to wait for the first forward
    ("scoring", lambda: wf.nn.MoE(16, 8, 4, 2, scoring="relu", backend="torch")),  # whose routing never checked it
    ("routed_scaling_factor", lambda: wf.nn.MoE(16, 8, 4, 2, routed_scaling_factor=-1.0)),
    ("num_expert_group", lambda: wf.nn.MoE(16, 8, 4, 2, num_expert_group=3, topk_group=1)),
    ("ffn_dim", lambda: wf.nn.MoE(16, -8, 4, 2)),
    ("num_shared_experts", lambda: wf.nn.MoE(16, 8, 4, 2, num_shared_experts=-1)),
    ("num_experts", lambda: wf.nn.MoE(16, 8, 0, 1)),
    ("topk", lambda: wf.nn.MoE(16, 8, 4, True)),
    ("dim", lambda: wf.nn.RMSNorm(-1)),
    ("hidden_dim", lambda: wf.nn.SwiGLU(16, -2)),
    ("hidden_dim", lambda: wf.nn.SwiGLU(16, 0)),  # the Triton kernel used to fail on it
    # absurd sizes: a TypeError (overflow) or an allocator error from torch before
    ("dim", lambda: wf.nn.RMSNorm(2**70)),
    ("dim", lambda: wf.nn.Attention(2**70, 2)),
    ("n_heads", lambda: wf.nn.Attention(64, 2**40)),
    ("max_seq_len", lambda: wf.nn.Attention(64, 2, rotary=True, max_seq_len=2**40)),
    ("dim", lambda: wf.nn.MLAttention(2**70, 16, q_lora_rank=None)),
    ("q_lora_rank", lambda: wf.nn.MLAttention(128, 16, q_lora_rank=2**40)),
    ("hidden_dim", lambda: wf.nn.SwiGLU(16, 2**40)),
    ("num_experts", lambda: wf.nn.MoE(16, 8, 2**40, 2)),
    ("max_tokens", lambda: wf.nn.KVCache.allocate(1, 2**40, 2, 32)),
    ("head_dim", lambda: wf.nn.KVCache.allocate(1, 8, 2, 2**70)),
    ("page_size", lambda: wf.nn.MLACache.allocate(1, 16, page_size=2**40)),
    ("page_size", lambda: wf.nn.MLACache.allocate(1, 16, page_size=8)),   # once refused only at the first decode
]


@pytest.mark.parametrize("name, make", CONSTRUCTION, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONSTRUCTION)])
def test_module_settings_are_refused_at_construction(name, make):
    _raises(name, make)


# ------------------------------------------------------------------------------------ nn: inputs
def _attn(**kw):
    return wf.nn.Attention(64, 2, backend="reference", **kw)


INPUTS = [
    ("x", lambda: _attn()(rn(1, 4, 32))),
    ("x", lambda: _attn()(torch.ones(1, 4, 64, dtype=torch.int64))),
    ("x", lambda: _attn()(None)),
    ("x", lambda: _attn()(rn(64))),  # was named q
    ("x", lambda: _attn()(rn(1, 4, 64).half())),
    ("x", lambda: _attn()(rn(1, 4, 64), cu_seqlens=_cu(0, 4))),  # packed x is [total, dim]
    ("x", lambda: _attn(rotary=True, max_seq_len=8)(rn(20, 64), cu_seqlens=_cu(0, 20))),  # was an IndexError
    ("cu_seqlens", lambda: _attn(rotary=True)(rn(10, 64), cu_seqlens=_cu(0, 7, 3, 10))),
    ("x", lambda: _mla()(rn(1, 3, 64))),
    ("x", lambda: wf.nn.MoE(16, 8, 4, 2, backend="reference")(rn(3, 15))),
    ("x", lambda: wf.nn.MoE(16, 8, 4, 2, backend="reference")(rn(3, 16).half())),  # fp32 weights
    ("x", lambda: wf.nn.RMSNorm(16, backend="reference")(rn(3, 8))),  # was named weight
    ("x", lambda: wf.nn.SwiGLU(16, 8, backend="reference")(rn(3, 8))),
]


@pytest.mark.parametrize("name, call", INPUTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(INPUTS)])
def test_module_inputs_are_checked(name, call):
    _raises(name, call)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("make, shape", [
    (lambda b: wf.nn.RMSNorm(16, backend=b), (3, 16)),
    (lambda b: wf.nn.SwiGLU(16, 8, backend=b), (3, 16)),
    (lambda b: wf.nn.MoE(16, 8, 4, 2, backend=b), (3, 16)),
    (lambda b: wf.nn.Attention(64, 2, backend=b), (1, 4, 64)),
    (lambda b: wf.nn.MLAttention(128, 16, q_lora_rank=None, qk_nope_head_dim=32, v_head_dim=32, max_seq_len=64,
                                 backend=b), (1, 3, 128)),
], ids=["rms_norm", "swiglu", "moe", "attention", "mla"])
def test_module_input_on_meta(make, shape, backend):
    """A meta input used to raise "unknown device type for autocast" (check_input asked autocast about meta): on
    another device than the module's weights it is refused naming x; a module moved to meta runs on it (shapes
    only), where its ops can (MoE's routing reads values)."""
    mod = make(backend)
    x = torch.randn(*shape, device="meta")
    _raises("x", lambda: mod(x))
    if not isinstance(mod, wf.nn.MoE):
        assert mod.to("meta")(x).shape == shape


def test_module_input_in_another_dtype_runs_under_autocast():
    mod = wf.nn.MoE(16, 8, 4, 2, backend="reference")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mod(rn(3, 16).half()).shape == (3, 16)


def test_packed_rotary_within_the_tables_matches_the_batch():
    torch.manual_seed(1)
    mod = _attn(rotary=True, max_seq_len=5)
    x = rn(2, 5, 64)
    torch.testing.assert_close(mod(x.reshape(10, 64), cu_seqlens=_cu(0, 5, 10)), mod(x).reshape(10, 64))


# ------------------------------------------------------------------------------------ nn: caches
def test_kv_cache_rows_advance_together():
    mod = _attn()
    cache = mod.new_cache(3, 8, dtype=torch.float32)
    mod(rn(3, 3, 64), cache)
    _raises("cache", lambda: mod(rn(1, 1, 64), cache))  # the other two rows would fall behind
    assert cache.length == 3
    _raises("cache", lambda: mod(rn(2, 3, 64), mod.new_cache(1, 8, dtype=torch.float32)))  # was an expand error


def test_mla_cache_batch_and_room():
    mod = _mla()
    _raises("cache", lambda: mod(rn(1, 3, 128), mod.new_cache(2, 32, dtype=torch.float32)))  # used to broadcast
    _raises("cache", lambda: mod(rn(1, 20, 128), mod.new_cache(1, 16, dtype=torch.float32)))  # an IndexError
    cache = mod.new_cache(1, 16, dtype=torch.float32)
    mod(rn(1, 16, 128), cache)
    _raises("cache", lambda: mod(rn(1, 1, 128), cache))
    assert cache.length == 16 and cache.cache_seqlens.tolist() == [16]


# ------------------------------------------------------------------------------------ nn: no tokens
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("make, x", [
    (lambda b: wf.nn.Attention(64, 2, rotary=True, backend=b), rn(1, 0, 64)),
    (lambda b: wf.nn.MoE(16, 8, 4, 2, backend=b), rn(0, 16)),
    (lambda b: wf.nn.SwiGLU(16, 8, backend=b), rn(0, 16)),
    (lambda b: wf.nn.RMSNorm(16, backend=b), rn(2, 0, 16)),
], ids=["attention", "moe", "swiglu", "rmsnorm"])
def test_no_tokens_give_an_empty_output(make, x, backend):
    dev = device_under_test()  # the triton backend runs on the GPU, or in the interpreter on CPU tensors
    mod, x = make(backend).to(dev), x.to(dev)
    assert mod(x).shape == x.shape
    if isinstance(mod, wf.nn.MoE):
        assert mod.aux_loss.item() == 0  # not the NaN of a mean over no tokens


def test_mla_no_tokens_give_an_empty_output():
    assert _mla()(rn(1, 0, 128)).shape == (1, 0, 128)


# ------------------------------------------------------------------------------------ GPT
TINY = dict(seq_len=16, n_layer=1, n_head=2, n_kv_head=1, d_model=64)


@pytest.mark.parametrize("name, fields", [
    ("attention", dict(attention="bogus")),  # used to build MHA silently
    ("n_layer", dict(n_layer=-1)),  # used to build no layers
    ("n_head", dict(n_head=0)),
    ("n_kv_head", dict(n_kv_head=0)),
    ("d_model", dict(d_model=100, n_head=6, n_kv_head=6)),
    ("vocab_size", dict(vocab_size=0)),
    ("ffn_mult", dict(ffn_mult=-1.0)),
    ("rope_base", dict(rope_base=0.0)),
])
def test_gpt_config_fields_are_checked(name, fields):
    _raises(name, lambda: GPTConfig(**{**TINY, **fields}))


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(**TINY), backend="reference")


@pytest.mark.parametrize("idx", [torch.tensor([[1, 256]]), torch.tensor([[1, -1]]), torch.rand(1, 4),
                                 torch.tensor([1, 2, 3]), torch.zeros(1, 17, dtype=torch.int64),
                                 torch.zeros(1, 0, dtype=torch.int64)],
                         ids=["past_vocab", "negative", "float", "1d", "past_seq_len", "empty"])
def test_gpt_idx_is_checked(gpt, idx):
    _raises("idx", lambda: gpt(idx))


@pytest.mark.parametrize("name, kw", [("temperature", dict(temperature=math.nan)), ("top_k", dict(top_k=0)),
                                      ("top_p", dict(top_p=-0.5)), ("max_new_tokens", dict(max_new_tokens=0))])
def test_generate_checks_its_settings_as_sample_does(gpt, name, kw):
    prompt = torch.zeros(1, 3, dtype=torch.int64)
    _raises(name, lambda: gpt.generate(prompt, **{"max_new_tokens": 2, **kw}))
    _raises(name, lambda: sample(gpt, "hi", **{"max_new_tokens": 2, **kw}))


def test_generate_refuses_an_empty_prompt_and_keeps_a_long_one(gpt):
    _raises("idx", lambda: gpt.generate(torch.zeros(1, 0, dtype=torch.int64), 2))
    prompt = torch.randint(0, 256, (1, 20))  # longer than seq_len: the model sees its last 16 tokens
    out = gpt.generate(prompt, 3, temperature=0.0)
    assert out.shape == (1, 23) and torch.equal(out[:, :20], prompt)


@pytest.mark.parametrize("name, args, kw", [
    ("max_new_tokens", ("hi", True), {}),  # a bool is not a count
    ("seed", ("hi", 2), dict(seed=2 ** 70)),
    ("top_k", ("hi", 2), dict(top_k=True)),
    ("prompt", (None, 2), {}),
    ("num_samples", ("hi", 2), dict(num_samples=0)),
])
def test_sample_arguments_are_checked(gpt, name, args, kw):
    _raises(name, lambda: sample(gpt, *args, **kw))


def test_sample_prompt_outside_the_vocabulary():
    model = GPT(GPTConfig(**{**TINY, "vocab_size": 100}), backend="reference")
    _raises("prompt", lambda: sample(model, "z~", 2))


@pytest.mark.parametrize("temperature", [1e-300, 2e-38, 1e-6])
def test_tiny_temperature_samples_the_most_likely_token(temperature):
    """Dividing fp32 logits by it used to overflow to inf: softmax NaN, and torch.multinomial refused."""
    logits = torch.tensor([[10.0, 5.0, 1.0], [-3.0, 40.0, 0.0]])
    assert sample_next(logits, temperature).tolist() == [[0], [1]]
    assert sample_next(logits, temperature, top_k=2, top_p=0.9).tolist() == [[0], [1]]


# ------------------------------------------------------------------------------------ command line
def _run(argv, capsys):
    """(exit code, stdout, stderr) of `warpforge argv`, whether argparse exits or the command returns."""
    try:
        rc = cli.main(argv)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(argv, capsys, match):
    rc, out, err = _run(argv, capsys)
    assert rc == 2, (argv, rc, out, err)
    assert err.strip() and "\n" not in err.strip() and "Traceback" not in err, err
    assert match in err, err
    return out


@pytest.fixture
def small_tiny(monkeypatch):
    """The "tiny" preset shrunk to a few seconds of training on random tokens."""
    small = config.Preset(GPTConfig(seq_len=32, n_layer=1, n_head=2, n_kv_head=2, d_model=64),
                          config.TrainConfig(batch_size=2, max_steps=2, lr=1e-3, warmup_steps=1, eval_every=10 ** 9,
                                             ckpt_every=10 ** 9, data="random"))
    monkeypatch.setitem(config.PRESETS, "tiny", small)
    return small


@pytest.fixture
def no_bench_run(monkeypatch):
    """Any benchmark run fails the test: the CLI must refuse before it."""
    def ran(*args, **kw):
        raise AssertionError("the benchmarks ran")
    monkeypatch.setattr(runner, "run", ran)


def test_bench_list_checks_the_family_and_applies_match(capsys):
    _one_line_error(["bench", "--list", "--family", "bogus"], capsys, match="unknown family 'bogus'")
    rc, out, _ = _run(["bench", "--list", "--match", "^swiglu"], capsys)
    names = [line.split()[1] for line in out.strip().splitlines()]
    assert rc == 0 and names and all(name.startswith("swiglu") for name in names), out
    rc, everything, _ = _run(["bench", "--list"], capsys)
    assert len(everything.strip().splitlines()) > len(names)


def test_bench_outputs_are_checked_before_running(tmp_path, capsys, monkeypatch, no_bench_run):
    afile = tmp_path / "afile"
    afile.write_text("x")
    _one_line_error(["bench", "--family", "fused", "--json", str(afile / "out.json")], capsys, match="--json")
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else
                        find_spec(name, *a))
    _one_line_error(["bench", "--family", "fused", "--plot", str(tmp_path / "p.png")], capsys, match="matplotlib")


@pytest.mark.parametrize("content", ["{}", "[]", '{"machine": {"gpu": "x", "torch": "1", "triton": "1", '
                                                 '"git_commit": "abc", "interpreter": true}}',
                                     '{"machine": {}, "rows": []}', '{"machine": {"gpu": "x", "torch": "1", '
                                     '"triton": "1", "git_commit": "a", "interpreter": true}, "rows": [{"case": 1}]}'],
                         ids=["empty_object", "list", "no_rows", "no_machine_keys", "bad_row"])
def test_report_of_json_of_the_wrong_shape_is_a_one_line_error(tmp_path, capsys, content):
    path = tmp_path / "r.json"
    path.write_text(content)
    _one_line_error(["report", str(path)], capsys, match="not a `warpforge bench --json` result")


def test_resume_with_max_steps_below_the_checkpoint_is_refused(tmp_path, capsys, small_tiny):
    train("tiny", str(tmp_path / "run"), max_steps=2)
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    _one_line_error(["gpt", "train", "--resume", "--max-steps", "1", "--out", str(tmp_path / "run")], capsys,
                    match="max_steps")
    assert ckpt.read_bytes() == before  # not rewritten as "step 2 of 1"


def test_unwritable_run_directory_is_refused_before_training(tmp_path, capsys, small_tiny, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    trained = []
    monkeypatch.setattr("warpforge.models.gpt.train.Trainer._loop", lambda *a: trained.append(1))
    _one_line_error(["gpt", "train", "--out", str(afile)], capsys, match="cannot write")
    _one_line_error(["gpt", "train", "--out", str(afile / "run")], capsys, match="cannot write")
    monkeypatch.setenv("WARPFORGE_CACHE", str(afile / "cache"))  # the default run directory is under it
    _one_line_error(["gpt", "train"], capsys, match="cannot write")
    assert not trained


@pytest.mark.parametrize("env", [{"WARPFORGE_BACKEND": "bogus"},
                                 {"WARPFORGE_BACKEND": "triton", "TRITON_INTERPRET": None}],
                         ids=["bogus", "triton_without_interpreter"])
def test_bad_backend_in_the_environment_is_a_one_line_error_for_train(tmp_path, capsys, small_tiny, monkeypatch,
                                                                      env):
    if torch.cuda.is_available() and env["WARPFORGE_BACKEND"] == "triton":
        pytest.skip("triton runs on the GPU")
    for key, value in env.items():
        monkeypatch.delenv(key, raising=False) if value is None else monkeypatch.setenv(key, value)
    _one_line_error(["gpt", "train", "--out", str(tmp_path / "run")], capsys, match="WARPFORGE_BACKEND")
    assert not (tmp_path / "run").exists()


def test_sample_seed_and_tiny_temperature(tmp_path, capsys, small_tiny):
    train("tiny", str(tmp_path / "run"), max_steps=1)
    ckpt = str(tmp_path / "run" / "ckpt.pt")
    _one_line_error(["gpt", "sample", "--ckpt", ckpt, "--seed", str(2 ** 70)], capsys, match="--seed")
    rc, out, err = _run(["gpt", "sample", "--ckpt", ckpt, "--temperature", "1e-300", "--tokens", "3"], capsys)
    # sampled (as greedy) or refused in one line: never torch.multinomial's traceback
    assert "Traceback" not in err and (rc == 0 or (rc == 2 and "temperature" in err and "\n" not in err.strip()))
