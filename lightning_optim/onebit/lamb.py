"""1-bit LAMB (Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training
with LAMB's Convergence Speed", arXiv 2104.06069), after DeepSpeed's ``onebit/lamb.py``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from lightning_optim.onebit.auto_freeze import AutoFreezeMixin
from lightning_optim.onebit.base import OnebitOptimizer
from lightning_optim.onebit.layout import Layout
from lightning_optim.optim.adam import adam_second_moment_
from lightning_optim.optim.base import Batch, ParamsT
from lightning_optim.optim.batch import TensorList
from lightning_optim.optim.lamb import lamb_denominator, lamb_direction, lamb_first_moment_, trust_ratios
from lightning_optim.optim.validation import (
    check_flag,
    check_non_negative,
    check_positive,
    check_unit_interval,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["OnebitLamb"]


class OnebitLamb(AutoFreezeMixin, OnebitOptimizer):
    r"""1-bit LAMB: LAMB until ``freeze_step`` while recording the trust ratios, then a 1-bit
    momentum with the frozen ratio rescaled by a variance-based factor.

    Step :math:`t` (1-based), this rank's gradient :math:`g_r`, :math:`C(\cdot)` the
    error-compensated 1-bit average over ranks of all momenta in one flat buffer (one scale
    per param).

    **Warmup**, :math:`t \le` ``freeze_step``: LAMB (``grad_averaging``, decay inside the
    update, trust ratio on every tensor) on the rank-averaged gradient :math:`\bar g`:
    :math:`u = \hat m/(\sqrt{\hat v}+\epsilon) + \lambda p`,
    :math:`r = \mathrm{clamp}(\|p\|/\|u\|,` ``min_coeff``, ``max_coeff``:math:`)`,
    :math:`p \leftarrow p - \eta r u`, and each tensor's EMA
    :math:`c \leftarrow \beta_c c + (1-\beta_c) r` (``coeff_beta``; skipped where a norm is 0).
    After step ``freeze_step`` a copy :math:`v_f` of :math:`v` starts ("fresh" variance).

    **Compression**, :math:`t >` ``freeze_step``. At its first step every momentum gets a fixed
    scaling coefficient :math:`s_j = \bar\sigma/\sigma_j`, :math:`\sigma_j = \|m_j\|/\sqrt{n_j}`
    (:math:`\bar\sigma` their mean; 1 for a zero momentum) so that one 1-bit code fits all
    tensors. Then:
    :math:`m_r \leftarrow \beta_1 m + (1-\beta_1) g_r`,
    :math:`m \leftarrow \mathrm{mask}\odot C(s\,m_1..s\,m_W)/s`,
    :math:`\tilde g = (m - \beta_1 m_{t-1})/(1-\beta_1)`,
    :math:`v_f \leftarrow \beta_2 v_f + (1-\beta_2)\tilde g^2`,
    :math:`u = \hat m/(\sqrt{\hat v}+\epsilon) + \lambda p` with the frozen :math:`v`, and the
    factor :math:`f = \max\big((\sqrt{\hat v}+\epsilon)/(\sqrt{\hat v_f}+\epsilon)\big)`, mixed
    as :math:`f\rho + 1 - \rho` with :math:`\rho = \min(1, \|u-\lambda p\|/\|u\|)` when
    :math:`\lambda > 0`, clamped to [``factor_min``, ``factor_max``] and to
    :math:`[1-\tau, 1+\tau]` times the previous factor (``factor_threshold`` :math:`\tau`);
    finally :math:`p \leftarrow p - \eta\,c f\,u`. ``max_coeff``/``min_coeff`` act in warmup only.

    Bias correction (``bias_correction=True``): :math:`\hat m = m/(1-\beta_1^t)`,
    :math:`\hat v = v/(1-\beta_2^{\min(t,T)})`, :math:`\hat v_f = v_f/(1-\beta_2^t)`.

    **DDP contract, gradient scale, checkpoints**: as :class:`~lightning_optim.onebit.OnebitAdam`
    (:attr:`needs_averaged_grads` is True exactly while the next step is a warmup step).

    Differences from DeepSpeed: the first step updates the params; ``bias_correction`` and
    ``eps_inside_sqrt`` work (DeepSpeed ignores both); the coefficient EMA skips the tensors
    whose ratio could not be measured (a zero norm; DeepSpeed skips any ratio equal to 1.0);
    a zero momentum gets scaling coefficient 1 (DeepSpeed divides by zero); a zero update
    norm gives :math:`\rho = 1`; error buffers, scaling coefficients and EMAs survive
    :meth:`load_state_dict` (DeepSpeed drops the errors and, in warmup, the EMAs); with one rank
    nothing is compressed.

    Args:
        lr, freeze_step, bias_correction, betas, eps, eps_inside_sqrt, max_grad_norm, amsgrad,
            cuda_aware, comm_backend_name, process_group, average_grads, kahan_sum, auto_mask, hierarchical,
            auto_freeze_window, auto_freeze_tolerance, auto_freeze_max: as :class:`~lightning_optim.onebit.OnebitAdam`
            (``freeze_step="auto"`` too; a plain ``Lamb``/``FusedLamb`` state dict loads only before
            ``freeze_step``: the frozen trust ratios are recorded in warmup).
        weight_decay: decay :math:`\lambda` >= 0 inside the LAMB update.
        max_coeff: upper clamp of the warmup trust ratio, in (0, inf].
        min_coeff: lower clamp of the warmup trust ratio, in [0, max_coeff].
        coeff_beta: EMA coefficient of the trust ratios, in [0, 1); keep
            ``1 / (1 - coeff_beta) <= freeze_step`` (the EMA starts at 0, as DeepSpeed's).
        factor_max: upper clamp of the scaling factor, >= factor_min.
        factor_min: lower clamp of the scaling factor, >= 0.
        factor_threshold: largest relative change of the factor per step, >= 0.
    """

    _lazy_flat_keys = ("exp_avg_sq_fresh",)
    _plain_state_extras = ("lamb_coeff",)  # Lamb's last trust ratio, the same quantity
    _optional_state_keys = ("scaling_coeff",)  # made at the first compression step

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        freeze_step: int | Literal["auto"] = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        *,
        process_group: ProcessGroup | None = None,
        average_grads: bool = True,
        kahan_sum: bool | None = None,
        auto_mask: bool | float = True,
        gradient_release: bool = False,
        hierarchical: bool | int = False,
        auto_freeze_window: int | None = None,
        auto_freeze_tolerance: float | None = None,
        auto_freeze_max: int | None = None,
    ) -> None:
        if check_flag("amsgrad", amsgrad):
            raise ValueError("amsgrad: 1-bit LAMB does not support the AMSGrad variant; leave amsgrad=False")
        self._init_freeze_step(freeze_step, auto_freeze_window, auto_freeze_tolerance, auto_freeze_max)
        self.coeff_beta = check_unit_interval("coeff_beta", coeff_beta)
        self.factor_min = check_non_negative("factor_min", factor_min)
        self.factor_max = check_positive("factor_max", factor_max)
        if self.factor_max < self.factor_min:
            raise ValueError(f"factor_max must be >= factor_min={factor_min}, got {factor_max}")
        self.factor_threshold = check_non_negative("factor_threshold", factor_threshold)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            kahan_sum=kahan_sum,
        )
        super().__init__(
            params,
            defaults,
            process_group=process_group,
            average_grads=average_grads,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
            auto_mask=auto_mask,
            gradient_release=gradient_release,
            hierarchical=hierarchical,
        )

    def _variance_freeze_step(self) -> int:
        return self.freeze_step

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        max_coeff = check_positive("max_coeff", group["max_coeff"], allow_inf=True)
        min_coeff = check_non_negative("min_coeff", group["min_coeff"])
        if min_coeff > max_coeff:
            raise ValueError(f"min_coeff must be in [0, max_coeff={max_coeff}], got {min_coeff}")

    def _init_param_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        for key, value in (("lamb_coeff", 1.0), ("lamb_coeff_freeze", 0.0), ("last_factor", 1.0)):
            if key not in state:
                state[key] = torch.full((), value, dtype=torch.float32, device=p.device)

    def _schedule_after_plain_steps(self, step: int) -> dict[str, Any]:
        if step >= self.freeze_step:
            raise ValueError(
                f"state_dict: a plain LAMB state saved at step {step} cannot resume as OnebitLamb with "
                f"freeze_step={self.freeze_step}: the compression stage scales by trust ratios recorded during "
                f"its own warmup, which a plain LAMB does not keep; use freeze_step > {step}"
            )
        return super()._schedule_after_plain_steps(step)

    @property
    def in_compression_stage(self) -> bool:
        """True once ``freeze_step`` steps are done (the next step compresses)."""
        return self._sched["step"] >= self.freeze_step

    def _needs_average(self, t: int) -> bool:
        return t <= self.freeze_step

    def get_lamb_coeffs(self) -> list[float]:
        """The last step's coefficient of every trained param (warmup: the trust ratio;
        compression: the frozen ratio times the factor), in param-group order."""
        return [
            self.state[p]["lamb_coeff"].item()
            for group in self.param_groups
            for p in group["params"]
            if p.requires_grad and "lamb_coeff" in self.state[p]
        ]

    def _onebit_step(self, layout: Layout, t: int) -> None:
        if t <= self.freeze_step:
            self._warmup_step(layout, t)
        else:
            self._compression_step(layout, t)

    @staticmethod
    def _with_decay(batch: Batch, update: TensorList, wd: float) -> TensorList:
        return torch._foreach_add(update, batch.params_compute, alpha=wd) if wd else update

    def _scale_and_apply(self, batch: Batch, group: dict[str, Any], update: TensorList, coeff: Tensor) -> None:
        torch._foreach_copy_(batch.state("lamb_coeff"), coeff.unbind())
        torch._foreach_mul_(update, (coeff * -group["lr"]).unbind())
        self._apply(batch, update)

    def _warmup_step(self, layout: Layout, t: int) -> None:
        if self.average_grads:
            self._average_(self._scratch(layout, "grad")[0])
        for _, group, batch in self._batches(layout, t):
            beta1, beta2 = group["betas"]
            exp_avg, exp_avg_sq = batch.state("exp_avg"), batch.state("exp_avg_sq")
            lamb_first_moment_(exp_avg, batch.grads, beta1)
            adam_second_moment_(exp_avg_sq, batch.grads, beta2)
            bc1, bc2 = (1 - beta1**t, 1 - beta2**t) if group["bias_correction"] else (1.0, 1.0)
            denom = lamb_denominator(exp_avg_sq, bc2, group["eps"], group["eps_inside_sqrt"])
            update = self._with_decay(batch, lamb_direction(exp_avg, denom, bc1), group["weight_decay"])
            ratio, measured = trust_ratios(batch.params_compute, update, group["min_coeff"], group["max_coeff"])
            ema = torch.stack(batch.state("lamb_coeff_freeze"))
            ema = torch.where(measured, self.coeff_beta * ema + (1 - self.coeff_beta) * ratio, ema)
            torch._foreach_copy_(batch.state("lamb_coeff_freeze"), ema.unbind())
            self._scale_and_apply(batch, group, update, ratio)
        self._decide_freeze(t)  # freeze_step="auto": this may be the last warmup step
        if t == self.freeze_step:
            self._flat("exp_avg_sq_fresh").copy_(self._flat("exp_avg_sq"))

    def _compression_step(self, layout: Layout, t: int) -> None:
        exp_avg_flat = self._flat("exp_avg")
        if not self._has_state("exp_avg_sq_fresh"):  # resumed past freeze_step from a plain LAMB state
            self._flat("exp_avg_sq_fresh").copy_(self._flat("exp_avg_sq"))
        momenta = [self.state[p]["exp_avg"] for p in layout.params]
        if not self._has_state("scaling_coeff"):
            self._init_scaling_coeffs(layout, momenta)
        scaling = [self.state[p]["scaling_coeff"] for p in layout.params]
        previous, previous_views = self._scratch(layout, "exp_avg_last")
        previous.copy_(exp_avg_flat)
        for _, group, batch in self._batches(layout, t):
            lamb_first_moment_(batch.state("exp_avg"), batch.grads, group["betas"][0])
        torch._foreach_mul_(momenta, scaling)
        self._compress_(exp_avg_flat)
        torch._foreach_div_(momenta, scaling)
        self._mask_(layout, momenta)
        self._auto_mask_(layout, exp_avg_flat)
        # The local gradients are spent: their buffer now takes the gradients reconstructed
        # from the averaged momentum, g~ = (m - beta1 m_prev) / (1 - beta1).
        _, grad_views = self._scratch(layout, "grad")
        for gi, idx in layout.buckets:
            beta1 = self.param_groups[gi]["betas"][0]
            rebuilt = torch._foreach_mul([previous_views[i] for i in idx], -beta1)
            torch._foreach_add_(rebuilt, [momenta[i] for i in idx])
            torch._foreach_div_(rebuilt, 1 - beta1)
            torch._foreach_copy_([grad_views[i] for i in idx], rebuilt)
        for _, group, batch in self._batches(layout, t):
            self._compressed_update(batch, group, t)

    def _init_scaling_coeffs(self, layout: Layout, momenta: list[Tensor]) -> None:
        scales = torch.stack(torch._foreach_norm(momenta))
        scales = scales / torch.tensor([math.sqrt(m.numel()) for m in momenta], device=scales.device)
        united = scales.mean()
        coeffs = torch.where(scales > 0, united / scales, torch.ones_like(scales))
        coeffs = torch.where(torch.isfinite(coeffs) & (coeffs > 0), coeffs, torch.ones_like(coeffs))
        for p, c in zip(layout.params, coeffs.unbind()):
            self.state[p]["scaling_coeff"] = c.clone()

    def _compressed_update(self, batch: Batch, group: dict[str, Any], t: int) -> None:
        beta1, beta2 = group["betas"]
        wd = group["weight_decay"]
        bc1 = bc2 = bc2_fresh = 1.0
        if group["bias_correction"]:
            bc1, bc2_fresh = 1 - beta1**t, 1 - beta2**t
            bc2 = 1 - beta2**self.freeze_step if self.freeze_step else 1.0
        fresh = batch.state("exp_avg_sq_fresh")
        adam_second_moment_(fresh, batch.grads, beta2)  # batch.grads: the reconstructed gradients
        denom = lamb_denominator(batch.state("exp_avg_sq"), bc2, group["eps"], group["eps_inside_sqrt"])
        direction = lamb_direction(batch.state("exp_avg"), denom, bc1)
        update = self._with_decay(batch, direction, wd)
        denom_fresh = lamb_denominator(fresh, bc2_fresh, group["eps"], group["eps_inside_sqrt"])
        factor = torch.stack(torch._foreach_max(torch._foreach_div(denom, denom_fresh)))
        if wd > 0:
            direction_norm = torch.stack(torch._foreach_norm(direction))
            update_norm = torch.stack(torch._foreach_norm(update))
            rho = torch.where(update_norm > 0, (direction_norm / update_norm).clamp(max=1.0), torch.ones_like(factor))
            factor = factor * rho + (1.0 - rho)
        factor = factor.clamp(self.factor_min, self.factor_max)
        last = torch.stack(batch.state("last_factor"))
        factor = torch.minimum(factor, last * (1.0 + self.factor_threshold))
        factor = torch.maximum(factor, last * (1.0 - self.factor_threshold))
        torch._foreach_copy_(batch.state("last_factor"), factor.unbind())
        coeff = torch.stack(batch.state("lamb_coeff_freeze")) * factor
        self._scale_and_apply(batch, group, update, coeff)
