"""LARS (You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks", arXiv 1708.03888),
with ColossalAI's ``Lars`` semantics (itself from NUS-HPC-AI-Lab/LARS-ImageNet-PyTorch)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_optim import ops
from lightning_optim.optim.base import BaseOptimizer, Batch, ParamsT
from lightning_optim.optim.validation import check_non_negative, check_positive
from lightning_optim.renames import Alias, argument_aliases

__all__ = ["Lars"]

# ColossalAI's spellings (its Lars takes eeta and epsilon)
ALIASES = (Alias("eeta", "trust_coefficient", "ColossalAI's Lars"), Alias("epsilon", "eps", "ColossalAI's Lars"))


@argument_aliases(*ALIASES)
class Lars(BaseOptimizer):
    r"""Layer-wise adaptive rate scaling, as ColossalAI's ``Lars`` computes it.

    Per parameter tensor :math:`p` with gradient :math:`g` (norms are L2 norms of the whole
    tensor, :math:`\|g\|` of the raw gradient):

    .. math::
        \tau &= \frac{\eta_e \|p\|}{\|g\| + \lambda \|p\| + \epsilon}
            \text{ if } \|p\| > 0 \text{ and } \|g\| > 0 \text{, else } 1;
            \qquad \tau \leftarrow \operatorname{clamp}(\tau, 0, \text{trust\_clip}) \\
        d &= \operatorname{clamp}(g + \lambda p,\ -\text{grad\_clip},\ \text{grad\_clip})
            \quad(\text{element-wise}) \\
        b &\leftarrow d \text{ at the first step, else } \mu b + d; \qquad d \leftarrow b
            \quad(\text{only when } \mu > 0) \\
        p &\leftarrow p - \eta\,\tau\, d

    The momentum buffer holds the *unscaled* decayed gradient; the current trust-scaled lr
    multiplies the whole buffer at each step (ColossalAI's order, not ``b = mu b + lr tau d``).
    ColossalAI hard-codes ``grad_clip=10`` and ``trust_clip=50``; they are keyword arguments here
    (None: no clamp) with those defaults.

    Args:
        lr: learning rate :math:`\eta`, >= 0.
        momentum: :math:`\mu`, >= 0 (0: no buffer).
        trust_coefficient: the LARS coefficient :math:`\eta_e`, in (0, 1].
        weight_decay: L2 coefficient :math:`\lambda`, >= 0 (also in the trust-ratio denominator).
        eps: :math:`\epsilon` in the trust-ratio denominator, >= 0.
        grad_clip: element-wise clamp of the decayed gradient, > 0 or None.
        trust_clip: upper clamp of the trust ratio, > 0 or None.
        maximize: maximize the objective instead.
        foreach, kahan_sum, fp32_state: see :class:`BaseOptimizer`.

    ``decouple_lr`` is not offered: the decay enters the trust ratio, so it is L2 by design.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0.0,
        trust_coefficient: float = 1e-3,
        weight_decay: float = 0.0,
        eps: float = 0.0,
        *,
        grad_clip: float | None = 10.0,
        trust_clip: float | None = 50.0,
        maximize: bool = False,
        foreach: bool | None = None,
        kahan_sum: bool | None = None,
        fp32_state: bool = False,
        gradient_release: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            trust_coefficient=trust_coefficient,
            weight_decay=weight_decay,
            eps=eps,
            grad_clip=grad_clip,
            trust_clip=trust_clip,
            maximize=maximize,
            foreach=foreach,
            kahan_sum=kahan_sum,
            fp32_state=fp32_state,
            gradient_release=gradient_release,
        )
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_non_negative("momentum", group["momentum"])
        if check_positive("trust_coefficient", group["trust_coefficient"]) > 1:
            raise ValueError(f"trust_coefficient must be in (0, 1], got {group['trust_coefficient']}")
        check_non_negative("eps", group["eps"])
        for name in ("grad_clip", "trust_clip"):
            if group[name] is not None:
                check_positive(name, group[name])

    def _accumulation_blocker(self) -> str | None:
        if any(g["momentum"] == 0 for g in self.param_groups):
            return "Lars without momentum has no state to accumulate gradients into (set momentum > 0)"
        return None

    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], dtype: torch.dtype) -> None:
        if group["momentum"] != 0:
            state["momentum_buffer"] = self._new_state(p, "momentum_buffer", dtype)

    def _update(self, group: dict[str, Any], batch: Batch, apply: bool) -> None:
        momentum, wd, clip = group["momentum"], group["weight_decay"], group["grad_clip"]
        kernel = ops.kernel("lars", batch)
        if kernel is not None:  # compiled: norms in one pass, clip + momentum + step in a second
            scales = None
            if apply:
                norms = kernel.norms(batch)
                scales = self._trust(group, norms[:, 0], norms[:, 1]) * -group["lr"]
            kernel.step(batch, apply, scales, weight_decay=wd, grad_clip=clip, momentum=momentum)
            return
        d = self.with_l2(batch, wd)
        if clip is not None:
            d = torch._foreach_clamp_min(d, -clip)  # new tensors: the grads stay untouched
            torch._foreach_clamp_max_(d, clip)
        if momentum != 0:
            buf = batch.state("momentum_buffer")
            if batch.step == 1:
                torch._foreach_copy_(buf, d)
            else:
                torch._foreach_mul_(buf, momentum)
                torch._foreach_add_(buf, d)
            d = buf
        if not apply:
            return
        w_norm = torch.stack(torch._foreach_norm(batch.params_compute))
        g_norm = torch.stack(torch._foreach_norm(batch.grads))
        trust = self._trust(group, w_norm, g_norm)
        deltas = torch._foreach_mul(d, (trust * -group["lr"]).unbind())
        self._apply(batch, deltas)

    @staticmethod
    def _trust(group: dict[str, Any], w_norm: Tensor, g_norm: Tensor) -> Tensor:
        """Per-tensor trust ratios from the norms of the params and of the raw gradients."""
        trust = group["trust_coefficient"] * w_norm / (g_norm + group["weight_decay"] * w_norm + group["eps"])
        trust = torch.where((w_norm > 0) & (g_norm > 0), trust, torch.ones_like(trust))
        if group["trust_clip"] is not None:
            trust = trust.clamp(0.0, group["trust_clip"])
        return trust
