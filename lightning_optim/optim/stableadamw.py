"""StableAdamW: AdamW with AdaFactor's update clipping (Wortsman et al., "Stable and
low-precision training for large-scale vision-language models", arXiv 2304.13013), with
optimi's arguments."""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_optim import ops
from lightning_optim.optim.base import LOW_PRECISION, BaseOptimizer, Batch, ParamsT
from lightning_optim.optim.validation import check_betas, check_positive

__all__ = ["StableAdamW"]


class StableAdamW(BaseOptimizer):
    r"""AdamW whose learning rate is clipped per tensor by the RMS of :math:`g^2/\hat v`.

    At step :math:`t` with gradient :math:`g`, for each parameter tensor separately:

    .. math::
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        \hat m &= m / (1-\beta_1^t), \qquad \hat v = v / (1-\beta_2^t) \\
        \mathrm{RMS} &= \sqrt{\operatorname{mean}\bigl(g^2 / \max(\hat v, \epsilon^2)\bigr)},
        \qquad \eta_t = \eta / \max(1, \mathrm{RMS}) \\
        p &\leftarrow p(1-\kappa_t) - \eta_t\,\frac{\hat m}{\sqrt{\hat v} + \epsilon}

    The RMS uses the current gradient and the updated :math:`\hat v`, over the whole tensor. The
    decay uses the clipped lr: :math:`\kappa_t = \eta_t\lambda`, or
    :math:`\kappa_t = \lambda\eta_t/\eta_{max}` with ``decouple_lr`` (fully decoupled). There is
    no L2 mode. optimi folds the bias correction into the betas and stores :math:`\hat m, \hat v`;
    we store the raw moments and divide (algebraically the same update).

    StableAdamW replaces gradient clipping, which is why it pairs well with gradient release and
    optimizer accumulation (which update states only; the RMS is taken at the applying step from
    that step's gradient).

    Args:
        lr: learning rate, >= 0. Required, as in optimi.
        betas: moment coefficients, each in [0, 1) (default (0.9, 0.99)).
        weight_decay: decoupled decay coefficient, >= 0 (default 1e-2, optimi's).
        eps: added to :math:`\sqrt{\hat v}`; :math:`\epsilon^2` floors :math:`\hat v` in the RMS;
            > 0 (default 1e-6).
        decouple_lr: fully decoupled decay ``p <- p - (lr_t / max_lr) * wd * p``.
        max_lr: the largest scheduled lr for ``decouple_lr`` (default: the group's lr).
        maximize: maximize the objective instead.
        kahan_sum, foreach, fp32_state: see :class:`BaseOptimizer`.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 1e-2,
        eps: float = 1e-6,
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
            eps=eps,
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
        check_positive("eps", group["eps"])

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any], dtype: torch.dtype) -> None:
        state["exp_avg"] = self._new_state(p, "exp_avg", dtype)
        state["exp_avg_sq"] = self._new_state(p, "exp_avg_sq", dtype)

    def _update(self, group: dict[str, Any], batch: Batch, apply: bool) -> None:
        beta1, beta2 = group["betas"]
        eps, grads = group["eps"], batch.grads
        kernel = ops.kernel("stableadamw", batch)
        if kernel is not None:  # compiled: moments + RMS in one pass, the step in a second
            bc1, bc2 = 1 - beta1**batch.step, 1 - beta2**batch.step
            kernel.step(batch, apply, lr=group["lr"], beta1=beta1, beta2=beta2, bc1=bc1, bc2=bc2, eps=eps,
                        decay_rule=self.decay_rule(group))
            return
        exp_avg, exp_avg_sq = batch.state("exp_avg"), batch.state("exp_avg_sq")
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
        if not apply:
            return
        bc1, bc2 = 1 - beta1**batch.step, 1 - beta2**batch.step
        v_hat = torch._foreach_div(exp_avg_sq, bc2)

        # per-tensor RMS of g^2 / max(v_hat, eps^2); one host sync per bucket
        ratio = torch._foreach_mul(grads, grads)
        torch._foreach_div_(ratio, torch._foreach_clamp_min(v_hat, eps * eps))
        mean_dtype = torch.float32 if batch.compute_dtype in LOW_PRECISION else None
        stacked = torch.stack([r.mean(dtype=mean_dtype) for r in ratio])
        means = [0.0] * len(ratio) if stacked.is_meta else stacked.tolist()  # meta: shapes only, no clip
        del ratio
        lrs = self._clipped_lrs(group, means)

        torch._foreach_sqrt_(v_hat)
        torch._foreach_add_(v_hat, eps)
        deltas = torch._foreach_div(exp_avg, v_hat)
        torch._foreach_mul_(deltas, [-lr_t / bc1 for lr_t in lrs])
        self._apply(batch, deltas, decay=[self.decoupled_decay(group, lr=lr_t) for lr_t in lrs])

    @staticmethod
    def _clipped_lrs(group: dict[str, Any], means: list[float]) -> list[float]:
        """Per tensor ``lr / max(1, RMS)`` from the mean of ``g^2 / max(v_hat, eps^2)``."""
        return [group["lr"] / max(1.0, math.sqrt(mean)) for mean in means]
