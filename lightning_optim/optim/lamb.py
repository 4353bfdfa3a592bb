"""LAMB (You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
arXiv 1904.00962): the union of DeepSpeed ``FusedLamb``, ColossalAI ``Lamb`` and apex/ColossalAI
``FusedLAMB``."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from lightning_optim import ops
from lightning_optim.optim.adam import adam_second_moment_
from lightning_optim.optim.base import BaseOptimizer, Batch, ParamsT
from lightning_optim.optim.batch import TensorList
from lightning_optim.optim.validation import check_betas, check_flag, check_non_negative, check_positive
from lightning_optim.renames import Alias, argument_aliases

__all__ = ["Lamb", "FusedLamb", "lamb_first_moment_", "lamb_denominator", "lamb_direction", "trust_ratios",
           "trust_ratios_from_norms"]


# LAMB's element-wise math, written once; OnebitLamb (lightning_optim.onebit) calls it too.
# The second moment is Adam's (adam_second_moment_).


def lamb_first_moment_(exp_avg: list[Tensor], grads: TensorList, beta1: float, grad_averaging: bool = True) -> None:
    """``m <- beta1 m + a g`` in place, ``a = 1 - beta1`` with ``grad_averaging``, else 1."""
    torch._foreach_mul_(exp_avg, beta1)
    torch._foreach_add_(exp_avg, grads, alpha=1 - beta1 if grad_averaging else 1.0)


def lamb_denominator(exp_avg_sq: list[Tensor], bc2: float, eps: float, eps_inside_sqrt: bool = False) -> TensorList:
    """``sqrt(v / bc2) + eps``, or ``sqrt(v / bc2 + eps)`` with ``eps_inside_sqrt`` (new tensors)."""
    denom = torch._foreach_div(exp_avg_sq, bc2)
    if eps_inside_sqrt:
        torch._foreach_add_(denom, eps)
        torch._foreach_sqrt_(denom)
    else:
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
    return denom


def lamb_direction(exp_avg: list[Tensor], denom: TensorList, bc1: float) -> TensorList:
    """The Adam-form direction ``(m / bc1) / denom`` (new tensors, decay not included)."""
    update = torch._foreach_div(exp_avg, bc1)
    torch._foreach_div_(update, denom)
    return update


def trust_ratios(
    params: TensorList, updates: TensorList, min_coeff: float, max_coeff: float
) -> tuple[Tensor, Tensor]:
    """Per tensor ``clamp(|p| / |u|, min_coeff, max_coeff)``, 1 where a norm is 0.

    Returns the ratios (1-dim, one per tensor) and a bool mask: True where both norms were
    non-zero, i.e. where the ratio was really measured.
    """
    p_norm = torch.stack(torch._foreach_norm(params))
    u_norm = torch.stack(torch._foreach_norm(updates))
    return trust_ratios_from_norms(p_norm, u_norm, min_coeff, max_coeff)


def trust_ratios_from_norms(
    p_norm: Tensor, u_norm: Tensor, min_coeff: float, max_coeff: float
) -> tuple[Tensor, Tensor]:
    """:func:`trust_ratios` from the per-tensor norms (the compiled kernels compute those)."""
    ratio = (p_norm / u_norm).clamp(min_coeff, max_coeff)
    measured = (p_norm != 0) & (u_norm != 0)
    return torch.where(measured, ratio, torch.ones_like(ratio)), measured


@argument_aliases(Alias("adam_w_mode", "decoupled_weight_decay", "apex's, ColossalAI's and DeepSpeed's LAMB"))
class Lamb(BaseOptimizer):
    r"""LAMB: Adam's step rescaled per tensor by the trust ratio :math:`\|p\| / \|u\|`.

    At step :math:`t`, for each parameter tensor :math:`p` with gradient :math:`g` (all norms are
    L2 norms of the whole tensor):

    .. math::
        N &= \Big(\sum_{\text{all params}} \|g\|^2\Big)^{1/2}, \qquad
            g \leftarrow g / \max(1, N / \text{max\_grad\_norm}) \quad(\text{max\_grad\_norm} > 0) \\
        g &\leftarrow g + \lambda p \quad(\text{only when adam\_w\_mode=False}) \\
        m &\leftarrow \beta_1 m + a\,g \quad(a = 1-\beta_1 \text{ with grad\_averaging, else } 1), \qquad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        \hat m &= m / b_1, \quad \hat v = v / b_2 \quad(b_k = 1-\beta_k^t;\ 1 \text{ without bias\_correction}) \\
        u &= \hat m / (\sqrt{\hat v} + \epsilon) \quad\text{or}\quad \hat m / \sqrt{\hat v + \epsilon}
            \ (\text{eps\_inside\_sqrt}) \\
        u &\leftarrow u + \lambda p \quad(\text{only when adam\_w\_mode=True}) \\
        r &= \operatorname{clamp}(\|p\| / \|u\|,\ \text{min\_coeff},\ \text{max\_coeff}) \\
        p &\leftarrow p - \eta\, r\, u

    :math:`r = 1` when ``adam=True``, when :math:`\|p\| = 0` or :math:`\|u\| = 0`, and (unless
    ``use_nvlamb``) for groups with :math:`\lambda = 0` (apex/NVIDIA: the trust ratio only
    rescales decayed tensors). :math:`\|p\|` is taken before this step's update. The global norm
    :math:`N` is taken over the raw gradients of every param of every group that has a gradient;
    each group clips with its own ``max_grad_norm`` against that shared norm.

    The last trust ratio of each tensor is kept in ``state["lamb_coeff"]`` (a 0-dim tensor;
    :meth:`get_lamb_coeffs` lists them).

    How the seed libraries map onto the flags:

    * apex / ColossalAI ``FusedLAMB``: ``max_coeff=inf, min_coeff=0`` (no clamp), its defaults
      otherwise (``weight_decay=0.01, max_grad_norm=1.0``). ColossalAI reads ``max_grad_norm``
      from the constructor defaults only; here it is a per-group hyper-parameter.
    * ColossalAI ``Lamb`` (pytorch-lamb port): ``bias_correction=False, use_nvlamb=True,
      max_coeff=inf, min_coeff=0``; its ``adam`` flag is ours.
    * DeepSpeed ``FusedLamb``: see :class:`FusedLamb` (``use_nvlamb=True``, clamp to
      [0.01, 10]). Its CUDA kernel, with ``bias_correction=True``, computes ``u`` and the trust
      ratio from the *uncorrected* moments and multiplies the step by
      :math:`\sqrt{b_2}/b_1` (the decay term is scaled too); this class corrects the moments
      instead, as apex and the paper do. DeepSpeed clips with the norm the caller passes to
      ``step`` (``(norm + 1e-6) / max_grad_norm``); here the global norm is computed.

    Args:
        lr: learning rate, >= 0.
        betas: moment coefficients, each in [0, 1).
        eps: added to the denominator (or under the square root), > 0.
        weight_decay: decay :math:`\lambda` >= 0, inside the trust-ratio update
            (``decoupled_weight_decay``) or as L2 on the gradient.
        bias_correction: divide the moments by :math:`1-\beta^t`.
        eps_inside_sqrt: :math:`\sqrt{\hat v + \epsilon}` instead of :math:`\sqrt{\hat v} + \epsilon`.
        decoupled_weight_decay: decoupled decay inside the update (True) or L2 (False).
        grad_averaging: scale the gradient by :math:`1-\beta_1` in the first moment.
        max_grad_norm: global gradient-norm clipping threshold, >= 0 (0: off). Not possible
            under gradient release.
        max_coeff: upper clamp of the trust ratio, in (0, inf] (inf: no upper clamp).
        min_coeff: lower clamp of the trust ratio, in [0, max_coeff].
        use_nvlamb: apply the trust ratio also to groups without weight decay.
        adam: trust ratio 1 always (Adam/AdamW with LAMB's update form).
        maximize: maximize the objective instead.
        foreach, kahan_sum, fp32_state: see :class:`BaseOptimizer`.

    ``decouple_lr`` is not offered: LAMB's decay lives inside the update that the trust ratio
    normalises, so it cannot be taken out of the lr without changing the algorithm.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        bias_correction: bool = True,
        eps_inside_sqrt: bool = False,
        decoupled_weight_decay: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        use_nvlamb: bool = False,
        adam: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        kahan_sum: bool | None = None,
        fp32_state: bool = False,
        gradient_release: bool = False,
    ) -> None:
        self._global_grad_norm: Tensor | None = None
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            eps_inside_sqrt=eps_inside_sqrt,
            decoupled_weight_decay=decoupled_weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            use_nvlamb=use_nvlamb,
            adam=adam,
            maximize=maximize,
            foreach=foreach,
            kahan_sum=kahan_sum,
            fp32_state=fp32_state,
            gradient_release=gradient_release,
        )
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_betas(group["betas"])
        check_positive("eps", group["eps"])
        for flag in ("bias_correction", "eps_inside_sqrt", "decoupled_weight_decay", "grad_averaging", "use_nvlamb",
                     "adam"):
            check_flag(flag, group[flag])
        if check_non_negative("max_grad_norm", group["max_grad_norm"]) > 0 and self.gradient_release:
            raise ValueError("max_grad_norm: global grad-norm clipping is not possible under gradient release")
        max_coeff = check_positive("max_coeff", group["max_coeff"], allow_inf=True)  # inf: apex, no clamp
        min_coeff = check_non_negative("min_coeff", group["min_coeff"])
        if min_coeff > max_coeff:
            raise ValueError(f"min_coeff must be in [0, max_coeff={max_coeff}], got {min_coeff}")

    def _release_blocker(self) -> str | None:
        if any(g["max_grad_norm"] > 0 for g in self.param_groups):
            return "max_grad_norm > 0 clips by the global norm of all gradients, which release never sees at once"
        return None

    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], dtype: torch.dtype) -> None:
        state["exp_avg"] = self._new_state(p, "exp_avg", dtype)
        state["exp_avg_sq"] = self._new_state(p, "exp_avg_sq", dtype)
        state["lamb_coeff"] = torch.ones((), dtype=dtype, device=p.device)

    def _after_step(self) -> None:
        self._global_grad_norm = None  # never reused by a later step or step_param

    def _before_step(self, work: list[tuple[dict[str, Any], list[Tensor]]]) -> None:
        self._warn_if_never_trust_scaled()
        if any(group["max_grad_norm"] > 0 and params for group, params in work):
            # every param of the work has a gradient: the filter only tells the type checker
            grads = [g for _, params in work for p in params if (g := p.grad) is not None]
            self._global_grad_norm = _global_norm(grads)

    def _warn_if_never_trust_scaled(self) -> None:
        """Once: with weight_decay=0 and use_nvlamb=False in every group (HF's Trainer passes
        weight_decay=0 by default), apex's rule gives no tensor a trust ratio: every step is AdamW's."""
        if self.__dict__.get("_warned_no_trust") or any(
                g["adam"] or g["use_nvlamb"] or g["weight_decay"] != 0 for g in self.param_groups):
            return
        self._warned_no_trust = True
        warnings.warn(
            f"{type(self).__name__}: no param group gets a trust ratio (weight_decay=0 and use_nvlamb=False "
            "in every group; apex's rule scales only groups with weight decay), so every step is AdamW's; "
            "set weight_decay > 0 on the groups to scale (HF: --weight_decay 0.01) or use_nvlamb=True",
            stacklevel=6,
        )

    def _update(self, group: dict[str, Any], batch: Batch, apply: bool) -> None:
        beta1, beta2 = group["betas"]
        wd = group["weight_decay"]
        grads: TensorList = batch.grads
        divisor = None
        if group["max_grad_norm"] > 0:
            if self._global_grad_norm is None:
                raise RuntimeError("max_grad_norm: global clipping needs step(); it cannot run per parameter")
            divisor = (self._global_grad_norm / group["max_grad_norm"]).clamp(min=1.0)
        kernel = ops.kernel("lamb", batch)
        if kernel is not None:  # compiled: moments + norms in one pass, the step in a second
            self._update_fused(kernel, group, batch, apply, 1.0 if divisor is None else divisor.item())
            return
        if divisor is not None:
            grads = torch._foreach_div(grads, divisor.to(grads[0].device))
        if not group["decoupled_weight_decay"]:
            grads = self.with_l2(batch, wd, grads)
        exp_avg, exp_avg_sq = batch.state("exp_avg"), batch.state("exp_avg_sq")
        lamb_first_moment_(exp_avg, grads, beta1, group["grad_averaging"])
        adam_second_moment_(exp_avg_sq, grads, beta2)
        if not apply:
            return

        bc1, bc2 = 1.0, 1.0
        if group["bias_correction"]:
            bc1, bc2 = 1 - beta1**batch.step, 1 - beta2**batch.step
        update = lamb_direction(exp_avg, lamb_denominator(exp_avg_sq, bc2, group["eps"], group["eps_inside_sqrt"]), bc1)
        if group["decoupled_weight_decay"] and wd != 0:
            torch._foreach_add_(update, batch.params_compute, alpha=wd)

        coeffs = batch.state("lamb_coeff")
        if not group["adam"] and (group["use_nvlamb"] or wd != 0):
            ratio, _ = trust_ratios(batch.params_compute, update, group["min_coeff"], group["max_coeff"])
            torch._foreach_copy_(coeffs, ratio.unbind())
            torch._foreach_mul_(update, torch._foreach_mul(coeffs, -group["lr"]))
        else:
            torch._foreach_zero_(coeffs)
            torch._foreach_add_(coeffs, 1.0)
            torch._foreach_mul_(update, -group["lr"])
        self._apply(batch, update)

    def _update_fused(self, kernel: Any, group: dict[str, Any], batch: Batch, apply: bool, clip_div: float) -> None:
        """The same step through the compiled kernels (``ops.kernel("lamb")``)."""
        beta1, beta2 = group["betas"]
        wd, decoupled = group["weight_decay"], group["decoupled_weight_decay"]
        bc1, bc2 = 1.0, 1.0
        if group["bias_correction"]:
            bc1, bc2 = 1 - beta1**batch.step, 1 - beta2**batch.step
        ratios = apply and not group["adam"] and (group["use_nvlamb"] or wd != 0)
        shape = dict(bc1=bc1, bc2=bc2, eps=group["eps"], wd=wd if decoupled else 0.0,
                     eps_inside_sqrt=group["eps_inside_sqrt"])
        norms = kernel.moments(batch, clip_div=clip_div, l2=0.0 if decoupled else wd, beta1=beta1,
                               m_coef=1 - beta1 if group["grad_averaging"] else 1.0, beta2=beta2, norms=ratios, **shape)
        if not apply:
            return
        coeffs = batch.state("lamb_coeff")
        if ratios:
            ratio, _ = trust_ratios_from_norms(norms[:, 0], norms[:, 1], group["min_coeff"], group["max_coeff"])
            torch._foreach_copy_(coeffs, ratio.unbind())
            scales = ratio * -group["lr"]
        else:
            torch._foreach_zero_(coeffs)
            torch._foreach_add_(coeffs, 1.0)
            scales = torch.full((len(coeffs),), -group["lr"], dtype=torch.float32)
        kernel.apply(batch, scales.to(batch.params[0].device), **shape)

    def get_lamb_coeffs(self) -> list[float]:
        """The last trust ratio of every param that has been updated, in param-group order.

        DeepSpeed lists only the params that had a gradient in the last step; the two agree when
        every param gets a gradient each step. Accumulation steps leave the ratios unchanged.
        """
        coeffs = [
            self.state[p]["lamb_coeff"]
            for group in self.param_groups
            for p in group["params"]
            if p in self.state and "lamb_coeff" in self.state[p]
        ]
        return [c.item() for c in coeffs]


