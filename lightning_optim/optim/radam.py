"""RAdam (Liu et al., arXiv 1908.03265) and the rectified step that Ranger reuses.

The RAdam math lives here once: :func:`rectification` (the variance rectification term) and
:func:`radam_deltas` (moments and parameter delta). :class:`RAdam` and
:class:`lightning_optim.optim.ranger.Ranger` both call them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_optim.optim.base import BaseOptimizer, Batch, ParamsT
from lightning_optim.optim.batch import TensorList
from lightning_optim.optim.validation import check_betas, check_flag, check_positive

__all__ = ["RAdam", "radam_deltas", "rectification"]


def rectification(beta2: float, step: int) -> float | None:
    r"""The variance rectification term :math:`r_t`, or None while :math:`\rho_t \le 5`.

    :math:`\rho_\infty = 2/(1-\beta_2) - 1`, :math:`\rho_t = \rho_\infty - 2 t \beta_2^t / (1-\beta_2^t)`,
    :math:`r_t = \sqrt{(\rho_t-4)(\rho_t-2)\rho_\infty / ((\rho_\infty-4)(\rho_\infty-2)\rho_t)}`.
    The expression order is torch's, so the threshold decision is the same bit for bit.
    """
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * (beta2**step) / (1 - beta2**step)
    if rho_t <= 5.0:
        return None
    return math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))


def radam_deltas(
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    grads: TensorList,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    eps_on_debiased: bool,
    apply: bool = True,
) -> TensorList | None:
    r"""Update the moments in place; return the parameter deltas (None when not ``apply``).

    .. math::
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        \Delta &= -\eta\, r_t \frac{m / b_1}{\sqrt{v}/\sqrt{b_2} + \epsilon'} \text{ if } \rho_t > 5,
        \text{ else } -\eta\, m / b_1

    with :math:`b_k = 1-\beta_k^t`. torch puts eps on the raw second moment
    (:math:`\epsilon' = \epsilon/\sqrt{b_2}`, ``eps_on_debiased=False``); optimi puts it on the
    bias-corrected one (:math:`\epsilon' = \epsilon`, ``eps_on_debiased=True``). Both are computed as
    :math:`-\eta r_t \sqrt{b_2}/b_1 \cdot m / (\sqrt{v} + \epsilon'')` with
    :math:`\epsilon'' = \epsilon` or :math:`\epsilon\sqrt{b_2}`.
    """
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    if not apply:
        return None
    bc1 = 1 - beta1**step
    rect = rectification(beta2, step)
    if rect is None:
        return torch._foreach_mul(exp_avgs, -lr / bc1)
    sqrt_bc2 = math.sqrt(1 - beta2**step)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, eps * sqrt_bc2 if eps_on_debiased else eps)
    deltas = torch._foreach_div(exp_avgs, denom)
    torch._foreach_mul_(deltas, -lr * rect * sqrt_bc2 / bc1)
    return deltas


class RAdam(BaseOptimizer):
    r"""Rectified Adam with torch.optim.RAdam's arguments and results.

    At step :math:`t` with gradient :math:`g` (L2 mode: :math:`g \leftarrow g + \lambda p`),
    :math:`b_k = 1-\beta_k^t`, :math:`\rho_\infty = 2/(1-\beta_2)-1`,
    :math:`\rho_t = \rho_\infty - 2t\beta_2^t/b_2`:

    .. math::
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        p &\leftarrow p - \eta\, r_t \frac{m}{b_1} \frac{\sqrt{b_2}}{\sqrt{v} + \epsilon} - c\,p
            \quad\text{if } \rho_t > 5, \qquad
        p \leftarrow p - \eta \frac{m}{b_1} - c\,p \quad\text{otherwise}

    with :math:`r_t` from :func:`rectification` and the decoupled decay :math:`c = \eta\lambda`
    (``decoupled_weight_decay``), :math:`c = \lambda\eta/\eta_{max}` (``decouple_lr``), else 0.

    Args:
        lr: learning rate, >= 0.
        betas: moment coefficients, each in [0, 1).
        eps: added to :math:`\sqrt{v}`, > 0.
        weight_decay: L2 penalty, or decoupled decay with ``decoupled_weight_decay``/``decouple_lr``.
        decoupled_weight_decay: torch's decoupled decay ``p <- p - lr * wd * p``.
        maximize: maximize the objective instead.
        capturable, differentiable: accepted for torch compatibility; must stay False.
        foreach, kahan_sum, decouple_lr, max_lr, fp32_state: see :class:`BaseOptimizer`.
    """

    _has_kernel = False  # torch ops only: a bucket steps in bounded slices
    _elementwise = True  # element-wise math: a big tensor may step in pieces on the torch path

    # where Ranger differs: the name of its decoupled-decay flag and where eps enters
    _decoupled_key = "decoupled_weight_decay"
    _eps_on_debiased = False

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        kahan_sum: bool | None = None,
        decouple_lr: bool = False,
        max_lr: float | None = None,
        fp32_state: bool = False,
        gradient_release: bool = False,
    ) -> None:
        if capturable or differentiable:
            raise ValueError("capturable/differentiable: not supported by lightning_optim.RAdam; leave them False")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            maximize=maximize,
            foreach=foreach,
            kahan_sum=kahan_sum,
            decouple_lr=decouple_lr,
            max_lr=max_lr,
            fp32_state=fp32_state,
            gradient_release=gradient_release,
        )
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_betas(group["betas"])
        check_positive("eps", group["eps"])
        check_flag(self._decoupled_key, group[self._decoupled_key])

    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], dtype: torch.dtype) -> None:
        state["exp_avg"] = self._new_state(p, "exp_avg", dtype)
        state["exp_avg_sq"] = self._new_state(p, "exp_avg_sq", dtype)

    def _update(self, group: dict[str, Any], batch: Batch, apply: bool) -> None:
        decoupled = group[self._decoupled_key] or group["decouple_lr"]
        grads = batch.grads if decoupled else self.with_l2(batch, group["weight_decay"])
        beta1, beta2 = group["betas"]
        deltas = radam_deltas(
            batch.state("exp_avg"),
            batch.state("exp_avg_sq"),
            grads,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            step=batch.step,
            eps_on_debiased=self._eps_on_debiased,
            apply=apply,
        )
        if deltas is not None:
            self._apply(batch, deltas, decay=self.decoupled_decay(group) if decoupled else 0.0)
