"""Rank side of tests/accel/test_accelerate_probe.py (inside run_workers' gloo group): on real DDP
models, an adapter call with an optimizer over another model is refused on every rank before it
registers anything, and the valid call that follows then works (a comm hook left behind by the
refused call would make it fail) and trains the ranks identically."""

from __future__ import annotations

import torch
from torch import nn

from tests.accel.refusal_workers import new_accelerator
from tests.distributed import error_text


def _prepared(accelerator, dtype: torch.dtype, make_optimizer):
    torch.manual_seed(0)
    model = nn.Linear(6, 3).to(dtype)
    other = nn.Linear(6, 3).to(dtype)
    model, optimizer = accelerator.prepare(model, make_optimizer(model.parameters()))
    return model, optimizer, make_optimizer(other.parameters())


def _train_step(accelerator, model, optimizer, rank: int, dtype: torch.dtype) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank)).to(dtype)
    accelerator.backward(model(x).float().pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


def refused_then_valid(rank: int, world: int) -> dict:
    from accelerate import Accelerator

    import accel_plugins
    import lightning_optim as lo

    accelerator = new_accelerator(rank, world, cpu=True)
    out: dict = {"kind": str(accelerator.distributed_type)}

    # fp16 master weights on a DDP model
    model, optimizer, foreign = _prepared(accelerator, torch.float16, lambda ps: lo.AdamW(ps, lr=1e-2))
    start = [p.detach().clone() for p in model.parameters()]
    out["masters_refused"] = error_text(lambda: accel_plugins.enable_master_weights(accelerator, model, foreign))
    out["masters_untouched"] = accelerator.scaler is None and "step" not in vars(optimizer)
    accel_plugins.enable_master_weights(accelerator, model, optimizer)
    _train_step(accelerator, model, optimizer, rank, torch.float16)
    out["masters_params"] = [p.detach().clone() for p in model.parameters()]
    out["masters_moved"] = any(not torch.equal(a, b) for a, b in zip(start, model.parameters()))

    # 1-bit communication on a second DDP model, fp32, under its own accelerator (the first one's scaler
    # slot holds the master weights, which its prepared optimizers would step through)
    def onebit_of(params):
        return accel_plugins.to_onebit_optimizer(torch.optim.AdamW(params, lr=1e-2), "onebit_adam", freeze_step=1)

    accelerator = Accelerator(cpu=True)
    model2, optimizer2, foreign2 = _prepared(accelerator, torch.float32, onebit_of)
    out["onebit_refused"] = error_text(lambda: accel_plugins.enable_onebit(accelerator, model2, foreign2))
    out["onebit_untouched"] = not foreign2.ddp_allreduce_managed and not optimizer2.optimizer.ddp_allreduce_managed
    handle = accel_plugins.enable_onebit(accelerator, model2, optimizer2)  # its comm hook: the first one
    for _ in range(2):  # warmup, then one compressed step
        _train_step(accelerator, model2, optimizer2, rank, torch.float32)
    out["onebit_params"] = [p.detach().clone() for p in model2.parameters()]
    handle.close()
    return out
