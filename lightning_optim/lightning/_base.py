"""The three 1-bit strategies, written once for both Lightning packages, composed by concern:

* ``_ddp_hooks.py``: DDP's allreduce as the switchable comm hook (also on CPU), switched per backward;
* ``_rank_checkpoints.py``: each rank's own optimizer state next to the checkpoint;
* ``_telemetry.py``: bytes on the wire per step (and the callback that logs them);
* ``_failures.py``: the collective timeout and what a rank does when a collective fails;
* here: argument checks, the precision guard, the optimizer conversion and the stage warnings.

The concrete classes (``strategies.py`` for ``lightning.pytorch``, ``pl_strategies.py`` for
``pytorch_lightning``) are ``class X(_Mixin, DDPStrategy)``: the mixins only call ``super()`` and
read the strategy's own attributes, so they work on either package's ``DDPStrategy``.

Per optimizer step (adapters only; the algorithms live in ``lightning_optim.onebit``/``comm``):
``setup_optimizers`` makes the optimizer from ``configure_optimizers`` the 1-bit variant
(``convert.to_onebit``, ``average_grads=False``) and points the LR schedulers at it; before every
backward the switch follows ``optimizer.needs_averaged_grads`` (it changes only in ``step()``, so
every micro-batch of an accumulation window agrees); after the step the bytes are recorded.
"""

from __future__ import annotations

import math
import warnings
from datetime import timedelta
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist

from lightning_optim.lightning._bases import attached, ddp_model
from lightning_optim.lightning._clipping import _AgreedClipMixin
from lightning_optim.lightning._ddp_hooks import _SwitchableAllreduceMixin
from lightning_optim.lightning._failures import DEFAULT_TIMEOUT_S, _CommFailureMixin
from lightning_optim.lightning._rank_checkpoints import CHECKPOINT_KEY, _PerRankCheckpointMixin, rank_file
from lightning_optim.lightning._telemetry import _ByteCountingMixin
from lightning_optim.onebit import OnebitAdam, OnebitLamb, OnebitOptimizer, ZeroOneAdam
from lightning_optim.onebit.auto_freeze import AutoFreezeMixin
from lightning_optim.onebit.base import _auto_mask_ratio
from lightning_optim.onebit.convert import retarget_schedulers, to_onebit
from lightning_optim.onebit.overlap import OverlapState, bind_overlap, check_trains_ddp_params, onebit_overlap_hook

__all__ = ["CHECKPOINT_KEY", "DEFAULT_TIMEOUT_S", "rank_file"]

_NOT_OURS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


