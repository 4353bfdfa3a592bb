"""Rank side of the enable_onebit refusal tests (inside run_workers' gloo group)."""

from __future__ import annotations

import os

import torch
from torch import nn


def new_accelerator(rank: int, world: int, **kwargs):
    """An Accelerator set up for this call alone: Accelerate keeps its state in class-level singletons, and a
    rank process reused from an earlier call (the harness's pool) would otherwise keep that call's
    distributed type (``Accelerator()`` without ``cpu=True`` leaves it at NO)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(**kwargs)


def _setup(rank: int, world: int, **kwargs):
    import accel_plugins

    accelerator = new_accelerator(rank, world, **kwargs)
    model = nn.Linear(4, 2)
    optimizer = accel_plugins.to_onebit_optimizer(torch.optim.AdamW(model.parameters()), "onebit_adam", freeze_step=2)
    return accelerator, model, optimizer


def single_process_trap(rank: int, world: int) -> str:
    """A gloo group of 2 exists, but Accelerator() without cpu=True stays single-process on a CPU torch."""
    import accel_plugins

    accelerator, model, optimizer = _setup(rank, world)
    model, optimizer = accelerator.prepare(model, optimizer)
    try:
        accel_plugins.enable_onebit(accelerator, model, optimizer)
    except RuntimeError as exc:
        return str(exc)
    return f"accepted (num_processes={accelerator.num_processes})"


def foreign_comm_hook(rank: int, world: int) -> str:
    import accel_plugins
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    accelerator, model, optimizer = _setup(rank, world, cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    try:
        accel_plugins.enable_onebit(accelerator, model, optimizer)
    except ValueError as exc:
        return str(exc)
    return "accepted"
