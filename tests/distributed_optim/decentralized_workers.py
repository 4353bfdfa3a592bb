"""Worker functions for test_decentralized.py (module level, so ``run_workers`` can pickle them).

Gradients are set directly (seeded per rank and step), so the reference can be fed the same ones.
"""
from __future__ import annotations

import io

import torch
from torch import nn

from lightning_optim.comm import comm_stats, set_collective_timeout
from lightning_optim.comm.gossip import Topology, consensus_distance
from lightning_optim.distributed.decentralized import DecentralizedSGD
from tests.ranks import seeded


def model(rank: int, dtype: torch.dtype = torch.float64) -> nn.Module:
    """Rank ``rank``'s starting model: ranks start apart, so the gossip has something to do."""
    with seeded(100 + rank):
        return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(dtype)


def grads(rank: int, step: int, params) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in params]


def neighbors_for(spec, rank: int):
    kind, value = spec
    if kind == "own":
        return value[rank]
    if kind == "topology":
        lists, weights = value
        return Topology.from_neighbors(lists, weights)
    return value  # None, a name or every rank's lists


def _train(opt, net, rank, start, steps):
    for step in range(start, start + steps):
        for p, g in zip(net.parameters(), grads(rank, step, list(net.parameters()))):
            p.grad = g
        opt.step()


def runs(rank: int, world: int, cases, steps: int) -> dict:
    """Each case ``(label, neighbors spec, kwargs)``: params and momentum buffers after ``steps`` steps."""
    out = {}
    for label, spec, kwargs in cases:
        net = model(rank)
        kwargs = {k: rank if v == "<rank>" else v for k, v in kwargs.items()}  # mlbench passes its rank
        opt = DecentralizedSGD(neighbors=neighbors_for(spec, rank), model=net, **kwargs)
        _train(opt, net, rank, 0, steps)
        out[label] = {
            "params": [p.detach().clone() for p in net.parameters()],
            "momentum": [opt.state[p].get("momentum_buffer") for p in net.parameters()],
            "neighbors": opt.neighbors,
        }
    return out


def pure_gossip(rank: int, world: int, steps: int) -> list[float]:
    """lr = 0 on a ring: only the averaging moves the params; the consensus distance per step."""
    net = model(rank)
    opt = DecentralizedSGD(model=net, lr=0.0)
    dists = [consensus_distance(net.parameters())]
    for step in range(steps):
        _train(opt, net, rank, step, 1)
        dists.append(consensus_distance(net.parameters()))
    return dists


class Point(nn.Module):
    def __init__(self, start: torch.Tensor) -> None:
        super().__init__()
        self.x = nn.Parameter(start.clone())


def quadratic(rank: int, world: int, lr: float, steps: int, dim: int = 3) -> dict:
    """f_i(x) = ||x - c_i||^2 / 2 with a different c_i per rank, gradients by autograd."""
    gen = torch.Generator().manual_seed(7 + rank)
    c = 5 * torch.randn(dim, generator=gen, dtype=torch.float64)
    net = Point(torch.randn(dim, generator=gen, dtype=torch.float64))
    opt = DecentralizedSGD(model=net, lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * (net.x - c).square().sum()).backward()
        opt.step()
    return {"c": c, "x": net.x.detach().clone()}


def bytes_per_step(rank: int, world: int, by_layer: bool) -> list[tuple[int, int, int]]:
    net = model(rank, torch.float32)
    opt = DecentralizedSGD(model=net, lr=0.1, momentum=0.9, by_layer=by_layer)
    out = []
    for step in range(3):
        before = comm_stats().copy()
        _train(opt, net, rank, step, 1)
        delta = comm_stats() - before
        out.append((delta.bytes_sent, delta.fp32_equivalent_bytes, delta.control_calls))
    return out


def resume(rank: int, world: int, kwargs: dict, steps: int, cut: int) -> dict:
    """``steps`` straight vs ``cut`` steps, per-rank save through torch.save, a fresh model + optimizer
    (different start) loading it, then the rest; and a load of another rank's state (refused)."""
    net = model(rank)
    opt = DecentralizedSGD(model=net, **kwargs)
    _train(opt, net, rank, 0, steps)
    straight = [p.detach().clone() for p in net.parameters()]

    net = model(rank)
    opt = DecentralizedSGD(model=net, **kwargs)
    _train(opt, net, rank, 0, cut)
    buffer = io.BytesIO()
    torch.save(opt.rank_state_dict(), buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    del net, opt

    net = model(rank + 50)
    opt = DecentralizedSGD(model=net, **kwargs)
    wrong = dict(saved, rank=(rank + 1) % world)
    before = [p.detach().clone() for p in net.parameters()]
    try:
        opt.load_rank_state_dict(wrong if rank == 1 else saved)  # rank 1 picked up its neighbour's file
        refused = None
    except ValueError as exc:
        refused = str(exc)
    untouched = all(torch.equal(a, b) for a, b in zip(before, net.parameters())) and not opt.state
    opt.load_rank_state_dict(saved)
    _train(opt, net, rank, cut, steps - cut)
    resumed = [p.detach().clone() for p in net.parameters()]
    return {"straight": straight, "resumed": resumed, "refused": refused, "untouched": untouched,
            "saved_rank": saved["rank"], "saved_momentum": [v["momentum_buffer"] for v in
                                                          saved["optimizer"]["state"].values()]}


def _argument(value, rank: int):
    if value == "<model>":
        return model(rank)
    if value == "<model-other-layout-on-1>":
        return model(rank) if rank != 1 else nn.Linear(4, 2).double()
    if value == "<no-params>":
        return nn.Tanh()
    if value == "<topology of 2>":
        return Topology.ring(2)
    return value


def bad_arguments(rank: int, world: int, cases) -> dict:
    """Each case ``(label, per-rank kwargs)``: what this rank raised (or None)."""
    set_collective_timeout(10)
    out = {}
    for label, per_rank in cases:
        kwargs = {k: _argument(v, rank) for k, v in per_rank[rank].items()}
        try:
            DecentralizedSGD(**kwargs)
            out[label] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[label] = (type(exc).__name__, str(exc))
    return out


def several(rank: int, world: int, calls) -> dict:
    """Run several of the workers above in one set of processes: ``calls`` is ``[(label, name, args), ...]``."""
    return {label: globals()[name](rank, world, *args) for label, name, args in calls}
