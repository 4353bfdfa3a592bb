"""Reference Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms",
arXiv 2302.06675), matching optimi's ``Lion`` (checked against optimi/lion.py).

Per step (g = gradient, m = gradient moving average, state init m = 0):

    weight decay (before the update, on the current p):
        decoupled (default):             p <- p * (1 - lr * wd)
        fully decoupled (decouple_lr):   p <- p * (1 - (lr / max_lr) * wd)
    c = b1 m + (1 - b1) g              (interpolation used for the update)
    p <- p - lr * sign(c)              (sign(0) = 0)
    m <- b2 m + (1 - b2) g

No bias correction. Defaults follow optimi: betas=(0.9, 0.99), weight_decay=0.
``max_lr`` defaults to the initial lr when ``decouple_lr=True``. ``self.lr`` may change between
steps. ``None`` grads are skipped.
"""

from __future__ import annotations

import torch

from ._common import (
    as_param_list,
    check_grads,
    decoupled_decay_factor,
    lazy_state,
    resolve_max_lr,
    with_grads,
)


class RefLion:
    def __init__(
        self,
        params,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        decouple_lr: bool = False,
        max_lr: float | None = None,
    ):
        self.params = as_param_list(params)
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.weight_decay = weight_decay
        self.decouple_lr = decouple_lr
        self.max_lr = resolve_max_lr(lr, decouple_lr, max_lr)
        self.state: dict[int, dict] = {}

    @torch.no_grad()
    def step(self, grads) -> None:
        grads = check_grads(self.params, grads)
        for i, p, g in with_grads(self.params, grads):
            m = lazy_state(self.state, i, lambda: {"exp_avg": torch.zeros_like(p)})["exp_avg"]

            if self.weight_decay != 0:
                p.mul_(decoupled_decay_factor(self.lr, self.weight_decay, self.decouple_lr, self.max_lr))

            c = self.beta1 * m + (1 - self.beta1) * g
            p.sub_(self.lr * torch.sign(c))
            m.copy_(self.beta2 * m + (1 - self.beta2) * g)
