"""Reference ``CentralizedSparsifiedSGD`` (mlbench-core) on W simulated workers, built on the
single-worker ``RefSparsifiedSGD`` (no lightning_optim import).

mlbench: each worker keeps its own memory (e <- e + lr g), picks its k positions, sends the sparse
vector s_w and zeroes those positions of its memory; all workers all-gather the sparse vectors, add them
(u = sum_w s_w, divided by world_size when average_world) and apply p <- p - u - wd p (wd not scaled by lr).

Built on the single-worker reference: worker w is a ``RefSparsifiedSGD`` with weight_decay 0 stepping a
scratch tensor that starts each step at zero, so after its step the scratch holds -s_w exactly (its
memory and position draws are the reference's own; worker w gets its own generator).
"""
from __future__ import annotations

import torch

from .sparsified_sgd import RefSparsifiedSGD


class RefCentralizedSparsifiedSGD:
    def __init__(self, params, world, lr, weight_decay=0.0, sparse_grad_size=10, random_sparse=False, mode=None,
                 generators=None, average_world=True):
        self.params = [p.clone() for p in params]
        self.world, self.weight_decay, self.average = world, weight_decay, average_world
        self.scratch = [[torch.zeros_like(p) for p in params] for _ in range(world)]
        gens = generators or [None] * world
        self.workers = [RefSparsifiedSGD(self.scratch[w], lr=lr, weight_decay=0.0, sparse_grad_size=sparse_grad_size,
                                         random_sparse=random_sparse, mode=mode, generator=gens[w])
                        for w in range(world)]

    def step(self, grads_per_worker):
        for w, worker in enumerate(self.workers):
            for s in self.scratch[w]:
                s.zero_()
            worker.step(grads_per_worker[w])
        for i, p in enumerate(self.params):
            u = torch.zeros_like(p)
            for w in range(self.world):
                u = u + (-self.scratch[w][i])
            if self.average:
                u = u / self.world
            p.sub_(u + self.weight_decay * p)
