"""Workers for test_release_ddp: plain DDP + step after backward vs gradient release in DDP's hook."""

from __future__ import annotations

import io

import torch
from torch import nn

import lightning_optim as lo
from tests.ranks import seeded


def _model() -> nn.Module:
    with seeded(0):
        return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


def _batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _reload(opt: torch.optim.Optimizer) -> None:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt.load_state_dict(torch.load(buf))


def release_vs_ddp(rank: int, world: int, name: str, steps: int, accumulate: int) -> dict:
    """Train the same model twice on this rank's data: DDP + opt.step() and DDP + release. Every
    ``accumulate`` micro-batches are accumulated under ``no_sync``; the lr follows a scheduler; at
    step ``steps // 2`` both optimizers are reloaded from their state dicts (resume)."""
    kwargs = {"AdamW": dict(lr=1e-2, weight_decay=0.1), "SGD": dict(lr=5e-2, momentum=0.9)}[name]
    runs = {}
    for mode in ("ddp", "release"):
        model = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.002)  # several buckets
        opt = getattr(lo, name)(model.parameters(), **kwargs)
        if mode == "release":
            lo.prepare_for_gradient_release(model, opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for step in range(steps):
            if step == steps // 2:
                _reload(opt)
            for micro in range(accumulate):
                x, y = _batch(rank, step, micro)
                last = micro == accumulate - 1
                ctx = model.no_sync() if not last else _null()
                with ctx:
                    (nn.functional.mse_loss(model(x), y) / accumulate).backward()
            opt.step()  # a no-op under release: the hook stepped each bucket
            opt.zero_grad()
            sched.step()
        runs[mode] = [p.detach().clone() for p in model.parameters()]
        if mode == "release":
            runs["buckets_stepped"] = model._lightning_optim_release[0][0].buckets_stepped
            runs["grads_left"] = sum(p.grad is not None for p in model.parameters())
    return runs


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def release_without_zero_grad(rank: int, world: int) -> dict:
    """A loop that never calls zero_grad: the forward pre-hook drops the stepped grads."""
    out = {}
    for mode in ("ddp", "release"):
        model = nn.parallel.DistributedDataParallel(_model())
        opt = lo.AdamW(model.parameters(), lr=1e-2)
        if mode == "release":
            lo.prepare_for_gradient_release(model, opt)
        for step in range(4):
            x, y = _batch(rank, step, 0)
            nn.functional.mse_loss(model(x), y).backward()
            if mode == "ddp":
                opt.step()
                opt.zero_grad()
        out[mode] = [p.detach().clone() for p in model.parameters()]
    return out
