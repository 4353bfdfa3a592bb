"""Reference int8/int4 quantization with error feedback on W simulated workers, written from the equations (no
lightning_optim import). Per call, per tensor x (flattened, d elements), worker w (residual e_w, zeros first):

    c = x + e_w;  in fp32, per chunk j of ``chunk`` elements (the last may be shorter), L = 2^(bits-1) - 1:
        s_j = max |c_i| / L;  y_i = c_i / s_j (0 where s_j = 0)
        nearest: q_i = round(y_i) (half to even);  stochastic: q_i = floor(y_i + u_i), u_i = the i-th of
        torch.rand(d, generator=gen_w, dtype=float32) (gen_w seeded seed + w, one draw per tensor per call)
        q_i = clamp(q_i, -L, L);  sent_i = q_i * s_j
    e_w <- c - sent (sent cast to the tensor's dtype)
    aggregate = (sum over w in order, in promote(dtype, fp32)) / W
"""
from __future__ import annotations

import math

import torch


class RefQuantizedWorkers:
    def __init__(self, bits: int, world: int, shapes, *, chunk: int, rounding: str = "nearest", seed: int = 0,
                 dtype=torch.float64):
        self.levels = 2 ** (bits - 1) - 1
        self.world, self.chunk, self.rounding = world, chunk, rounding
        self.residuals = [[torch.zeros(s, dtype=dtype) for s in shapes] for _ in range(world)]
        self.gens = [torch.Generator().manual_seed(seed + w) for w in range(world)]

    def quantize(self, w: int, c: torch.Tensor) -> torch.Tensor:
        x = c.reshape(-1).to(torch.float32)
        d = x.numel()
        u = torch.rand(d, generator=self.gens[w], dtype=torch.float32) if self.rounding == "stochastic" else None
        out = torch.empty(d, dtype=torch.float32)
        for j in range(math.ceil(d / self.chunk)):
            lo, hi = j * self.chunk, min(d, (j + 1) * self.chunk)
            s = x[lo:hi].abs().max() / self.levels
            y = x[lo:hi] / s if s > 0 else torch.zeros(hi - lo)
            q = torch.floor(y + u[lo:hi]) if u is not None else torch.round(y)
            out[lo:hi] = q.clamp(-self.levels, self.levels) * s
        return out.view(c.shape)

    def step(self, per_worker):
        """``per_worker[w][i]``: worker w's tensor i; returns the aggregate of each tensor."""
        out = []
        for i in range(len(per_worker[0])):
            total = None
            for w in range(self.world):
                c = per_worker[w][i] + self.residuals[w][i]
                sent = self.quantize(w, c)
                self.residuals[w][i] = c - sent.to(c.dtype)
                wide = sent.to(torch.promote_types(c.dtype, torch.float32))
                total = wide if total is None else total + wide
            out.append((total / self.world).to(per_worker[0][i].dtype))
        return out
