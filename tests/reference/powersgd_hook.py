"""Reference of torch's DDP PowerSGD comm hook (``powerSGD_hook``, Vogels, Karimireddy & Jaggi 2019,
arXiv 1905.13727, Algorithm 1 with error feedback and warm start) on W simulated workers, in one
process: the result every worker gets back, per param, from every worker's own gradient. Written from
the paper and torch's documentation of the hook, without torch's hook code or ``lightning_optim``.

Per step (``iter`` counts steps from 0):
* ``iter < start_powerSGD_iter``: the plain average ``(1/W) sum_w g_w``.
* otherwise, bucket by bucket (the params of each, in DDP's call order), on every worker w with its
  error ``e_w`` (zeros at first): ``M_w = g_w + e_w``, each param viewed as ``(shape[0], -1)``, n x m,
  ``r = min(n, m, rank)``, compressed when ``(n + m) r * min_compression_rate < n m``:

      Q = the warm-start memory, orthogonalised (``warm_start`` and the bucket seen before), else fresh
      P = orth(sum_w M_w Q);   Q = (1/W) sum_w M_w^T P;   result = P Q^T   (Q kept as the memory)

  the other params of the bucket: ``(1/W) sum_w M_w``; then ``e_w = M_w - result`` for every param of the
  bucket (``use_error_feedback``; for an exactly averaged param the W errors sum to zero).
* ``orth``: Gram-Schmidt over the columns, each divided by ``norm + orthogonalization_epsilon``.
* Fresh queries (torch's documented seeding, which every rank shares): one ``numpy.random.RandomState(
  random_seed)``; per bucket that needs them ``torch.manual_seed(rng.randint(1_000_000_000))``, then one
  ``randn((m, r))`` per compressed param, the params grouped by shape in order of first appearance in the
  bucket (torch's batching), each orthogonalised. Mathematically the orthogonalisation of a warm-start Q
  changes nothing (orth(M Q R^-1) = orth(M Q) for upper-triangular R); it is kept for the rounding.

Sums over workers are taken in worker order; gloo's all-reduce adds in an order of its own, so float64
results agree to ~1e-13, not bitwise.
"""
from __future__ import annotations

import numpy as np
import torch


def orth(matrix: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    out = matrix.clone()
    for i in range(out.shape[1]):
        out[:, i] = out[:, i] / (out[:, i].norm() + eps)
        for j in range(i + 1, out.shape[1]):
            out[:, j] = out[:, j] - (out[:, i] * out[:, j]).sum() * out[:, i]
    return out


class RefPowerSGDHook:
    def __init__(self, world: int, shapes, *, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1000,
                 min_compression_rate: float = 2.0, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, random_seed: int = 0) -> None:
        self.world, self.shapes = world, [tuple(s) for s in shapes]
        self.rank, self.start, self.rate = matrix_approximation_rank, start_powerSGD_iter, min_compression_rate
        self.feedback, self.warm, self.eps = use_error_feedback, warm_start, orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)
        self.iter = 0
        self.errors: list[dict[int, torch.Tensor]] = [{} for _ in range(world)]  # worker -> param -> error
        self.queries: dict[int, torch.Tensor] = {}  # param -> warm-start Q
        self.seen: set[tuple[int, ...]] = set()  # buckets whose queries exist

    def _matrix(self, i: int) -> tuple[int, int, int, bool]:
        shape = self.shapes[i]
        n = shape[0] if shape else 1
        m = int(np.prod(shape, dtype=np.int64)) // n
        r = min(n, m, self.rank)
        return n, m, r, (n + m) * r * self.rate < n * m

    def step(self, grads_per_worker, buckets) -> list[torch.Tensor]:
        """The result for every param, from ``grads_per_worker[w][i]``; ``buckets``: lists of param indices."""
        W = self.world
        if self.iter < self.start:
            self.iter += 1
            return [sum(g[i] for g in grads_per_worker) / W for i in range(len(self.shapes))]
        out: list[torch.Tensor] = [None] * len(self.shapes)  # type: ignore[list-item]
        for bucket in buckets:
            ms = [{i: grads_per_worker[w][i] + self.errors[w].get(i, 0) for i in bucket} for w in range(W)]
            compressed = [i for i in bucket if self._matrix(i)[3]]
            key = tuple(bucket)
            if not self.warm or key not in self.seen:
                gen = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
                by_shape: dict[tuple[int, int], list[int]] = {}
                for i in compressed:
                    by_shape.setdefault(self._matrix(i)[:2], []).append(i)
                for group in by_shape.values():
                    for i in group:
                        _, m, r, _ = self._matrix(i)
                        dtype = grads_per_worker[0][i].dtype
                        self.queries[i] = orth(torch.randn((m, r), generator=gen, dtype=dtype), self.eps)
                self.seen.add(key)
            else:
                for i in compressed:
                    self.queries[i] = orth(self.queries[i], self.eps)
            for i in bucket:
                if i in compressed:
                    n = self._matrix(i)[0]
                    mats = [ms[w][i].reshape(n, -1) for w in range(W)]
                    p = orth(sum(mat @ self.queries[i] for mat in mats), self.eps)
                    q = sum(mat.t() @ p for mat in mats) / W
                    self.queries[i] = q
                    out[i] = (p @ q.t()).reshape(self.shapes[i])
                else:
                    out[i] = sum(ms[w][i] for w in range(W)) / W
                if self.feedback:
                    for w in range(W):
                        self.errors[w][i] = ms[w][i] - out[i]
            if not self.warm:
                self.queries.clear()
        self.iter += 1
        return out
