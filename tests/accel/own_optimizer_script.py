"""Run by torchrun (2 CPU ranks): ``enable_onebit`` with the user's own 1-bit optimizer, for each class.

    python -m torch.distributed.run --nproc_per_node 2 own_optimizer_script.py OUT

For OnebitAdam, ZeroOneAdam and OnebitLamb, two runs of STEPS steps each (past the freeze step), from the
same initial model and per-rank data, under ``Accelerator(cpu=True)``:

* ``own``: ``Class(model.parameters(), lr=..., freeze)`` (``average_grads=True``, the classes' default)
  -> ``accelerator.prepare`` -> ``enable_onebit``;
* ``converted``: ``to_onebit_optimizer(source, name, freeze)`` -> prepare -> ``enable_onebit`` (the
  documented route, ``average_grads=False`` from the start);

and ``refused``: the own optimizer steps once before ``enable_onebit``. Each rank writes OUT/rank<r>.pt.
"""

import gc
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

import accel_plugins
import lightning_optim
from lightning_optim.comm import comm_stats

STEPS, FREEZE, LR = 8, 3, 1e-2
# name: (class, its freeze argument, the source optimizer to_onebit_optimizer converts, with the same values)
CASES = {
    "onebit_adam": (lightning_optim.OnebitAdam, {"freeze_step": FREEZE},
                    lambda params: torch.optim.Adam(params, lr=LR, eps=1e-8)),
    "zero_one_adam": (lightning_optim.ZeroOneAdam, {"var_freeze_step": FREEZE},
                      lambda params: torch.optim.Adam(params, lr=LR, eps=1e-8)),
    "onebit_lamb": (lightning_optim.OnebitLamb, {"freeze_step": FREEZE},
                    lambda params: lightning_optim.Lamb(params, lr=LR, eps=1e-8, use_nvlamb=True)),
}


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data: local grads differ
    return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def train(name: str, route: str, rank: int) -> dict:
    cls, freeze, source = CASES[name]
    accelerator = Accelerator(cpu=True)
    model = build_model()
    if route == "own":
        optimizer = cls(model.parameters(), lr=LR, eps=1e-8, **freeze)
    else:
        optimizer = accel_plugins.to_onebit_optimizer(source(model.parameters()), name, **freeze)
    built = {"average_grads": optimizer.average_grads, "hyper_parameters": hyper_parameters(optimizer)}
    model, prepared = accelerator.prepare(model, optimizer)
    handle = accel_plugins.enable_onebit(accelerator, model, prepared)
    rows = []
    for step in range(STEPS):
        before = comm_stats().bytes_sent
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        prepared.step()
        prepared.zero_grad()
        rows.append({"bytes": comm_stats().bytes_sent - before, "ddp_allreduce": handle.switch.enabled,
                     "loss": loss.item()})
    result = {**built, "average_grads_after": optimizer.average_grads, "rows": rows, "summary": handle.summary(),
              "params": [p.detach().clone() for p in model.parameters()], "global_step": optimizer.global_step,
              "numel": sum(p.numel() for p in model.parameters())}
    handle.close()  # free the DDP model and the optimizer while the process group exists
    accelerator.free_memory()
    del model, prepared, optimizer, handle
    gc.collect()
    return result


def refused(name: str, rank: int) -> dict:
    """The own optimizer steps once (averaging its grads itself), then enable_onebit: refused, nothing changed."""
    cls, freeze, _ = CASES[name]
    accelerator = Accelerator(cpu=True)
    model = build_model()
    optimizer = cls(model.parameters(), lr=LR, **freeze)
    model, prepared = accelerator.prepare(model, optimizer)
    x, y = batch(0, rank)
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    prepared.step()
    try:
        accel_plugins.enable_onebit(accelerator, model, prepared)
        message = "no error"
    except ValueError as exc:
        message = f"ValueError: {exc}"
    result = {"message": message, "average_grads": optimizer.average_grads, "managed": optimizer.ddp_allreduce_managed,
              "comm_hooks": len(model._comm_hooks), "clip_replaced": "clip_grad_norm_" in vars(accelerator)}
    accelerator.free_memory()
    del model, prepared, optimizer
    gc.collect()
    return result


out = Path(sys.argv[1])
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
results = {"world": accelerator.num_processes}
for case in CASES:
    results[case] = {route: train(case, route, rank) for route in ("own", "converted")}
    results[case]["refused"] = refused(case, rank)
torch.save(results, out / f"rank{rank}.pt")
accelerator.wait_for_everyone()
accelerator.end_training()  # destroys the process group: exiting with a live gloo group can abort at teardown
