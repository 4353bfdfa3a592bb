r"""Hierarchical averaging: full precision inside a node, compressed (or fp32) across nodes.

A world of ``W = K L`` ranks is ``K`` nodes of ``L`` ranks each, node ``k`` holding the consecutive ranks
``kL .. kL + L - 1`` (the order torchrun and Lightning give ranks). Two families of groups are made once:
``intra`` (this rank's node) and ``inter`` (the ``K`` ranks with this rank's local rank ``l``, one per node).
An ``n``-element vector :math:`x_r` on every rank is averaged in three collectives:

1. reduce-scatter inside the node (fp32, the fast link): local rank ``l`` gets the node's mean of
   shard ``l``, :math:`y_{k,l} = \frac{1}{L} \sum_{j<L} x_{kL+j}[\,lS : (l+1)S\,]` with
   :math:`S = \lceil n / L \rceil` (the last shard is padded with zeros that are never sent back);
2. across nodes, between the ranks holding shard ``l`` (the slow link): either the error-compensated 1-bit
   average :math:`\bar y_l = \mathcal{C}(\frac{1}{K}\sum_k y_{k,l})` (``compressed_allreduce``, with this
   rank's own worker/server error buffers for its shard; one scale per piece of a segment in the shard) or,
   in the warmup, a full-precision mean;
3. all-gather inside the node: every rank of every node ends with the same :math:`\bar y`.

Inter-node bytes per rank are those of one compressed allreduce of ``n / L`` elements on ``K`` ranks, about
``L`` times fewer than a flat 1-bit allreduce puts on the slow link from every node, and every byte inside a
node is fp32 on the fast link. ``K == 1`` (one node): step 2 has nothing to do, the result is the exact mean.
``L == 1``: steps 1 and 3 have nothing to do, the flat 1-bit allreduce.

Bytes (``CommStats``): the intra-node collectives are counted in ``bytes_sent`` and also in
``intra_node_bytes``, as the node group's backend sends them: the all-gather ``(L - 1) S * 4`` per rank, the
reduce-scatter ``(L - 1) S * 4`` on NCCL but ``2 (L - 1) S * 4`` on gloo, which has no reduce-scatter of its
own and all-reduces the whole padded vector (``stats.reduce_scatter_bytes``). The slow link's share is
``bytes_sent - intra_node_bytes``. One node on gloo (``K == 1``) therefore sends 1.5x the bytes of a flat fp32
all-reduce (DDP's), and as many on NCCL: rank 0 says so when the groups are made.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .dense import allreduce_mean, world_size
from .stats import CommStats, comm_stats, reduce_scatter_bytes, ring_allreduce_bytes
from .timeouts import collective, gather_rows

__all__ = ["NodeGroups", "backend_name", "check_hierarchical", "node_groups", "hierarchical_average_", "one_node_ratio",
           "shard_segments"]

LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"  # torchrun's ranks on this node
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_hierarchical(value: object) -> bool | int:
    """``hierarchical``: False (flat), True (ranks per node from ``LOCAL_WORLD_SIZE``) or an int >= 1."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(f"hierarchical must be True, False or the number of ranks per node (an int >= 1), got "
                        f"{value!r}")
    if value < 1:
        raise ValueError(f"hierarchical must be True, False or the number of ranks per node (an int >= 1), got {value}")
    return int(value)


def ranks_per_node(hierarchical: bool | int) -> int:
    """The node size ``hierarchical`` asks for on this rank (``True``: torchrun's ``LOCAL_WORLD_SIZE``)."""
    if hierarchical is True:
        raw = os.environ.get(LOCAL_WORLD_SIZE)
        if raw is None or not raw.strip().isdigit() or int(raw) < 1:
            raise ValueError(f"hierarchical=True takes the ranks per node from {LOCAL_WORLD_SIZE} (set by torchrun "
                             f"and Lightning), which is {raw!r} here; pass the number of ranks per node instead")
        return int(raw)
    return int(hierarchical)


