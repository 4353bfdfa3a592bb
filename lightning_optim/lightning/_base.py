"""What the three 1-bit strategies share, written once for both Lightning packages.

The concrete classes (``strategies.py`` for ``lightning.pytorch``, ``pl_strategies.py`` for
``pytorch_lightning``) are ``class X(_Mixin, DDPStrategy)``: the mixin only calls ``super()``
and reads the strategy's own attributes, so it works on either package's ``DDPStrategy``.

Per optimizer step (adapters only; the algorithms live in ``lightning_optim.onebit``/``comm``):

1. ``setup_optimizers`` (after DDP wrapped the model): the optimizer from
   ``configure_optimizers`` becomes the 1-bit variant (``convert.to_onebit``, built with
   ``average_grads=False``), LR schedulers are pointed at it; a 1-bit optimizer is kept.
2. ``_register_ddp_hooks`` (also on CPU, unlike ``DDPStrategy``): DDP's allreduce is replaced
   by ``register_switchable_allreduce``.
3. ``pre_backward`` (every backward, through ``manual_backward`` too): the switch is set to
   ``optimizer.needs_averaged_grads``. It only changes in ``step()``, so every micro-batch of an
   accumulation window agrees; Lightning's ``no_sync`` still skips the non-final ones.
4. ``optimizer_step``: the bytes this rank sent (``comm_stats()`` delta) and what DDP's fp32
   ring allreduce of the trained params would have sent are recorded; the telemetry callback
   logs them.
"""

from __future__ import annotations

import math
import re
import signal
import sys
import warnings
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_optim.comm import CommunicationError, comm_stats, register_switchable_allreduce
from lightning_optim.comm.stats import CommStats, ring_allreduce_bytes
from lightning_optim.lightning.convert import retarget_schedulers, to_onebit
from lightning_optim.onebit import OnebitAdam, OnebitLamb, OnebitOptimizer, ZeroOneAdam

__all__ = ["CHECKPOINT_KEY", "DEFAULT_TIMEOUT_S", "rank_file"]

CHECKPOINT_KEY = "lightning_optim_onebit"  # in the main checkpoint: how the per-rank files were written
DEFAULT_TIMEOUT_S = 300.0
_NOT_OURS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")
_COMM_FAILURE = re.compile(r"gloo|nccl|connection (closed|reset)|timed out|timeout|socket|broken pipe", re.I)


def rank_file(checkpoint_path: Any, rank: int) -> str:
    """Where rank ``rank`` (>= 1) keeps its own 1-bit state next to the checkpoint."""
    return f"{checkpoint_path}.rank{rank}.pt"


def _timeout(value: Any, owner: str) -> timedelta:
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{owner}: timeout must be a number of seconds or a timedelta, got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{owner}: timeout must be a finite number of seconds > 0, got {seconds}")
    return timedelta(seconds=seconds)


def _drop_error_buffers(states: list[dict[str, Any]]) -> bool:
    """Remove the error buffers from the optimizer states; whether there were any."""
    dropped = False
    for i, state in enumerate(states):
        onebit = state.get("onebit")
        if isinstance(onebit, dict):
            dropped = dropped or onebit.get("worker_error") is not None
            states[i] = {**state, "onebit": {**onebit, "worker_error": None, "server_error": None}}
    return dropped


