"""0/1 Adam (Lu et al., "Maximizing Communication Efficiency for Large-scale Training via 0/1
Adam", arXiv 2202.06009), after DeepSpeed's ``onebit/zoadam.py``."""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any

import torch

from lightning_optim.onebit.base import OnebitOptimizer
from lightning_optim.onebit.layout import VARIANCE_FIRST, Layout, check_step_count
from lightning_optim.optim.adam import adam_denominator, adam_first_moment_
from lightning_optim.optim.base import ParamsT
from lightning_optim.optim.validation import check_flag

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ZeroOneAdam"]


class ZeroOneAdam(OnebitOptimizer):
    r"""0/1 Adam: Adam whose variance is updated on exponentially spaced steps, 1-bit gradients
    in between, then local steps with 1-bit momentum synchronisation on a growing interval.

    Step :math:`t` (1-based), this rank's gradient :math:`g_r`, :math:`C(\cdot)` the
    error-compensated 1-bit average over ranks of the whole model in one flat buffer, one
    scale per param (:func:`lightning_optim.comm.compressed_allreduce`), ``mask`` each group's ``exp_avg_mask``.

    **Variance stage**, :math:`t \le` ``var_freeze_step``. Step :math:`t` is a *variance step*
    when ``t % var_interval == 0``; ``var_interval`` starts at 1 and doubles after every
    ``var_update_scaler`` variance steps (the paper's :math:`\kappa`).

    * variance step: :math:`\bar g` = full-precision mean of the gradients over ranks;
      :math:`m \leftarrow \beta_1 m + (1-\beta_1)\bar g`, :math:`v \leftarrow \beta_2 v + (1-\beta_2)\bar g^2`.
    * other steps: :math:`m \leftarrow \beta_1 m + (1-\beta_1)\,\mathrm{mask}\odot C(g_1..g_W)`.

    then :math:`p \leftarrow p - \eta\,\hat m/(\sqrt{\hat v}+\epsilon) - \eta\lambda p`. After step
    ``var_freeze_step`` the error buffers are zeroed (they change from gradients to momenta).

    **Local stage**, :math:`t >` ``var_freeze_step`` (the variance stays frozen). Every rank
    steps on its own: :math:`m_r \leftarrow \beta_1 m_r + (1-\beta_1) g_r`, the same Adam update
    with :math:`m_r`, and it accumulates :math:`u_r \leftarrow (1-\eta\lambda) u_r + a_t m_r`
    with :math:`a_t = \eta_t/b_{1,t}` (and :math:`A \leftarrow (1-\eta\lambda) A + a_t`,
    :math:`D \leftarrow (1-\eta\lambda) D`). Step :math:`t` *synchronises* when
    ``t % local_step_interval == 0``: :math:`\bar u = \mathrm{mask}\odot C(u_1..u_W)`, the params
    become :math:`p_0 D - \bar u / (\sqrt{\hat v}+\epsilon)` with :math:`p_0` the params after the
    previous synchronisation, :math:`m \leftarrow \bar u / A` (the paper's momentum
    re-estimate), and :math:`u, A, D` restart. ``local_step_interval`` starts at 1 and doubles,
    up to ``local_step_clipper`` (the paper's :math:`H`), after every ``local_step_scaler``
    local-stage steps. Between synchronisations the params differ across ranks
    (:attr:`params_synchronized` is False); after one they are bitwise equal on every rank.

    Bias correction (``bias_correction=True``): :math:`\hat m = m/(1-\beta_1^t)`,
    :math:`\hat v = v/(1-\beta_2^{n})` with :math:`n` the number of variance steps so far.

    **Schedule versus DeepSpeed.** DeepSpeed's first ``step()`` only builds buffers and counts
    as step 1, so its rules (``step % var_interval``, ``step > var_freeze_step``,
    ``step % local_step_interval``) run on a counter one ahead of its real updates. Here every
    step updates and the same rules run on the real step count: the variance stage holds
    ``var_freeze_step`` real steps in both, and the variance-step / synchronisation patterns
    are DeepSpeed's, counted from the first real step.

    **DDP contract.** :attr:`needs_averaged_grads` is True exactly when the next step is a
    variance step. ``average_grads=True``: the optimizer averages the gradients itself on those
    steps; ``average_grads=False``: the caller must deliver averaged gradients then (DDP's
    allreduce on for that backward) and local gradients otherwise (DDP's allreduce off). The
    other steps always treat ``p.grad`` as this rank's own gradient; every stage consumes the
    mean over ranks of what the caller accumulated per rank.

    **Checkpoints.** :meth:`state_dict` is per rank: error buffers, and in the local stage the
    rank's own momentum, accumulator ``momentum_accumulator`` and params. Save at a
    synchronised step (:attr:`params_synchronized`) or save params per rank too.

    Other differences from DeepSpeed: decay is kept out of the momentum (DeepSpeed's
    accumulator mixes :math:`\lambda p` into the re-estimated momentum), and the synchronised
    params are computed from :math:`p_0` instead of subtracting the local updates again, so
    ranks agree bitwise; with one rank the non-variance steps use the plain gradient (DeepSpeed
    skips the momentum update there); ``bias_correction``/``eps_inside_sqrt`` work; the error
    buffers and accumulators can be checkpointed.

    Args:
        lr, bias_correction, betas, eps, eps_inside_sqrt, weight_decay, max_grad_norm, amsgrad,
            cuda_aware, comm_backend_name, process_group, average_grads, kahan_sum, auto_mask, hierarchical:
            as :class:`~lightning_optim.onebit.OnebitAdam` (``auto_mask`` also masks the 1-bit
            gradients of the variance stage, from the variance so far; plain Adam/AdamW state dicts
            load as there).
        var_freeze_step: the last step of the variance stage, >= 1.
        var_update_scaler: variance steps per doubling of ``var_interval``, >= 1.
        local_step_scaler: local-stage steps per doubling of ``local_step_interval``, >= 1.
        local_step_clipper: the largest ``local_step_interval``, >= 1.
    """

    _lazy_flat_keys = ("momentum_accumulator", "anchor")

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
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        *,
        process_group: ProcessGroup | None = None,
        average_grads: bool = True,
        kahan_sum: bool | None = None,
        auto_mask: bool | float = True,
        gradient_release: bool = False,
        hierarchical: bool | int = False,
    ) -> None:
        if check_flag("amsgrad", amsgrad):
            raise ValueError("amsgrad: 0/1 Adam does not support the AMSGrad variant; leave amsgrad=False")
        self.var_freeze_step = check_step_count("var_freeze_step", var_freeze_step, 1, why=VARIANCE_FIRST)
        self.var_update_scaler = check_step_count("var_update_scaler", var_update_scaler, 1)
        self.local_step_scaler = check_step_count("local_step_scaler", local_step_scaler, 1)
        self.local_step_clipper = check_step_count("local_step_clipper", local_step_clipper, 1)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
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

    def _initial_schedule(self) -> dict[str, Any]:
        return {
            "step": 0,
            "var_interval": 1,
            "var_counter": 0,
            "var_updates": 0,
            "local_step_interval": 1,
            "local_step_counter": 0,
            "steps_since_sync": 0,
            "lr_sum": [],  # per param group: A
            "decay_product": [],  # per param group: D
        }

    def _variance_freeze_step(self) -> int:
        return self.var_freeze_step

    def _check_schedule(self, schedule: object) -> None:
        super()._check_schedule(schedule)
        if not isinstance(schedule, dict):  # refused above
            return
        for key in ("lr_sum", "decay_product"):  # per param group, sums of lr and products of weight decay
            values = schedule.get(key, [])
            if len(values) > len(self.param_groups):
                raise ValueError(f"state_dict: onebit schedule {key} holds {len(values)} values, more than the "
                                 f"{len(self.param_groups)} param groups (one per group)")
            for i, v in enumerate(values):
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                    raise ValueError(f"state_dict: onebit schedule {key}[{i}] must be a finite number, got {v!r}")

    def _schedule_after_plain_steps(self, step: int) -> dict[str, Any]:
        """The counters after ``step`` steps, all of them variance updates (a plain Adam's)."""
        s = self._initial_schedule()
        s["step"] = s["var_updates"] = step
        for t in range(1, min(step, self.var_freeze_step) + 1):
            if t % s["var_interval"] == 0:
                s["var_counter"] += 1
                if s["var_counter"] == self.var_update_scaler:
                    s["var_counter"], s["var_interval"] = 0, s["var_interval"] * 2
        for _ in range(max(0, step - self.var_freeze_step)):
            s["local_step_counter"] += 1
            if s["local_step_counter"] == self.local_step_scaler:
                s["local_step_counter"] = 0
                s["local_step_interval"] = min(self.local_step_clipper, s["local_step_interval"] * 2)
        return s

    def _variance_version(self) -> int:
        return self._sched["var_updates"]

    @property
    def in_local_stage(self) -> bool:
        """True once ``var_freeze_step`` steps are done (the variance is frozen)."""
        return self._sched["step"] >= self.var_freeze_step

    @property
    def params_synchronized(self) -> bool:
        return self._sched["steps_since_sync"] == 0

    def _needs_average(self, t: int) -> bool:
        return t <= self.var_freeze_step and t % self._sched["var_interval"] == 0

    def _local_step(self, t: int) -> bool:
        return t > self.var_freeze_step  # the local stage: gradients never leave the rank

    def _onebit_step(self, layout: Layout, t: int) -> None:
        if t <= self.var_freeze_step:
            self._variance_stage_step(layout, t)
        else:
            self._local_stage_step(layout, t)

    def _bias_corrections(self, group: dict[str, Any], t: int) -> tuple[float, float]:
        if not group["bias_correction"]:
            return 1.0, 1.0
        beta1, beta2 = group["betas"]
        n = self._sched["var_updates"]
        return 1 - beta1**t, (1 - beta2**n if n else 1.0)

    def _variance_stage_step(self, layout: Layout, t: int) -> None:
        s = self._sched
        var_step = t % s["var_interval"] == 0
        grad_flat, grad_views = self._scratch(layout, "grad")
        if var_step:
            if self.average_grads:
                self._average_(grad_flat)
            s["var_updates"] += 1
        else:
            self._compress_(grad_flat)
            self._mask_(layout, grad_views)
            self._auto_mask_(layout, grad_flat)
        for _, group, batch in self._batches(layout, t):
            beta1, beta2 = group["betas"]
            bc1, bc2 = self._bias_corrections(group, t)
            self._adam_step(group, batch, beta1=beta1, beta2=beta2 if var_step else 1.0, bc1=bc1, bc2=bc2)
        if var_step:
            s["var_counter"] += 1
            if s["var_counter"] == self.var_update_scaler:
                s["var_counter"] = 0
                s["var_interval"] *= 2
        if t == self.var_freeze_step:
            self._reset_error_buffers()  # from now on they hold momentum residue, not gradient residue

    def _local_stage_step(self, layout: Layout, t: int) -> None:
        s = self._sched
        groups = self.param_groups
        s["lr_sum"] += [0.0] * (len(groups) - len(s["lr_sum"]))
        s["decay_product"] += [1.0] * (len(groups) - len(s["decay_product"]))
        sync = t % s["local_step_interval"] == 0
        accumulator = self._flat("momentum_accumulator")
        first_local = s["steps_since_sync"] == 0 and not sync
        anchor = self._flat("anchor") if first_local or s["steps_since_sync"] > 0 else None
        for gi, group in enumerate(groups):
            decay = 1 - group["lr"] * group["weight_decay"]
            s["decay_product"][gi] *= decay
        for _, group, batch in self._batches(layout, t):
            beta1 = group["betas"][0]
            bc1, bc2 = self._bias_corrections(group, t)
            decay = 1 - group["lr"] * group["weight_decay"]
            weight = group["lr"] / bc1
            exp_avg, acc = batch.state("exp_avg"), batch.state("momentum_accumulator")
            if first_local:
                torch._foreach_copy_(batch.state("anchor"), self._param_values(batch))
            if sync:
                adam_first_moment_(exp_avg, batch.grads, beta1)
            else:  # the local Adam step, variance frozen
                self._adam_step(group, batch, beta1=beta1, beta2=1.0, bc1=bc1, bc2=bc2)
            torch._foreach_mul_(acc, decay)
            torch._foreach_add_(acc, exp_avg, alpha=weight)
        for gi, group in enumerate(groups):
            decay = 1 - group["lr"] * group["weight_decay"]
            s["lr_sum"][gi] = s["lr_sum"][gi] * decay + group["lr"] / self._bias_corrections(group, t)[0]
        if sync:
            self._synchronize(layout, t, accumulator, anchor is not None)
        else:
            s["steps_since_sync"] += 1
        s["local_step_counter"] += 1
        if s["local_step_counter"] == self.local_step_scaler:
            s["local_step_counter"] = 0
            s["local_step_interval"] = min(self.local_step_clipper, s["local_step_interval"] * 2)

    def _synchronize(self, layout: Layout, t: int, accumulator: torch.Tensor, from_anchor: bool) -> None:
        s = self._sched
        self._compress_(accumulator)
        self._mask_(layout, [self.state[p]["momentum_accumulator"] for p in layout.params])
        self._auto_mask_(layout, accumulator)
        for gi, group, batch in self._batches(layout, t):
            _, bc2 = self._bias_corrections(group, t)
            acc = batch.state("momentum_accumulator")
            start = batch.state("anchor") if from_anchor else self._param_values(batch)
            new = torch._foreach_mul(start, s["decay_product"][gi])
            denom = adam_denominator(batch.state("exp_avg_sq"), bc2, group["eps"], group["eps_inside_sqrt"])
            torch._foreach_sub_(new, torch._foreach_div(acc, denom))
            self._assign(batch, new)
            lr_sum = s["lr_sum"][gi]
            torch._foreach_copy_(batch.state("exp_avg"), acc)
            if lr_sum != 0:  # lr 0 through the interval: the accumulated momentum is 0 too
                torch._foreach_div_(batch.state("exp_avg"), lr_sum)
        accumulator.zero_()
        s["lr_sum"] = [0.0] * len(self.param_groups)
        s["decay_product"] = [1.0] * len(self.param_groups)
        s["steps_since_sync"] = 0
