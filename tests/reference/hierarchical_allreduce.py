"""Single-process simulation of the hierarchical 1-bit average: fp32 inside a node, 1-bit across nodes.

Written from the algorithm (the node/shard scheme of hierarchical allreduces), on top of the plain
1-bit simulation in ``onebit_allreduce.py``; it never imports ``lightning_optim``.

``W = K * L`` workers, node ``k`` holding workers ``kL .. kL + L - 1``. For an ``n``-element input per
worker, with ``S = ceil(n / L)`` and each input padded with zeros to ``L * S``:

    y_k           = (sum of node k's inputs) / L                      (exact fp32 mean inside the node)
    shard l       = positions [l S, (l + 1) S)
    out[shard l]  = onebit_l( y_0[shard l], ..., y_{K-1}[shard l] )   (one 1-bit allreduce over K "workers"
                                                                       per l, each with its own error buffers)
    every worker receives out[:n]

The segments (one scale each) are the input's segments cut at the shard edges; the zeros past ``n`` in the
last shards form one more segment. ``K == 1``: out = y_0 (nothing is compressed).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .onebit_allreduce import RefOnebitAllreduce


def cut(segments: list[int], start: int, stop: int, size: int) -> list[int]:
    """``segments``' parts inside ``[start, stop)``, then the zero tail up to ``size`` elements."""
    out, pos = [], 0
    for length in segments:
        lo, hi = max(pos, start), min(pos + length, stop)
        if hi > lo:
            out.append(hi - lo)
        pos += length
    if sum(out) < size:
        out.append(size - sum(out))
    return out


class RefHierarchicalAllreduce:
    def __init__(self, numel: int, nodes: int, per_node: int, segments=None):
        self.n, self.nodes, self.per_node = numel, nodes, per_node
        self.world = nodes * per_node
        self.shard = -(-numel // per_node)
        lengths = [numel] if segments is None else [int(v) for v in segments if v]
        self.across = [
            RefOnebitAllreduce(self.shard, nodes, segments=cut(lengths, l * self.shard, min(numel, (l + 1) * self.shard),
                                                               self.shard))
            for l in range(per_node)
        ]

    def node_means(self, inputs: list[Tensor]) -> list[Tensor]:
        size = self.shard * self.per_node
        means = []
        for k in range(self.nodes):
            total = torch.zeros(size)
            for j in range(self.per_node):
                total[: self.n] += inputs[k * self.per_node + j].reshape(-1).float()
            means.append(total / self.per_node)
        return means

    def step(self, inputs: list[Tensor]) -> Tensor:
        assert len(inputs) == self.world
        means = self.node_means(inputs)
        if self.nodes == 1:
            return means[0][: self.n].clone()
        out = torch.zeros(self.shard * self.per_node)
        for l, sim in enumerate(self.across):
            lo, hi = l * self.shard, (l + 1) * self.shard
            out[lo:hi] = sim.step([means[k][lo:hi] for k in range(self.nodes)])
        return out[: self.n].clone()

    def worker_error(self, rank: int) -> Tensor:
        """Rank ``rank``'s worker error: that of its node among the ``K`` workers of its shard's allreduce."""
        return self.across[rank % self.per_node].worker_error[rank // self.per_node]

    def server_error(self, rank: int) -> Tensor:
        return self.across[rank % self.per_node].server_error[rank // self.per_node]
