r"""DDP comm hook ``"decentralized"``: no gradient averaging at all; gossip of the params after each step.

:func:`local_gradient_hook` hands DDP each bucket back untouched, so ``param.grad`` holds this rank's
own gradient :math:`g_i` (with a comm hook DDP does not divide by the world size: the hook's result
is the gradient). After the optimizer's local step, :meth:`DecentralizedHookState.after_step` runs
one gossip round of the params with the neighbours of a topology (:mod:`lightning_optim.comm.gossip`,
point-to-point, no global allreduce):

.. math::
    x_i^{t+\frac12} = \mathrm{opt}(x_i^t, g_i^t), \qquad
    x_i^{t+1} = M_{ii} x_i^{t+\frac12} + \textstyle\sum_{j \in N(i)} M_{ij} x_j^{t+\frac12}

(decentralized SGD, Lian et al. 2017; mlbench's ``DecentralizedSGD`` with any local optimizer). Every
``consensus_every`` steps (0: never) the consensus distance
:math:`\sqrt{\frac1W \sum_i \|x_i - \bar x\|^2}` is measured: two float64 all-reduces, telemetry only.

``neighbors``: ``"ring"`` (default), ``"torus"``, ``"torus:RxC"``, ``"exponential"``, a
:class:`~lightning_optim.comm.gossip.Topology`, this rank's own neighbour list or every rank's lists;
``weights``: ``"uniform"`` (mlbench: :math:`1/(\deg(i)+1)`) or ``"metropolis"`` (doubly stochastic on
any graph). :meth:`~DecentralizedHookState.attach` is collective: the ranks agree on the topology
(and on the params' layout) in one bounded all-gather, or all raise the same error (a list naming a
missing rank, asymmetric lists, differing names), none hangs.

Bytes: the hook sends nothing; each gossip round sends :math:`\deg(i)` copies of the params
(``comm_stats()``, with the fp32 ring allreduce it replaces as ``fp32_equivalent_bytes``); the
consensus distance adds control bytes. The ranks' params differ between rounds: checkpoints must keep
every rank's params and optimizer state (the Lightning strategy does); ``state_dict()`` holds the
step counter.
"""
# no ``from __future__ import annotations``: DDP checks the hook's return annotation at runtime
import hashlib
import numbers
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_optim.optim.validation import check_flag, check_int

from ..gossip import Topology, agree_topology, consensus_distance, gossip_average
from ..stats import CommStats
from ..topology import WEIGHTS
from ._bucket import HookState
from .local import local_gradient_hook

__all__ = ["DecentralizedHookState", "check_neighbors", "local_gradient_hook"]

_NAME = re.compile(r"^(ring|exponential|torus|torus:\d+x\d+)$")


def _is_rank(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def check_neighbors(neighbors: object) -> object:
    """What can be checked before the ranks meet: the kind of ``neighbors`` and its names or entries
    (ranges, symmetry and agreement are checked by every rank together in ``attach``)."""
    if neighbors is None or isinstance(neighbors, Topology):
        return neighbors
    if isinstance(neighbors, str):
        if not _NAME.match(neighbors.strip().lower()):
            raise ValueError(f"neighbors must be 'ring', 'torus', 'torus:RxC', 'exponential', a Topology or neighbour "
                             f"lists, got {neighbors!r}")
        return neighbors
    if isinstance(neighbors, bytes) or not isinstance(neighbors, Sequence):
        raise TypeError(f"neighbors must be a topology name, a Topology, this rank's neighbour list or every rank's "
                        f"lists, got {type(neighbors).__name__}")
    rows = neighbors if neighbors and all(isinstance(r, Sequence) and not isinstance(r, (str, bytes))
                                          for r in neighbors) else [neighbors]
    for row in rows:
        for j in row:
            if not _is_rank(j):
                raise ValueError(f"neighbors must list ranks (ints >= 0), got {j!r} in {list(row)!r}")
    return neighbors


def _layout_digest(params: Sequence[torch.Tensor]) -> int:
    text = repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


class DecentralizedHookState(HookState):
    """Local gradients in backward, one gossip round of the params after each step (module docstring)."""

    hook_name = "decentralized"

    def __init__(self, neighbors: object = "ring", weights: str | None = None, consensus_every: int = 10,
                 by_layer: bool = False, *, group: Any = None, stats: CommStats | None = None) -> None:
        super().__init__(group, stats)
        self.neighbors = check_neighbors(neighbors)
        if weights is not None and weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS} or None (the Topology's own, else uniform), "
                             f"got {weights!r}")
        self.weights = weights
        self.consensus_every = check_int("consensus_every", consensus_every, 0)
        self.by_layer = check_flag("by_layer", by_layer)
        self.topology: Topology | None = None
        self.steps = 0
        self.buckets_local = 0
        self.last_consensus_distance: float | None = None

    def attach(self, ddp_model: nn.Module) -> None:
        """Collective: every rank agrees on the topology (and the params' layout) or raises."""
        super().attach(ddp_model)
        module = getattr(ddp_model, "module", ddp_model)
        layout = _layout_digest(list(module.parameters()))
        self.topology = agree_topology(self.neighbors, self.group, weights=self.weights,
                                       agree={"the model's parameter layout (count, shapes, dtypes)": layout})

    def after_step(self, params: Iterable[torch.Tensor]) -> float | None:
        """One gossip round of ``params`` (collective); the consensus distance when it was measured."""
        if self.topology is None:
            raise RuntimeError("DecentralizedHookState.after_step before attach(ddp_model): the ranks have not "
                               "agreed on a topology yet")
        params = list(params)
        gossip_average(params, self.topology, self.group, by_layer=self.by_layer, stats=self.stats)
        self.steps += 1
        if self.consensus_every and self.steps % self.consensus_every == 0:
            self.last_consensus_distance = consensus_distance(params, self.group, stats=self.stats)
            return self.last_consensus_distance
        return None

    def state_dict(self) -> dict[str, Any]:
        return {**self._stamp(), "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = self._check_stamp(state)
        self.steps = check_int("state['steps']", state.get("steps"), 0)