@dataclass(frozen=True)
class NodeGroups:
    """This rank's place in ``nodes`` x ``per_node`` and the two groups it averages in."""

    per_node: int
    nodes: int
    node: int
    local_rank: int
    intra: Any  # this node's ranks (None when per_node == 1: nothing to do inside a node)
    inter: Any  # the ranks with this local rank, one per node (None when nodes == 1)
    rank: int  # in the parent group
    world: int

    def shard(self, numel: int) -> tuple[int, int]:
        """``(S, start)``: shard size and where this rank's shard starts in an ``numel``-element vector."""
        size = -(-numel // self.per_node) if numel else 0
        return size, self.local_rank * size


def backend_name(group, device: torch.device | None = None) -> str:
    """The backend that runs ``group``'s collectives on ``device`` (``"gloo"``, ``"nccl"``, ...): a group made
    for several device types (``"cpu:gloo,cuda:nccl"``) uses the one of the tensors' device (CPU without one)."""
    name = str(dist.get_backend(group)).lower()
    if ":" in name:
        table = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        name = table.get(device.type if device is not None else "cpu", next(iter(table.values())))
    return name


def one_node_ratio(per_node: int, backend: str) -> float:
    """Bytes of a one-node hierarchical average (reduce-scatter + all-gather) over those of a flat fp32 ring
    all-reduce of the same vector, per rank, on ``backend``: 1.5 on gloo, 1.0 where the reduce-scatter is a ring."""
    flat = ring_allreduce_bytes(per_node, per_node)
    return (reduce_scatter_bytes(per_node, per_node, 4, backend) + (per_node - 1) * 4) / flat if flat else 1.0


def node_groups(hierarchical: bool | int, group=None, device: torch.device | None = None) -> NodeGroups:
    """Make the intra- and inter-node groups of ``group`` (default: the world) for ``hierarchical``.

    Every rank of ``group`` must call it (it creates groups, in the same order everywhere). Refused on every
    rank, with the same message, when the ranks ask for different node sizes (uneven nodes) or the node size
    does not divide the world. ``device``: where the averaged tensors live (names the backend in the one-node
    warning)."""
    world = world_size(group)
    per_node = ranks_per_node(hierarchical) if world > 1 else 1
    rows = gather_rows("all_gather(node size)", (per_node,), group=group) if world > 1 else [(per_node,)]
    sizes = [r[0] for r in rows]
    if len(set(sizes)) > 1:
        raise ValueError(f"hierarchical: the ranks give different node sizes (by rank: {sizes}); uneven nodes are "
                         "not supported: run the same number of ranks on every node, or hierarchical=False")
    if world % per_node:
        raise ValueError(f"hierarchical: {per_node} ranks per node do not divide the {world} ranks of the group; "
                         "give a node size that divides the world, or hierarchical=False")
    members = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    rank = dist.get_rank(group) if world > 1 else 0
    nodes = world // per_node
    if nodes == 1 and world > 1 and rank == 0:
        backend = backend_name(group, device)
        ratio = one_node_ratio(per_node, backend)
        cost = (f"it sends {ratio:g}x the bytes of DDP's flat fp32 all-reduce ({backend}'s reduce-scatter sends a "
                "whole all-reduce's bytes, and the all-gather follows it)" if ratio > 1 else
                f"it sends as many bytes as DDP's flat fp32 all-reduce on {backend}")
        warnings.warn(f"hierarchical: the {world} ranks are one node of {per_node}; every exchange is the exact fp32 "
                      f"mean inside it and nothing is compressed, and {cost} (hierarchical=False for the flat "
                      "1-bit exchange)", UserWarning, stacklevel=3)
    intra = inter = None
    if world > 1:
        # every rank creates every group, in one order (torch's rule for new_group)
        for k in range(nodes):
            made = _new_group([members[k * per_node + j] for j in range(per_node)]) if per_node > 1 else None
            if k == rank // per_node:
                intra = made
        for j in range(per_node):
            made = _new_group([members[k * per_node + j] for k in range(nodes)]) if nodes > 1 else None
            if j == rank % per_node:
                inter = made
    return NodeGroups(per_node, nodes, rank // per_node, rank % per_node, intra, inter, rank, world)


def _new_group(ranks: list[int]):
    return dist.new_group(ranks, use_local_synchronization=False)


def shard_segments(segments: Sequence[int] | None, numel: int, start: int, size: int) -> list[int]:
    """The lengths of ``segments`` (adding up to ``numel``) cut to ``[start, start + size)``, in order; the
    padding past ``numel`` is one more segment (so the lengths add up to ``size``)."""
    lengths = [numel] if segments is None else [int(s) for s in segments]
    out, pos, stop = [], 0, start + size
    for length in lengths:
        lo, hi = max(pos, start), min(pos + length, stop)
        if hi > lo:
            out.append(hi - lo)
        pos += length
    real = sum(out)
    if real < size:
        out.append(size - real)  # zeros past the end: a segment of its own, so no real scale sees them
    return out


class _Scratch:
    def __init__(self) -> None:
        self.padded: Tensor | None = None
        self.shard: Tensor | None = None

    def get(self, size: int, per_node: int, like: Tensor) -> tuple[Tensor, Tensor]:
        if (self.padded is None or self.shard is None or self.padded.numel() != size * per_node
                or self.padded.device != like.device):
            self.padded = torch.zeros(size * per_node, dtype=torch.float32, device=like.device)
            self.shard = torch.empty(size, dtype=torch.float32, device=like.device)
        return self.padded, self.shard


def hierarchical_average_(flat: Tensor, groups: NodeGroups, *, scratch: _Scratch | None = None,
                          across: Callable[[Tensor, CommStats], None] | None = None,
                          stats: CommStats | None = None) -> Tensor:
    """Average ``flat`` (fp32, contiguous, 1-D) over the world of ``groups`` in place (see the module doc).

    ``across(shard, stats)``: the inter-node average of this rank's shard in place, counting its bytes in
    ``stats``; default: the full-precision mean. Bytes go to ``stats`` (default ``comm_stats()``)."""
    if groups.world == 1 or not flat.numel():
        return flat
    n, per_node = flat.numel(), groups.per_node
    size, _ = groups.shard(n)
    padded, shard = (scratch or _Scratch()).get(size, per_node, flat)
    intra = 0
    if per_node > 1:
        padded[:n].copy_(flat)
        padded[n:].zero_()  # the last shard's tail: zeros, never part of a result
        collective("reduce_scatter(node)", _reduce_scatter_single, shard, padded, group=groups.intra)
        shard.div_(per_node)
        # counted as this backend sends it (gloo: an all-reduce of all of padded)
        intra += reduce_scatter_bytes(padded.numel(), per_node, 4, backend_name(groups.intra, flat.device))
    else:
        shard.copy_(flat)
    inter = CommStats()
    if groups.nodes > 1:
        if across is None:
            allreduce_mean(shard, group=groups.inter, stats=inter)
        else:
            across(shard, inter)
    if per_node > 1:
        collective("all_gather(node)", _all_gather_single, padded, shard, group=groups.intra)
        intra += (per_node - 1) * size * 4
        flat.copy_(padded[:n])
    else:
        flat.copy_(shard)
    (stats if stats is not None else comm_stats()).add_hierarchical(intra, inter, n, groups.world)
    return flat
