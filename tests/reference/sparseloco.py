"""Reference SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706) on W simulated workers, written from the equations and
the wire format (no lightning_optim import). Every worker w keeps one accumulator e per tensor (zeros at the start);
per call, per tensor, with the worker's pseudo-gradient delta:

    e <- beta * e + delta                      (beta: the decay)
    C  = Q(TopK_chunks(e))
    e <- e - C
    aggregate = (C_0 + C_1 + ... + C_{W-1}) / W      (added in worker order, in promote(dtype, fp32))

TopK_chunks: the flattened tensor cut into runs of ``chunk`` elements (the last may be shorter); a run of n elements
keeps k = max(1, round(density * n)) (Python's round) of them: the k largest |e_i|, in descending |e_i| order (a
plain sort here, ties by position).
Q, per run, L = 2 ** (bits - 1), G = min(L, k): the kept value at place i (0-based, in that order) belongs to group
i * G // k; group g's level = its members' |values| added in that order in float64, divided by their count,
rounded to fp32; a kept value decodes to -level if it is negative, else +level; every other element to 0.

Wire (what ``message_bytes`` counts), per tensor of K kept values and M levels: K positions as int16, the K codes of
``bits`` bits packed ceil(K * bits / 8) bytes, M levels as fp32; per call and worker, (W - 1) times the sum over the
tensors (an all-gather).
"""
from __future__ import annotations

import math

import torch


def kept(n: int, density: float) -> int:
    return max(1, round(density * n))


def _fp32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def runs(numel: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) of each run of a ``numel``-element tensor."""
    return [(lo, min(chunk, numel - lo)) for lo in range(0, numel, chunk)]


def compress(x: torch.Tensor, *, density: float, bits: int, chunk: int) -> torch.Tensor:
    """C(x) for one tensor, shaped and typed like ``x``."""
    values = x.reshape(-1).tolist()
    out = [0.0] * len(values)
    for lo, n in runs(len(values), chunk):
        part = values[lo:lo + n]
        k = kept(n, density)
        order = sorted(range(n), key=lambda j: -abs(part[j]))[:k]
        groups = min(2 ** (bits - 1), k)
        members: list[list[int]] = [[] for _ in range(groups)]
        for place, j in enumerate(order):
            members[place * groups // k].append(j)
        for js in members:
            total = 0.0
            for j in js:
                total += abs(part[j])
            level = _fp32(total / len(js))
            for j in js:
                out[lo + j] = -level if part[j] < 0 else level
    return torch.tensor(out, dtype=x.dtype).view(x.shape)


def message_bytes(numel: int, *, density: float, bits: int, chunk: int) -> int:
    """Bytes of one tensor's message in the all-gather."""
    ks = [kept(n, density) for _, n in runs(numel, chunk)]
    levels = sum(min(2 ** (bits - 1), k) for k in ks)
    return 2 * sum(ks) + math.ceil(sum(ks) * bits / 8) + 4 * levels


class RefSparseLoCoWorkers:
    """W workers' accumulators for tensors of ``shapes``; ``step(per_worker)`` is one call (the aggregates)."""

    def __init__(self, world: int, shapes, *, density: float, bits: int, chunk: int, decay: float,
                 dtype: torch.dtype = torch.float64):
        self.world, self.density, self.bits, self.chunk, self.decay = world, density, bits, chunk, decay
        self.accumulators = [[torch.zeros(s, dtype=dtype) for s in shapes] for _ in range(world)]

    def step(self, per_worker) -> list[torch.Tensor]:
        """``per_worker[w][i]``: worker w's pseudo-gradient of tensor i."""
        out = []
        for i in range(len(per_worker[0])):
            total = None
            for w in range(self.world):
                e = self.accumulators[w][i] * self.decay + per_worker[w][i]
                sent = compress(e, density=self.density, bits=self.bits, chunk=self.chunk)
                self.accumulators[w][i] = e - sent
                wide = sent.to(torch.promote_types(sent.dtype, torch.float32))
                total = wide.clone() if total is None else total + wide
            out.append((total / self.world).to(per_worker[0][i].dtype))
        return out
