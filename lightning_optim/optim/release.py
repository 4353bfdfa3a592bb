"""Gradient release: run each parameter's update inside backward, then free its gradient.

Only one layer's gradients are alive at a time (Pudipeddi et al., arXiv 2002.05645). The hook
looks the param group up at call time, so LR schedulers keep driving the update, also after
``optimizer.load_state_dict`` (which replaces the group dicts). ``step()`` and ``zero_grad()``
become no-ops, so training loops that call them keep working.

Under DDP pass the ``DistributedDataParallel`` model: the update then runs in DDP's comm hook,
after each bucket is averaged (:mod:`lightning_optim.comm.ddp_hooks.release`, which extends
:func:`release_handles` for DDP models). A plain module's
post-accumulate hooks see the local, un-averaged gradient, so with more than one rank they refuse
to step. That check holds whenever a hook fires, not only when the hooks are registered: hooks
prepared before the process group existed (e.g. before ``Accelerator()``) and then run under a
world size > 1 raise before stepping anything.

Limits: anything that needs all gradients at once after backward (global-norm clipping,
GradScaler unscaling, gradient accumulation across backward calls) does not see the gradients;
use ``optimizer_accumulation`` to accumulate instead.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from lightning_optim.optim.base import BaseOptimizer

_HANDLES_ATTR = "_lightning_optim_release"


def _refuse_distributed() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            raise RuntimeError(
                f"gradient release on a plain module is single-process: with {world} ranks its hooks would "
                "step un-averaged local gradients and the ranks would drift apart. Wrap the model in "
                "DistributedDataParallel first and pass the DDP model to prepare_for_gradient_release "
                "(remove_gradient_release undoes this preparation)"
            )


def prepare_for_gradient_release(model: nn.Module, optimizer: BaseOptimizer) -> None:
    """Register per-parameter post-accumulate-grad hooks that step ``optimizer`` (a DDP model: its
    comm hook steps each averaged bucket instead, see :mod:`~lightning_optim.comm.ddp_hooks.release`).

    Every parameter of ``optimizer`` must belong to ``model``.
    """
    if not isinstance(optimizer, BaseOptimizer):
        raise TypeError(
            f"optimizer: gradient release needs a lightning_optim optimizer, got {type(optimizer).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    blocker = optimizer._release_blocker()
    if blocker is not None:
        raise ValueError(f"optimizer: gradient release is not possible: {blocker}")
    if getattr(model, _HANDLES_ATTR, None) is not None:
        raise RuntimeError("model: gradient release is already prepared; call remove_gradient_release first")
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        _refuse_distributed()
    model_params = {id(p) for p in model.parameters()}
    opt_params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    missing = [i for i, p in enumerate(opt_params) if id(p) not in model_params]
    if missing:
        raise ValueError(f"model: {len(missing)} optimizer parameters are not parameters of the model")
    handles = release_handles(model, optimizer, opt_params)
    setattr(model, _HANDLES_ATTR, (handles, optimizer))
    optimizer._released = True


def remove_gradient_release(model: nn.Module) -> None:
    """Remove the hooks; the optimizer goes back to normal ``step()``/``zero_grad()``."""
    prepared = getattr(model, _HANDLES_ATTR, None)
    if prepared is None:
        return
    handles, optimizer = prepared
    for handle in handles:
        handle.remove()
    optimizer._released = False
    delattr(model, _HANDLES_ATTR)


@functools.singledispatch
def release_handles(model: nn.Module, optimizer: BaseOptimizer, params: list[Tensor]) -> list[Any]:
    """Make ``model``'s backward step ``optimizer``; returns handles with ``remove()``. A plain module:
    per-parameter post-accumulate-grad hooks, one process only. A DDP model's variant (its comm hook
    steps each averaged bucket) is registered by ``comm/ddp_hooks/release.py``."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise RuntimeError("gradient release under DDP needs lightning_optim.comm.ddp_hooks.release (not imported)")

    def hook(p: Tensor) -> None:
        _refuse_distributed()  # the process group may have appeared after the hooks were registered
        optimizer.step_param(p)
        p.grad = None

    return [p.register_post_accumulate_grad_hook(hook) for p in params]
