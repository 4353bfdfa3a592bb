"""Single-process simulation of the error-compensated 1-bit allreduce over W workers.

Written plainly from the algorithm (1-bit Adam, Tang et al. 2021; DeepSpeed's compressed_allreduce):
no packing, no torch.distributed, one list entry per worker. It never imports ``lightning_optim``.

    sim = RefOnebitAllreduce(numel, world_size, segments=None)
    outs = sim.step([x_0, ..., x_{W-1}])   # one tensor per worker; returns what every worker gets

Layout: the tensor is cut into segments (None: one); in the padded space each segment starts on a
multiple of 8, the rest is padding, and the space is padded to ``N``, a multiple of ``8W``.
Per worker ``w`` (error buffer of ``N`` elements, zeros at start):
    z_w       = x_w (placed in the padded space) + worker_error_w
    s_w,seg   = ||z_w[seg]|| / sqrt(len(seg))   for every segment
    c_w       = s_w,seg * sign(z_w) on each segment (sign(0) = +1), 0 on the padding
    worker_error_w = z_w - c_w  on the segments, 0 on the padding
Per chunk ``r`` of ``C = N / W`` elements (server ``r``, error buffer of C elements):
    y         = (sum_w c_w[chunk r]) / W + server_error_r
    t_r,piece = ||y[piece]|| / sqrt(len(piece))   for each segment's part (piece) of the chunk
    out[chunk r] = t_r,piece * sign(y) on each piece, 0 on the padding
    server_error_r = y - out[chunk r]  on the pieces, 0 on the padding
Everyone receives ``out`` read back from the segments' places. ``error_feedback=False`` keeps both error buffers at zero (the
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
    def __init__(self, numel: int, world_size: int, error_feedback: bool = True, segments=None):
        self.n = numel
        self.world = world_size
        lengths = [numel] if segments is None else [int(v) for v in segments if v]
        assert sum(lengths) == numel
        # each segment starts on a multiple of 8 of the padded space; -1 marks padding
        self.spans = []  # (start in x, start in the padded space, length)
        start = pos = 0
        for length in lengths:
            self.spans.append((start, pos, length))
            start += length
            pos += -(-length // 8) * 8
        unit = 8 * world_size
        self.padded = -(-pos // unit) * unit
        self.chunk = self.padded // world_size
        self.owner = torch.full((self.padded,), -1)
        for s, (_, pos, length) in enumerate(self.spans):
            self.owner[pos : pos + length] = s
        self.error_feedback = error_feedback
        self.worker_error = [torch.zeros(self.padded) for _ in range(world_size)]
        self.server_error = [torch.zeros(self.chunk) for _ in range(world_size)]

    def step(self, inputs: list[Tensor]) -> Tensor:
        world, chunk = self.world, self.chunk
        assert len(inputs) == world
        if world == 1:
            return inputs[0].reshape(-1).float().clone()
        real = self.owner >= 0

        compressed = []
        for w in range(world):
            x = inputs[w].reshape(-1).float()
            z = torch.zeros(self.padded)
            for start, pos, length in self.spans:
                z[pos : pos + length] = x[start : start + length]
            z = z + self.worker_error[w]
            c = torch.zeros(self.padded)
            for s in range(len(self.spans)):
                where = self.owner == s
                c[where] = rms_scale(z[where]) * sign_pm1(z[where])
            if self.error_feedback:
                self.worker_error[w] = torch.where(real, z - c, torch.zeros(()))
            compressed.append(c)

        out = torch.zeros(self.padded)
        for r in range(world):
            lo, hi = r * chunk, (r + 1) * chunk
            total = compressed[0][lo:hi].clone()
            for w in range(1, world):
                total = total + compressed[w][lo:hi]
            avg = total / world
            owner = self.owner[lo:hi]
            y = avg + self.server_error[r]
            res = torch.zeros(chunk)
            for s in owner[owner >= 0].unique().tolist():  # the piece of segment s in this chunk
                where = owner == s
                res[where] = rms_scale(y[where]) * sign_pm1(y[where])
            out[lo:hi] = res
            if self.error_feedback:
                self.server_error[r] = torch.where(owner >= 0, y - res, torch.zeros(()))
        result = torch.zeros(self.n)
        for start, pos, length in self.spans:
            result[start : start + length] = out[pos : pos + length]
        return result
