"""Reference SignSGD (Bernstein et al. 2018, "signSGD: Compressed Optimisation for Non-Convex
Problems", arXiv 1802.04434), matching mlbench-core's ``SignSGD``
(mlbench_core/optim/pytorch/optim.py, checked against its source): torch-SGD-style weight decay
and momentum, then a step of size lr in the direction of the sign.

Per parameter tensor, per step (g = gradient):
    d = g + wd * p                                   (L2, only if wd != 0)
    if momentum != 0:
        buf = d                                      first step (no dampening on the first step)
        buf = momentum * buf + (1 - dampening) * d   afterwards
        d = d + momentum * buf   if nesterov   else   d = buf
    p <- p - lr * sign(d)                            (sign(0) = 0)

With momentum 0 this is signSGD; with momentum it is mlbench's "signum"-like variant (sign of the
torch SGD momentum direction). mlbench mutates ``p.grad`` in place with the weight decay; this
reference leaves the given grads untouched. ``self.lr`` may be changed between steps.
"""

from __future__ import annotations

import torch

from ._common import as_param_list, check_grads, torch_momentum, with_grads


class RefSignSGD:
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ):
        self.params = as_param_list(params)
        self.lr = lr
        self.momentum = momentum
        self.dampening = dampening
        self.weight_decay = weight_decay
        self.nesterov = nesterov
        self.state: dict[int, dict] = {}

    @torch.no_grad()
    def step(self, grads) -> None:
        grads = check_grads(self.params, grads)
        for i, p, g in with_grads(self.params, grads):
            d = g.clone()
            if self.weight_decay != 0:
                d = d + self.weight_decay * p
            if self.momentum != 0:
                buf = torch_momentum(self.state, i, d, self.momentum, self.dampening)
                if self.nesterov:
                    d = d + self.momentum * buf
                else:
                    d = buf
            p.sub_(self.lr * torch.sign(d))
