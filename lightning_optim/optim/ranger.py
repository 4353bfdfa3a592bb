"""Ranger: RAdam with Lookahead (Zhang et al., arXiv 1907.08610), with optimi's arguments.

The RAdam step is :class:`lightning_optim.optim.radam.RAdam`'s (same functions); this file only
adds the Lookahead slow weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_optim.optim.base import BaseOptimizer, Batch, ParamsT
from lightning_optim.optim.batch import TensorList
from lightning_optim.optim.radam import RAdam
from lightning_optim.optim.validation import check_int, check_positive
from lightning_optim.renames import Alias, argument_aliases

__all__ = ["Ranger", "lookahead_sync"]


def lookahead_sync(params: list[Tensor], slow: list[Tensor], alpha: float, comps: list[Tensor] | None = None) -> None:
    r"""One Lookahead synchronisation: :math:`\phi \leftarrow \phi + \alpha (p - \phi)`, then :math:`p \leftarrow \phi`.

    ``slow`` (:math:`\phi`) may have a wider dtype than ``params``. With Kahan compensations
    ``comps`` the fast weights are :math:`p + c`; the new :math:`\phi` is computed in fp32, ``p`` gets
    it rounded and ``c`` what the rounding lost, so :math:`p + c = \phi` exactly after the sync.
    """
    if comps is None:
        fast: TensorList = [p.to(s.dtype) for p, s in zip(params, slow)]
        torch._foreach_lerp_(slow, fast, alpha)
        for p, s in zip(params, slow):
            p.copy_(s)
        return
    fast = torch._foreach_add([p.float() for p in params], [c.float() for c in comps])
    new_slow = [s.float() for s in slow]  # the state itself when it is already fp32
    torch._foreach_lerp_(new_slow, fast, alpha)
    for p, c, s, n in zip(params, comps, slow, new_slow):
        if s is not n:
            s.copy_(n)
        p.copy_(n)  # rounds to the param dtype
        c.copy_(n - p.float())


# optimi's spelling (its Ranger takes decouple_wd)
ALIASES = (Alias("decouple_wd", "decoupled_weight_decay", "optimi's Ranger"),)


@argument_aliases(*ALIASES)
class Ranger(RAdam):
    r"""RAdam (optimi's variant) plus Lookahead slow weights synchronised every ``k`` applied steps.

    The fast weights take RAdam steps (:class:`RAdam`'s math, with eps on the bias-corrected second
    moment as optimi does):

    .. math::
        p \leftarrow p - \eta\, r_t \frac{m/b_1}{\sqrt{v/b_2} + \epsilon} - c\,p \quad (\rho_t > 5),
        \qquad p \leftarrow p - \eta\, m/b_1 - c\,p \quad (\text{otherwise})

    and after every ``k``-th applied step :math:`\phi \leftarrow \phi + \alpha (p - \phi)`,
    :math:`p \leftarrow \phi`. The slow weights :math:`\phi` (state ``la_param``, in the state dtype,
    so fp32 with ``fp32_state``) start as a copy of the params at their first step.
    :math:`c = \eta\lambda` with ``decoupled_weight_decay`` (the default), :math:`\lambda\eta/\eta_{max}` with
    ``decouple_lr``; with neither, :math:`\lambda` is an L2 penalty added to the gradient.

    Lookahead counts applied steps only (state ``la_step``): steps taken while
    ``optimizer_accumulation`` is on update the moments (and the bias-correction step) but do not
    move the params, so they neither count toward ``k`` nor trigger a sync. optimi counts every
    step toward ``k`` and skips a sync that falls on an accumulation step.

    Args:
        lr: learning rate, >= 0 (required, as in optimi).
        betas: moment coefficients, each in [0, 1).
        weight_decay: decay coefficient (decoupled by default, see above).
        eps: added to :math:`\sqrt{v/b_2}`, > 0.
        k: Lookahead synchronisation period, an int >= 1.
        alpha: Lookahead interpolation coefficient, in (0, 1] (1: plain RAdam).
        decoupled_weight_decay: torch-style decoupled decay ``p <- p - lr * wd * p`` (optimi's ``decouple_wd``).
        maximize: maximize the objective instead.
        decouple_lr, max_lr, kahan_sum, foreach, fp32_state: see :class:`BaseOptimizer`.
    """

    _elementwise = False  # Lookahead counts its steps in the state dict

    _eps_on_debiased = True

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        eps: float = 1e-6,
        k: int = 6,
        alpha: float = 0.5,
        decoupled_weight_decay: bool = True,
        decouple_lr: bool = False,
        max_lr: float | None = None,
        kahan_sum: bool | None = None,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        fp32_state: bool = False,
        gradient_release: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            eps=eps,
            k=k,
            alpha=alpha,
            decoupled_weight_decay=decoupled_weight_decay,
            decouple_lr=decouple_lr,
            max_lr=max_lr,
            kahan_sum=kahan_sum,
            foreach=foreach,
            maximize=maximize,
            fp32_state=fp32_state,
            gradient_release=gradient_release,
        )
        BaseOptimizer.__init__(self, params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        check_int("k", group["k"], 1)
        alpha = check_positive("alpha", group["alpha"])
        if alpha > 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")

    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], dtype: torch.dtype) -> None:
        super()._init_state(group, p, state, dtype)
        state["la_param"] = self._new_state(p, "la_param", dtype).copy_(p.detach())
        state["la_step"] = 0

    def _update(self, group: dict[str, Any], batch: Batch, apply: bool) -> None:
        super()._update(group, batch, apply)
        if not apply:
            return
        for s in batch.states:
            s["la_step"] += 1
        due = [i for i, s in enumerate(batch.states) if s["la_step"] % group["k"] == 0]
        if not due:
            return
        states = [batch.states[i] for i in due]
        comps = [s["kahan_comp"] for s in states] if "kahan_comp" in states[0] else None
        lookahead_sync([batch.params[i] for i in due], [s["la_param"] for s in states], group["alpha"], comps)
