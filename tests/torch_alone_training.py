"""Run by tests/test_packaging.py inside an environment that holds torch and the installed wheel only.

``python torch_alone_training.py single``: AdamW against torch.optim.AdamW, the adapters' ImportErrors.
``torchrun --nproc_per_node 2 torch_alone_training.py ranks``: OnebitAdam past its freeze step and DiLoCo past
a sync on two gloo ranks. Each reports what it saw as JSON (stdout; report_rank<r>.json)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import lightning_optim
from lightning_optim.comm import comm_stats

FRAMEWORKS = ("lightning", "pytorch_lightning", "hydra", "omegaconf", "matplotlib", "transformers", "accelerate")
# what `import lightning_optim` itself brought in: nothing heavy (torch._dynamo costs seconds per process)
HEAVY_AFTER_IMPORT = [m for m in (*FRAMEWORKS, "torch._dynamo", "numpy") if m in sys.modules]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def single() -> dict:
    ours, theirs = _model(0), _model(0)
    opt_ours = lightning_optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(30):
        x, y = _batch(step, 0)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(loss.item())
    gap = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    refusals = {}
    for target in ("lightning_optim.lightning", "accel_plugins", "lightning_optim.train",
                   "lightning_optim.data:ByteDataModule", "lightning_optim:OnebitAdamStrategy"):
        module, _, name = target.partition(":")
        try:
            imported = importlib.import_module(module)
            if name:
                getattr(imported, name)
            refusals[target] = None
        except ImportError as error:
            refusals[target] = str(error)
    return {"heavy_after_import": HEAVY_AFTER_IMPORT, "max_gap_to_torch": gap, "first_loss": losses[0], "last_loss": losses[-1], "refusals": refusals,
            "frameworks_imported": [m for m in FRAMEWORKS if m in sys.modules]}


def _spread(model: torch.nn.Module) -> float:
    """The largest difference of any parameter between the ranks (0 when they hold the same model)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """Each rank its own batches; the optimizer does all the communication (no DDP)."""
    rank, losses = dist.get_rank(), []
    for step in range(steps):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def ranks() -> dict:
    dist.init_process_group("gloo")
    model = _model(0)
    onebit = lightning_optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3)
    before = comm_stats().compressed_calls
    onebit_losses = _train(model, onebit, steps=8)
    onebit_compressed = comm_stats().compressed_calls - before
    onebit_spread = _spread(model)

    model = _model(1)
    diloco = lightning_optim.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=3)
    bytes_before = comm_stats().bytes_sent
    diloco_losses = _train(model, diloco, steps=6)  # syncs after steps 3 and 6
    out = {"rank": dist.get_rank(), "onebit_compressed_calls": onebit_compressed, "onebit_spread": onebit_spread,
           "onebit_losses": onebit_losses, "diloco_bytes": comm_stats().bytes_sent - bytes_before,
           "diloco_spread": _spread(model), "diloco_losses": diloco_losses,
           "frameworks_imported": [m for m in FRAMEWORKS if m in sys.modules]}
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    if sys.argv[1] == "single":
        print(json.dumps(single()), flush=True)
    else:  # one file per rank: torchrun's ranks share one stdout and their lines may interleave
        report = ranks()
        Path(f"report_rank{report['rank']}.json").write_text(json.dumps(report))
