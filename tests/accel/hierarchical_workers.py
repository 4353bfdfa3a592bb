"""Rank side of test_hierarchical.py: enable_onebit with a hierarchical 1-bit optimizer on 4 gloo ranks (2 nodes
of 2), and the same steps with the optimizer averaging by itself (no Accelerate, no DDP)."""
from __future__ import annotations

import torch
from torch import nn

STEPS, FREEZE = 7, 3


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 512), nn.Tanh(), nn.Linear(512, 3))


def accelerate_run(rank: int, world: int) -> dict:
    import os

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import accel_plugins
    from lightning_optim.comm import comm_stats

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % 2), MASTER_ADDR="127.0.0.1")
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    model = _model()
    optimizer = accel_plugins.to_onebit_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "onebit_adam",
                                                  freeze_step=FREEZE, hierarchical=2)
    model, optimizer = accelerator.prepare(model, optimizer)
    handle = accel_plugins.enable_onebit(accelerator, model, optimizer)
    steps = []
    for step in range(1, STEPS + 1):
        before = comm_stats().copy()
        x, y = _batch(step, rank)
        optimizer.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        delta = comm_stats() - before
        steps.append({"intra": delta.intra_node_bytes, "inter": delta.inter_node_bytes,
                      "ddp": handle.switch.buckets_reduced})
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return {"params": params, "steps": steps}


def plain_run(rank: int, world: int) -> list[torch.Tensor]:
    from lightning_optim import OnebitAdam

    model = _model()
    optimizer = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, hierarchical=2, betas=(0.9, 0.999),
                           weight_decay=0.01)
    for step in range(1, STEPS + 1):
        x, y = _batch(step, rank)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]