def _is_comm_failure(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, CommunicationError) or isinstance(exc, getattr(dist, "DistError", ())):
            return True
        if isinstance(exc, RuntimeError) and _COMM_FAILURE.search(str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class _OnebitStrategyMixin:
    """DDP whose gradient allreduce follows ``optimizer.needs_averaged_grads``; see the module doc."""

    optimizer_class: ClassVar[type[OnebitOptimizer]]
    telemetry_callback_class: ClassVar[type]  # set by the package-specific module

    def __init__(
        self,
        *,
        knobs: dict[str, Any],
        timeout: float | timedelta = DEFAULT_TIMEOUT_S,
        telemetry: bool = True,
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
        try:  # the optimizer's own checks name the argument and its range
            self.optimizer_class([torch.zeros(1, requires_grad=True)], **self._knobs)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        self._timeout_s = _timeout(timeout, name).total_seconds()
        self._telemetry = telemetry
        super().__init__(timeout=timedelta(seconds=self._timeout_s), **kwargs)
        self._onebit: OnebitOptimizer | None = None
        self._switch: Any = None
        self._per_rank_model_state: dict[str, Any] | None = None
        self._warned_unsynchronized = False
        self._trained_numel = 0
        self._comm_before = CommStats()
        self.comm_totals = {"steps": 0, "steps_without_ddp_allreduce": 0, "bytes_sent": 0, "fp32_bytes": 0}
        self.comm_last_step: dict[str, Any] = {}

    # ------------------------------------------------------------------ public
    @property
    def onebit_optimizer(self) -> OnebitOptimizer | None:
        """The 1-bit optimizer in use (after ``setup``)."""
        return self._onebit

    @property
    def allreduce_switch(self) -> Any:
        """The ``SwitchableAllreduceState`` of DDP's comm hook (``enabled``, bucket counters)."""
        return self._switch

    @property
    def timeout_s(self) -> float:
        """The process-group collective timeout in seconds."""
        return self._timeout_s

    def comm_summary(self) -> dict[str, Any]:
        """Totals of this fit, per rank: bytes sent by the 1-bit path (DDP's switchable allreduce
        plus the optimizer's own collectives) and what DDP's fp32 ring allreduce would have sent."""
        t = self.comm_totals
        return {
            **t,
            "compression_ratio": t["fp32_bytes"] / t["bytes_sent"] if t["bytes_sent"] else None,
            "world_size": self.world_size,
            "optimizer": type(self._onebit).__name__ if self._onebit is not None else None,
        }

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: Any) -> None:
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                f"{type(self).__name__}: fp16 loss scaling (precision='16-mixed') decides on every rank alone "
                "whether to skip a step, but the compression stage needs all ranks to step together; use "
                "precision='bf16-mixed' or '32-true'"
            )
        fitting = trainer.state.fn == "fit"
        if fitting and self._telemetry:
            if not any(isinstance(cb, self.telemetry_callback_class) for cb in trainer.callbacks):
                trainer.callbacks.append(self.telemetry_callback_class())
        super().setup(trainer)
        if fitting:
            self._comm_before = comm_stats().copy()
            self.comm_totals = dict.fromkeys(self.comm_totals, 0)
            self.comm_last_step = {}

    def _register_ddp_hooks(self) -> None:
        # DDPStrategy registers comm hooks on CUDA only; this one works on every backend.
        self._switch = register_switchable_allreduce(self.model, group=None, enabled=True)

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"{type(self).__name__} needs exactly one optimizer from configure_optimizers, got {len(self.optimizers)}"
            )
        old = self.optimizers[0]
        new = self._adopt(old)
        if new is not old:
            retarget_schedulers([config.scheduler for config in self.lr_scheduler_configs], old, new)
            self.optimizers = [new]
        self._onebit = new
        self._trained_numel = sum(p.numel() for p in self.model.parameters() if p.requires_grad)

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
        ignored = {k: v for k, v in self._knobs.items() if getattr(optimizer, k, v) != v}
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

    # ------------------------------------------------------------------ every step
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self._switch is not None and self._onebit is not None:
            self._switch.enabled = self._onebit.needs_averaged_grads
        super().pre_backward(closure_loss)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        local = self._onebit is not None and not self._onebit.needs_averaged_grads
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        now = comm_stats()
        sent = (now - self._comm_before).bytes_sent
        self._comm_before = now.copy()
        fp32 = ring_allreduce_bytes(self._trained_numel, self.world_size)
        self.comm_last_step = {"bytes_sent": sent, "fp32_bytes": fp32, "ddp_allreduce": not local}
        totals = self.comm_totals
        totals["steps"] += 1
        totals["steps_without_ddp_allreduce"] += int(local)
        totals["bytes_sent"] += sent
        totals["fp32_bytes"] += fp32
        return output

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

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Rank 0 writes the checkpoint (with its own 1-bit state); every other rank writes its
        error buffers (and, between ZeroOneAdam synchronisations, its whole optimizer state and
        params) to ``<filepath>.rank<r>.pt``."""
        states = checkpoint.get("optimizer_states")
        if states and self._onebit is not None:
            per_rank = not self._onebit.params_synchronized
            world, rank = self.world_size, self.global_rank
            checkpoint[CHECKPOINT_KEY] = {"format": 1, "world_size": world, "per_rank_params": per_rank}
            if world > 1 and rank != 0:
                payload = {
                    "format": 1,
                    "rank": rank,
                    "world_size": world,
                    "optimizer_states": [s if per_rank else {"onebit": s.get("onebit")} for s in states],
                    "state_dict": checkpoint.get("state_dict") if per_rank else None,
                }
                self.checkpoint_io.save_checkpoint(payload, rank_file(filepath, rank), storage_options=storage_options)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.world_size > 1 and self.global_rank != 0:
            self.checkpoint_io.remove_checkpoint(rank_file(filepath, self.global_rank))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._per_rank_model_state = None
        meta, states = checkpoint.get(CHECKPOINT_KEY), checkpoint.get("optimizer_states")
        if not isinstance(meta, dict) or not states:
            return checkpoint
        name, world, rank = type(self).__name__, self.world_size, self.global_rank
        if meta["world_size"] != world:
            dropped = _drop_error_buffers(states)
            if rank == 0 and (dropped or meta.get("per_rank_params")):
                extra = (" It was saved between two ZeroOneAdam synchronisations: every rank continues from rank 0's "
                         "params and momentum." if meta.get("per_rank_params") else "")
                warnings.warn(
                    f"{name}: the checkpoint was saved on {meta['world_size']} ranks and training resumes on {world}; "
                    "the compression error buffers are re-initialised to zero (moments, step counters and the "
                    f"frozen variance carry over).{extra}",
                    UserWarning,
                    stacklevel=2,
                )
            return checkpoint
        if rank == 0:
            return checkpoint
        path = rank_file(checkpoint_path, rank)
        try:
            payload = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        except FileNotFoundError:
            payload = None
        if not payload or payload.get("rank") != rank or payload.get("world_size") != world:
            _drop_error_buffers(states)
            warnings.warn(
                f"[rank {rank}] {name}: {path} is missing or belongs to another rank; this rank's compression error "
                "buffers are re-initialised to zero",
                UserWarning,
                stacklevel=2,
            )
            return checkpoint
        for i, entry in enumerate(payload["optimizer_states"][: len(states)]):
            if "state" in entry:  # the whole per-rank optimizer state (ZeroOneAdam between syncs)
                states[i] = entry
            else:
                states[i] = {**states[i], "onebit": entry["onebit"]}
        if payload.get("state_dict") is not None:
            checkpoint["state_dict"] = payload["state_dict"]
            self._per_rank_model_state = payload["state_dict"]
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._per_rank_model_state is not None:
            # DDP broadcast rank 0's params when it wrapped the model; this rank's own come back now.
            self.lightning_module.load_state_dict(self._per_rank_model_state)
            self._per_rank_model_state = None

    # ------------------------------------------------------------------ failures
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if not _is_comm_failure(exception):
            return
        first = (str(exception).strip().splitlines() or [""])[0][:300]
        print(
            f"[rank {self.global_rank}] {type(self).__name__}: a collective failed ({type(exception).__name__}: "
            f"{first}). Another rank has probably died or hung; collectives give up after the process-group "
            f"timeout of {self._timeout_s:.0f}s (strategy argument `timeout`). Stopping this rank.",
            file=sys.stderr,
            flush=True,
        )
        launcher = self.launcher
        if launcher is not None and getattr(launcher, "procs", None):
            launcher.kill(getattr(signal, "SIGKILL", signal.SIGTERM))  # the local ranks this process started


class _OnebitAdamMixin(_OnebitStrategyMixin):
    """DDP + 1-bit Adam: DDP's fp32 allreduce for ``freeze_step`` warmup steps, then only the
    optimizer's 1-bit momentum allreduce.

    Args:
        freeze_step: warmup steps (``OnebitAdam``'s default, 100000, when None).
        timeout: collective timeout in seconds (or a ``timedelta``).
        telemetry: log ``comm/*`` metrics per step (adds :class:`CommTelemetry`).
        **kwargs: ``DDPStrategy`` arguments.
    """

    optimizer_class = OnebitAdam

    def __init__(self, freeze_step: int | None = None, **kwargs: Any) -> None:
        super().__init__(knobs={"freeze_step": freeze_step}, **kwargs)


class _ZeroOneAdamMixin(_OnebitStrategyMixin):
    """DDP + 0/1 Adam: DDP's fp32 allreduce only on the variance-update steps; 1-bit gradients,
    then local steps with 1-bit synchronisation, otherwise. Between synchronisations the ranks'
    params differ (validation scores each rank's own; checkpoints keep each rank's params).

    Args:
        var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper:
            ``ZeroOneAdam``'s (its defaults when None).
        timeout, telemetry, **kwargs: as :class:`OnebitAdamStrategy`.
    """

    optimizer_class = ZeroOneAdam

    def __init__(
        self,
        var_freeze_step: int | None = None,
        var_update_scaler: int | None = None,
        local_step_scaler: int | None = None,
        local_step_clipper: int | None = None,
        **kwargs: Any,
    ) -> None:
        knobs = dict(var_freeze_step=var_freeze_step, var_update_scaler=var_update_scaler,
                     local_step_scaler=local_step_scaler, local_step_clipper=local_step_clipper)
        super().__init__(knobs=knobs, **kwargs)


class _OnebitLambMixin(_OnebitStrategyMixin):
    """DDP + 1-bit LAMB: DDP's fp32 allreduce for ``freeze_step`` warmup steps, then only the
    optimizer's 1-bit momentum allreduce. Converts ``lightning_optim.Lamb``/``FusedLamb``.

    Args:
        freeze_step, coeff_beta, factor_max, factor_min, factor_threshold: ``OnebitLamb``'s
            (its defaults when None).
        timeout, telemetry, **kwargs: as :class:`OnebitAdamStrategy`.
    """

    optimizer_class = OnebitLamb

    def __init__(
        self,
        freeze_step: int | None = None,
        coeff_beta: float | None = None,
        factor_max: float | None = None,
        factor_min: float | None = None,
        factor_threshold: float | None = None,
        **kwargs: Any,
    ) -> None:
        knobs = dict(freeze_step=freeze_step, coeff_beta=coeff_beta, factor_max=factor_max,
                     factor_min=factor_min, factor_threshold=factor_threshold)
        super().__init__(knobs=knobs, **kwargs)


class _CommTelemetryMixin:
    """Logs, after every optimizer step: ``comm/bytes_sent`` (this rank, this step),
    ``comm/fp32_bytes`` (what DDP's fp32 ring allreduce of the trained params sends per step),
    ``comm/compression_ratio`` (their ratio, on steps that sent anything) and
    ``comm/compression_ratio_total`` (since the start of the fit)."""

    def __init__(self) -> None:
        super().__init__()
        self._seen_steps = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._seen_steps = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        totals = getattr(strategy, "comm_totals", None)
        if not totals or totals["steps"] == self._seen_steps:
            return
        self._seen_steps = totals["steps"]
        last = strategy.comm_last_step
        metrics = {"comm/bytes_sent": float(last["bytes_sent"]), "comm/fp32_bytes": float(last["fp32_bytes"])}
        if last["bytes_sent"]:
            metrics["comm/compression_ratio"] = last["fp32_bytes"] / last["bytes_sent"]
        if totals["bytes_sent"]:
            metrics["comm/compression_ratio_total"] = totals["fp32_bytes"] / totals["bytes_sent"]
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, logger=True, batch_size=1)