class _OnebitStrategyMixin(_AgreedClipMixin, _PerRankCheckpointMixin, _ByteCountingMixin, _SwitchableAllreduceMixin,
                           _CommFailureMixin):
    """DDP whose gradient allreduce follows ``optimizer.needs_averaged_grads``; see the module doc."""

    optimizer_class: ClassVar[type[OnebitOptimizer]]
    telemetry_callback_class: ClassVar[type]  # set by the package-specific module
    _freeze_arg: ClassVar[str] = "freeze_step"

    def __init__(
        self,
        *,
        knobs: dict[str, Any],
        timeout: float | timedelta = DEFAULT_TIMEOUT_S,
        telemetry: bool = True,
        hierarchical: bool | int = False,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        for key in _NOT_OURS:
            if kwargs.get(key) is not None:
                raise TypeError(
                    f"{name}: {key} is not supported: the strategy registers its own DDP comm hook (the "
                    "switchable allreduce) and the optimizer communicates itself in the compression stage"
                )
            kwargs.pop(key, None)
        if not isinstance(telemetry, bool):
            raise TypeError(f"{name}: telemetry must be True or False, got {telemetry!r}")
        self._knobs = {k: v for k, v in knobs.items() if v is not None}
        if hierarchical is not False:  # the optimizer's default otherwise
            self._knobs["hierarchical"] = hierarchical
        try:  # the optimizer's own checks name the argument and its range
            self.optimizer_class([torch.zeros(1, requires_grad=True)], **self._knobs)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        self._telemetry = telemetry
        super().__init__(timeout=self._init_timeout(timeout), **kwargs)
        self._onebit: OnebitOptimizer | None = None
        self._warned_unsynchronized = False
        self._init_counting()

    @property
    def onebit_optimizer(self) -> OnebitOptimizer | None:
        """The 1-bit optimizer in use (after ``setup``)."""
        return self._onebit

    def comm_summary(self) -> dict[str, Any]:
        return {**super().comm_summary(),
                "optimizer": type(self._onebit).__name__ if self._onebit is not None else None}

    def check_world(self, processes_per_node: int, num_nodes: int) -> None:
        per_node = self._knobs.get("hierarchical", False)
        world = processes_per_node * num_nodes
        if per_node is not True and per_node is not False and world % per_node:
            raise ValueError(f"{type(self).__name__}: hierarchical={per_node} ranks per node do not divide the "
                             f"{world} ranks of the world; give a node size that divides it (true: the "
                             f"{processes_per_node} processes per node), or false")
        super().check_world(processes_per_node, num_nodes)

    # ------------------------------------------------------------------ the concerns' questions
    def _per_rank_optimizer(self) -> OnebitOptimizer | None:
        return self._onebit

    def _per_rank_format(self) -> type[OnebitOptimizer]:
        return OnebitOptimizer  # the split/merge rules are the same for the three classes

    def _grads_need_averaging(self) -> bool:
        return self._onebit is None or self._onebit.needs_averaged_grads

    def _step_skips_ddp_allreduce(self) -> bool:
        return self._onebit is not None and not self._onebit.needs_averaged_grads

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: Any) -> None:
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                f"{type(self).__name__}: torch's GradScaler (precision='16-mixed') decides on every rank alone "
                "whether to skip a step, but the compression stage needs all ranks to step together; use "
                "plugins=[lightning_optim.lightning.MasterWeightsPrecision()] (fp16 with the overflow decision "
                "shared by all ranks), precision='bf16-mixed' or '32-true'"
            )
        fitting = trainer.state.fn == "fit"
        if fitting and self._telemetry and not any(
            isinstance(cb, self.telemetry_callback_class) for cb in trainer.callbacks
        ):
            trainer.callbacks.append(self.telemetry_callback_class())
        super().setup(trainer)
        self._agree_on_clipping()
        if fitting:
            self._start_counting()

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"{type(self).__name__} needs exactly one optimizer from configure_optimizers, "
                f"got {len(self.optimizers)}"
            )
        if self._knobs.get("hierarchical") is True:  # Lightning sets no LOCAL_WORLD_SIZE: its devices per node
            self._knobs["hierarchical"] = self.num_processes
        old = self.optimizers[0]
        new = self._adopt(old)
        if new is not old:
            retarget_schedulers([config.scheduler for config in self.lr_scheduler_configs], old, new)
            self.optimizers = [new]
        self._onebit = new
        new.ddp_allreduce_managed = True  # the switchable hook follows needs_averaged_grads
        if new.hierarchical and self._switch is not None:  # the warmup's DDP average is hierarchical too
            self._switch.average = new.average_
        model = attached(self.model, "model")
        self._trained_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def _adopt(self, optimizer: torch.optim.Optimizer) -> OnebitOptimizer:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        if not isinstance(optimizer, OnebitOptimizer):
            try:
                return to_onebit(optimizer, self.optimizer_class, self._knobs, average_grads=False)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{type(self).__name__}: {exc}") from None
        name = type(self).__name__
        if optimizer.process_group not in (None, getattr(dist.group, "WORLD", None)):
            raise ValueError(f"{name}: the {type(optimizer).__name__} must use the default process group "
                             "(process_group=None): DDP averages over all ranks")
        wanted = {k: _auto_mask_ratio(v) if k == "auto_mask" else v for k, v in self._knobs.items()}
        ignored = {k: v for k, v in wanted.items() if getattr(optimizer, k, v) != v}
        if ignored and self.global_rank == 0:
            own = ", ".join(f"{k}={getattr(optimizer, k)}" for k in ignored)
            warnings.warn(
                f"{name}: configure_optimizers returned a {type(optimizer).__name__}; it is used as is, with its own "
                f"{own} (the strategy's {ignored} are ignored)",
                UserWarning,
                stacklevel=2,
            )
        optimizer.average_grads = False  # DDP's switchable allreduce averages whenever it is needed
        return optimizer

    # ------------------------------------------------------------------ stage warnings
    def on_train_start(self) -> None:
        super().on_train_start()
        opt, trainer = self._onebit, attached(self.lightning_module, "lightning_module").trainer
        total = trainer.estimated_stepping_batches
        if opt is None or not math.isfinite(total):
            return
        run = opt.global_step + max(0, int(total) - trainer.global_step)
        if run >= 1 and isinstance(opt, AutoFreezeMixin):
            opt.limit_auto_freeze(run)  # every rank
        if self.global_rank != 0:
            return
        auto = getattr(opt, "_auto", None)  # freeze_step="auto": the earliest step it may choose
        freeze = min(opt.global_step, auto[2]) + auto[0] if auto else opt._variance_freeze_step()
        last_step = opt.global_step + max(0, int(total) - trainer.global_step)
        compressing = isinstance(opt, (OnebitAdam, OnebitLamb)) and opt.in_compression_stage
        if last_step <= freeze and not (auto and compressing):
            warnings.warn(
                f"{type(self).__name__}: {self._freeze_arg}={freeze}, but this fit ends at optimizer step {last_step}: "
                "compression will not engage (every step is a full-precision DDP step). Pass "
                f"{self._freeze_arg}=... below that (e.g. 10-25% of the run) for 1-bit communication",
                UserWarning,
                stacklevel=2,
            )

    def on_validation_start(self) -> None:
        super().on_validation_start()
        opt = self._onebit
        if opt is not None and not opt.params_synchronized and not self._warned_unsynchronized:
            self._warned_unsynchronized = True
            if self.global_rank == 0:
                warnings.warn(
                    f"{type(self).__name__}: validating between two {type(opt).__name__} synchronisations; every "
                    "rank scores its own params, and a sync_dist metric is the mean over ranks of those scores "
                    "(validate on steps where params are synchronised for one model's score)",
                    UserWarning,
                    stacklevel=2,
                )


