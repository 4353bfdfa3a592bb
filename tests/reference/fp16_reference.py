"""Reference for mlbench-core's FP16Optimizer, written from the algorithm (no lightning_optim import).

One step of the wrapper, for ranks ``r = 0..W-1`` holding fp16 gradients ``h_r`` of a loss scaled by ``S``:

1. ``g_r = float32(h_r)`` (the flat fp32 gradient of rank ``r``; the caller passes these);
2. averaging, with the divisor ``D``:

   * ``average_world``: ``D = W``;
   * ``average_custom``: ``D = sum_r denom_r`` (each rank gives its own ``denom``);
   * neither (only legal for ``W = 1``): ``D = 1``;

   ``divide_before``: ``g = sum_r (g_r / D)``, otherwise ``g = (sum_r g_r) / D``;
3. unscaling: ``g <- g / (S * multiplier)``;
4. any inf/NaN in ``g``: the step is skipped (no update on any rank);
5. ``grad_clip`` finite: ``g <- g * min(1, grad_clip / (||g||_2 + eps))`` with torch's
   ``clip_grad_norm_`` convention ``eps = 1e-6``.

Everything is computed in float32 in rank order, as a two-rank all-reduce does (``a + b`` is
commutative, so the rounding is the same whichever rank adds first); the clipping coefficient is
computed in float64, so a clipped gradient agrees with torch's to about one float32 ulp.

The loss-scale schedule (mlbench / apex's dynamic scaler, no hysteresis): on an overflowing step
``S <- S / scale_factor`` (an error if that falls below ``min_scale``); after ``scale_window``
clean steps in a row ``S <- min(S * scale_factor, max_scale)``, and the count starts again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["expected_gradient", "divisor", "ScaleSchedule", "simulate_scale", "ScaleUnderflow"]

CLIP_EPS = 1e-6


def divisor(world_size: int, *, average_world: bool = False, average_custom: bool = False,
            denoms: Sequence[float] | None = None) -> float:
    """The ``D`` of step 2."""
    if average_world and average_custom:
        raise ValueError("give one of average_world / average_custom")
    if average_world:
        return float(world_size)
    if average_custom:
        if denoms is None or len(denoms) != world_size:
            raise ValueError("average_custom needs one denom per rank")
        return float(sum(float(d) for d in denoms))
    if world_size != 1:
        raise ValueError("with several ranks the sum must be averaged")
    return 1.0


def expected_gradient(rank_grads: Sequence[Tensor], *, scale: float, average_world: bool = False,
                      average_custom: bool = False, denoms: Sequence[float] | None = None,
                      divide_before: bool = False, multiplier: float = 1.0,
                      grad_clip: float = math.inf) -> Tensor | None:
    """The averaged, unscaled, clipped fp32 gradient of one step, or None when the step overflows.

    ``rank_grads[r]``: rank ``r``'s flat fp32 gradient (float32 of its fp16 grads, still scaled by S).
    """
    grads = [g.detach().to(torch.float32).clone() for g in rank_grads]
    if not grads:
        raise ValueError("need at least one rank")
    d = divisor(len(grads), average_world=average_world, average_custom=average_custom, denoms=denoms)
    if divide_before:
        total = grads[0] / d
        for g in grads[1:]:
            total = total + g / d
    else:
        total = grads[0].clone()
        for g in grads[1:]:
            total = total + g
        total = total / d
    total = total / float(scale * multiplier)
    if not bool(torch.isfinite(total).all()):
        return None
    if math.isfinite(grad_clip):
        norm = float(total.double().norm())
        coef = grad_clip / (norm + CLIP_EPS)
        if coef < 1.0:
            total = total * coef
    return total


def clip_coefficient(grad: Tensor, grad_clip: float) -> float:
    """``min(1, grad_clip / (||grad|| + eps))``: how much step 5 shrinks ``grad`` (1.0: not clipped)."""
    return min(1.0, grad_clip / (float(grad.double().norm()) + CLIP_EPS))


class ScaleUnderflow(Exception):
    """The schedule would take the scale below ``min_scale``."""


@dataclass
class ScaleSchedule:
    """The outcome of :func:`simulate_scale`."""

    used: list[float] = field(default_factory=list)      # the scale each step's loss was multiplied by
    skipped: list[int] = field(default_factory=list)     # indices of skipped (overflowing) steps
    final: float = 0.0                                   # the scale after the last step
    underflow_at: int | None = None                      # the step whose back-off went below min_scale


def simulate_scale(overflows: Sequence[bool], *, init_scale: float = 1024, scale_factor: float = 2,
                   scale_window: int = 128, min_scale: float = 1e-4,
                   max_scale: float | None = None) -> ScaleSchedule:
    """Run the schedule over a scripted sequence of overflow flags (stops at an underflow)."""
    cap = math.inf if max_scale is None else float(max_scale)
    out = ScaleSchedule()
    scale, clean = float(init_scale), 0
    for i, overflow in enumerate(overflows):
        out.used.append(scale)
        if overflow:
            out.skipped.append(i)
            clean = 0
            new = scale / scale_factor
            if new < min_scale:
                out.underflow_at = i
                break
            scale = new
        else:
            clean += 1
            if clean == scale_window:
                scale = min(scale * scale_factor, cap)
                clean = 0
    out.final = scale
    return out
