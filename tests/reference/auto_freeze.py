"""Reference of ``freeze_step="auto"`` (docs: lightning_optim/onebit/auto_freeze.py), written from its
equations: the warmup's variance of the rank-averaged gradients, in float64,

    v_t = b2 v_{t-1} + (1 - b2) gbar_t^2,     n_t = ||v_t||_2 / (1 - b2^t)

and the warmup ends at the first t > W whose last W + 1 norms n_{t-W} .. n_t lie within a band of tau,
(max - min) / min < tau, or at t = cap."""

from __future__ import annotations

import torch


def auto_freeze_step(mean_grads: list[list[torch.Tensor]], beta2: float, window: int, tolerance: float,
                     cap: int) -> int | None:
    """``mean_grads[t-1][j]``: step t's rank-averaged gradient of param j. The chosen step (None: not within them)."""
    v = [torch.zeros_like(g, dtype=torch.float64) for g in mean_grads[0]]
    norms = []
    for t, grads in enumerate(mean_grads, start=1):
        v = [beta2 * vj + (1 - beta2) * g.double() ** 2 for vj, g in zip(v, grads)]
        norms.append(torch.sqrt(sum((vj**2).sum() for vj in v)).item() / (1 - beta2**t))
        last = norms[-1 - window:]
        if t > window and (max(last) - min(last)) / min(last) < tolerance:
            return t
        if t >= cap:
            return t
    return None
