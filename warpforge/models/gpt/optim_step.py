"""The end of every training step, gradient clipping + AdamW, optionally replayed from one CUDA graph.

Eagerly the two cost ~150 tensors' worth of Python and a few dozen launches. On one GPU that hides behind the
queued backward, but under DDP the host reaches the optimizer late (the backward's bucket hooks run on it), and
the GPU waits: gpt2-124m on 2 H200s sat idle 1.9 ms of a 23 ms step, most of it around these kernels. From a
graph the host's share is an lr fill and a replay.

A graph reads the gradients where they were at capture. DDP keeps them in its buckets, and one GPU's come from
the same graph-pool slots each step; if they ever move, the step goes back to eager for good (and says so).
"""
from __future__ import annotations

from typing import Callable

import torch


class OptimizerStep:
    def __init__(self, params: list[torch.nn.Parameter], optim: torch.optim.Optimizer, max_norm: float,
                 graphed: bool, log: Callable[[str], None] = print):
        self.params, self.optim, self.max_norm, self.log = params, optim, max_norm, log
        self.graphed = graphed
        self.graph, self.grad_ptrs, self.lr, self.steps = None, None, None, 0
        self.capturable = [g["capturable"] for g in optim.param_groups]

    def __call__(self, lr: float) -> None:
        ptrs = self._grad_ptrs() if self.graphed else None
        self.steps += 1
        if ptrs is None or self.steps == 1:  # eager; a first step also creates AdamW's state and warms up
            self._eager(lr)
            return
        if self.graph is None:
            self._capture(ptrs)
        elif ptrs != self.grad_ptrs:
            self.log("optimizer step: the gradients moved since the graph was captured; stepping eagerly from now")
            self._release()
            self._eager(lr)
            return
        self.lr.fill_(lr)
        self.graph.replay()

    def state_dict(self) -> dict:
        """The optimizer's state as an eager one writes it (float lr, capturable as built): checkpoints load
        anywhere."""
        state = self.optim.state_dict()
        state["param_groups"] = [dict(g, lr=float(g["lr"]), capturable=c)
                                 for g, c in zip(state["param_groups"], self.capturable)]
        return state

    def _eager(self, lr: float) -> None:
        for g in self.optim.param_groups:
            g["lr"] = lr
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.optim.step()

    def _grad_ptrs(self):
        ptrs = tuple(p.grad.data_ptr() if p.grad is not None else 0 for p in self.params)
        return None if 0 in ptrs else ptrs  # a parameter without a gradient this step: eager

    def _capture(self, ptrs) -> None:
        device = self.params[0].device
        self.lr = torch.zeros((), device=device, dtype=torch.float32)
        for g in self.optim.param_groups:  # a device lr the replay reads; capturable: no host-side step count
            g["lr"], g["capturable"] = self.lr, True
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # recorded, not run: the caller replays it
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
            self.optim.step()
        self.grad_ptrs = ptrs

    def _release(self) -> None:
        self.graphed, self.graph = False, None
        for g, c in zip(self.optim.param_groups, self.capturable):
            g["lr"], g["capturable"] = float(self.lr), c
