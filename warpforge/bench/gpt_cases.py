"""GPT training throughput: one optimizer step of the gpt2-124m preset (bf16 autocast, fused AdamW, random
tokens), warpforge's ops against the same model on plain PyTorch ops (GPT(cfg, backend="torch"): SDPA,
F.rms_norm, ...), eager and torch.compile'd, both compiled ones also replayed from CUDA graphs
(mode="reduce-overhead").
Reported as ms per step and TFLOP/s by llm.c's count (6N + 6·L·C·T per token); tokens/s = tokens / time."""
from __future__ import annotations

import torch

from ..models.gpt.config import GPTConfig, preset
from ..models.gpt.model import GPT
from ..nn import functional
from .cases import Setup, register

# the hot ops of the dense GPT, each swapped in alone by the ablation
ABLATION_OPS = ("attention", "rms_norm", "add_rms_norm", "rope", "swiglu", "linear_cross_entropy")


def gpt_train_setup(device, tiny, *, name="gpt2-124m", ablation=False):
    """ablation: also the PyTorch model with one warpforge op swapped in at a time (all compiled), to see which
    op gains or loses against Inductor's own code."""
    cfg = preset(name).model
    batch = preset(name).train.batch_size
    if tiny:
        cfg, batch = GPTConfig(seq_len=32, n_layer=2, n_head=4, n_kv_head=4, d_model=128), 2
    torch.manual_seed(0)
    base = GPT(cfg).to(device)
    tokens = batch * cfg.seq_len
    flops = base.flops_per_token() * tokens
    gen = torch.Generator(device="cpu").manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen).to(device)
               for _ in range(4)]

    def make_step(backend, compile_mode):
        """backend: GPT's (None: warpforge, "torch", or a dict per op); compile_mode: None (eager), "default"
        (Inductor) or "reduce-overhead" (Inductor + CUDA graphs)."""
        model = GPT(cfg, backend=backend).to(device)
        model.load_state_dict(base.state_dict())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        fwd = torch.compile(model, mode=compile_mode) if compile_mode else model
        graphs = compile_mode == "reduce-overhead"
        state = {"i": 0}

        def step():
            x = batches[state["i"] % len(batches)]
            state["i"] += 1
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = fwd(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach().clone()  # a graph's output buffer is reused by its next replay
        return step, state

    impls, states = {}, []
    cuda = device.type == "cuda"
    variants = [("warpforge", None, "default" if cuda else None)]
    if cuda:
        variants += [("warpforge (CUDA graphs)", None, "reduce-overhead"),
                     ("torch.compile", functional.TORCH, "default"),
                     ("torch.compile (CUDA graphs)", functional.TORCH, "reduce-overhead"),
                     ("torch eager", functional.TORCH, None)]
    if ablation:
        variants += [(f"warpforge (only {op})", {"*": functional.TORCH, op: None}, "default" if cuda else None)
                     for op in ABLATION_OPS]
    for label, backend, comp in variants:
        impls[label], st = make_step(backend, comp)
        states.append(st)
    ref_model = GPT(cfg, backend=functional.TORCH).to(device)  # fp32, plain ops: the loss each first step should see
    ref_model.load_state_dict(base.state_dict())
    with torch.no_grad():
        ref_loss = ref_model(batches[0][:, :-1], batches[0][:, 1:]).float()
    del ref_model

    def reset():  # the scored call is each impl's first step, on batch 0, from the same weights
        for st in states:
            st["i"] = 0

    def score(loss):
        return (abs(loss.float() - ref_loss) / ref_loss).item()

    return Setup(flops=flops, bytes=0, impls=impls, score=score, reset=reset, err_kind="rel loss", tokens=tokens)


register("gpt", "train step gpt2-124m bf16 b16 s1024", quick=True)(lambda dev, tiny: gpt_train_setup(dev, tiny))
register("gpt", "train step gpt2-124m bf16 b16 s1024 op ablation")(
    lambda dev, tiny: gpt_train_setup(dev, tiny, ablation=True))
