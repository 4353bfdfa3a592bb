"""Rank side of the freeze_step="auto" tests: 2 gloo ranks, each its own gradients (decaying, so the
variance settles), OnebitAdam/OnebitLamb averaging the warmup itself; a checkpoint mid-warmup resumed. The
``AutoFreezeDecision`` warnings each run issued are recorded."""

from __future__ import annotations

import io

import torch

from lightning_optim import OnebitAdam, OnebitLamb
from lightning_optim.onebit.auto_freeze import AutoFreezeDecision
from tests.ranks import record_warnings, seeded

SHAPES = [(40, 8), (8,), (16, 4)]
STEPS = 40
SAVE_AT = 6  # mid-warmup: the norms' history travels in the checkpoint
KW = dict(freeze_step="auto", auto_freeze_window=5, auto_freeze_tolerance=0.15, betas=(0.9, 0.9))


def grads(step: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s gradients at ``step``: noise whose size decays towards a floor."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    scale = 0.5 + 4.0 * 0.6**step
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


def _build(cls, rank: int):
    with seeded(0):
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    extra = {"freeze_step": "auto"} if cls is OnebitLamb else {}
    return params, cls(params, lr=1e-2, **{**KW, **extra})


def _run(params, opt, rank: int, steps, announced: list[str]) -> list[dict]:
    rows = []
    with record_warnings() as caught:
        for t in steps:
            for p, g in zip(params, grads(t, rank)):
                p.grad = g
            opt.step()
            rows.append({"needs": opt.needs_averaged_grads, "freeze_step": opt.freeze_step,
                         "params": [p.detach().clone() for p in params]})
    announced += [str(w.message) for w in caught if issubclass(w.category, AutoFreezeDecision)]
    return rows


def suite(rank: int, world: int) -> dict:
    out = {}
    for cls in (OnebitAdam, OnebitLamb):
        params, opt = _build(cls, rank)
        announced: list[str] = []
        full = _run(params, opt, rank, range(1, SAVE_AT + 1), announced)
        blob = io.BytesIO()
        torch.save({"opt": opt.state_dict(), "params": [p.detach().clone() for p in params]}, blob)
        full += _run(params, opt, rank, range(SAVE_AT + 1, STEPS + 1), announced)
        params2, opt2 = _build(cls, rank)
        blob.seek(0)
        saved = torch.load(blob, weights_only=False)
        opt2.load_state_dict(saved["opt"])
        with torch.no_grad():
            for p, q in zip(params2, saved["params"]):
                p.copy_(q)
        announced_resumed: list[str] = []
        resumed = _run(params2, opt2, rank, range(SAVE_AT + 1, STEPS + 1), announced_resumed)
        out[cls.__name__] = {"full": full, "resumed": resumed, "chosen": opt.freeze_step, "announced": announced,
                             "announced_resumed": announced_resumed}
    return out
