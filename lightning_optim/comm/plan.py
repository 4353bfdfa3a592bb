"""The layout of one tensor in the 1-bit format: segments (one scale each), padding, chunks per rank.

A tensor of ``n`` elements is split into segments (``segments=None``: one segment, the whole
tensor; the 1-bit optimizers pass one segment per param, as DeepSpeed compresses each param with
its own scale). In the padded index space that the signs and the error buffers live in, each
segment starts on a multiple of 8 (so its signs start on a byte) and the space is padded to
``N``, a multiple of ``8 W``; rank ``r`` serves chunk ``[r C, (r + 1) C)`` with ``C = N / W``.
Padding never carries data: its error stays 0, its signs are ignored, and it is not part of any
scale. With one segment this is the plain layout ``[x, 0 ... 0]``.

The pieces a chunk cuts out of the segments are the units of the server stage: each gets its own
server scale, sent after the chunk's packed signs (``max_pieces`` slots per rank).
"""
from __future__ import annotations

import operator
import zlib
from collections import OrderedDict
from collections.abc import Sequence

import torch

from .pieces import Pieces

_MAX_CACHED = 16


def _lengths(numel: int, segments: Sequence[int] | None) -> tuple[int, ...]:
    if segments is None:
        return (numel,) if numel else ()
    if isinstance(segments, torch.Tensor):
        segments = segments.tolist()
    lengths = []
    for i, s in enumerate(segments):
        try:
            value = operator.index(s)  # ints, numpy integers, 0-d integer tensors
        except TypeError:
            value = None
        if isinstance(s, bool) or value is None or value < 0:
            raise ValueError(f"segments[{i}] must be an integer >= 0, got {s!r}")
        if value:
            lengths.append(value)
    if sum(lengths) != numel:
        raise ValueError(f"segments must add up to the tensor's {numel} elements, they add up to {sum(lengths)}")
    return tuple(lengths)


def _align8(v: int) -> int:
    return -(-v // 8) * 8


class CompressionPlan:
    """Where every element of an ``n``-element tensor goes for ``world`` ranks (see the module doc)."""

    def __init__(self, numel: int, world: int, segments: Sequence[int] | None = None) -> None:
        if world < 1:
            raise ValueError(f"world_size must be >= 1, got {world}")
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        self.numel, self.world = numel, world
        self.lengths = _lengths(numel, segments)
        offs, poss, pos, off = [], [], 0, 0
        for length in self.lengths:
            offs.append(off)
            poss.append(pos)
            off += length
            pos += _align8(length)
        unit = 8 * world
        self.padded = -(-pos // unit) * unit
        self.chunk = self.padded // world
        # (n, #segments, crc of the lengths): what every rank must agree on before exchanging data
        self.signature = (numel, len(self.lengths), zlib.crc32(repr(self.lengths).encode()))
        self.worker = Pieces(poss, offs, list(self.lengths), self.padded)
        self.segment_ids: list[torch.Tensor] = []  # per rank: the segment of each piece of its chunk
        self.server: list[Pieces] = []  # per rank: its pieces, pos and off chunk-local (the error buffer)
        self.final: list[Pieces] = []  # per rank: the same pieces, off in the tensor
        for r in range(world):
            lo, hi = r * self.chunk, (r + 1) * self.chunk
            ids, local, xoff, lens = [], [], [], []
            for s, (p, o, length) in enumerate(zip(poss, offs, self.lengths)):
                a, b = max(lo, p), min(hi, p + length)
                if a < b:
                    ids.append(s)
                    local.append(a - lo)
                    xoff.append(o + a - p)
                    lens.append(b - a)
            self.segment_ids.append(torch.tensor(ids, dtype=torch.int64))
            self.server.append(Pieces(local, local, lens, self.chunk))
            self.final.append(Pieces(local, xoff, lens, self.chunk))
        self.max_pieces = max([pc.count for pc in self.server] + [1])
        self._ids_on: dict[tuple[int, torch.device], torch.Tensor] = {}

    def ids_on(self, rank: int, device: torch.device) -> torch.Tensor:
        """``segment_ids[rank]`` on ``device`` (cached: no host-to-device copy per call)."""
        key = (rank, device)
        found = self._ids_on.get(key)
        if found is None:
            found = self._ids_on[key] = self.segment_ids[rank].to(device)
        return found


_PLANS: OrderedDict[tuple, CompressionPlan] = OrderedDict()


def plan_for(numel: int, world: int, segments: Sequence[int] | None = None) -> CompressionPlan:
    """The (cached) plan of ``numel`` elements in ``segments`` on ``world`` ranks."""
    lengths = _lengths(numel, segments)  # validated before the cache sees them (3.0 == 3 as a key)
    key = (numel, world, lengths)
    found = _PLANS.get(key)
    if found is None:
        found = _PLANS[key] = CompressionPlan(numel, world, lengths)
        while len(_PLANS) > _MAX_CACHED:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return found
