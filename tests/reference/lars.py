"""Reference LARS (You, Gitman & Ginsburg 2017, "Large Batch Training of Convolutional Networks",
arXiv 1708.03888), matching ColossalAI's ``colossalai/nn/optimizer/lars.py`` (itself adapted from
NUS-HPC-AI-Lab/LARS-ImageNet-PyTorch), checked against its source.

Per parameter tensor, per step (g = gradient, all norms are L2 norms of the whole tensor):

    trust = eeta * ||p|| / (||g|| + wd * ||p|| + epsilon)   if ||p|| > 0 and ||g|| > 0, else 1
    trust = clamp(trust, 0, trust_clip)                      (ColossalAI: trust_clip = 50)
    scaled_lr = lr * trust
    d = g + wd * p                                           (only if wd != 0)
    d = clamp(d, -grad_clip, grad_clip)                      (ColossalAI: grad_clip = 10, elementwise)
    if momentum != 0:
        buf = d                       on the first step (clone, no scaling)
        buf = momentum * buf + d      afterwards
        d = buf
    p <- p - scaled_lr * d

Notes on what ColossalAI actually does (and this reference therefore does):
  * ||g|| in the trust ratio is the norm of the raw gradient (before weight decay and clipping).
  * The momentum buffer accumulates the *unscaled* decayed gradient; the (current) trust-scaled lr
    multiplies the whole buffer at every step. (It is NOT "buf = m*buf + scaled_lr*d".)
  * The elementwise clamp of d to [-10, 10] and the trust-ratio clamp to [0, 50] are hard-coded
    constants in ColossalAI; they are exposed here as ``grad_clip`` / ``trust_clip`` (None
    disables) with ColossalAI's values as defaults.
``self.lr`` may be changed between steps. ``None`` grads are skipped.
"""

from __future__ import annotations

import torch

from ._common import as_param_list, check_grads, torch_momentum, with_grads


class RefLARS:
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.0,
        eeta: float = 1e-3,
        weight_decay: float = 0.0,
        epsilon: float = 0.0,
        grad_clip: float | None = 10.0,
        trust_clip: float | None = 50.0,
    ):
        self.params = as_param_list(params)
        self.lr = lr
        self.momentum = momentum
        self.eeta = eeta
        self.weight_decay = weight_decay
        self.epsilon = epsilon
        self.grad_clip = grad_clip
        self.trust_clip = trust_clip
        self.state: dict[int, dict] = {}
        self.last_trust_ratios: list[float | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self, grads) -> None:
        grads = check_grads(self.params, grads)
        wd = self.weight_decay
        for i, p, g in with_grads(self.params, grads):
            w_norm = float(torch.linalg.vector_norm(p))
            g_norm = float(torch.linalg.vector_norm(g))
            if w_norm > 0 and g_norm > 0:
                trust = self.eeta * w_norm / (g_norm + wd * w_norm + self.epsilon)
            else:
                trust = 1.0
            if self.trust_clip is not None:
                trust = min(max(trust, 0.0), self.trust_clip)
            self.last_trust_ratios[i] = trust
            scaled_lr = self.lr * trust

            d = g.clone()
            if wd != 0:
                d = d + wd * p
            if self.grad_clip is not None:
                d = torch.clamp(d, -self.grad_clip, self.grad_clip)

            if self.momentum != 0:  # torch's buffer without dampening: momentum * buf + d
                d = torch_momentum(self.state, i, d, self.momentum)

            p.sub_(scaled_lr * d)
