"""warpforge.hf: patched and unpatched tiny random transformers models (no download) train alike, and
attn_implementation="warpforge" generates the same greedy tokens as eager / sdpa. On CPU the "triton" backend is
the Triton interpreter (tests/conftest.py turns it on), "reference" warpforge's PyTorch references."""
import copy
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'warpforge[hf]')")

import warpforge.hf as wfh  # noqa: E402
from warpforge.hf import _common  # noqa: E402
from warpforge.hf import attention as wf_attention  # noqa: E402
from warpforge.hf import patch as wf_patch  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
# the tiny models stay on the CPU, where "triton" is the Triton interpreter: on only on a machine without a GPU
# (tests/conftest.py); on a GPU machine these run the references, and the kernels' own GPU tests cover the rest
BACKENDS = ["reference"] + (["triton"] if not torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _fresh_fallback_log():
    """Each test sees its own fallbacks logged (they are logged once per process)."""
    _common._logged.clear()


def make_config(family, **over):
    kw = dict(TINY, **over)
    if family == "llama":
        return transformers.LlamaConfig(**kw)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=kw["hidden_size"] // kw["num_attention_heads"], **kw)
    if family == "mixtral":
        kw["intermediate_size"] = 48
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **kw)
    if family == "mistral":   # its sliding window (4096 by default) makes transformers ask for a sliding-window mask
        return transformers.MistralConfig(**kw)
    raise ValueError(family)


CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
           "mistral": "MistralForCausalLM"}


def build(family, attn="sdpa", seed=0, **over):
    torch.manual_seed(seed)
    cls = getattr(transformers, CLASSES[family])
    return cls._from_config(make_config(family, **over), attn_implementation=attn, dtype=torch.float32)


def twin(model, attn):
    """A copy of model (same weights) with its own config and the given attention implementation."""
    other = copy.deepcopy(model)
    other.set_attn_implementation(attn)
    return other


class Spy:
    """Counts the warpforge ops the patches call."""

    def __init__(self, monkeypatch):
        self.calls = {}
        for module, name in ((wf_patch, "rms_norm"), (wf_patch, "swiglu"), (wf_patch, "apply_rope"),
                             (wf_patch, "linear_cross_entropy"), (wf_attention, "flash_attention")):
            monkeypatch.setattr(module, name, self._count(name, getattr(module, name)))

    def _count(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def batch(step, b=2, s=16, vocab=128):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100  # ignored targets, as a prompt mask makes them
    return ids, labels


def train_alike(ref, patched, steps, tol=1e-4, padded=False):
    ref.train(), patched.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, patched)]
    for step in range(steps):
        ids, labels = batch(step)
        mask = None
        if padded:  # right padding, as a collator pads a training batch
            mask = torch.ones_like(ids)
            mask[1, -5:] = 0
            labels[1, -5:] = -100
        outs = []
        for model, opt in zip((ref, patched), opts):
            opt.zero_grad()
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            outs.append(out)
        assert outs[1].logits is None  # the linear cross-entropy did not form logits
        assert abs(outs[1].loss.item() - outs[0].loss.item()) <= tol * abs(outs[0].loss.item()), step
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), patched.named_parameters()):
            assert rel(p.grad, p_ref.grad) <= tol, (step, name, rel(p.grad, p_ref.grad))
        for opt in opts:
            opt.step()


# ------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_apply_warpforge_trains_like_transformers(family, backend, monkeypatch, caplog):
    """Two training steps (the second after an AdamW update of both models) give the same losses and gradients;
    each warpforge op runs the expected number of times a step and nothing falls back."""
    ref = build(family)
    patched = wfh.apply_warpforge(twin(ref, "sdpa"), backend=backend)
    assert patched.config._attn_implementation == "warpforge" and ref.config._attn_implementation == "sdpa"
    spy = Spy(monkeypatch)
    steps = 2
    with caplog.at_level(logging.WARNING, logger="warpforge.hf"):
        train_alike(ref, patched, steps=steps)
    assert not [r for r in caplog.records if r.name == "warpforge.hf"], caplog.text  # nothing fell back
    n = TINY["num_hidden_layers"]
    expected = {"rms_norm": steps * (2 * n + 1 + (2 * n if family == "qwen3" else 0)), "apply_rope": steps * 2 * n,
                "flash_attention": steps * n, "linear_cross_entropy": steps}
    if family != "mixtral":  # Mixtral's experts stay transformers'
        expected["swiglu"] = steps * n
    assert spy.calls == expected


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_class_patch_trains_like_transformers(family, monkeypatch):
    ref = build(family)
    getattr(wfh, f"apply_warpforge_kernel_to_{family}")(backend="reference")
    try:
        patched = build(family)  # built after the patch: same seed, same weights
        assert patched.config._attn_implementation == "warpforge"
        spy = Spy(monkeypatch)
        train_alike(ref, patched, steps=2)
        assert spy.calls["flash_attention"] and spy.calls["apply_rope"] and spy.calls["linear_cross_entropy"]
    finally:
        wfh.revert_warpforge_kernels()
    again = build(family)
    assert again.config._attn_implementation == "sdpa"
    out = again.train()(input_ids=batch(0)[0], labels=batch(0)[1])
    assert out.logits is not None  # transformers' forward again


