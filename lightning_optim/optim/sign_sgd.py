"""SignSGD (Bernstein et al., arXiv 1802.04434) as mlbench-core's ``SignSGD``."""

from __future__ import annotations

from typing import Any

import torch

from lightning_optim.optim.base import BaseOptimizer, Batch, ParamsT
from lightning_optim.optim.batch import TensorList
from lightning_optim.optim.sgd import momentum_direction
from lightning_optim.optim.validation import check_flag, check_non_negative, check_unit_interval

__all__ = ["SignSGD"]


def propagating_sign(xs: TensorList) -> TensorList:
    """``sign(x)`` per element, NaN where ``x`` is NaN or +-Inf (``sign(x) + 0 * x``).

    ``torch.sign(nan)`` is 0: a sign step would freeze a coordinate whose momentum became NaN while
    the param stays finite. Here a non-finite value propagates, as in torch's own optimizers (an Inf
    gradient makes Adam's param NaN), identically to the compiled kernels' ``sign_of``.
    """
    signs = torch._foreach_sign(xs)
    torch._foreach_add_(signs, torch._foreach_mul(xs, 0.0))
    return signs


class SignSGD(BaseOptimizer):
    r"""Steps of size ``lr`` along the sign of torch-SGD's momentum direction (mlbench-core).

    With gradient :math:`g`, L2 coefficient :math:`\lambda`, momentum :math:`\mu`, dampening
    :math:`\tau`:

    .. math::
        d &= g + \lambda p \\
        b &\leftarrow d \text{ at the first step, else } \mu b + (1-\tau) d \\
        d &\leftarrow d + \mu b \text{ (nesterov) or } b \quad(\text{only when } \mu \ne 0) \\
        p &\leftarrow p - \eta\,\mathrm{sign}(d) - c\,p

    (:math:`\mathrm{sign}(0) = 0`). With ``decouple_lr`` the decay is not an L2 term but the fully
    decoupled :math:`c = \lambda\eta/\eta_{max}`; otherwise :math:`c = 0`. mlbench adds the L2 term
    to ``p.grad`` in place; here the gradients are left untouched.

    Args:
        lr: learning rate (step size), >= 0.
        momentum: momentum factor, >= 0 (0: plain signSGD, no state).
        dampening: momentum dampening, in [0, 1].
        weight_decay: L2 penalty (inside the sign), or fully decoupled decay with ``decouple_lr``.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0, as torch's SGD).
        maximize: maximize the objective instead.
        foreach, kahan_sum, decouple_lr, max_lr, fp32_state: see :class:`BaseOptimizer`.
    """

    _has_kernel = False  # torch ops only: a bucket steps in bounded slices
    _elementwise = True  # element-wise math: a big tensor may step in pieces on the torch path

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        kahan_sum: bool | None = None,
        decouple_lr: bool = False,
        max_lr: float | None = None,
        fp32_state: bool = False,
        gradient_release: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
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
        check_non_negative("momentum", group["momentum"])
        check_unit_interval("dampening", group["dampening"], closed_right=True)
        check_flag("nesterov", group["nesterov"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("nesterov: needs momentum > 0 and dampening = 0")

    def _accumulation_blocker(self) -> str | None:
        if any(g["momentum"] == 0 for g in self.param_groups):
            return "SignSGD without momentum has no state to accumulate gradients into (set momentum > 0)"
        return None

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any], dtype: torch.dtype) -> None:
        if group["momentum"] != 0:
            state["momentum_buffer"] = self._new_state(p, "momentum_buffer", dtype)

    def _update(self, group: dict[str, Any], batch: Batch, apply: bool) -> None:
        l2 = 0.0 if group["decouple_lr"] else group["weight_decay"]
        d = momentum_direction(group, batch, self.with_l2(batch, l2))
        if not apply:
            return
        deltas = propagating_sign(d)
        torch._foreach_mul_(deltas, -group["lr"])
        decay = self.decoupled_decay(group) if group["decouple_lr"] else 0.0
        self._apply(batch, deltas, decay=decay)
