"""1-bit Adam (Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed", arXiv 2102.02888), after DeepSpeed's ``onebit/adam.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from lightning_optim.onebit.auto_freeze import AutoFreezeMixin
from lightning_optim.onebit.base import OnebitOptimizer
from lightning_optim.onebit.layout import Layout
from lightning_optim.onebit.units import CompressionUnitsMixin
from lightning_optim.optim.adam import adam_first_moment_
from lightning_optim.optim.base import ParamsT
from lightning_optim.optim.validation import check_flag

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["OnebitAdam"]


class OnebitAdam(CompressionUnitsMixin, AutoFreezeMixin, OnebitOptimizer):
    r"""1-bit Adam: Adam until ``freeze_step``, then a frozen variance and a 1-bit momentum.

    Step :math:`t` (1-based) with this rank's gradient :math:`g_r`, :math:`W` ranks:

    * **warmup**, :math:`t \le` ``freeze_step``: Adam (decoupled decay, as DeepSpeed) on the
      rank-averaged gradient :math:`\bar g = \frac1W\sum_r g_r`:
      :math:`m \leftarrow \beta_1 m + (1-\beta_1)\bar g,\ v \leftarrow \beta_2 v + (1-\beta_2)\bar g^2`.
    * **compression**, :math:`t >` ``freeze_step``: :math:`v` stays as it was after step
      ``freeze_step``; each rank updates the momentum from its LOCAL gradient,
      :math:`m_r \leftarrow \beta_1 m + (1-\beta_1) g_r`, and the ranks agree on
      :math:`m \leftarrow \mathrm{mask}\odot C(m_1..m_W)`, the error-compensated 1-bit average
      (:func:`lightning_optim.comm.compressed_allreduce`) of the whole model's momenta in one
      flat buffer and one call, each param's slice with its own scale, with one pair of error
      buffers per rank.

    Both stages then step
    :math:`p \leftarrow p - \eta\,\hat m / (\sqrt{\hat v} + \epsilon) - \eta\lambda p`, with
    :math:`\hat m = m / (1-\beta_1^t)` and :math:`\hat v = v / (1-\beta_2^{\min(t, T)})`
    (:math:`T` = ``freeze_step``: the variance's bias correction freezes with it) when
    ``bias_correction``, and :math:`\sqrt{\hat v + \epsilon}` with ``eps_inside_sqrt``.

    **Gradient averaging / DDP contract.** :attr:`needs_averaged_grads` says, after each step,
    whether the next step wants rank-averaged gradients (True exactly while the next step is a
    warmup step). With ``average_grads=True`` the optimizer averages them itself (one fp32
    allreduce of all gradients): use it with plain PyTorch, or with DDP whose allreduce is off.
    With ``average_grads=False`` the caller (the Lightning strategy's DDP comm hook) must hand
    in averaged gradients whenever :attr:`needs_averaged_grads` was True before the backward,
    and may skip DDP's allreduce otherwise. In the compression stage the optimizer always reads
    ``p.grad`` as this rank's own gradient. Both stages therefore consume the same quantity,
    the mean over ranks of whatever the caller accumulated per rank (accumulate the MEAN of
    micro-batch gradients, e.g. ``loss / k``, and both stages see the mean gradient, where
    DeepSpeed's compression stage sees a sum).

    **Checkpoints.** :meth:`state_dict` is per rank (it holds this rank's error buffers);
    restoring each rank's own dict continues bitwise. See :class:`OnebitOptimizer`.

    Differences from DeepSpeed: the first step updates the params (DeepSpeed only builds its
    buffers); ``bias_correction`` and ``eps_inside_sqrt`` work (DeepSpeed ignores them: no bias
    correction, eps outside); on one rank the momentum is used uncompressed; the error
    buffers can be checkpointed (DeepSpeed drops them on load); momenta are compressed in one
    call for the whole model (one scale per param, as DeepSpeed's per-param calls);
    ``max_grad_norm`` is ignored with a warning (silently in
    DeepSpeed); ``comm_backend_name``/``cuda_aware`` are accepted but communication goes
    through the torch.distributed process group.

    Args:
        lr: learning rate, >= 0.
        freeze_step: number of warmup (full-precision Adam) steps, >= 1 (the compression stage
            divides by the variance they estimate), or ``"auto"``: warmup ends when the variance's norm has
            settled (:mod:`lightning_optim.onebit.auto_freeze`: its norm stayed within a band of
            ``auto_freeze_tolerance`` through the last ``auto_freeze_window`` steps), at step ``auto_freeze_max``
            at the latest.
        auto_freeze_window, auto_freeze_tolerance, auto_freeze_max: that rule's W (20), tau (0.15) and cap
            (100000); only with ``freeze_step="auto"``.
        bias_correction: bias-correct the moments (see above).
        betas: moment coefficients, each in [0, 1).
        eps: denominator term, > 0.
        eps_inside_sqrt: :math:`\sqrt{\hat v + \epsilon}` instead of :math:`\sqrt{\hat v} + \epsilon`.
        weight_decay: decoupled decay :math:`\lambda` >= 0 (``p -= lr * wd * p``; DeepSpeed's).
        max_grad_norm: accepted, ignored (warns when > 0).
        amsgrad: must be False (ValueError otherwise; DeepSpeed raises too).
        cuda_aware, comm_backend_name: DeepSpeed config compatibility; no effect (warns when
            not the default).
        process_group: the ranks to average over (None: the default group).
        hierarchical: False (flat: every rank in one 1-bit exchange), True (nodes of ``LOCAL_WORLD_SIZE``
            ranks, torchrun's) or the number of ranks per node: the momenta (and the warmup's gradients when
            ``average_grads``) are reduce-scattered inside each node in fp32, each shard is averaged across
            nodes (1-bit with this rank's error buffers for its shard, or fp32 in the warmup) and all-gathered
            in the node (``lightning_optim.comm.hierarchy``). Not with compression units (``overlap``).
        average_grads: average full-precision gradients over ranks inside :meth:`step` when
            they are needed (see above).
        kahan_sum: Kahan-compensated updates of fp16/bf16 params (None: on for those dtypes).
        auto_mask: True (:math:`\rho` = 1e-3), False (off) or :math:`\rho` in [0, 1). After every compressed
            allreduce, the elements whose frozen variance is at most :math:`\rho^2` times their param's mean
            variance (gradients that were all but zero through warmup, e.g. the key part of a fused
            attention bias) get momentum 0 and stay still, instead of moving on the compression's
            +-scale noise divided by a tiny :math:`\sqrt{v}`. 0: exact zeros only. Composes with
            ``exp_avg_mask`` (both apply); derived from the state, so it survives checkpoints.

    **Resuming a full-precision run.** :meth:`load_state_dict` also takes the state dict of a
    torch.optim or lightning_optim ``Adam``/``AdamW`` over the same params: moments and step count
    carry over and the stage follows from the step count (see :mod:`lightning_optim.onebit.resume`).

    Param groups may carry ``exp_avg_mask``: a tensor broadcastable to every param of the
    group that multiplies the momentum after each compressed allreduce (for momenta with
    constant exact zeros, which 1-bit codes cannot represent); the current mask survives
    :meth:`load_state_dict`.
    """

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
        auto_freeze_window: int | None = None,
        auto_freeze_tolerance: float | None = None,
        auto_freeze_max: int | None = None,
    ) -> None:
        if check_flag("amsgrad", amsgrad):
            raise ValueError("amsgrad: 1-bit Adam does not support the AMSGrad variant; leave amsgrad=False")
        self._init_freeze_step(freeze_step, auto_freeze_window, auto_freeze_tolerance, auto_freeze_max)
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
        self._init_units()

    def _initial_schedule(self) -> dict[str, Any]:
        return {**super()._initial_schedule(), "variance_steps": 0}

    def _variance_freeze_step(self) -> int:
        return self.freeze_step

    def _schedule_after_plain_steps(self, step: int) -> dict[str, Any]:
        return {**super()._schedule_after_plain_steps(step), "variance_steps": step}

    def _schedule_keys_added_since(self, schedule: dict[str, Any]) -> dict[str, Any]:
        return {**super()._schedule_keys_added_since(schedule),
                "variance_steps": min(schedule["step"], self.freeze_step)}

    def _variance_version(self) -> int:
        return self._sched["variance_steps"]

    @property
    def in_compression_stage(self) -> bool:
        """True once ``freeze_step`` steps are done (the next step compresses)."""
        return self._sched["step"] >= self.freeze_step

    def _needs_average(self, t: int) -> bool:
        return t <= self.freeze_step

    def momentum_weight(self) -> float:
        """``1 - beta1``, the weight of the gradient in the momentum update (one beta1 for all groups:
        compression units and the overlap hook need it)."""
        beta1s = {group["betas"][0] for group in self.param_groups}
        if len(beta1s) != 1:
            raise ValueError(
                f"betas: per-bucket compression needs one beta1 for every param group, got {sorted(beta1s)}")
        return 1.0 - float(beta1s.pop())

    def _reads_param_grads(self, t: int) -> bool:
        return t > self.freeze_step  # the compression stage lerps the momentum straight from p.grad

    def _onebit_step(self, layout: Layout, t: int) -> None:
        warmup = t <= self.freeze_step
        if not warmup:  # the compression stage reads p.grad: the warmup's flat gradient copy is dead weight
            layout.scratch.pop("grad", None)
        if warmup:
            if self.average_grads:
                self._average_(self._scratch(layout, "grad")[0])
            self._sched["variance_steps"] += 1
        elif self.uses_units:  # per DDP bucket (units.py); the overlap hook may have done some already
            self._compress_units(layout, self._step_param_grads(), self.momentum_weight())
        else:
            grads = self._local_grads(layout)
            beta1s = {self.param_groups[gi]["betas"][0] for gi, _ in layout.buckets}
            if len(beta1s) == 1:  # the momentum update rides on the compression's first pass
                self._compress_(self._flat("exp_avg"), momentum=(grads, 1.0 - float(beta1s.pop())))
            else:
                for _, group, batch in self._batches(layout, t, grads=grads):
                    adam_first_moment_(batch.state("exp_avg"), batch.grads, group["betas"][0])
                self._compress_(self._flat("exp_avg"))
            self._mask_(layout, self._flat_views["exp_avg"])
            self._auto_mask_(layout, self._flat("exp_avg"))
        # warmup: Adam on the averaged grads; compression: the final m (as "grads", beta1 = 0), v frozen
        step_grads = None if warmup else self._flat_views["exp_avg"]
        for _, group, batch in self._batches(layout, t, grads=step_grads):
            beta1, beta2 = group["betas"]
            bc1 = bc2 = 1.0
            if group["bias_correction"]:
                variance_steps = self._sched["variance_steps"]
                bc1 = 1 - beta1**t
                bc2 = 1 - beta2**variance_steps if variance_steps else 1.0
            if warmup:
                self._adam_step(group, batch, beta1=beta1, beta2=beta2, bc1=bc1, bc2=bc2)
            else:
                self._adam_step(group, batch, beta1=0.0, beta2=1.0, bc1=bc1, bc2=bc2, momentum_is_state=True)
        if warmup:
            self._decide_freeze(t)  # freeze_step="auto": this may be the last warmup step
