"""Reference DiLoCo / Streaming DiLoCo on W simulated workers, in one process, written from the papers'
equations (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1; Douillard et al. 2025, arXiv 2501.18512,
Algorithm 1 with delay tau = 1 and mixing alpha). No lightning_optim import.

Every worker w holds its params theta_w and its own inner optimizer (``make_inner(params)``, the caller's);
all share the global params theta_g (a list) and, per param, the outer momentum b (zeros at the start).
Fragments: the params cut into F contiguous runs; the cut closing fragment f (1..F-1) after param k, k
chosen among the allowed ones (each fragment keeps one param at least) to bring the running element count
closest to f * total / F (the smaller k on a tie).

Inner step t = 1, 2, ... (``step(grad_fn)``; ``grad_fn(w, t, params)`` fills the grads of worker w):
  1. every worker: grad_fn, then its inner optimizer's step;
  2. overlap: the fragment whose exchange started at t - 1 is merged:
        outer(f, avg);  theta_w[f] = alpha * theta_w[f] + (1 - alpha) * theta_g[f]  for every w
  3. the fragment f with t mod H == ((f + 1) * H / F) mod H, if any:
        delta_w = theta_g[f] - theta_w[f];  avg = reduce_f([delta_w for w])   (mean in worker order, or a
        compressor reference's aggregate)
        without overlap: outer(f, avg);  theta_w[f] = theta_g[f]  for every w
        with overlap: kept for step t + 1
  The run's end with final_sync (``finish()``): a kept exchange merged as step t + 1 would merge it; then every
  fragment f in which some worker's params differ from theta_g: delta_w, avg, outer(f, avg), theta_w[f] =
  theta_g[f] for every w (the step-3 equations without overlap).
  outer(f, avg), per param (SGD with momentum mu, lr eta, no dampening):
        b = mu b + avg;  u = avg + mu b (Nesterov) | b (momentum) | avg (mu = 0);  theta_g = theta_g - eta u
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def fragments_of(numels: Sequence[int], fragments: int) -> list[list[int]]:
    """The param indices of each fragment."""
    total, count = sum(numels), len(numels)
    cuts = [0]
    for f in range(1, fragments):
        best = None
        for k in range(cuts[-1] + 1, count - (fragments - f) + 1):
            distance = abs(sum(numels[:k]) - f * total / fragments)
            if best is None or distance < best[0]:
                best = (distance, k)
        cuts.append(best[1])
    cuts.append(count)
    return [list(range(a, b)) for a, b in zip(cuts[:-1], cuts[1:])]


def mean_of(per_worker: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    out = []
    for i in range(len(per_worker[0])):
        total = per_worker[0][i].clone()
        for w in range(1, len(per_worker)):
            total = total + per_worker[w][i]
        out.append(total / len(per_worker))
    return out


class RefDiLoCo:
    def __init__(self, init: Sequence[torch.Tensor], world: int, make_inner: Callable, *, sync_every: int,
                 outer_lr: float = 0.8, outer_momentum: float = 0.5, nesterov: bool = True, fragments: int = 1,
                 overlap: bool = False, mixing: float = 0.5, reducers: Sequence[Callable] | None = None):
        self.world, self.H, self.F = world, sync_every, fragments
        self.lr, self.mu, self.nesterov, self.overlap, self.alpha = outer_lr, outer_momentum, nesterov, overlap, mixing
        self.workers = [[p.detach().clone().requires_grad_() for p in init] for _ in range(world)]
        self.inners = [make_inner(params) for params in self.workers]
        self.global_params = [p.detach().clone() for p in init]
        self.momenta = [torch.zeros_like(p) for p in self.global_params]
        self.fragments = fragments_of([p.numel() for p in init], fragments)
        self.reducers = list(reducers) if reducers is not None else [mean_of] * fragments
        self.t = 0
        self.kept: tuple[int, list[torch.Tensor]] | None = None

    def _syncing(self, t: int) -> int | None:
        for f in range(self.F):
            if t % self.H == ((f + 1) * self.H // self.F) % self.H:
                return f
        return None

    def _outer(self, f: int, avg: Sequence[torch.Tensor]) -> None:
        for i, a in zip(self.fragments[f], avg):
            if self.mu:
                self.momenta[i] = self.mu * self.momenta[i] + a
                u = a + self.mu * self.momenta[i] if self.nesterov else self.momenta[i]
            else:
                u = a
            self.global_params[i] = self.global_params[i] - self.lr * u

    def _merge_kept(self) -> None:
        f, avg = self.kept
        self.kept = None
        self._outer(f, avg)
        for params in self.workers:
            for i in self.fragments[f]:
                params[i].copy_(self.alpha * params[i] + (1 - self.alpha) * self.global_params[i])

    def _sync(self, f: int) -> None:
        deltas = [[self.global_params[i] - params[i] for i in self.fragments[f]] for params in self.workers]
        self._outer(f, self.reducers[f](deltas))
        for params in self.workers:
            for i in self.fragments[f]:
                params[i].copy_(self.global_params[i])

    def finish(self) -> list[int]:
        """The final synchronisation (see the module docstring); the fragments it synchronised."""
        synced = []
        with torch.no_grad():
            if self.kept is not None:
                self._merge_kept()
            for f in range(self.F):
                if any(not torch.equal(params[i], self.global_params[i]) for params in self.workers
                       for i in self.fragments[f]):
                    self._sync(f)
                    synced.append(f)
        return synced

    def step(self, grad_fn: Callable) -> None:
        self.t += 1
        t = self.t
        for w, (params, inner) in enumerate(zip(self.workers, self.inners)):
            inner.zero_grad()
            grad_fn(w, t, params)
            inner.step()
        with torch.no_grad():
            if self.kept is not None:
                self._merge_kept()
            f = self._syncing(t)
            if f is None:
                return
            if not self.overlap:
                self._sync(f)
                return
            deltas = [[self.global_params[i] - params[i] for i in self.fragments[f]] for params in self.workers]
            self.kept = (f, self.reducers[f](deltas))
