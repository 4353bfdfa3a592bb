"""Adan: Adaptive Nesterov Momentum (Xie et al., arXiv 2208.06677), with optimi's arguments."""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_optim import ops
from lightning_optim.optim.base import BaseOptimizer, Batch, ParamsT
from lightning_optim.optim.validation import check_betas, check_flag, check_positive

__all__ = ["Adan"]


class Adan(BaseOptimizer):
    r"""Adan: Adam-like steps on a Nesterov estimate built from gradient differences.

    Betas weight the *old* value (optimi's and the official code's convention; the paper writes
    :math:`1-\beta`). At step :math:`t` with gradient :math:`g` and the previous gradient
    :math:`g'` (:math:`g' = g` at the first step, so the difference starts at zero):

    .. math::
        d &= g - g' \\
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad
        n \leftarrow \beta_2 n + (1-\beta_2) d \\
        v &\leftarrow \beta_3 v + (1-\beta_3) (g + \beta_2 d)^2 \\
        u &= \frac{m/b_1 + \beta_2\, n/b_2}{\sqrt{v/b_3} + \epsilon}, \qquad b_k = 1-\beta_k^t \\
        p &\leftarrow \frac{p - \eta u}{1 + \kappa}
            \quad\text{(Adan's proximal decay, default)} \\
        p &\leftarrow p(1-\kappa) - \eta u \quad\text{(``adam_wd=True``)}

    with :math:`\kappa = \eta\lambda`, or :math:`\kappa = \lambda\eta/\eta_{max}` with
    ``decouple_lr`` (fully decoupled). The plain :math:`\beta_2` (not bias-corrected) weights
    :math:`d` inside :math:`v` and :math:`n` in :math:`u`; :math:`\epsilon` is added to the
    bias-corrected :math:`\sqrt{\hat v}`. optimi folds the bias correction into the betas and
    stores :math:`\hat m, \hat n, \hat v`; we store the raw moments and divide, as in the paper
    (algebraically the same update).

    Optimizer accumulation: each accumulating step is a full state update, so ``prev_grad`` is
    the latest *micro-batch* gradient and :math:`d` is the difference between consecutive
    micro-batch gradients, within and across optimizer steps (optimi does the same); the step
    counter (bias correction) counts micro-steps.

    Args:
        lr: learning rate, >= 0. Required, as in optimi.
        betas: ``(beta1, beta2, beta3)`` for the gradient, gradient-difference and squared
            moving averages, each in [0, 1) (default (0.98, 0.92, 0.99)).
        weight_decay: decay coefficient, >= 0 (default 0.02, the paper's).
        eps: added to the denominator, > 0 (default 1e-6).
        adam_wd: decay before the step, ``p(1 - kappa)``, instead of Adan's proximal
            ``1 / (1 + kappa)`` after it.
        decouple_lr: fully decoupled decay (``kappa = wd * lr / max_lr``).
        max_lr: the largest scheduled lr for ``decouple_lr`` (default: the group's lr).
        maximize: maximize the objective instead.
        kahan_sum, foreach, fp32_state: see :class:`BaseOptimizer`.
    """

    _elementwise = True  # element-wise math: a big tensor may step in pieces on the torch path

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        betas: tuple[float, float, float] = (0.98, 0.92, 0.99),
        weight_decay: float = 2e-2,
        eps: float = 1e-6,
        *,
        decouple_lr: bool = False,
        max_lr: float | None = None,
        adam_wd: bool = False,
        kahan_sum: bool | None = None,
        foreach: bool | None = None,
        fp32_state: bool = False,
        gradient_release: bool = False,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            eps=eps,
            decouple_lr=decouple_lr,
            max_lr=max_lr,
            adam_wd=adam_wd,
            kahan_sum=kahan_sum,
            foreach=foreach,
            fp32_state=fp32_state,
            gradient_release=gradient_release,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_betas(group["betas"], count=3)
        check_positive("eps", group["eps"])
        check_flag("adam_wd", group["adam_wd"])

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any], dtype: torch.dtype) -> None:
        for key in ("exp_avg", "exp_avg_diff", "exp_avg_sq", "prev_grad"):
            state[key] = self._new_state(p, key, dtype)

    def _update(self, group: dict[str, Any], batch: Batch, apply: bool) -> None:
        beta1, beta2, beta3 = group["betas"]
        kernel = ops.kernel("adan", batch)
        if kernel is not None:  # compiled: the same math, the whole bucket in one pass
            kappa = self.decoupled_decay(group)
            proximal = not group["adam_wd"]  # (p - lr u) / (1 + kappa), as below
            kernel(batch, apply, beta1=beta1, beta2=beta2, beta3=beta3, eps=group["eps"],
                   step_size=-group["lr"] / (1 + kappa) if proximal else -group["lr"],
                   decay=kappa / (1 + kappa) if proximal else kappa)
            return
        grads = batch.grads
        exp_avg, exp_avg_diff = batch.state("exp_avg"), batch.state("exp_avg_diff")
        exp_avg_sq, prev_grad = batch.state("exp_avg_sq"), batch.state("prev_grad")
        if batch.step == 1:
            torch._foreach_copy_(prev_grad, grads)  # no previous gradient: the difference is 0
        diff = torch._foreach_sub(grads, prev_grad)
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_lerp_(exp_avg_diff, diff, 1 - beta2)
        nesterov = torch._foreach_add(grads, diff, alpha=beta2)  # g + beta2 * d
        torch._foreach_mul_(exp_avg_sq, beta3)
        torch._foreach_addcmul_(exp_avg_sq, nesterov, nesterov, value=1 - beta3)
        torch._foreach_copy_(prev_grad, grads)
        if not apply:
            return
        step = batch.step
        bc1, bc2, bc3 = 1 - beta1**step, 1 - beta2**step, 1 - beta3**step
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, math.sqrt(bc3))
        torch._foreach_add_(denom, group["eps"])
        # numerator m/b1 + beta2 n/b2, reusing the scratch lists
        deltas = torch._foreach_div(exp_avg, bc1)
        torch._foreach_add_(deltas, exp_avg_diff, alpha=beta2 / bc2)
        torch._foreach_div_(deltas, denom)
        kappa = self.decoupled_decay(group)
        if group["adam_wd"]:
            torch._foreach_mul_(deltas, -group["lr"])
            self._apply(batch, deltas, decay=kappa)
        else:
            # (p - lr u) / (1 + kappa) == p (1 - kappa / (1 + kappa)) - lr u / (1 + kappa)
            torch._foreach_mul_(deltas, -group["lr"] / (1 + kappa))
            self._apply(batch, deltas, decay=kappa / (1 + kappa))
