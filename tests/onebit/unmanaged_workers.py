"""A 1-bit optimizer in a DDP model whose allreduce nobody switches: one warning at the first compressed step,
and comm_stats() stops claiming a compression ratio (DDP's own allreduce is invisible to it)."""

from __future__ import annotations

import torch
from torch import nn

import lightning_optim as lo
from lightning_optim.comm import comm_stats
from tests.ranks import record_warnings


def unmanaged(rank: int, world: int, managed: bool) -> tuple[list[str], int, float]:
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    opt = lo.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2, average_grads=False)
    opt.ddp_allreduce_managed = managed
    with record_warnings() as caught:
        for step in range(5):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    stats = comm_stats()
    return ([str(w.message) for w in caught if "nothing switches DDP" in str(w.message)], stats.unmanaged_steps,
            stats.compression_ratio)
