"""Reference StableAdamW (Wortsman et al. 2023, "Stable and low-precision training for large-scale
vision-language models", arXiv 2304.13013), matching optimi's ``StableAdamW`` (checked against
optimi/stableadamw.py).

AdamW with per-tensor update clipping (AdaFactor-style RMS of g^2 / v). Per step t = 1, 2, ...:

    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    m_hat = m / (1 - b1^t);   v_hat = v / (1 - b2^t)
    RMS  = sqrt( mean( g^2 / max(v_hat, eps^2) ) )      (current g, updated v_hat; whole tensor)
    lr_t = lr / max(1, RMS)
    weight decay with the clipped lr:
        decoupled:         p <- p * (1 - lr_t * wd)
        fully decoupled:   p <- p * (1 - (lr_t / max_lr) * wd)      (decouple_lr=True)
    p <- p - lr_t * m_hat / (sqrt(v_hat) + eps)

optimi keeps the bias-corrected moments directly ("debiased betas"), which is algebraically the
same as the explicit bias correction above. eps is added to sqrt(v_hat) (bias-corrected), and
eps^2 floors v_hat inside the RMS. There is no L2 mode. Defaults follow optimi:
betas=(0.9, 0.99), eps=1e-6, weight_decay=1e-2 (optimi/stableadamw.py's signature and its docs:
"The default weight decay of 0.01").

``max_lr`` defaults to the initial lr when ``decouple_lr=True``. ``self.lr`` may change between
steps. Step counter per optimizer; ``None`` grads are skipped.
"""

from __future__ import annotations

import math

import torch

from ._common import (
    as_param_list,
    check_grads,
    decoupled_decay_factor,
    lazy_state,
    resolve_max_lr,
    with_grads,
)


class RefStableAdamW:
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-6,
        weight_decay: float = 1e-2,
        decouple_lr: bool = False,
        max_lr: float | None = None,
    ):
        self.params = as_param_list(params)
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.decouple_lr = decouple_lr
        self.max_lr = resolve_max_lr(lr, decouple_lr, max_lr)
        self.t = 0
        self.state: dict[int, dict] = {}
        self.last_rms: list[float | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self, grads) -> None:
        grads = check_grads(self.params, grads)
        self.t += 1
        t = self.t
        b1, b2 = self.beta1, self.beta2
        for i, p, g in with_grads(self.params, grads):
            st = lazy_state(self.state, i,
                            lambda: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)})
            m, v = st["exp_avg"], st["exp_avg_sq"]

            m.copy_(b1 * m + (1 - b1) * g)
            v.copy_(b2 * v + (1 - b2) * g * g)
            m_hat = m / (1 - b1**t)
            v_hat = v / (1 - b2**t)

            floor = torch.full_like(v_hat, self.eps * self.eps)
            rms = math.sqrt(float(torch.mean(g * g / torch.maximum(v_hat, floor))))
            self.last_rms[i] = rms
            lr_t = self.lr / max(1.0, rms)

            if self.weight_decay != 0:  # with the clipped lr
                p.mul_(decoupled_decay_factor(lr_t, self.weight_decay, self.decouple_lr, self.max_lr))

            p.sub_(lr_t * m_hat / (torch.sqrt(v_hat) + self.eps))
