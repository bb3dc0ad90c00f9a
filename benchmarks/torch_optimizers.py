"""The artifacts' optimizers written in PyTorch, for the scripts that make PyTorch reference trajectories
(benchmarks/loop_goldens.py, benchmarks/decoders/make_models.py); needs torch, never a dependency of odtrain.

`AdamWLikeOnnxRuntime` is the AdamW that `generate_artifacts` writes by default (ONNX Runtime's): its ε is added
to √v after the bias correction is folded into the step size, and its decay follows the update, where
torch.optim.AdamW differs (~1e-4 relative over a few steps), so a golden compares like with like.
"""
from __future__ import annotations

import numpy as np
import torch

ADAMW = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "weight_decay": 0.0, "bias_correction": True}


class AdamWLikeOnnxRuntime:
    """ONNX Runtime's AdamW: step size lr·√(1-β2ᵗ)/(1-β1ᵗ), ε added to √v, decay after the update."""

    def __init__(self, params, lr):
        self.params, self.lr, self.t = list(params), lr, 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        self.t += 1
        b1, b2 = ADAMW["beta1"], ADAMW["beta2"]
        size = self.lr * np.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t)
        for p, m, v in zip(self.params, self.m, self.v):
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            p.sub_(size * m / (v.sqrt() + ADAMW["eps"]))
            p.sub_(self.lr * ADAMW["weight_decay"] * p)


class SGD:
    """Plain SGD: w ← w - lr·g."""

    def __init__(self, params, lr):
        self.params, self.lr = list(params), lr

    @torch.no_grad()
    def step(self):
        for p in self.params:
            p.sub_(self.lr * p.grad)
