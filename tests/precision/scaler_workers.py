"""Workers for test_loss_scaler: a scripted overflow pattern where only one rank overflows."""

from __future__ import annotations

import torch

from lightning_optim.precision import DynamicLossScaler, LossScaleUnderflow


def run_schedule(rank: int, world: int, pattern: list[bool], kwargs: dict) -> dict:
    """Rank ``r`` overflows at step i iff ``pattern[i]`` and ``i % world == r`` (one rank at a time)."""
    scaler = DynamicLossScaler(**kwargs)
    used, skipped = [], []
    for i, overflow in enumerate(pattern):
        grad = torch.ones(5) * scaler.loss_scale
        if overflow and i % world == rank:
            grad[2] = float("inf") if i % 2 else float("nan")
        used.append(scaler.loss_scale)
        agreed = scaler.unscale_and_check([grad])
        if not agreed:
            assert torch.equal(grad, torch.ones(5))  # unscaled in place
        try:
            scaler.update(agreed)
        except LossScaleUnderflow as exc:
            return {"used": used, "skipped": skipped + [i], "underflow": i, "message": str(exc)}
        if agreed:
            skipped.append(i)
    return {"used": used, "skipped": skipped, "underflow": None, "state": scaler.state_dict()}
