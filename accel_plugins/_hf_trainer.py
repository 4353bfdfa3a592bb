"""The HF Trainer methods that run lightning-optim's 1-bit optimizers right under DDP, written once:
``accel_plugins.hf.Trainer`` has them, and ``accel_plugins.hf.register()`` puts these same functions on the
stock ``transformers.Trainer`` (its subclasses included), so both do exactly the same:

- ``__init__``: HF's, then a callback that calls ``enable_onebit`` on the DDP model at ``on_train_begin``
  (``model_wrapped`` is the DDP model by then): DDP's fp32 allreduce is off in the compression stage; the same
  callback installs a :class:`~accel_plugins.hf.DiLoCoCallback` given in ``callbacks`` (``_hf_diloco.py``);
- ``_save_optimizer_and_scheduler``: HF's (rank 0 writes ``optimizer.pt``), then every rank writes its own
  error-feedback state, ``onebit_rank<r>.pt`` (DiLoCo: its state and params, ``diloco_rank<r>.pt``);
- ``_load_optimizer_and_scheduler``: HF's (every rank loads rank 0's ``optimizer.pt``), then this rank's file
  (DiLoCo's: once it is installed, at ``on_train_begin``);
- ``log``: ``comm/bytes_sent`` and ``comm/compression_ratio`` since the last log, then HF's;
- ``onebit_optimizer``: the 1-bit optimizer being trained, or ``None``.

Each of them does nothing more than HF's method for an optimizer that is not 1-bit. They call HF's own
methods as this module found them at import (before ``register()`` could replace them), so a class that has
them and derives from the patched ``transformers.Trainer`` runs each addition once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import transformers

from accel_plugins._hf_diloco import diloco_callback
from accel_plugins.accelerate import enable_onebit, load_rank_state, save_rank_state
from lightning_optim.comm import comm_stats
from lightning_optim.onebit import OnebitOptimizer

__all__ = ["TRAINER_METHODS", "HF_METHODS", "onebit_optimizer"]

_WRAPPED = ("__init__", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "log")
# HF's own methods, taken once: None where a transformers release lacks one (register() refuses then)
HF_METHODS: dict[str, Callable[..., Any] | None] = {name: vars(transformers.Trainer).get(name) for name in _WRAPPED}


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def onebit_optimizer(trainer: Any) -> OnebitOptimizer | None:
    """The trainer's 1-bit optimizer (unwrapped from Accelerate's), or ``None``."""
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return opt if isinstance(opt, OnebitOptimizer) else None


class _OnebitSetup(transformers.TrainerCallback):
    """Registers the DDP switch on the wrapped model before the first step (or installs a DiLoCoCallback)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        diloco = diloco_callback(trainer)
        if diloco is not None:  # after HF's own callbacks' on_train_begin: the optimizer is prepared by now
            diloco.setup(trainer)
        optimizer = onebit_optimizer(trainer)
        if optimizer is not None and state.max_steps > 0 and hasattr(optimizer, "limit_auto_freeze"):
            optimizer.limit_auto_freeze(state.max_steps)  # freeze_step="auto": at most 15% of the run
        if optimizer is not None and _world() > 1 and trainer._onebit_handle is None:
            trainer._onebit_handle = enable_onebit(trainer.accelerator, trainer.model_wrapped, trainer.optimizer)


def _hf(name: str) -> Callable[..., Any]:
    """HF's method ``name``, which register() made sure exists before installing the wrappers that call it."""
    original = HF_METHODS[name]
    if original is None:
        raise RuntimeError(f"transformers.Trainer.{name} is missing: register() refuses this transformers release")
    return original


def _calls(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Name, doc and ``__wrapped__`` of HF's method ``name``: ``inspect.signature`` sees HF's signature
    (code that inspects ``Trainer.__init__``, as ``register()`` does, keeps working)."""
    original = HF_METHODS[name]
    if original is None:
        return lambda function: function
    return functools.wraps(original, assigned=("__name__", "__doc__"))


@_calls("__init__")
def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    _hf("__init__")(self, *args, **kwargs)
    self._onebit_handle = None  # set at on_train_begin under DDP (an accel_plugins.accelerate.OnebitHandle)
    self._comm_at_last_log = (0, 0)
    self.add_callback(_OnebitSetup(self))


@_calls("_save_optimizer_and_scheduler")
def _save_optimizer_and_scheduler(self: Any, output_dir: str) -> None:
    _hf("_save_optimizer_and_scheduler")(self, output_dir)
    optimizer = onebit_optimizer(self)
    if optimizer is not None and _world() > 1:
        save_rank_state(optimizer, self.model_wrapped, output_dir)
    diloco = diloco_callback(self)
    if diloco is not None:
        diloco.save(self, output_dir)


@_calls("_load_optimizer_and_scheduler")
def _load_optimizer_and_scheduler(self: Any, checkpoint: str | None) -> None:
    _hf("_load_optimizer_and_scheduler")(self, checkpoint)
    optimizer = onebit_optimizer(self)
    if checkpoint is not None and optimizer is not None and _world() > 1:
        load_rank_state(optimizer, self.model_wrapped, checkpoint)
    diloco = diloco_callback(self)
    if checkpoint is not None and diloco is not None:
        diloco.resume_from(checkpoint)


@_calls("log")
def _log(self: Any, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
    if onebit_optimizer(self) is not None and "loss" in logs:
        stats = comm_stats()
        last_sent, last_fp32 = getattr(self, "_comm_at_last_log", (0, 0))
        sent, fp32 = stats.bytes_sent - last_sent, stats.fp32_equivalent_bytes - last_fp32
        self._comm_at_last_log = (stats.bytes_sent, stats.fp32_equivalent_bytes)
        logs["comm/bytes_sent"] = float(sent)
        if sent:
            logs["comm/compression_ratio"] = fp32 / sent
    _hf("log")(self, logs, *args, **kwargs)


TRAINER_METHODS: dict[str, Any] = {
    "__init__": _init,
    "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
    "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
    "log": _log,
    "onebit_optimizer": property(onebit_optimizer, doc=onebit_optimizer.__doc__),
}
