"""Adam and AdamW (Kingma & Ba, arXiv 1412.6980; Loshchilov & Hutter, arXiv 1711.05101)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_optim import ops
from lightning_optim.optim.base import BaseOptimizer, Batch, ParamsT
from lightning_optim.optim.batch import TensorList
from lightning_optim.optim.validation import check_betas, check_flag, check_positive
from lightning_optim.renames import FUSED_NOTE, Alias, argument_aliases, warn_ignored

__all__ = ["Adam", "AdamW", "ADAM_W_MODE", "adam_first_moment_", "adam_second_moment_", "adam_denominator",
           "adam_deltas"]

# DeepSpeed's and apex's FusedAdam name torch's decoupled_weight_decay adam_w_mode
ADAM_W_MODE = Alias("adam_w_mode", "decoupled_weight_decay", "DeepSpeed's and apex's FusedAdam")


# The element-wise math of Adam, written once. The 1-bit optimizers (lightning_optim.onebit)
# run the same formulas on averaged, local or compressed inputs, so they call these too.


def adam_first_moment_(exp_avg: list[Tensor], grads: TensorList, beta1: float) -> None:
    """``m <- beta1 m + (1 - beta1) g`` in place (as a lerp towards ``g``)."""
    torch._foreach_lerp_(exp_avg, grads, 1 - beta1)


def adam_second_moment_(exp_avg_sq: list[Tensor], grads: TensorList, beta2: float) -> None:
    """``v <- beta2 v + (1 - beta2) g^2`` in place."""
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)


def adam_denominator(exp_avg_sq: list[Tensor], bc2: float, eps: float, eps_inside_sqrt: bool = False) -> TensorList:
    """``sqrt(v) / sqrt(bc2) + eps``, or ``sqrt(v / bc2 + eps)`` with ``eps_inside_sqrt`` (new tensors)."""
    if eps_inside_sqrt:
        denom = torch._foreach_div(exp_avg_sq, bc2)
        torch._foreach_add_(denom, eps)
        torch._foreach_sqrt_(denom)
        return denom
    denom = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_div_(denom, math.sqrt(bc2))
    torch._foreach_add_(denom, eps)
    return denom


def adam_deltas(
    exp_avg: list[Tensor],
    exp_avg_sq: list[Tensor],
    *,
    lr: float,
    bc1: float,
    bc2: float,
    eps: float,
    eps_inside_sqrt: bool = False,
) -> TensorList:
    """Adam's parameter delta ``-(lr / bc1) m / denominator`` (new tensors; decay not included)."""
    deltas = torch._foreach_div(exp_avg, adam_denominator(exp_avg_sq, bc2, eps, eps_inside_sqrt))
    torch._foreach_mul_(deltas, -lr / bc1)
    return deltas


@argument_aliases(ADAM_W_MODE)
class Adam(BaseOptimizer):

    r"""Adam, with torch's arguments plus FusedAdam's ``bias_correction``.

    At step :math:`t` with gradient :math:`g` (L2 mode adds :math:`\lambda p` to :math:`g`):

    .. math::
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        \hat v &= \max(\hat v_{t-1}, v) \text{ with amsgrad, else } v \\
        p &\leftarrow p - \frac{\eta}{b_1} \frac{m}{\sqrt{\hat v}/\sqrt{b_2} + \epsilon} - c\,p

    with :math:`b_k = 1-\beta_k^t` (1 when ``bias_correction=False``) and the decoupled decay
    :math:`c = \eta\lambda` (AdamW), :math:`c = \lambda\eta/\eta_{max}` (``decouple_lr``), else 0.

    Args:
        lr: learning rate, >= 0.
        betas: moment coefficients, each in [0, 1).
        eps: added to the denominator, > 0.
        weight_decay: L2 penalty, or decoupled decay with ``decoupled_weight_decay``.
        amsgrad: use the running maximum of ``v`` (FusedAdam and optimi refuse it; we support it).
        decoupled_weight_decay: AdamW's decay ``p <- p - lr * wd * p``.
        bias_correction: divide the moments by ``1 - beta^t``.
        maximize: maximize the objective instead.
        fused: accepted for torch compatibility; the fastest available path is always taken (True warns).
        foreach, kahan_sum, decouple_lr, max_lr, fp32_state: see :class:`BaseOptimizer`.
    """

    _elementwise = True  # element-wise math: a big tensor may step in pieces on the torch path

    _compiled_tensor_lr = True  # the step hands a tensor lr to adam_at_step

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        decoupled_weight_decay: bool = False,
        bias_correction: bool = True,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        kahan_sum: bool | None = None,
        decouple_lr: bool = False,
        max_lr: float | None = None,
        fp32_state: bool = False,
        gradient_release: bool = False,
    ) -> None:
        if capturable or differentiable:
            raise ValueError("capturable/differentiable: not supported by lightning_optim.Adam; leave them False")
        if fused is True:
            warn_ignored(type(self).__name__, "fused", fused, FUSED_NOTE)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=decoupled_weight_decay,
            bias_correction=bias_correction,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
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
        for flag in ("amsgrad", "decoupled_weight_decay", "bias_correction"):
            check_flag(flag, group[flag])

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any], dtype: torch.dtype) -> None:
        state["exp_avg"] = self._new_state(p, "exp_avg", dtype)
        state["exp_avg_sq"] = self._new_state(p, "exp_avg_sq", dtype)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = self._new_state(p, "max_exp_avg_sq", dtype)

    def _update(self, group: dict[str, Any], batch: Batch, apply: bool) -> None:
        beta1, beta2 = group["betas"]
        decoupled = group["decoupled_weight_decay"] or group["decouple_lr"]
        bc1, bc2 = 1.0, 1.0
        if group["bias_correction"]:
            bc1, bc2 = 1 - beta1**batch.step, 1 - beta2**batch.step
        kernel = ops.kernel("adam", batch)
        if kernel is not None:  # compiled: the same math, the whole bucket in one pass
            kernel(batch, apply, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], bc1=bc1, bc2=bc2,
                   l2=0.0 if decoupled else group["weight_decay"],
                   decay_rule=self.decay_rule(group) if decoupled else (0.0, 0.0), amsgrad=group["amsgrad"],
                   count=batch.step if group["bias_correction"] else None)
            return
        group = self.with_float_lr(group)  # a compiled step on the torch path reads a tensor lr here
        decay = self.decoupled_decay(group) if decoupled else 0.0
        grads = batch.grads if decoupled else self.with_l2(batch, group["weight_decay"])
        exp_avg, exp_avg_sq = batch.state("exp_avg"), batch.state("exp_avg_sq")
        adam_first_moment_(exp_avg, grads, beta1)
        adam_second_moment_(exp_avg_sq, grads, beta2)
        if group["amsgrad"]:
            max_sq = batch.state("max_exp_avg_sq")
            torch._foreach_maximum_(max_sq, exp_avg_sq)
            exp_avg_sq = max_sq
        if not apply:
            return
        deltas = adam_deltas(exp_avg, exp_avg_sq, lr=group["lr"], bc1=bc1, bc2=bc2, eps=group["eps"])
        self._apply(batch, deltas, decay=decay)


@argument_aliases(ADAM_W_MODE)
class AdamW(Adam):
    """Adam with decoupled weight decay (``decoupled_weight_decay=True``, torch's default wd 1e-2); the other
    keyword arguments are :class:`Adam`'s."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        decoupled_weight_decay: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, decoupled_weight_decay=decoupled_weight_decay,
                         **kwargs)
