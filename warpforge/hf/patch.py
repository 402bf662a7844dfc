"""Patch Hugging Face Llama / Qwen3 / Mixtral models onto warpforge's kernels, in Liger-Kernel's manner.

    from warpforge.hf import apply_warpforge, apply_warpforge_kernel_to_llama
    apply_warpforge(model)                       # a built model, in place; other models are untouched
    apply_warpforge_kernel_to_llama()            # the transformers classes, before models are built

What each flag swaps (every swap falls back to the transformers code it replaced, logged once per reason, where
warpforge's op refuses an input: a dtype such as bf16 on the CPU Triton interpreter, a head dim, ...):

- rms_norm: every <Model>RMSNorm's forward -> warpforge.rms_norm (output in the promoted dtype of input and weight,
  as transformers'; Qwen3's per-head q_norm / k_norm included).
- swiglu: <Model>MLP's forward -> one GEMM with gate and up weights concatenated, warpforge.swiglu, down_proj (only
  where the activation is SiLU). Mixtral's experts are left to transformers (its `experts_implementation`).
- rope: the rotary application inside each attention module -> warpforge.apply_rope on the [b, s, h, d] views
  (per-sequence position ids fold the batch into the sequence axis). Done by swapping the modeling module's
  `apply_rotary_pos_emb` for a dispatcher that calls warpforge only while a patched attention module runs (a
  context variable), so unpatched models in the same process keep transformers' code.
- cross_entropy: <Model>ForCausalLM's forward, when training with labels (or skip_logits=True) -> the base model,
  then warpforge.linear_cross_entropy on the last hidden states and lm_head's weight, shifted labels and
  ignore_index -100 as transformers' ForCausalLMLoss (num_items_in_batch honoured); logits are not materialised and
  come back as None. Mixtral's router aux loss is added as transformers does. Eval, or logits_to_keep != 0, or an
  lm_head with a bias: transformers' forward.
- attention: `attn_implementation="warpforge"` (warpforge/hf/attention.py says which masks run on warpforge).

Under autocast the matmul-like ops (attention, linear_cross_entropy) run in autocast's dtype, as transformers'
modules would. backend: None (CUDA -> Triton kernels, CPU -> the PyTorch references, WARPFORGE_BACKEND overrides),
"triton" or "reference", for every patched op.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib
import inspect
import sys
import types

import torch
import torch.nn.functional as F

from ..errors import WarpforgeInputError, fail
from ..ops.linear_ce import linear_cross_entropy
from ..ops.norm import rms_norm
from ..ops.rope import apply_rope
from ..ops.swiglu import swiglu
from . import attention as wf_attention
from ._common import compute_dtype, fall_back

# model_type -> (modeling module, class prefix)
FAMILIES = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "Mixtral"),
}
_OFF = object()
_rope_backend = contextvars.ContextVar("warpforge_rope_backend", default=_OFF)  # set while a patched attention runs
_class_patches: list = []  # (owner, attribute name, previous value or _OFF) of every class-level patch, in order


def _original(fn):
    """The transformers function under a warpforge wrapper (itself if not wrapped)."""
    while getattr(fn, "__warpforge__", False):
        fn = fn.__wrapped__
    return fn


def _wraps(original):
    def mark(fn):
        fn = functools.wraps(original)(fn)
        fn.__warpforge__ = True
        return fn
    return mark


# ------------------------------------------------------------------------------------ forwards
def rms_norm_forward(original, backend=None):
    @_wraps(original)
    def forward(self, hidden_states):
        try:
            return rms_norm(hidden_states, self.weight, getattr(self, "variance_epsilon", 1e-6), backend,
                            out_dtype=torch.promote_types(hidden_states.dtype, self.weight.dtype))
        except WarpforgeInputError as e:
            fall_back("rms_norm", e)
            return original(self, hidden_states)
    return forward


def _is_silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def mlp_forward(original, backend=None):
    @_wraps(original)
    def forward(self, x):
        if not _is_silu(getattr(self, "act_fn", None)):
            fall_back("swiglu", f"activation {type(getattr(self, 'act_fn', None)).__name__} is not SiLU")
            return original(self, x)
        gate, up = self.gate_proj, self.up_proj
        bias = None if gate.bias is None else torch.cat((gate.bias, up.bias))
        gate_up = F.linear(x, torch.cat((gate.weight, up.weight)), bias)  # one GEMM, gate first as swiglu wants
        try:
            h = swiglu(gate_up, backend)
        except WarpforgeInputError as e:
            fall_back("swiglu", e)
            g, u = gate_up.chunk(2, dim=-1)
            h = self.act_fn(g) * u
        return self.down_proj(h)
    return forward


def attention_forward(original, backend=None):
    """The attention module's own forward, run with the RoPE dispatcher switched on for its duration."""
    @_wraps(original)
    def forward(self, *args, **kwargs):
        token = _rope_backend.set(backend)
        try:
            return original(self, *args, **kwargs)
        finally:
            _rope_backend.reset(token)
    return forward


