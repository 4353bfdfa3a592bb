"""torchrun script: DDP(gradient_as_bucket_view=True) over a model flattened with ``grads=False``, trained
with lightning_optim.AdamW, next to the same model unflattened; saves both results as out/rank<r>.pt.

    python -m torch.distributed.run --nproc_per_node 2 tests/optim/flat_params_ddp.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lightning_optim


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def train(flatten: bool, rank: int) -> dict:
    net = model()
    if flatten:
        lightning_optim.flatten_parameters(net, grads=False)
    ddp = DDP(net, gradient_as_bucket_view=True, bucket_cap_mb=0.001)  # several buckets
    opt = lightning_optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):
        x = torch.randn(8, 12, generator=gen)
        y = torch.randint(0, 3, (8,), generator=gen)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    storages = {p.untyped_storage().data_ptr() for p in net.parameters()}
    return {"params": [p.detach().clone() for p in net.parameters()], "storages": len(storages)}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"plain": train(False, rank), "flat": train(True, rank)}
    torch.save(result, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
