"""``GradientRelease``: Lightning callback for gradient release on one device and under DDPStrategy.

One device: each param is stepped by a post-accumulate hook during backward and its gradient is
freed at once (peak memory drops by about the gradients' size). ``DDPStrategy``: each bucket's
params are stepped inside DDP's comm hook right after the bucket is averaged (the step overlaps
the rest of backward; DDP's bucket buffers persist, so no memory is saved). Both are in
:mod:`lightning_optim.optim.release` / :mod:`~lightning_optim.comm.ddp_hooks.release`; this adapter only
wires them in and refuses what cannot work.

``accumulate_grad_batches > 1``: on one device the non-final micro-batches are accumulated into the
optimizer states (``optimizer_accumulation``, optimi's approximation: the gradients are freed);
under DDP, Lightning's ``no_sync`` keeps the gradients until the synced backward, which steps on
their average: exactly DDP's gradient accumulation. LR schedulers and checkpoints keep working.

Refused, with the conflict named: ``gradient_clip_val > 0`` (no step ever sees all gradients at
once), ``precision="16-mixed"`` and ``MasterWeightsPrecision`` (loss scaling unscales and checks
the whole model before stepping), the 1-bit strategies (they communicate the whole model's momentum
in one step), strategies other than one device and DDP, more than one optimizer, and optimizers
that are not lightning_optim's.

The hooks are removed when training ends (or fails): after ``fit`` the module carries none of them.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import nn

from lightning_optim.optim.base import BaseOptimizer
from lightning_optim.optim.release import prepare_for_gradient_release, remove_gradient_release

__all__ = ["GradientRelease"]


class GradientRelease(Callback):
    """Step every param during backward (see the module doc)."""

    def __init__(self) -> None:
        self._model: nn.Module | None = None
        self._optimizer: BaseOptimizer | None = None
        self._ddp = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        problems = self.conflicts(trainer)
        if problems:
            raise ValueError("GradientRelease: " + "; ".join(problems))

    @staticmethod
    def conflicts(trainer: Any) -> list[str]:
        """What in ``trainer`` cannot run with gradient release ([] when nothing)."""
        from lightning_optim.lightning._base import _OnebitStrategyMixin
        from lightning_optim.lightning.precision import MasterWeightsPrecision

        problems = []
        if trainer.gradient_clip_val:
            problems.append(f"gradient_clip_val={trainer.gradient_clip_val}: clipping needs all gradients after "
                            "backward, but each is stepped and freed during it; set gradient_clip_val=None")
        plugin = trainer.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            problems.append("precision='16-mixed': its GradScaler unscales and checks the whole model before the "
                            "step; use 'bf16-mixed' or 'bf16-true'")
        if isinstance(plugin, MasterWeightsPrecision):
            problems.append("MasterWeightsPrecision steps fp32 masters after checking every gradient for overflow; "
                            "use KahanPrecision (bf16 + Kahan) with gradient release instead")
        strategy = trainer.strategy
        if isinstance(strategy, _OnebitStrategyMixin):
            problems.append(f"strategy {type(strategy).__name__}: the 1-bit optimizers communicate the whole "
                            "model's momentum in one step; use DDPStrategy or one device with gradient release")
        elif not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            problems.append(f"strategy {type(strategy).__name__}: only one device and DDPStrategy are supported")
        return problems

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"GradientRelease: needs exactly one optimizer, got {len(trainer.optimizers)}")
        optimizer = trainer.optimizers[0]
        if not isinstance(optimizer, BaseOptimizer):
            raise TypeError(f"GradientRelease: needs a lightning_optim optimizer (e.g. lightning_optim.AdamW), "
                            f"got {type(optimizer).__name__}")
        model = trainer.strategy.model
        self._ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        try:
            prepare_for_gradient_release(model if self._ddp else pl_module, optimizer)
        except RuntimeError as exc:
            if "register_comm_hook" in str(exc) or "comm hook" in str(exc):
                raise ValueError("GradientRelease: the DDP model already has a comm hook "
                                 "(DDPStrategy(ddp_comm_hook=...)); gradient release steps inside its own hook, "
                                 "remove the other one") from exc
            raise
        self._model, self._optimizer = (model if self._ddp else pl_module), optimizer

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._optimizer is None or self._ddp or trainer.accumulate_grad_batches == 1:
            return
        last = batch_idx + 1 == trainer.num_training_batches
        self._optimizer.optimizer_accumulation = not ((batch_idx + 1) % trainer.accumulate_grad_batches == 0 or last)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._remove()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._remove()  # a failed fit calls neither on_train_end nor teardown

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._remove()

    def _remove(self) -> None:
        """Undo ``on_train_start``: no hook of ours stays on the user's module (its params would step the
        optimizer in any later backward), the optimizer steps normally again."""
        if self._model is not None:
            remove_gradient_release(self._model)
            if self._optimizer is not None and not self._ddp:
                self._optimizer.optimizer_accumulation = False
        self._model = self._optimizer = None