def rope_dispatcher(original):
    """A stand-in for a modeling module's apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1): warpforge's RoPE
    while a patched attention module runs, else (and for anything it does not express) the original."""
    @_wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        backend = _rope_backend.get()
        if backend is _OFF:
            return original(q, k, cos, sin, *args, **kwargs)
        try:
            if args or set(kwargs) - {"unsqueeze_dim"} or kwargs.get("unsqueeze_dim", 1) != 1:
                raise WarpforgeInputError("apply_rotary_pos_emb: expected (q, k, cos, sin) with unsqueeze_dim=1")
            return _rope(q, cos, sin, backend), _rope(k, cos, sin, backend)
        except WarpforgeInputError as e:
            fall_back("rope", e)
            return original(q, k, cos, sin, *args, **kwargs)
    return apply_rotary_pos_emb


def _rope(x, cos, sin, backend):
    """x [b, h, s, d] (transformers' layout), cos/sin [b or 1, s, d] with the halves repeated -> rotated x."""
    b, h, s, d = x.shape
    if cos.dim() != 3 or cos.shape[-1] != d or cos.shape[1] != s or cos.shape[0] not in (1, b) or \
            sin.shape != cos.shape:
        raise WarpforgeInputError(f"cos/sin: expected [1 or {b}, {s}, {d}] (full rotary dim), got "
                                  f"{tuple(cos.shape)} / {tuple(sin.shape)}")
    xs = x.transpose(1, 2)  # [b, s, h, d]: a view of the projection's output
    c, sn = cos[..., :d // 2], sin[..., :d // 2]
    if cos.shape[0] == 1:
        return apply_rope(xs, c[0], sn[0], backend).transpose(1, 2)
    # positions differ per sequence: fold the batch into the sequence axis
    out = apply_rope(xs.reshape(1, b * s, h, d), c.reshape(b * s, d // 2), sn.reshape(b * s, d // 2), backend)
    return out.view(b, s, h, d).transpose(1, 2)


def causal_lm_forward(original, backend=None):
    """<Model>ForCausalLM.forward with the loss from linear_cross_entropy when training with labels."""
    signature = inspect.signature(original)

    @_wraps(original)
    def forward(self, *args, skip_logits=None, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        named = {k: v for k, v in bound.items() if k not in ("self", "kwargs")}
        extra = dict(bound.get("kwargs", {}))
        labels, shift_labels = named.pop("labels", None), extra.pop("shift_labels", None)
        has_labels = labels is not None or shift_labels is not None
        skip = skip_logits if skip_logits is not None else (self.training and has_labels)
        reason = _lce_refusal(self, named, has_labels) if skip else None
        if not skip or reason:
            if reason:
                fall_back("cross_entropy", reason)
            return original(self, *args, **kwargs)
        named.pop("logits_to_keep", None)
        return_dict = extra.pop("return_dict", None)
        if "output_router_logits" in named and named["output_router_logits"] is None:
            named["output_router_logits"] = getattr(self.config, "output_router_logits", False)
        outputs = self.model(**named, **extra)
        hidden = outputs[0]
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = _lce_loss(hidden, self.lm_head.weight, shift_labels, extra.get("num_items_in_batch"), backend)
        result = _output(self, outputs, loss, named.get("attention_mask"))
        return result.to_tuple() if return_dict is False else result
    return forward


def _lce_refusal(model, named, has_labels):
    if not has_labels:
        return "skip_logits=True needs labels"
    keep = named.get("logits_to_keep", 0)
    if not (keep is None or (isinstance(keep, int) and keep == 0)):
        return "logits_to_keep != 0"
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return "lm_head is not a bias-free nn.Linear"
    if getattr(model.config, "final_logit_softcapping", None):
        return "final_logit_softcapping"
    return None


def _lce_loss(hidden, weight, shift_labels, num_items_in_batch, backend):
    dtype = compute_dtype(hidden)  # autocast's, as lm_head's GEMM would run
    h = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
    targets = shift_labels.reshape(-1).to(h.device)
    loss = linear_cross_entropy(h, weight.to(dtype), targets, -100, backend)
    if num_items_in_batch is not None:  # transformers' sum / num_items_in_batch (gradient accumulation)
        loss = loss * (targets != -100).sum() / num_items_in_batch
    return loss


def _output(model, outputs, loss, attention_mask):
    """The ForCausalLM output transformers would return, with the loss and no logits."""
    module = sys.modules[type(model).__module__]
    router_logits = getattr(outputs, "router_logits", None)
    moe = hasattr(outputs, "router_logits")
    cls = getattr(module, "MoeCausalLMOutputWithPast" if moe else "CausalLMOutputWithPast")
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {name: getattr(outputs, name) for name in fields if hasattr(outputs, name)}
    if moe and router_logits is not None and hasattr(module, "load_balancing_loss_func"):
        aux = module.load_balancing_loss_func(router_logits, model.num_experts, model.num_experts_per_tok,
                                              attention_mask)
        values["aux_loss"] = aux
        loss = loss + model.router_aux_loss_coef * aux.to(loss.device)
    values.update(loss=loss, logits=None)
    return cls(**values)


# ------------------------------------------------------------------------------------ instance patching
def _family(model_type):
    if model_type not in FAMILIES:
        fail("model", f"a transformers model of type {sorted(FAMILIES)}", repr(model_type))
    module_name, prefix = FAMILIES[model_type]
    return importlib.import_module(module_name), prefix


def _bind(module, make, backend):
    """module.forward (on the instance) = make(the class's transformers forward)."""
    module.forward = types.MethodType(make(_original(type(module).forward), backend), module)


def _install_rope(modeling) -> None:
    if not getattr(modeling.apply_rotary_pos_emb, "__warpforge__", False):
        modeling.apply_rotary_pos_emb = rope_dispatcher(modeling.apply_rotary_pos_emb)


def apply_warpforge(model, rms_norm=True, rope=True, swiglu=True, cross_entropy=True, attention=True, *,
                    backend=None):
    """Patch a built transformers Llama / Qwen3 / Mixtral model (a <Model>ForCausalLM or its base <Model>Model) in
    place onto warpforge's kernels; returns the model. Only this model changes (the RoPE dispatcher it installs in
    the modeling module is inert for other models). Calling it again re-patches with the new flags' forwards."""
    config = getattr(model, "config", None)
    modeling, prefix = _family(getattr(config, "model_type", None))
    want = {"RMSNorm": (rms_norm, rms_norm_forward), "MLP": (swiglu, mlp_forward),
            "Attention": (rope, attention_forward), "ForCausalLM": (cross_entropy, causal_lm_forward)}
    classes = {suffix: getattr(modeling, f"{prefix}{suffix}", None) for suffix in want}
    if rope:
        _install_rope(modeling)
    for module in model.modules():
        for suffix, (on, make) in want.items():
            cls = classes[suffix]
            if on and cls is not None and isinstance(module, cls):
                _bind(module, make, backend)
        if classes["Attention"] is not None and isinstance(module, classes["Attention"]):
            module._warpforge_backend = backend
    if attention:
        wf_attention.register()
        _set_attention(model, wf_attention.NAME)
    return model


def _set_attention(model, name):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # transformers before set_attn_implementation
        model.config._attn_implementation = name


# ------------------------------------------------------------------------------------ class patching
def _set_class_attr(owner, name, value):
    _class_patches.append((owner, name, owner.__dict__.get(name, _OFF)))
    setattr(owner, name, value)


def _patch_family(model_type, rms_norm, rope, swiglu, cross_entropy, attention, backend):
    modeling, prefix = _family(model_type)
    for on, suffix, make in ((rms_norm, "RMSNorm", rms_norm_forward), (swiglu, "MLP", mlp_forward),
                             (rope, "Attention", attention_forward),
                             (cross_entropy, "ForCausalLM", causal_lm_forward)):
        cls = getattr(modeling, f"{prefix}{suffix}", None)
        if on and cls is not None:
            _set_class_attr(cls, "forward", make(_original(cls.forward), backend))
    if swiglu and getattr(modeling, f"{prefix}MLP", None) is None:
        fall_back("swiglu", f"{prefix} has no dense MLP (its experts run through transformers)")
    if rope:
        _install_rope(modeling)
    attn_cls = getattr(modeling, f"{prefix}Attention")
    _set_class_attr(attn_cls, "_warpforge_backend", backend)
    if attention:
        wf_attention.register()
        base = getattr(modeling, f"{prefix}PreTrainedModel")
        _set_class_attr(base, "post_init", _post_init(base.post_init))


def _post_init(original):
    """post_init that switches a model built on transformers' default attention (sdpa / eager) to warpforge."""
    original = _original(original)

    @_wraps(original)
    def post_init(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if getattr(self.config, "_attn_implementation", None) in (None, "sdpa", "eager"):
            _set_attention(self, wf_attention.NAME)
        return out
    return post_init


def apply_warpforge_kernel_to_llama(rms_norm=True, rope=True, swiglu=True, cross_entropy=True, attention=True, *,
                                    backend=None):
    """Patch transformers' Llama classes (models built afterwards; the ForCausalLM forward and RMSNorm / MLP /
    attention forwards of models already built, too): see this module's docstring for each flag."""
    _patch_family("llama", rms_norm, rope, swiglu, cross_entropy, attention, backend)


def apply_warpforge_kernel_to_qwen3(rms_norm=True, rope=True, swiglu=True, cross_entropy=True, attention=True, *,
                                    backend=None):
    """Patch transformers' Qwen3 classes, as apply_warpforge_kernel_to_llama."""
    _patch_family("qwen3", rms_norm, rope, swiglu, cross_entropy, attention, backend)


def apply_warpforge_kernel_to_mixtral(rms_norm=True, rope=True, swiglu=True, cross_entropy=True, attention=True, *,
                                      backend=None):
    """Patch transformers' Mixtral classes, as apply_warpforge_kernel_to_llama. swiglu has nothing to patch:
    Mixtral's experts stay transformers' (logged once)."""
    _patch_family("mixtral", rms_norm, rope, swiglu, cross_entropy, attention, backend)


def revert_warpforge_kernels() -> None:
    """Undo every apply_warpforge_kernel_to_* patch (models built meanwhile keep the attention they were given)."""
    while _class_patches:
        owner, name, previous = _class_patches.pop()
        if previous is _OFF:
            delattr(owner, name)
        else:
            setattr(owner, name, previous)
