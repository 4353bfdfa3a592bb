"""Reference Adan (Xie et al. 2022, "Adan: Adaptive Nesterov Momentum Algorithm for Faster
Optimizing Deep Models", arXiv 2208.06677), matching optimi's ``Adan`` (checked against
optimi/adan.py).

Betas are the weights of the OLD value (optimi / official sail-sg convention; the paper writes
1 - beta). Per step t = 1, 2, ... (g = gradient, g_prev = previous step's gradient; at the first
step g_prev = g, so the difference is 0):

    d = g - g_prev
    m <- b1 m + (1 - b1) g
    n <- b2 n + (1 - b2) d
    v <- b3 v + (1 - b3) (g + b2 d)^2
    m_hat = m / (1 - b1^t),  n_hat = n / (1 - b2^t),  v_hat = v / (1 - b3^t)
    update = (m_hat + b2 n_hat) / (sqrt(v_hat) + eps)
    lam = lr * wd            (fully decoupled, decouple_lr=True:  lam = (lr / max_lr) * wd)
    adam_wd=False (Adan's proximal decay, default):  p <- (p - lr * update) / (1 + lam)
    adam_wd=True  (Adam-style, before the step):     p <- p * (1 - lam);  p <- p - lr * update

optimi stores the bias-corrected moments directly ("debiased betas",
beta_hat_t = (beta^t - beta) / (beta^t - 1)); that is algebraically identical to the explicit
bias correction above, which this reference uses because it is the paper's form. Note that
optimi uses the *plain* b2 inside (g + b2 d) and in (m_hat + b2 n_hat), and eps is added to
sqrt(v_hat) (the bias-corrected second moment). Defaults follow optimi:
betas=(0.98, 0.92, 0.99), eps=1e-6, weight_decay=0.02.

``max_lr`` defaults to the initial lr when ``decouple_lr=True``. ``self.lr`` may change between
steps. The step counter t is per optimizer (optimi: per param group); ``None`` grads are skipped.
"""

from __future__ import annotations

import torch

from ._common import (
    as_param_list,
    check_grads,
    decay_coefficient,
    lazy_state,
    resolve_max_lr,
    with_grads,
)


class RefAdan:
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.98, 0.92, 0.99),
        eps: float = 1e-6,
        weight_decay: float = 0.02,
        decouple_lr: bool = False,
        max_lr: float | None = None,
        adam_wd: bool = False,
    ):
        self.params = as_param_list(params)
        self.lr = lr
        self.beta1, self.beta2, self.beta3 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.decouple_lr = decouple_lr
        self.max_lr = resolve_max_lr(lr, decouple_lr, max_lr)
        self.adam_wd = adam_wd
        self.t = 0
        self.state: dict[int, dict] = {}

    @torch.no_grad()
    def step(self, grads) -> None:
        grads = check_grads(self.params, grads)
        self.t += 1
        t = self.t
        b1, b2, b3 = self.beta1, self.beta2, self.beta3

        lam = decay_coefficient(self.lr, self.weight_decay, self.decouple_lr, self.max_lr)

        for i, p, g in with_grads(self.params, grads):
            st = lazy_state(self.state, i, lambda: {
                "exp_avg": torch.zeros_like(p),
                "exp_avg_diff": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
                "prev_grad": g.clone(),
            })
            m, n, v = st["exp_avg"], st["exp_avg_diff"], st["exp_avg_sq"]

            d = g - st["prev_grad"]
            m.copy_(b1 * m + (1 - b1) * g)
            n.copy_(b2 * n + (1 - b2) * d)
            z = g + b2 * d
            v.copy_(b3 * v + (1 - b3) * z * z)
            st["prev_grad"].copy_(g)

            m_hat = m / (1 - b1**t)
            n_hat = n / (1 - b2**t)
            v_hat = v / (1 - b3**t)
            update = (m_hat + b2 * n_hat) / (torch.sqrt(v_hat) + self.eps)

            if self.adam_wd:
                if self.weight_decay != 0:
                    p.mul_(1 - lam)
                p.sub_(self.lr * update)
            else:
                p.sub_(self.lr * update)
                if self.weight_decay != 0:
                    p.div_(1 + lam)
