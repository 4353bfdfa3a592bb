"""Single-process simulation of the error-compensated 1-bit allreduce over W workers.

Written plainly from the algorithm (1-bit Adam, Tang et al. 2021; DeepSpeed's compressed_allreduce):
no packing, no torch.distributed, one list entry per worker. It never imports ``lightning_optim``.

    sim = RefOnebitAllreduce(numel, world_size)
    outs = sim.step([x_0, ..., x_{W-1}])   # one tensor per worker; returns what every worker gets

Per worker ``w`` (error buffer of the padded length ``N = ceil(n / 8W) * 8W``, zeros at start):
    z_w       = x_w (padded with zeros) + worker_error_w
    s_w       = ||z_w[:n]|| / sqrt(n)
    c_w       = s_w * sign(z_w)               (sign(0) = +1; padding positions of c_w are ignored)
    worker_error_w = z_w - c_w  on [:n], 0 on the padding
Per chunk ``r`` of ``C = N / W`` elements (server ``r``, error buffer of C elements):
    avg       = (sum_w c_w[chunk r]) / W,  with positions >= n set to 0
    y         = avg + server_error_r
    t_r       = ||y[real]|| / sqrt(#real)     (0 when the chunk holds no real element)
    out[chunk r] = t_r * sign(y)
    server_error_r = y - out[chunk r]  on real positions, 0 on the padding
Everyone receives ``out[:n]``. ``error_feedback=False`` keeps both error buffers at zero (the
plain "scaled sign" compressor) — the tests use it to show what error feedback buys.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def sign_pm1(v: Tensor) -> Tensor:
    """+1 where v >= 0 (zero included), -1 elsewhere, in v's dtype."""
    return torch.where(v >= 0, torch.ones_like(v), -torch.ones_like(v))


def rms_scale(v: Tensor) -> Tensor:
    if v.numel() == 0:
        return torch.zeros((), dtype=v.dtype)
    return torch.linalg.vector_norm(v) / math.sqrt(v.numel())


class RefOnebitAllreduce:
    def __init__(self, numel: int, world_size: int, error_feedback: bool = True):
        self.n = numel
        self.world = world_size
        unit = 8 * world_size
        self.padded = ((numel + unit - 1) // unit) * unit
        self.chunk = self.padded // world_size
        self.error_feedback = error_feedback
        self.worker_error = [torch.zeros(self.padded) for _ in range(world_size)]
        self.server_error = [torch.zeros(self.chunk) for _ in range(world_size)]

    def step(self, inputs: list[Tensor]) -> Tensor:
        n, world, chunk = self.n, self.world, self.chunk
        assert len(inputs) == world
        if world == 1:
            return inputs[0].reshape(-1).float().clone()

        compressed = []
        for w in range(world):
            z = torch.zeros(self.padded)
            z[:n] = inputs[w].reshape(-1).float()
            z = z + self.worker_error[w]
            s = rms_scale(z[:n])
            c = s * sign_pm1(z)
            if self.error_feedback:
                err = z - c
                err[n:] = 0
                self.worker_error[w] = err
            compressed.append(c)

        out = torch.zeros(self.padded)
        for r in range(world):
            lo, hi = r * chunk, (r + 1) * chunk
            total = compressed[0][lo:hi].clone()
            for w in range(1, world):
                total = total + compressed[w][lo:hi]
            avg = total / world
            real = max(0, min(chunk, n - lo))
            avg[real:] = 0
            y = avg + self.server_error[r]
            t = rms_scale(y[:real])
            out[lo:hi] = t * sign_pm1(y)
            if self.error_feedback:
                err = y - out[lo:hi]
                err[real:] = 0
                self.server_error[r] = err
        return out[:n]
