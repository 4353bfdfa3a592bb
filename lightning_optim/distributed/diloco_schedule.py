r"""DiLoCo's arithmetic: how the params split into fragments, when each fragment synchronises, and the outer
update of one fragment (pure functions over tensors; ``diloco.py`` holds the state and the exchange).

Fragments (Streaming DiLoCo, Douillard et al. 2025): the :math:`N` params, in the inner optimizer's order,
cut into :math:`F` contiguous runs balanced by element count: with :math:`n_k` the elements of the first
:math:`k` params, the cut closing fragment :math:`f` (``f = 1..F-1``) is the :math:`k` that brings
:math:`n_k` closest to :math:`f \cdot n_N / F` (the earlier :math:`k` on a tie), each fragment keeping at
least one param.

Schedule: with :math:`H` = ``sync_every`` and :math:`F \mid H`, fragment :math:`f \in \{0..F-1\}` synchronises
after inner step :math:`t` (1-based) when

.. math:: t \bmod H = (f + 1)\,\tfrac{H}{F} \bmod H,

so one fragment every :math:`H/F` steps, each every :math:`H` steps; its first round is :math:`(f+1) H/F`
steps long. :math:`F = 1` is DiLoCo: everything after steps :math:`H, 2H, \dots`.

Outer step of one fragment (``outer_step_``), torch.optim.SGD's equations with ``lr`` :math:`\eta`,
``momentum`` :math:`\mu`, no dampening, the averaged pseudo-gradient :math:`\bar\Delta` as the gradient:

.. math::
    b \leftarrow \mu b + \bar\Delta \;(b_0 = 0), \qquad
    u = \bar\Delta + \mu b \text{ (Nesterov)},\ b \text{ (momentum)},\ \bar\Delta\ (\mu = 0), \qquad
    \theta_g \leftarrow \theta_g - \eta u

then every rank takes the new global params (``take_global_``): :math:`\theta \leftarrow \theta_g`, or with
mixing :math:`\alpha` (the overlapped exchange) :math:`\theta \leftarrow \alpha\,\theta + (1-\alpha)\,\theta_g`.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import Tensor

__all__ = ["fragment_bounds", "outer_step_", "pseudo_gradients", "syncing_fragment", "take_global_"]


def fragment_bounds(numels: Sequence[int], fragments: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` param index ranges of the ``fragments`` runs (see the module docstring)."""
    count = len(numels)
    if not 1 <= fragments <= count:
        raise ValueError(f"fragments must be in [1, {count}] (one param at least per fragment), got {fragments}")
    running = [0]
    for n in numels:
        running.append(running[-1] + int(n))
    total = running[-1]
    cuts = [0]
    for f in range(1, fragments):
        lowest, highest = cuts[-1] + 1, count - (fragments - f)
        target = f * total / fragments
        cuts.append(min(range(lowest, highest + 1), key=lambda k: (abs(running[k] - target), k)))
    cuts.append(count)
    return list(pairwise(cuts))


def syncing_fragment(step: int, sync_every: int, fragments: int) -> int | None:
    """The fragment that synchronises after inner step ``step`` (1-based), or None."""
    period = sync_every // fragments
    phase = step % sync_every
    if phase == 0:
        return fragments - 1
    if phase % period == 0:
        return phase // period - 1
    return None


@torch.no_grad()
def pseudo_gradients(global_params: Sequence[Tensor], params: Sequence[Tensor]) -> list[Tensor]:
    r""":math:`\Delta = \theta_g - \theta` per param, in the global copy's dtype (new tensors)."""
    return [g - p.detach().to(g.dtype) for g, p in zip(global_params, params)]


@torch.no_grad()
def outer_step_(global_params: Sequence[Tensor], momenta: Sequence[Tensor], deltas: Sequence[Tensor], *,
                lr: float, momentum: float, nesterov: bool) -> None:
    """The outer SGD step on the global copy, in place (``momenta`` empty when ``momentum`` is 0)."""
    for i, (g, d) in enumerate(zip(global_params, deltas)):
        d = d.to(g.dtype)
        if momentum:
            b = momenta[i]
            b.mul_(momentum).add_(d)
            d = d.add(b, alpha=momentum) if nesterov else b
        g.add_(d, alpha=-lr)


@torch.no_grad()
def take_global_(params: Sequence[Tensor], global_params: Sequence[Tensor], mixing: float | None) -> None:
    r""":math:`\theta \leftarrow \theta_g` (``mixing`` None), else
    :math:`\theta \leftarrow \alpha\theta + (1-\alpha)\theta_g`, as ``lerp(theta_g, theta, alpha)`` in the global
    copy's dtype."""
    for p, g in zip(params, global_params):
        if mixing is None:
            p.copy_(g)
        else:
            p.copy_(torch.lerp(g, p.detach().to(g.dtype), mixing))
