"""Reference PowerSGD (Vogels, Karimireddy & Jaggi 2019, arXiv 1905.13727, Algorithms 1-2) on W simulated
workers, followed by torch.optim.SGD's momentum step, as mlbench-core's ``PowerSGD`` optimizer documents
it (no lightning_optim import).

Per step, for each param tensor i (in order) of every worker w (residual e_w, zeros at the start):
  * vectors (ndim <= 1): aggregate = (1/W) sum_w (g_w + e_w), sent exactly (e_w stays 0);
  * matrices, M_w = (g_w + e_w) reshaped to (shape[0], -1), n x m, r = min(n, m, rank):
        Q  = query: a fresh torch.randn((m, r), generator, float32) cast to the params' dtype, or (with
             reuse_query, after the first step) the previous step's averaged Q
        P  = sum_w M_w Q;  P = gram_schmidt(P)
        Q  = (1/W) sum_w M_w^T P
        A  = P Q^T;  e_w = M_w - A;  aggregate = A (or W A without averaging)
    One generator seeded ``seed``, drawn in param order (the contract of the class under test).
  * gram_schmidt: the paper's orthogonalisation, modified Gram-Schmidt over the columns: each column is
    divided by (its norm + 1e-16), then its projection is removed from every later column. The class
    under test uses the same algorithm and epsilon; only the summation order inside the matrix products
    and the all-reduce differs, so float64 results agree to ~1e-13.
Then SGD (torch's equations): d = a + wd p; buf = d (first step) else momentum buf + (1 - dampening) d;
d = d + momentum buf (nesterov) or buf; p <- p - lr d. With W = 1 nothing is compressed (mlbench).
"""
from __future__ import annotations

import torch


def gram_schmidt(p: torch.Tensor, eps: float = 1e-16) -> torch.Tensor:
    p = p.clone()
    for i in range(p.shape[1]):
        p[:, i] = p[:, i] / (torch.sqrt(torch.sum(p[:, i] ** 2)) + eps)
        for j in range(i + 1, p.shape[1]):
            p[:, j] = p[:, j] - torch.sum(p[:, i] * p[:, j]) * p[:, i]
    return p


class RefPowerSGD:
    def __init__(self, params, world, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                 rank=1, reuse_query=False, seed=0, average=True):
        self.params = [p.clone() for p in params]  # the same on every worker
        self.world, self.lr, self.momentum, self.dampening = world, lr, momentum, dampening
        self.weight_decay, self.nesterov, self.rank, self.reuse, self.average = (
            weight_decay, nesterov, rank, reuse_query, average)
        self.memory = [[torch.zeros_like(p) for p in params] for _ in range(world)]
        self.gen = torch.Generator().manual_seed(seed)
        self.queries: dict[int, torch.Tensor] = {}
        self.buffers: dict[int, torch.Tensor] = {}

    def aggregate(self, grads_per_worker):
        out = []
        for i, p in enumerate(self.params):
            ms = [grads_per_worker[w][i] + self.memory[w][i] for w in range(self.world)]
            if p.dim() <= 1:
                total = sum(ms[1:], ms[0].clone())
                out.append(total / self.world if self.average else total)
                continue
            mats = [m.reshape(p.shape[0], -1) for m in ms]
            n, m = mats[0].shape
            r = min(n, m, self.rank)
            q = self.queries.get(i) if self.reuse else None
            if q is None:
                q = torch.randn((m, r), generator=self.gen, dtype=torch.float32).to(p.dtype)
            pm = gram_schmidt(sum(mat @ q for mat in mats))
            q = sum(mat.t() @ pm for mat in mats) / self.world
            approx = pm @ q.t()
            if self.reuse:
                self.queries[i] = q
            for w in range(self.world):
                self.memory[w][i] = (mats[w] - approx).view(p.shape)
            out.append((approx if self.average else approx * self.world).view(p.shape))
        return out

    def step(self, grads_per_worker):
        grads = self.aggregate(grads_per_worker) if self.world > 1 else list(grads_per_worker[0])
        for i, (p, g) in enumerate(zip(self.params, grads)):
            d = g + self.weight_decay * p if self.weight_decay else g.clone()
            if self.momentum:
                buf = self.buffers.get(i)
                buf = d.clone() if buf is None else self.momentum * buf + (1 - self.dampening) * d
                self.buffers[i] = buf
                d = d + self.momentum * buf if self.nesterov else buf
            p.sub_(self.lr * d)
