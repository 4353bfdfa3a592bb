"""Reference compressors with error feedback on W simulated workers, written from the papers' equations
(no lightning_optim import). Every worker holds one residual per tensor; per call, per worker w:

    c_w = g_w + e_w          s_w = C(c_w)          e_w <- c_w - s_w
    aggregate = (1/W) sum_w s_w      (sum without averaging; the workers are added in order 0..W-1)

C, per flattened tensor x of d elements (k elements kept):
  * top-k (Stich et al. 2018): keep the k largest |x_i| (a plain sort here, not torch.topk);
  * random-k: keep ``torch.randperm(d, generator=gen)[:k]`` (the draw contract of the compressor under
    test: one draw per tensor per call, in tensor order); with shared indices every worker uses the
    positions of one generator seeded ``seed``; otherwise worker w draws from its own, seeded ``seed + w``;
  * blockwise (mlbench): keep [b k, b k + k) with ``b = torch.randint(0, d // k, (1,), generator=gen)``;
  * scaled sign (Karimireddy et al. 2019): (||x||_1 / d) * sign(x), sign(0) = +1;
  * majority vote (Bernstein et al. 2018): each worker sends sign(x); the aggregate is
    sign(sum_w sign(x_w)) (0 on a tie), neither averaged nor summed.
k = the given k, or max(1, floor(ratio * d)).
"""
from __future__ import annotations

import torch


def k_of(d: int, k: int | None, ratio: float | None) -> int:
    return k if k is not None else max(1, int(ratio * d))


def topk_positions(x: torch.Tensor, k: int) -> list[int]:
    values = x.tolist()
    return sorted(range(len(values)), key=lambda i: -abs(values[i]))[:k]


def keep(x: torch.Tensor, positions) -> torch.Tensor:
    out = torch.zeros_like(x)
    for i in positions:
        out[i] = x[i]
    return out


def sign_plus(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, torch.ones_like(x), -torch.ones_like(x))


class RefCompressedWorkers:
    """W workers of one compressor kind: "topk", "randomk", "blockwise", "sign", "majority"."""

    def __init__(self, kind: str, world: int, shapes, *, k=None, ratio=None, seed=0, shared_indices=True,
                 dtype=torch.float64, feedback=True):
        self.kind, self.world, self.k, self.ratio = kind, world, k, ratio
        self.shared = shared_indices
        self.feedback = feedback
        self.residuals = [[torch.zeros(s, dtype=dtype) for s in shapes] for _ in range(world)]
        n_gens = 1 if shared_indices else world
        self.gens = [torch.Generator().manual_seed(seed + (0 if shared_indices else w)) for w in range(n_gens)]

    def _positions(self, w: int, x: torch.Tensor, k: int, drawn: dict) -> list[int]:
        d = x.numel()
        if self.kind == "topk":
            return topk_positions(x, k)
        if self.shared and "positions" in drawn:
            return drawn["positions"]
        gen = self.gens[0 if self.shared else w]
        if self.kind == "randomk":
            positions = torch.randperm(d, generator=gen)[:k].tolist()
        else:
            b = int(torch.randint(0, d // k, (1,), generator=gen))
            positions = list(range(b * k, b * k + k))
        drawn["positions"] = positions
        return positions

    def _compress(self, w: int, x: torch.Tensor, drawn: dict) -> torch.Tensor:
        if self.kind == "sign":
            return x.abs().sum() / x.numel() * sign_plus(x)
        if self.kind == "majority":
            return sign_plus(x)
        return keep(x, self._positions(w, x, k_of(x.numel(), self.k, self.ratio), drawn))

    def step(self, grads_per_worker, average=True) -> list[torch.Tensor]:
        """One call: grads_per_worker[w][i] is worker w's tensor i; returns the aggregates."""
        out = []
        for i in range(len(grads_per_worker[0])):
            drawn: dict = {}
            total = None
            for w in range(self.world):
                g = grads_per_worker[w][i]
                c = (g + self.residuals[w][i]) if self.feedback else g.clone()
                flat = c.reshape(-1)
                sent = self._compress(w, flat, drawn).view_as(c)
                if self.feedback:
                    self.residuals[w][i] = c - sent
                total = sent.clone() if total is None else total + sent
            if self.kind == "majority":
                out.append(torch.sign(total))
            else:
                out.append(total / self.world if average else total)
        return out
