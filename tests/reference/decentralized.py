"""Reference for mlbench-core's ``DecentralizedSGD``: ``W`` workers simulated in one process, plain loops.

Written from the equations (mlbench's ``DecentralizedSGD.step`` and ``DecentralizedAggregation``),
without lightning_optim. Each step, every worker ``i``:

1. takes a local ``torch.optim.SGD`` step with its own gradient ``g_i`` (L2 decay ``d = g + wd x``;
   momentum ``b = d`` at the first step, else ``b = mu b + (1 - dampening) d``; Nesterov
   ``d = d + mu b``, else ``d = b``; ``x = x - lr d``);
2. then all workers mix: ``X <- M X``, i.e. ``x_i = sum_j M[i, j] x_j``, with the mixing matrix
   ``M`` of the graph: mlbench's uniform ``M[i, j] = 1 / (deg(i) + 1)`` over ``i`` and its
   neighbours, or Metropolis-Hastings ``M[i, j] = 1 / (1 + max(deg(i), deg(j)))``,
   ``M[i, i] = 1 - sum_{j != i} M[i, j]``.

Graphs (undirected, neighbour sets without the rank itself): ring ``i +- 1``; 2-D torus
``rows x cols`` with rank ``r * cols + c`` joined to its four grid neighbours (wrapping);
symmetric exponential graph ``i +- 2^k`` for ``2^k < W``.
"""
from __future__ import annotations

import math

import torch

DT = torch.float64


def ring_neighbors(world: int) -> list[list[int]]:
    return [sorted({(i - 1) % world, (i + 1) % world} - {i}) for i in range(world)]


def torus_neighbors(rows: int, cols: int) -> list[list[int]]:
    out = []
    for r in range(rows):
        for c in range(cols):
            me = r * cols + c
            grid = {((r + dr) % rows) * cols + (c + dc) % cols for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1))}
            out.append(sorted(grid - {me}))
    return out


def exponential_neighbors(world: int) -> list[list[int]]:
    out = []
    for i in range(world):
        hop, near = 1, set()
        while hop < world:
            near |= {(i + hop) % world, (i - hop) % world}
            hop *= 2
        out.append(sorted(near - {i}))
    return out


def mixing_matrix(neighbors: list[list[int]], weights: str = "uniform") -> torch.Tensor:
    world = len(neighbors)
    m = torch.zeros(world, world, dtype=DT)
    for i, row in enumerate(neighbors):
        for j in row:
            if weights == "uniform":
                m[i, j] = 1.0 / (len(row) + 1)
            else:
                m[i, j] = 1.0 / (1 + max(len(row), len(neighbors[j])))
        m[i, i] = 1.0 - sum(float(m[i, j]) for j in row)
    return m


def second_eigenvalue_modulus(m: torch.Tensor) -> float:
    moduli = sorted((abs(complex(v)) for v in torch.linalg.eigvals(m)), reverse=True)
    return moduli[1]


def mix(xs: list[list[torch.Tensor]], m: torch.Tensor) -> list[list[torch.Tensor]]:
    """``xs[i][k]``: worker i's k-th tensor; returns ``sum_j m[i, j] xs[j][k]`` for every i, k."""
    world = len(xs)
    out = []
    for i in range(world):
        mixed = []
        for k in range(len(xs[i])):
            acc = torch.zeros_like(xs[i][k], dtype=DT)
            for j in range(world):
                if m[i, j] != 0:
                    acc = acc + float(m[i, j]) * xs[j][k].to(DT)
            mixed.append(acc)
        out.append(mixed)
    return out


def consensus_distance(xs: list[list[torch.Tensor]]) -> float:
    """``sqrt(mean_i ||x_i - x_bar||^2)`` over the workers' flattened tensors."""
    flat = [torch.cat([t.reshape(-1).to(DT) for t in x]) for x in xs]
    mean = sum(flat) / len(flat)
    return math.sqrt(sum(float(((f - mean) ** 2).sum()) for f in flat) / len(flat))


class DecentralizedSGDReference:
    """``W`` workers' params (float64 copies) and momentum buffers; ``step(grads)`` with ``grads[i][k]``."""

    def __init__(self, params: list[list[torch.Tensor]], m: torch.Tensor, lr: float, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False) -> None:
        self.xs = [[p.detach().to(DT, copy=True) for p in ps] for ps in params]
        self.m = m.to(DT)
        self.lr, self.momentum, self.dampening = lr, momentum, dampening
        self.weight_decay, self.nesterov = weight_decay, nesterov
        self.buffers: list[list[torch.Tensor | None]] = [[None] * len(ps) for ps in params]

    def _local_step(self, i: int, grads: list[torch.Tensor]) -> None:
        for k, g in enumerate(grads):
            x = self.xs[i][k]
            d = g.to(DT) + self.weight_decay * x
            if self.momentum != 0:
                b = self.buffers[i][k]
                b = d.clone() if b is None else self.momentum * b + (1 - self.dampening) * d
                self.buffers[i][k] = b
                d = d + self.momentum * b if self.nesterov else b
            self.xs[i][k] = x - self.lr * d

    def step(self, grads: list[list[torch.Tensor]]) -> None:
        for i, g in enumerate(grads):
            self._local_step(i, g)
        self.xs = mix(self.xs, self.m)
