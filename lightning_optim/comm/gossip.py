r"""Gossip averaging over a topology, on point-to-point ops (no global allreduce in the averaging).

One round, on rank :math:`i` with neighbours :math:`N(i)` and mixing weights :math:`M_{ij}`
(:mod:`lightning_optim.comm.topology`):

.. math::
    x_i \leftarrow M_{ii} x_i + \sum_{j \in N(i),\ \text{ascending}} M_{ij} x_j

Every rank sends its own :math:`x_i` to each neighbour and receives theirs
(``torch.distributed.batch_isend_irecv``: one isend and one irecv per neighbour, any backend),
waits for all of them within ``collective_timeout()`` (``Work.wait(timeout)``, which gloo and NCCL
honour for point-to-point ops) and then mixes in place. Stacking the ranks' vectors as the rows of
:math:`X`, a round is :math:`X \leftarrow M X`.

Bytes (``comm_stats()``): this rank sends ``deg(i) * numel * element_size`` per round (each
neighbour gets one full copy); ``fp32_equivalent_bytes`` grows by what an fp32 ring allreduce of
the same numel sends, ``2 (W-1)/W * numel * 4``. Gossip is not a compressor: with two or more
neighbours it sends *more* bytes than a ring allreduce. What it saves is the global
synchronisation: each rank waits only for its neighbours, and the message count per rank is
``2 deg`` whatever the world size.

``consensus_distance`` is telemetry and is *not* point-to-point: it costs two allreduces (the
float64 mean of the flat params and one scalar), counted as control bytes.

* :class:`Topology`, :func:`agree_topology` (the bounded agreement every rank runs once),
  ``TopologyError``: see ``topology.py`` and ``gossip_agreement.py``.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from .gossip_agreement import TopologyError, agree_topology
from .stats import CommStats, comm_stats, ring_allreduce_bytes
from .timeouts import CommunicationError, check_process_group, collective, collective_timeout, group_timeout
from .topology import WEIGHTS, Topology

__all__ = ["Topology", "TopologyError", "WEIGHTS", "agree_topology", "consensus_distance", "gossip_average"]

_UPCAST = (torch.float16, torch.bfloat16)  # mixed in fp32: a weighted sum in 16 bits loses the small shares


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _exchange(buf: Tensor, peers: Sequence[int], group, deadline: float, bound: float) -> list[Tensor]:
    """Send ``buf`` to every peer (global ranks) and receive one same-shape tensor from each."""
    received = [torch.empty_like(buf) for _ in peers]
    ops = []
    for peer, into in zip(peers, received):
        ops.append(dist.P2POp(dist.isend, buf, peer, group))
        ops.append(dist.P2POp(dist.irecv, into, peer, group))
    start = time.monotonic()
    try:
        for work in dist.batch_isend_irecv(ops):
            left = max(deadline - time.monotonic(), 1e-3)
            work.wait(timeout=timedelta(seconds=left))
    except RuntimeError as exc:
        elapsed = time.monotonic() - start
        own = group_timeout(group)
        what = (f"did not complete within the bound of {bound:.0f}s" if time.monotonic() >= deadline
                else f"failed after {elapsed:.1f}s" + (f" (process-group timeout {own:.0f}s)" if own else ""))
        raise CommunicationError(
            f"gossip exchange with ranks {list(peers)} {what} on rank {dist.get_rank()} "
            f"(lightning_optim.comm.set_collective_timeout sets the bound): a neighbour may have died, hung or "
            f"skipped this step. Backend error: {exc}") from exc
    return received


def _mix(buf: Tensor, received: Sequence[Tensor], own_weight: float, weights: Sequence[float]) -> Tensor:
    """``own_weight * buf + sum_k weights[k] * received[k]``, in order, in buf's dtype (fp32 for 16-bit)."""
    if buf.dtype in _UPCAST:
        out = buf.float().mul_(own_weight)
        for w, x in zip(weights, received):
            out.add_(x.float(), alpha=w)
        return buf.copy_(out)
    buf.mul_(own_weight)
    for w, x in zip(weights, received):
        buf.add_(x, alpha=w)
    return buf