@pytest.mark.parametrize("backend", BACKENDS)
def test_right_padded_batch_trains_alike(backend, monkeypatch):
    """A padding mask runs as varlen flash_attention, forward and backward."""
    ref = build("llama")
    patched = wfh.apply_warpforge(twin(ref, "sdpa"), backend=backend)
    spy = Spy(monkeypatch)
    train_alike(ref, patched, steps=2, padded=True)
    assert spy.calls["flash_attention"] == 2 * TINY["num_hidden_layers"]


def test_unpatched_model_keeps_transformers_code(monkeypatch):
    wfh.apply_warpforge(build("llama"))  # installs the RoPE dispatcher in modeling_llama
    other = build("llama")
    spy = Spy(monkeypatch)
    other.train()(input_ids=batch(0)[0], labels=batch(0)[1]).loss.backward()
    assert spy.calls == {}


def test_eval_and_skip_logits():
    ref = build("llama").eval()
    patched = wfh.apply_warpforge(twin(ref, "sdpa"), backend="reference").eval()
    ids, labels = batch(0)
    with torch.no_grad():
        a, b = ref(input_ids=ids, labels=labels), patched(input_ids=ids, labels=labels)
        assert rel(b.logits, a.logits) < 1e-5 and abs(a.loss - b.loss) < 1e-5  # eval keeps the logits
        c = patched(input_ids=ids, labels=labels, skip_logits=True)
        assert c.logits is None and abs(c.loss - a.loss) < 1e-5
        d = patched(input_ids=ids, labels=labels, skip_logits=True, num_items_in_batch=7)
        n_valid = (labels[:, 1:] != -100).sum()
        assert torch.allclose(d.loss, a.loss * n_valid / 7, rtol=1e-5)


def test_autocast_bf16_reference():
    ref = build("llama")
    patched = wfh.apply_warpforge(twin(ref, "sdpa"), backend="reference")
    ids, labels = batch(0)
    losses = []
    for model in (ref.train(), patched.train()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(model(input_ids=ids, labels=labels).loss.float())
    assert abs(losses[0] - losses[1]) <= 2e-2 * losses[0]


def test_falls_back_and_logs_once(monkeypatch, caplog):
    """head dim 12 is not a multiple of 8: flash_attention refuses it, transformers' SDPA runs instead."""
    ref = build("llama", hidden_size=48)
    patched = wfh.apply_warpforge(twin(ref, "sdpa"), backend="reference")
    with caplog.at_level(logging.WARNING, logger="warpforge.hf"):
        train_alike(ref, patched, steps=1)
        patched(input_ids=batch(1)[0], labels=batch(1)[1])
    logged = [r.getMessage() for r in caplog.records if r.name == "warpforge.hf"]
    assert len(logged) == 1 and "attention" in logged[0] and "multiple of 8" in logged[0], logged


def test_unsupported_model_is_refused():
    with pytest.raises(ValueError, match="model"):
        wfh.apply_warpforge(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------ generation
def generate(model, ids, mask=None, **kw):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              pad_token_id=0, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_attn_implementation_generates_the_same_tokens(family, backend, monkeypatch):
    monkeypatch.setenv("WARPFORGE_BACKEND", backend)
    wf = build(family, attn="warpforge").eval()
    assert wf.config._attn_implementation == "warpforge"
    spy = Spy(monkeypatch)
    prompt = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    out = generate(wf, prompt)
    assert spy.calls["flash_attention"] >= 8 * TINY["num_hidden_layers"]  # prefill and each cached decode step
    for attn in ("eager", "sdpa"):
        assert torch.equal(generate(twin(wf, attn), prompt), out), attn


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_left_padded_batch_and_static_cache(family, monkeypatch):
    """A left-padded batch runs as varlen attention; a StaticCache's unused slots are dropped by the mask."""
    wf = wfh.apply_warpforge(build(family).eval(), backend="reference")
    eager = twin(build(family).eval(), "eager")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 128, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    want = generate(eager, ids, mask)
    spy = Spy(monkeypatch)
    assert torch.equal(generate(wf, ids, mask), want)
    assert torch.equal(generate(wf, ids, mask, cache_implementation="static"), want)
    assert spy.calls["flash_attention"] > 0


def test_sliding_window_model_with_a_static_cache():
    """A window wider than the text: transformers' mask hook answers "plain causal" (None), which under a
    StaticCache's unused slots past the text means the key-validity mask, not causal over every slot (the tokens
    were wrong before)."""
    wf = build("mistral", attn="warpforge").eval()
    assert wf.config.sliding_window is not None
    prompt = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    want = generate(twin(wf, "eager"), prompt)
    assert torch.equal(generate(wf, prompt), want)
    assert torch.equal(generate(wf, prompt, cache_implementation="static"), want)


def test_packed_positions_fall_back_to_sdpa(caplog):
    """position_ids that restart (packed sequences) make transformers build a 4D mask: SDPA runs it."""
    wf = build("llama", attn="warpforge").eval()
    eager = twin(wf, "eager")
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([list(range(5)) + list(range(7))])
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="warpforge.hf"):
        a = wf(input_ids=ids, position_ids=pos, use_cache=False).logits
        b = eager(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert rel(a, b) < 1e-5
    assert any("4D mask" in r.getMessage() for r in caplog.records)
