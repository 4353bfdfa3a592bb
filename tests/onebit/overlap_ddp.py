"""torchrun script: OnebitAdam under DDP with the overlap hook (overlap=True) next to the same run with
the units compressed at step() time (overlap=False), through the stage switch, and a resume from a
compression-stage checkpoint; saves every step's params per run as out/rank<r>.pt.

    python -m torch.distributed.run --nproc_per_node 2 tests/onebit/overlap_ddp.py OUT
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lightning_optim
from lightning_optim.onebit import overlap_with_ddp

STEPS, FREEZE, SAVE_AT = 8, 3, 5


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


def batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def build(overlap: bool, state=None):
    net = model()
    if state is not None:
        net.load_state_dict(state[0])
    ddp = DDP(net, bucket_cap_mb=0.002)  # several buckets
    opt = lightning_optim.OnebitAdam(ddp.parameters(), lr=1e-2, freeze_step=FREEZE, average_grads=False,
                                     weight_decay=0.01)
    if state is not None:
        opt.load_state_dict(state[1])
    return net, ddp, opt, overlap_with_ddp(ddp, opt, overlap=overlap)


def train(rank: int, overlap: bool, first: int, last: int, state=None):
    net, ddp, opt, hook = build(overlap, state)
    trace, saved = [], None
    for step in range(first, last + 1):
        x, y = batch(step, rank)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        trace.append([p.detach().clone() for p in net.parameters()])
        if step == SAVE_AT:
            saved = copy.deepcopy((net.state_dict(), opt.state_dict()))
    hook.close()
    return trace, saved, hook.units_overlapped, len(opt._units(opt._layout))


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    overlapped, saved, overlapped_buckets, units = train(rank, True, 1, STEPS)
    sequential, _, sequential_buckets, _ = train(rank, False, 1, STEPS)
    resumed, _, _, _ = train(rank, True, SAVE_AT + 1, STEPS, saved)
    torch.save({"overlapped": overlapped, "sequential": sequential, "resumed": resumed, "units": units,
                "overlapped_buckets": overlapped_buckets, "sequential_buckets": sequential_buckets}, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