class _OnebitAdamMixin(_OnebitStrategyMixin):
    """DDP + 1-bit Adam: DDP's fp32 allreduce for ``freeze_step`` warmup steps, then only the
    optimizer's 1-bit momentum allreduce.

    Args:
        freeze_step: warmup steps (``OnebitAdam``'s default, 100000, when None), or ``"auto"``: warmup ends when
            the variance has settled (``lightning_optim.onebit.auto_freeze``; the chosen step is announced once).
        auto_freeze_window, auto_freeze_tolerance, auto_freeze_max: that rule's W, tau and cap (``OnebitAdam``'s;
            only with ``freeze_step="auto"``; without ``auto_freeze_max`` the cap is 15% of the fit's steps).
        auto_mask: ``OnebitAdam``'s (True when None; False: off; or the ratio, see docs/guides/onebit.md).
        overlap: exchange the momenta of each unit of params while backward still runs (the comm hook of
            ``lightning_optim.onebit.overlap``) instead of in ``optimizer.step()``; not with
            ``gradient_clip_val`` (the momentum is updated before clipping could run) or master weights.
        overlap_unit_mb: the size of a compression unit with ``overlap`` (None: DDP's ``bucket_cap_mb``).
        timeout: collective timeout in seconds (or a ``timedelta``).
        telemetry: log ``comm/*`` metrics per step (adds :class:`CommTelemetry`).
        hierarchical: False, True (nodes of ``LOCAL_WORLD_SIZE`` ranks) or the ranks per node: fp32 inside a
            node, 1-bit across nodes, in the warmup's DDP average too (``OnebitAdam``'s ``hierarchical``);
            not with ``overlap``.
        **kwargs: ``DDPStrategy`` arguments.
    """

    optimizer_class = OnebitAdam

    def __init__(self, freeze_step: int | Literal["auto"] | None = None, auto_mask: bool | float | None = None,
                 overlap: bool = False,
                 overlap_unit_mb: float | None = None, auto_freeze_window: int | None = None,
                 auto_freeze_tolerance: float | None = None, auto_freeze_max: int | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(overlap, bool):
            raise TypeError(f"{type(self).__name__}: overlap must be True or False, got {overlap!r}")
        if overlap_unit_mb is not None and not overlap:
            raise ValueError(f"{type(self).__name__}: overlap_unit_mb needs overlap=True")
        self._overlap, self._overlap_unit_mb = overlap, overlap_unit_mb
        self._overlap_state: OverlapState | None = None
        knobs = dict(freeze_step=freeze_step, auto_mask=auto_mask, auto_freeze_window=auto_freeze_window,
                     auto_freeze_tolerance=auto_freeze_tolerance, auto_freeze_max=auto_freeze_max)
        super().__init__(knobs=knobs, **kwargs)

    @property
    def overlap_state(self) -> OverlapState | None:
        """The overlap hook's state (``units_overlapped``) when ``overlap=True``."""
        return self._overlap_state

    def setup(self, trainer: Any) -> None:
        if self._overlap and trainer.gradient_clip_val:
            raise ValueError(f"{type(self).__name__}: overlap=True updates the momentum from each bucket's "
                             "gradients during backward, before gradient_clip_val could clip them; drop one")
        super().setup(trainer)
        if self._overlap_state is not None and self._onebit is not None:
            try:  # after the precision plugin's setup: master weights swap fp32 copies into the optimizer
                check_trains_ddp_params(attached(self.model, "model"), self._onebit)
            except ValueError as exc:
                raise ValueError(f"{type(self).__name__}: {exc}") from None

    def _register_ddp_hooks(self) -> None:
        if not self._overlap:
            return super()._register_ddp_hooks()
        self._overlap_state = OverlapState()  # averages like DDP until the optimizer is bound
        self._switch = self._overlap_state.allreduce
        ddp_model(self.model).register_comm_hook(self._overlap_state, onebit_overlap_hook)
        return None

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self._overlap_state is not None:
            try:
                bind_overlap(self._overlap_state, ddp_model(self.model), self._onebit, self._overlap_unit_mb)
            except ValueError as exc:
                raise ValueError(f"{type(self).__name__}: {exc}") from None

    def teardown(self) -> None:
        if self._overlap_state is not None:
            self._overlap_state.close()
        super().teardown()


class _ZeroOneAdamMixin(_OnebitStrategyMixin):
    """DDP + 0/1 Adam: DDP's fp32 allreduce only on the variance-update steps; 1-bit gradients,
    then local steps with 1-bit synchronisation, otherwise. Between synchronisations the ranks'
    params differ (validation scores each rank's own; checkpoints keep each rank's params).

    Args:
        var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper, auto_mask:
            ``ZeroOneAdam``'s (its defaults when None).
        timeout, telemetry, hierarchical, **kwargs: as :class:`OnebitAdamStrategy`.
    """

    optimizer_class = ZeroOneAdam
    _freeze_arg = "var_freeze_step"

    def __init__(
        self,
        var_freeze_step: int | None = None,
        var_update_scaler: int | None = None,
        local_step_scaler: int | None = None,
        local_step_clipper: int | None = None,
        auto_mask: bool | float | None = None,
        **kwargs: Any,
    ) -> None:
        knobs = dict(var_freeze_step=var_freeze_step, var_update_scaler=var_update_scaler,
                     local_step_scaler=local_step_scaler, local_step_clipper=local_step_clipper, auto_mask=auto_mask)
        super().__init__(knobs=knobs, **kwargs)


class _OnebitLambMixin(_OnebitStrategyMixin):
    """DDP + 1-bit LAMB: DDP's fp32 allreduce for ``freeze_step`` warmup steps, then only the
    optimizer's 1-bit momentum allreduce. Converts ``lightning_optim.Lamb``/``FusedLamb``.

    Args:
        freeze_step, coeff_beta, factor_max, factor_min, factor_threshold, auto_mask, auto_freeze_window,
            auto_freeze_tolerance, auto_freeze_max: ``OnebitLamb``'s (its defaults when None; ``freeze_step="auto"``
            as :class:`OnebitAdamStrategy`).
        timeout, telemetry, hierarchical, **kwargs: as :class:`OnebitAdamStrategy`.
    """

    optimizer_class = OnebitLamb

    def __init__(
        self,
        freeze_step: int | Literal["auto"] | None = None,
        coeff_beta: float | None = None,
        factor_max: float | None = None,
        factor_min: float | None = None,
        factor_threshold: float | None = None,
        auto_mask: bool | float | None = None,
        auto_freeze_window: int | None = None,
        auto_freeze_tolerance: float | None = None,
        auto_freeze_max: int | None = None,
        **kwargs: Any,
    ) -> None:
        knobs = dict(freeze_step=freeze_step, coeff_beta=coeff_beta, factor_max=factor_max,
                     factor_min=factor_min, factor_threshold=factor_threshold, auto_mask=auto_mask,
                     auto_freeze_window=auto_freeze_window, auto_freeze_tolerance=auto_freeze_tolerance,
                     auto_freeze_max=auto_freeze_max)
        super().__init__(knobs=knobs, **kwargs)