def _global_norm(grads: list[Tensor]) -> Tensor:
    """L2 norm of all ``grads`` together, accumulated in fp32 (fp64 if any grad is fp64)."""
    acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    by_kind: dict[tuple, list[Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    device = grads[0].device
    norms: list[Tensor] = []
    for (_, dtype), gs in by_kind.items():
        norm_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        norms.extend(n.to(device=device, dtype=acc) for n in torch._foreach_norm(gs, 2, dtype=norm_dtype))
    return torch.linalg.vector_norm(torch.stack(norms))


class FusedLamb(Lamb):
    """DeepSpeed's ``FusedLamb`` signature on :class:`Lamb`.

    The trust ratio applies to every tensor (``use_nvlamb=True``), clamped to
    ``[min_coeff, max_coeff]``; decay is decoupled (``decoupled_weight_decay=True``) and the first moment
    averages (``grad_averaging=True``). DeepSpeed's eps default (1e-8) is kept. ``amsgrad`` is
    refused, as DeepSpeed does (it raises RuntimeError; we raise ValueError). The differences of
    DeepSpeed's CUDA kernel with ``bias_correction=True`` and its clipping are listed on
    :class:`Lamb`; DeepSpeed's extra ``step`` arguments (``grads``, ``output_params``,
    ``scale``, ``grad_norms``) are not supported.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        kahan_sum: bool | None = None,
        fp32_state: bool = False,
        gradient_release: bool = False,
    ) -> None:
        if check_flag("amsgrad", amsgrad):
            raise ValueError("amsgrad: FusedLamb does not support the AMSGrad variant; leave amsgrad=False")
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            eps_inside_sqrt=eps_inside_sqrt,
            decoupled_weight_decay=True,
            grad_averaging=True,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            use_nvlamb=True,
            adam=False,
            maximize=maximize,
            foreach=foreach,
            kahan_sum=kahan_sum,
            fp32_state=fp32_state,
            gradient_release=gradient_release,
        )
