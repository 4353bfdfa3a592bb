"""SGD with momentum (torch semantics) plus FusedSGD's ``wd_after_momentum``."""

from __future__ import annotations

from typing import Any

import torch

from lightning_optim import ops
from lightning_optim.optim.base import BaseOptimizer, Batch, ParamsT
from lightning_optim.optim.batch import TensorList
from lightning_optim.optim.validation import check_flag, check_non_negative, check_unit_interval
from lightning_optim.renames import FUSED_NOTE, warn_ignored

__all__ = ["SGD", "momentum_direction"]


def momentum_direction(group: dict[str, Any], batch: Batch, d: TensorList) -> TensorList:
    """torch-SGD's heavy-ball/Nesterov direction from ``d``, updating ``momentum_buffer``.

    ``b <- d`` at the first step, else ``b <- mu b + (1 - dampening) d``; returns ``d + mu b``
    (nesterov) or ``b``; ``d`` itself when momentum is 0. SGD and SignSGD share it.
    """
    momentum = group["momentum"]
    if momentum == 0:
        return d
    buf = batch.state("momentum_buffer")
    if batch.step == 1:
        torch._foreach_copy_(buf, d)
    else:
        torch._foreach_mul_(buf, momentum)
        torch._foreach_add_(buf, d, alpha=1 - group["dampening"])
    return torch._foreach_add(d, buf, alpha=momentum) if group["nesterov"] else buf


class SGD(BaseOptimizer):
    r"""Stochastic gradient descent with momentum.

    With gradient :math:`g`, L2 coefficient :math:`\lambda`, momentum :math:`\mu`, dampening
    :math:`\tau`:

    .. math::
        d &= g + \lambda p \quad(\text{skipped when wd\_after\_momentum}) \\
        b &\leftarrow d \text{ at the first step, else } \mu b + (1-\tau) d \\
        d &\leftarrow d + \mu b \text{ (nesterov) or } b \\
        d &\leftarrow d + \lambda p \quad(\text{only when wd\_after\_momentum}) \\
        p &\leftarrow p - \eta d - c\,p

    where :math:`c` is the fully decoupled decay with ``decouple_lr`` (then :math:`\lambda` is
    not used as L2). ``wd_after_momentum`` is ColossalAI/apex FusedSGD's flag.
    """

    _elementwise = True  # element-wise math: a big tensor may step in pieces on the torch path

    _compiled_tensor_lr = True  # the step hands a tensor lr to sgd_at_lr

    _implied_step: int | None = 1  # torch's SGD keeps no step count; a momentum buffer means >= 1 step

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        wd_after_momentum: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
        kahan_sum: bool | None = None,
        decouple_lr: bool = False,
        max_lr: float | None = None,
        fp32_state: bool = False,
        gradient_release: bool = False,
    ) -> None:
        if differentiable:
            raise ValueError("differentiable: not supported by lightning_optim.SGD; leave it False")
        if fused is True:
            warn_ignored(type(self).__name__, "fused", fused, FUSED_NOTE)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            wd_after_momentum=wd_after_momentum,
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
        check_non_negative("momentum", group["momentum"])
        check_unit_interval("dampening", group["dampening"], closed_right=True)
        check_flag("nesterov", group["nesterov"])
        check_flag("wd_after_momentum", group["wd_after_momentum"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("nesterov: needs momentum > 0 and dampening = 0")

    def _accumulation_blocker(self) -> str | None:
        if any(g["momentum"] == 0 for g in self.param_groups):
            return "SGD without momentum has no state to accumulate gradients into (set momentum > 0)"
        return None

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any], dtype: torch.dtype) -> None:
        if group["momentum"] != 0:
            state["momentum_buffer"] = self._new_state(p, "momentum_buffer", dtype)

    def _update(self, group: dict[str, Any], batch: Batch, apply: bool) -> None:
        l2 = 0.0 if group["decouple_lr"] else group["weight_decay"]
        kernel = ops.kernel("sgd", batch)
        if kernel is not None:  # compiled: the same math, the whole bucket in one pass
            after = group["wd_after_momentum"]
            kernel(batch, apply, lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
                   nesterov=group["nesterov"], l2_pre=0.0 if after else l2, l2_post=l2 if after else 0.0,
                   decay_rule=self.decay_rule(group) if group["decouple_lr"] else (0.0, 0.0))
            return
        group = self.with_float_lr(group)  # a compiled step on the torch path reads a tensor lr here
        decay = self.decoupled_decay(group) if group["decouple_lr"] else 0.0
        d = batch.grads if group["wd_after_momentum"] else self.with_l2(batch, l2)
        d = momentum_direction(group, batch, d)
        if not apply:
            return
        if group["wd_after_momentum"] and l2 != 0:
            d = torch._foreach_add(d, batch.params_compute, alpha=l2)
        deltas = torch._foreach_mul(d, -group["lr"])
        self._apply(batch, deltas, decay=decay)
