"""Worker functions for test_gossip.py (module level, so ``run_workers`` can pickle them).

A topology case is ``(label, kind, value, weights)``: ``kind`` "name" (value: a name), "own" (value:
every rank's list; each rank passes only its own, mlbench's form), "full" (value: every rank's
lists, passed whole) or "path_metropolis" (a Topology object).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_optim.comm import comm_stats, set_collective_timeout
from lightning_optim.comm.gossip import Topology, agree_topology, consensus_distance, gossip_average

SHAPES = [(3, 4), (5,), (2, 2, 2)]


def tensors(rank: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> list[torch.Tensor]:
    """Rank ``rank``'s starting tensors (the test rebuilds them for the reference)."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in SHAPES]


def spec_for(kind: str, value, rank: int):
    if kind == "own":
        return value[rank]
    if kind == "path_metropolis":
        return Topology.from_neighbors([[1], [0, 2], [1, 3], [2]], "metropolis")
    return value


def _rounds(xs, topology, rounds, by_layer, group=None):
    dists, sent, per_peer = [consensus_distance(xs, group)], [], []
    for _ in range(rounds):
        before = comm_stats().copy()
        per_peer.append(gossip_average(xs, topology, group, by_layer=by_layer))
        delta = comm_stats() - before
        sent.append((delta.bytes_sent, delta.fp32_equivalent_bytes))
        dists.append(consensus_distance(xs, group))
    return {"xs": xs, "dists": dists, "sent": sent, "per_peer": per_peer}


def gossip_cases(rank: int, world: int, cases, rounds: int) -> dict:
    """For each case: the agreed topology, then ``rounds`` gossip rounds in float64 (flat and by layer)
    and in float32 (flat), recording consensus distances and bytes."""
    out = {}
    for label, kind, value, weights in cases:
        topology = agree_topology(spec_for(kind, value, rank), weights=weights)
        out[label] = {
            "neighbors": topology.neighbors,
            "weights": topology.weights,
            "matrix": topology.mixing_matrix(),
            "flat": _rounds(tensors(rank), topology, rounds, by_layer=False),
            "by_layer": _rounds(tensors(rank), topology, rounds, by_layer=True),
            "fp32": _rounds(tensors(rank, torch.float32), topology, 1, by_layer=False),
            "fp32_by_layer": _rounds(tensors(rank, torch.float32), topology, 1, by_layer=True),
            "bf16": _rounds(tensors(rank, torch.bfloat16), topology, 1, by_layer=False),
        }
    return out


def subgroup_ring(rank: int, world: int, rounds: int):
    """A ring on the subgroup of global ranks 1..world-1 (group ranks 0..world-2); rank 0 stays out."""
    group = dist.new_group(list(range(1, world)))
    if rank == 0:
        return None
    topology = agree_topology("ring", group)
    return _rounds(tensors(rank - 1), topology, rounds, by_layer=False, group=group)


def bad_topologies(rank: int, world: int, cases) -> dict:
    """Each case ``(label, per-rank kwargs for agree_topology)``: what this rank raised (or None)."""
    set_collective_timeout(10)
    out = {}
    for label, per_rank in cases:
        kwargs = dict(per_rank[rank])
        if kwargs.get("neighbors") == "<topology of 2>":
            kwargs["neighbors"] = Topology.ring(2)
        try:
            agree_topology(**kwargs)
            out[label] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[label] = (type(exc).__name__, str(exc))
    return out


def silent_neighbour(rank: int, world: int, bound: float):
    """Rank ``world - 1`` never gossips: its ring neighbours must fail within ``bound`` seconds."""
    import time

    from lightning_optim.comm import CommunicationError

    topology = agree_topology("ring")
    set_collective_timeout(bound)
    if rank == world - 1:
        time.sleep(bound + 2)
        return "silent"
    start = time.monotonic()
    try:
        gossip_average(tensors(rank), topology)
    except CommunicationError as exc:
        return ("CommunicationError", time.monotonic() - start, str(exc))
    return ("no error", time.monotonic() - start, "")