def _buckets(tensors: list[Tensor], by_layer: bool) -> list[list[Tensor]]:
    """One bucket per tensor (``by_layer``) or one per (dtype, device), in first-seen order."""
    if by_layer:
        return [[t] for t in tensors]
    buckets: dict[tuple, list[Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    return list(buckets.values())


@torch.no_grad()
def gossip_average(tensors: Iterable[Tensor], topology: Topology, group=None, *, by_layer: bool = False,
                   stats: CommStats | None = None) -> dict[int, int]:
    """One gossip round over ``tensors`` (e.g. a model's parameters), in place, on every rank of ``group``.

    ``by_layer=True``: one exchange per tensor; False: one flat buffer per dtype/device (fewer,
    larger messages). The result is the same up to rounding order (none: the mix is element-wise).
    ``topology`` must be the agreed one (:func:`agree_topology`); its ranks are ``group``'s ranks.
    Returns the bytes sent to each neighbour (group ranks) and adds them to ``stats``
    (default ``comm_stats()``). Raises ``CommunicationError`` when a neighbour does not answer
    within ``collective_timeout()``.
    """
    check_process_group("group", group)
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a lightning_optim.comm.gossip.Topology, got {type(topology).__name__}")
    tensors = list(tensors)
    world = dist.get_world_size(group) if _distributed() else 1
    if topology.world_size != world:
        raise ValueError(f"topology has {topology.world_size} ranks, the group has {world}")
    rank = dist.get_rank(group) if _distributed() else 0
    neighbours = topology.neighbors[rank]
    sent = dict.fromkeys(neighbours, 0)
    if not neighbours or not tensors:
        return sent
    row = topology.mixing_row(rank)
    weights = [row[j] for j in neighbours]
    peers = [dist.get_global_rank(group, j) if group is not None else j for j in neighbours]
    bound = collective_timeout()
    deadline = time.monotonic() + bound
    stats = stats if stats is not None else comm_stats()
    for bucket in _buckets(tensors, by_layer):
        single = len(bucket) == 1 and bucket[0].is_contiguous()
        buf = bucket[0] if single else torch.cat([t.reshape(-1) for t in bucket])
        received = _exchange(buf, peers, group, deadline, bound)
        _mix(buf, received, row[rank], weights)
        if not single:
            offset = 0
            for t in bucket:
                t.copy_(buf[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
        nbytes = buf.numel() * buf.element_size()
        for j in neighbours:
            sent[j] += nbytes
        # gossip is full precision but no allreduce: its bytes and the fp32 ring figure it replaces
        stats.add_point_to_point(nbytes * len(neighbours), buf.numel(), world)
    return sent


@torch.no_grad()
def consensus_distance(params: Iterable[Tensor], group=None, stats: CommStats | None = None) -> float:
    r"""``sqrt(mean_i ||x_i - x_bar||^2)`` over the ranks of ``group``, :math:`x_i` this rank's ``params``
    flattened (in float64), :math:`x_bar` their mean over ranks. The same value on every rank.

    Telemetry, not part of the gossip: it costs two float64 allreduces (``numel`` elements, then one),
    counted in ``stats`` (default ``comm_stats()``) as control bytes. 0.0 on one rank.
    """
    check_process_group("group", group)
    flat = torch.cat([p.detach().reshape(-1).to(torch.float64, copy=True) for p in params])
    world = dist.get_world_size(group) if _distributed() else 1
    if world == 1:
        return 0.0
    stats = stats if stats is not None else comm_stats()
    mean = flat.clone()
    collective("all_reduce", dist.all_reduce, mean, group=group)
    mean.div_(world)
    squared = (flat - mean).square().sum().reshape(1)
    collective("all_reduce", dist.all_reduce, squared, group=group)
    stats.add_control(ring_allreduce_bytes(flat.numel(), world, 8) + ring_allreduce_bytes(1, world, 8))
    return math.sqrt(float(squared) / world)
