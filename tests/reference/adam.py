"""Reference Adam / AdamW (incl. AMSGrad, no-bias-correction FusedAdam mode, fully decoupled wd).

Sources: Kingma & Ba 2014, arXiv 1412.6980 (Adam); Loshchilov & Hutter 2017, arXiv 1711.05101
(AdamW, decoupled weight decay); Reddi et al. 2018 (AMSGrad, "On the Convergence of Adam and
Beyond"). Flag semantics follow torch.optim.Adam/AdamW, apex/DeepSpeed/ColossalAI FusedAdam
(``bias_correction``, ``adam_w_mode``) and optimi (``decouple_lr``, ``max_lr``).

For t = 1, 2, ...  (g = gradient)
    L2 mode (adam_w_mode=False, decouple_lr=False):  g <- g + wd * p
    decoupled (adam_w_mode=True):                    p <- p * (1 - lr * wd)
    fully decoupled (decouple_lr=True, any mode):    p <- p * (1 - (lr / max_lr) * wd)
    m <- b1 m + (1 - b1) g
    v <- b2 v + (1 - b2) g^2
    if amsgrad:  v_max <- max(v_max, v)   (max over the *raw* v, as torch does); use v_max below
    if bias_correction:  m_hat = m / (1 - b1^t),  v_hat = v / (1 - b2^t)
    else:                m_hat = m,              v_hat = v
    p <- p - lr * m_hat / (sqrt(v_hat) + eps)

``max_lr`` defaults to the initial ``lr`` when ``decouple_lr=True`` (optimi convention).
Changing ``self.lr`` between steps is supported (scheduler tests); ``max_lr`` stays fixed.
A ``None`` grad skips that parameter (its state is not touched); the step counter is
per-parameter, as in torch.
"""

from __future__ import annotations

import torch

from ._common import as_param_list, check_grads, decay_or_l2, lazy_state, resolve_max_lr, with_grads


class RefAdam:
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        bias_correction: bool = True,
        adam_w_mode: bool = False,
        decouple_lr: bool = False,
        max_lr: float | None = None,
    ):
        self.params = as_param_list(params)
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.amsgrad = amsgrad
        self.bias_correction = bias_correction
        self.adam_w_mode = adam_w_mode
        self.decouple_lr = decouple_lr
        self.max_lr = resolve_max_lr(lr, decouple_lr, max_lr)
        self.state: dict[int, dict] = {}

    def _new_state(self, p: torch.Tensor) -> dict:
        st = {"step": 0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        if self.amsgrad:
            st["max_exp_avg_sq"] = torch.zeros_like(p)
        return st

    @torch.no_grad()
    def step(self, grads) -> None:
        grads = check_grads(self.params, grads)
        for i, p, g in with_grads(self.params, grads):
            st = lazy_state(self.state, i, lambda: self._new_state(p))
            st["step"] += 1
            t = st["step"]
            g = decay_or_l2(p, g.clone(), self.lr, self.weight_decay, decoupled=self.adam_w_mode,
                            decouple_lr=self.decouple_lr, max_lr=self.max_lr)

            m = st["exp_avg"]
            v = st["exp_avg_sq"]
            m.copy_(self.beta1 * m + (1 - self.beta1) * g)
            v.copy_(self.beta2 * v + (1 - self.beta2) * g * g)

            v_used = v
            if self.amsgrad:
                st["max_exp_avg_sq"].copy_(torch.maximum(st["max_exp_avg_sq"], v))
                v_used = st["max_exp_avg_sq"]

            if self.bias_correction:
                m_hat = m / (1 - self.beta1**t)
                v_hat = v_used / (1 - self.beta2**t)
            else:
                m_hat = m
                v_hat = v_used

            p.sub_(self.lr * m_hat / (torch.sqrt(v_hat) + self.eps))


class RefAdamW(RefAdam):
    """AdamW: RefAdam with ``adam_w_mode=True`` and torch.optim.AdamW's default weight decay 1e-2."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, bias_correction: bool = True,
                 decouple_lr: bool = False, max_lr: float | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, bias_correction=bias_correction, adam_w_mode=True,
                         decouple_lr=decouple_lr, max_lr=max_lr)
