"""Reference RAdam, Lookahead and Ranger (= RAdam + Lookahead).

RAdam: Liu et al. 2019, "On the Variance of the Adaptive Learning Rate and Beyond",
arXiv 1908.03265. Lookahead: Zhang et al. 2019, "Lookahead Optimizer: k steps forward, 1 step
back", arXiv 1907.08610. Ranger: Wright 2019 (RAdam + Lookahead), here with optimi's ``Ranger``
arguments and semantics (checked against optimi/ranger.py and optimi/radam.py).

RAdam, per step t = 1, 2, ... (g = gradient):
    weight decay:
        L2 (default):                                   g <- g + wd * p
        decoupled (decoupled_weight_decay / decouple_wd): p <- p * (1 - lr * wd)
        fully decoupled (decouple_lr=True):              p <- p * (1 - (lr / max_lr) * wd)
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    m_hat = m / (1 - b1^t)
    rho_inf = 2 / (1 - b2) - 1
    rho_t   = rho_inf - 2 t b2^t / (1 - b2^t)
    if rho_t > 5:
        rect = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))
        torch.optim.RAdam (eps_on_debiased=False):   p <- p - lr * rect * m_hat * sqrt(1 - b2^t) / (sqrt(v) + eps)
        optimi RAdam/Ranger (eps_on_debiased=True):  p <- p - lr * rect * m_hat / (sqrt(v / (1 - b2^t)) + eps)
    else (un-adapted momentum step):
        p <- p - lr * m_hat
    The two libraries differ ONLY in where eps enters (on sqrt of the raw or of the bias-corrected
    second moment); both use the threshold rho_t > 5. RefRAdam defaults to torch's form
    (``eps=1e-8, betas=(0.9, 0.999)``); RefRanger uses optimi's form and defaults.

Lookahead (wrapping any reference "fast" optimizer with ``step(grads)``):
    slow weights phi are initialised to a copy of the params at the first step (before it runs);
    after every inner step, the step counter s increases; if s % k == 0 (s counted from 1):
        phi <- phi + alpha (p - phi);   p <- phi
    With alpha = 1 Lookahead is the identity on the inner optimizer's trajectory.

Ranger (optimi): RAdam(eps_on_debiased=True) + Lookahead(k=6, alpha=0.5), betas=(0.9, 0.99),
eps=1e-6, weight_decay=0, ``decouple_wd=True`` (optimi's Ranger default: torch-style decoupled
decay), ``decouple_lr`` (fully decoupled), ``max_lr`` (defaults to the initial lr).

Step counters are per optimizer (optimi: per param group; torch: per param - identical when no
grad is None). ``self.lr`` may be changed between steps (Lookahead/Ranger forward it).
"""

from __future__ import annotations

import math

import torch

from ._common import as_param_list, check_grads, decay_or_l2, lazy_state, resolve_max_lr, with_grads


class RefRAdam:
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        decouple_lr: bool = False,
        max_lr: float | None = None,
        eps_on_debiased: bool = False,
    ):
        self.params = as_param_list(params)
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.decoupled_weight_decay = decoupled_weight_decay
        self.decouple_lr = decouple_lr
        self.max_lr = resolve_max_lr(lr, decouple_lr, max_lr)
        self.eps_on_debiased = eps_on_debiased
        self.t = 0
        self.state: dict[int, dict] = {}

    @torch.no_grad()
    def step(self, grads) -> None:
        grads = check_grads(self.params, grads)
        self.t += 1
        t = self.t
        b1, b2 = self.beta1, self.beta2
        bc1 = 1 - b1**t
        bc2 = 1 - b2**t
        rho_inf = 2 / (1 - b2) - 1
        rho_t = rho_inf - 2 * t * b2**t / bc2
        rect = None
        if rho_t > 5:
            rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))

        for i, p, g in with_grads(self.params, grads):
            st = lazy_state(self.state, i,
                            lambda: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)})
            m, v = st["exp_avg"], st["exp_avg_sq"]
            g = decay_or_l2(p, g, self.lr, self.weight_decay, decoupled=self.decoupled_weight_decay,
                            decouple_lr=self.decouple_lr, max_lr=self.max_lr)

            m.copy_(b1 * m + (1 - b1) * g)
            v.copy_(b2 * v + (1 - b2) * g * g)
            m_hat = m / bc1

            if rect is None:
                p.sub_(self.lr * m_hat)
            elif self.eps_on_debiased:
                p.sub_(self.lr * rect * m_hat / (torch.sqrt(v / bc2) + self.eps))
            else:
                p.sub_(self.lr * rect * m_hat * math.sqrt(bc2) / (torch.sqrt(v) + self.eps))


class RefLookahead:
    """Lookahead around a reference optimizer ``inner`` that updates ``inner.params`` in place.

    As in optimi, a parameter whose grad is None at a step is left out of that step entirely
    (inner step and synchronisation); its slow copy is taken the first time it has a grad.
    """

    def __init__(self, inner, k: int = 6, alpha: float = 0.5):
        self.inner = inner
        self.params = inner.params
        self.k = k
        self.alpha = alpha
        self.s = 0
        self.slow: list[torch.Tensor | None] = [None] * len(self.params)

    @property
    def lr(self) -> float:
        return self.inner.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.inner.lr = value

    @torch.no_grad()
    def step(self, grads) -> None:
        grads = check_grads(self.params, grads)
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is not None and self.slow[i] is None:
                self.slow[i] = p.clone()
        self.inner.step(grads)
        self.s += 1
        if self.s % self.k == 0:
            for p, g, phi in zip(self.params, grads, self.slow):
                if g is None:
                    continue
                phi.copy_(phi + self.alpha * (p - phi))
                p.copy_(phi)


class RefRanger(RefLookahead):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        decouple_wd: bool = True,
        decouple_lr: bool = False,
        max_lr: float | None = None,
        k: int = 6,
        alpha: float = 0.5,
    ):
        inner = RefRAdam(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            decoupled_weight_decay=decouple_wd, decouple_lr=decouple_lr, max_lr=max_lr,
            eps_on_debiased=True,
        )
        super().__init__(inner, k=k, alpha=alpha)
