"""Gradient release for Hugging Face Accelerate: one call after ``accelerator.prepare``.

    model, optimizer, loader = accelerator.prepare(model, lightning_optim.AdamW(model.parameters()), loader)
    release = accel_plugins.enable_gradient_release(accelerator, model, optimizer)
    # the loop stays as it is; optimizer.step() and zero_grad() become no-ops

The work is :func:`lightning_optim.prepare_for_gradient_release`: one process steps each param in a
post-accumulate hook and frees its gradient at once (peak memory drops by about the gradients'
size); under DDP each bucket is stepped inside DDP's comm hook right after it is averaged (the step
overlaps the rest of backward; results equal DDP + a step after backward).

``accelerator.accumulate``: under DDP Accelerate's ``no_sync`` keeps the micro-batch gradients and
the synced backward steps on their average (exactly DDP's accumulation); in one process the
non-final micro-batches go into the optimizer states (``optimizer_accumulation``, optimi's
approximation: the gradients are freed as they come).

Refused, with the conflict named: ``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` (raise when
called: no moment ever holds all gradients), ``mixed_precision="fp16"`` and master weights (they
check every gradient for overflow before any step), the 1-bit optimizers, DeepSpeed/FSDP,
optimizers that are not lightning-optim's, a DDP model that already has a comm hook.
"""

from __future__ import annotations

from typing import Any, NoReturn

from torch import nn

from accel_plugins._accelerator import (
    AcceleratorMethods,
    check_accelerator,
    check_ddp_ground,
    check_model,
    check_owned_params,
    unwrap_optimizer,
)
from accel_plugins.master_weights import MasterWeightsHandle, refuse_grad_scaler
from lightning_optim.optim.base import BaseOptimizer
from lightning_optim.optim.release import prepare_for_gradient_release, remove_gradient_release

__all__ = ["GradientReleaseHandle", "enable_gradient_release"]


class GradientReleaseHandle:
    """What :func:`enable_gradient_release` set up; :meth:`close` undoes it."""

    def __init__(self, accelerator: Any, model: nn.Module, optimizer: BaseOptimizer) -> None:
        check_accelerator(accelerator)
        check_model(model)
        if not isinstance(optimizer, BaseOptimizer):
            raise TypeError(f"optimizer: expected the unwrapped lightning_optim optimizer, got "
                            f"{type(optimizer).__name__}")
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self._methods = AcceleratorMethods(accelerator)
        self._hooks: list = []

    @staticmethod
    def _refuse_clipping(*args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError("clip_grad_norm_ / clip_grad_value_: gradient release steps and frees each gradient during "
                         "backward, so no moment holds all of them to clip; remove the clipping or call "
                         "release.close() to train without release")

    def _accumulate_until_sync(self, module: nn.Module, args: Any) -> None:
        self.optimizer.optimizer_accumulation = not self.accelerator.sync_gradients

    def close(self) -> None:
        """Back to plain stepping: hooks removed, clipping and ``optimizer.step()`` work again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        remove_gradient_release(self.model)
        self.optimizer.optimizer_accumulation = False
        self._methods.restore()


def enable_gradient_release(accelerator: Any, model: nn.Module, optimizer: Any) -> GradientReleaseHandle:
    """Step every param during backward (see the module doc).

    Args:
        accelerator: the ``Accelerator`` that prepared ``model`` and ``optimizer``.
        model: the prepared model (a DDP model on several ranks).
        optimizer: the prepared lightning-optim optimizer (not a 1-bit one).
    """
    caller = "enable_gradient_release"
    check_accelerator(accelerator)
    check_model(model)
    inner = unwrap_optimizer(optimizer)
    if not isinstance(inner, BaseOptimizer):
        raise TypeError(f"optimizer: gradient release needs a lightning_optim optimizer (e.g. lightning_optim.AdamW), "
                        f"got {type(inner).__name__}")
    if isinstance(getattr(accelerator, "scaler", None), MasterWeightsHandle):
        raise ValueError(f"{caller}: master weights step after checking every gradient for overflow; gradient "
                         "release steps during backward. Use one of them (bf16 params + Kahan summation go with "
                         "release)")
    refuse_grad_scaler(caller, accelerator, "unscales and checks every gradient before any step")
    size = check_ddp_ground(caller, accelerator, model)
    check_owned_params(inner, model)
    handle = GradientReleaseHandle(accelerator, model, inner)
    try:
        prepare_for_gradient_release(model, inner)  # validates the optimizer and the model before any change
    except RuntimeError as exc:
        if "comm hook" in str(exc) or "register_comm_hook" in str(exc):
            raise ValueError("model: its DDP already has a comm hook (DistributedDataParallelKwargs(comm_hook=...) "
                             "or your own); gradient release steps inside its own hook: remove the other one") from exc
        raise
    handle._methods.replace("clip_grad_norm_", handle._refuse_clipping)
    handle._methods.replace("clip_grad_value_", handle._refuse_clipping)
    if size == 1 and getattr(accelerator, "gradient_accumulation_steps", 1) > 1:
        handle._hooks.append(model.register_forward_pre_hook(handle._accumulate_until_sync))
    return handle
