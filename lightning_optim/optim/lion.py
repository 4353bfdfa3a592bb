"""Lion: EvoLved Sign Momentum (Chen et al., "Symbolic Discovery of Optimization Algorithms",
arXiv 2302.06675), with optimi's arguments."""

from __future__ import annotations

from typing import Any

import torch

from lightning_optim import ops
from lightning_optim.optim.base import BaseOptimizer, Batch, ParamsT
from lightning_optim.optim.sign_sgd import propagating_sign
from lightning_optim.optim.validation import check_betas

__all__ = ["Lion"]


class Lion(BaseOptimizer):
    r"""Lion: the sign of an interpolated momentum, a uniform step of size ``lr`` per coordinate.

    At each step, with gradient :math:`g` and gradient moving average :math:`m` (zeros at start):

    .. math::
        c &= \beta_1 m + (1-\beta_1) g \\
        p &\leftarrow p - \eta\,\mathrm{sign}(c) - \kappa\,p \\
        m &\leftarrow \beta_2 m + (1-\beta_2) g

    where the decay is always decoupled: :math:`\kappa = \eta\lambda`, or, with ``decouple_lr``,
    :math:`\kappa = \lambda\eta/\eta_{max}` (fully decoupled). The decay is applied to the
    parameter before the sign step (:math:`p(1-\kappa) - \eta\,\mathrm{sign}(c)`). There is no
    bias correction; :math:`\mathrm{sign}(0) = 0`, and a NaN or Inf in :math:`c` gives a NaN step
    (propagated, as torch's optimizers propagate it; ``torch.sign`` alone would freeze the coordinate).

    Lion's update has a larger norm than Adam's: the paper uses an lr 3-10x smaller than
    AdamW's and a weight decay 3-10x larger, so that :math:`\eta\lambda` stays the same.

    Optimizer accumulation updates :math:`m` only (the sign step happens on the next normal step).

    Args:
        lr: learning rate, >= 0. Required, as in optimi.
        betas: ``(beta1, beta2)``: the interpolation weight of the update and the coefficient of
            the gradient moving average, each in [0, 1) (default (0.9, 0.99)).
        weight_decay: decoupled decay coefficient, >= 0 (default 0).
        decouple_lr: fully decoupled decay ``p <- p - (lr / max_lr) * wd * p``.
        max_lr: the largest scheduled lr for ``decouple_lr`` (default: the group's lr).
        maximize: maximize the objective instead.
        kahan_sum, foreach, fp32_state: see :class:`BaseOptimizer`.
    """

    _elementwise = True  # element-wise math: a big tensor may step in pieces on the torch path

    _compiled_tensor_lr = True  # the step hands a tensor lr to lion_at_lr

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        decouple_lr: bool = False,
        max_lr: float | None = None,
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
            decouple_lr=decouple_lr,
            max_lr=max_lr,
            kahan_sum=kahan_sum,
            foreach=foreach,
            fp32_state=fp32_state,
            gradient_release=gradient_release,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_betas(group["betas"])

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any], dtype: torch.dtype) -> None:
        state["exp_avg"] = self._new_state(p, "exp_avg", dtype)

    def _update(self, group: dict[str, Any], batch: Batch, apply: bool) -> None:
        beta1, beta2 = group["betas"]
        kernel = ops.kernel("lion", batch)
        if kernel is not None:  # compiled: the same math, the whole bucket in one pass
            kernel(batch, apply, lr=group["lr"], beta1=beta1, beta2=beta2, decay_rule=self.decay_rule(group))
            return
        group = self.with_float_lr(group)  # a compiled step on the torch path reads a tensor lr here
        exp_avg = batch.state("exp_avg")
        if apply:
            # the sign of the interpolation, taken before the moving average moves on
            deltas = propagating_sign(torch._foreach_lerp(exp_avg, batch.grads, 1 - beta1))
            torch._foreach_mul_(deltas, -group["lr"])
        torch._foreach_lerp_(exp_avg, batch.grads, 1 - beta2)
        if apply:
            self._apply(batch, deltas, decay=self.decoupled_decay(group))
