r"""SparseLoCo's compressor (Sarfi et al. 2025, arXiv 2508.15706): chunk-wise top-k of an error-feedback
accumulator, the kept values quantised to ``bits`` bits.

Per call, per tensor, with this rank's accumulator :math:`e` (zeros at the start; the ``residuals`` of
``reduce``), :math:`\beta` = ``decay``:

.. math::
    e \leftarrow \beta e + \Delta, \qquad C = Q(\mathrm{TopK}_\text{chunks}(e)), \qquad e \leftarrow e - C, \qquad
    \text{aggregate} = \tfrac1W \textstyle\sum_r C_r

(:math:`\beta = 1`: plain error feedback; without residuals :math:`C = Q(\mathrm{TopK}_\text{chunks}(\Delta))`).

* **Chunks**: the flattened tensor cut into runs of ``chunk`` elements (the last may be shorter); a run of
  :math:`n` elements keeps :math:`k = \max(1, \mathrm{round}(\text{density}\cdot n))` elements (Python's
  ``round``, half to even): its :math:`k` largest :math:`|e_i|`, in descending order (``torch.topk``).
* **Quantiser**: :math:`L = 2^{\text{bits}-1}` magnitude levels per chunk. The kept values, in descending
  :math:`|\cdot|` order, are cut into :math:`G = \min(L, k)` groups of (nearly) equal count, position :math:`i`
  in group :math:`\lfloor iG/k \rfloor`; group :math:`g`'s level :math:`\ell_g` is the mean :math:`|v|` of its
  members (summed in float64 in that order, divided by their count, rounded to fp32). A value travels as the
  code :math:`2g + [v < 0]` (``bits`` bits) and decodes to :math:`\pm\ell_g`. ``bits=1``: one level, the
  chunk's scaled sign.
* **Wire**: one uint8 buffer per rank and call, all-gathered; per tensor: the :math:`K = \sum k` positions as
  int16 within their chunk (``chunk`` <= 32768), then the :math:`K` codes bit-packed (code :math:`j`'s bit
  :math:`b` is bit :math:`(j\cdot\text{bits} + b) \bmod 8` of byte :math:`\lfloor (j\cdot\text{bits} + b)/8
  \rfloor`, the last byte padded with zeros), then the :math:`\sum G` levels as fp32. Every rank decodes every
  rank's message and adds them in rank order, in ``promote(dtype, fp32)``, then divides by :math:`W`
  (``average``). Bytes per rank and call: :math:`(W-1)\sum_\text{tensors}(2K + \lceil K\,\text{bits}/8\rceil +
  4\sum G)` (:meth:`SparseLoCo.bytes_sent`).

The paper's setting is the default: 64 of every 4096 elements (density 1/64), 2 bits, decay 0.95; in DiLoCo
(``compressor="sparseloco"``) the decayed accumulator takes the place of the outer momentum.
"""
from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim.optim.validation import check_unit_interval, is_bool

from ..dense import world_size
from ..stats import CommStats
from ..timeouts import collective
from .base import LocalCompressor, stats_or_default

__all__ = ["SparseLoCo", "SparseLoCoPayload"]

MAX_CHUNK = 32768  # positions within a chunk travel as int16
_LEVEL_BYTES = 4  # fp32


def _check_int_in(name: str, value: object, low: int, high: int) -> int:
    if is_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    number = int(value)
    if not low <= number <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {number}")
    return number


def _check_density(value: object) -> float:
    try:
        density = check_unit_interval("density", value, closed_right=True)
    except ValueError:
        density = 0.0  # NaN, inf or out of range: one message with the whole range
    if not density > 0:  # 0 would keep nothing
        raise ValueError(f"density must be in (0, 1], got {value!r}")
    return density


def _bits_of(value: float) -> int:
    """The float's IEEE-754 bits as an int64 (an exact agreement field)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


@dataclass
class SparseLoCoPayload:
    """One tensor's message: positions within their chunks (int16), packed codes (uint8), levels (fp32)."""

    positions: Tensor
    packed: Tensor
    levels: Tensor
    numel: int
    dtype: torch.dtype


@dataclass
class _Layout:
    """What a ``numel``-element tensor's message holds, known to every rank from ``numel`` alone."""

    ks: list[int]  # kept per chunk
    groups: list[int]  # levels per chunk
    starts: Tensor  # per kept element: its chunk's first position
    level_base: Tensor  # per kept element: its chunk's first level
    kept: int
    levels: int


class SparseLoCo(LocalCompressor):
    """Chunk-wise top-k of an error-feedback accumulator, quantised to ``bits`` bits (see the module docstring).

    Args:
        density: the share of each chunk kept, in (0, 1] (1/64: the paper's 64 of 4096).
        bits: bits per kept value, in [1, 8]: a sign and ``bits - 1`` bits of magnitude level (2: the paper's).
        chunk: elements per chunk, in [2, 32768] (4096: the paper's).
        decay: :math:`\\beta` of the accumulator, in [0, 1] (0.95: the paper's; 1: plain error feedback).
    """

    def __init__(self, density: float = 0.015625, bits: int = 2, chunk: int = 4096, decay: float = 0.95) -> None:
        self.density = _check_density(density)
        self.bits = _check_int_in("bits", bits, 1, 8)
        self.chunk = _check_int_in("chunk", chunk, 2, MAX_CHUNK)
        self.decay = check_unit_interval("decay", decay, closed_right=True)
        self.level_count = 2 ** (self.bits - 1)
        self._layouts: dict[tuple[int, torch.device], _Layout] = {}

    def __repr__(self) -> str:
        return f"SparseLoCo(density={self.density}, bits={self.bits}, chunk={self.chunk}, decay={self.decay})"

    def kept(self, n: int) -> int:
        """Elements kept of a chunk of ``n`` elements."""
        return max(1, round(self.density * n))

    def _layout(self, numel: int, device: torch.device) -> _Layout:
        key = (numel, device)
        layout = self._layouts.get(key)
        if layout is None:
            sizes = [self.chunk] * (numel // self.chunk) + ([numel % self.chunk] if numel % self.chunk else [])
            ks = [self.kept(n) for n in sizes]
            groups = [min(self.level_count, k) for k in ks]
            counts, per_chunk = torch.tensor(ks, dtype=torch.int64), torch.tensor(groups, dtype=torch.int64)
            chunk_starts = torch.arange(len(sizes), dtype=torch.int64) * self.chunk
            level_starts = per_chunk.cumsum(0) - per_chunk
            layout = self._layouts[key] = _Layout(
                ks, groups, chunk_starts.repeat_interleave(counts).to(device),
                level_starts.repeat_interleave(counts).to(device), sum(ks), sum(groups))
        return layout

    def agreement_fields(self, tensors: Sequence[Tensor]) -> dict[str, int]:
        return {**super().agreement_fields(tensors), "density": _bits_of(self.density), "bits": self.bits,
                "chunk": self.chunk, "decay": _bits_of(self.decay)}

    # ------------------------------------------------------------------ one tensor
    def _select(self, flat: Tensor, layout: _Layout) -> tuple[Tensor, Tensor, Tensor]:
        """(positions within chunk, values in descending |.| per chunk, group of each) of the kept elements."""
        full = flat.numel() // self.chunk
        positions, values, groups = [], [], []
        runs = [(flat[:full * self.chunk].reshape(full, self.chunk), layout.ks[0], layout.groups[0])] if full else []
        if len(layout.ks) > full:
            runs.append((flat[full * self.chunk:].reshape(1, -1), layout.ks[-1], layout.groups[-1]))
        if not runs:  # an empty tensor: an empty message
            empty = flat.new_zeros(0, dtype=torch.int64)
            return empty, flat.new_zeros(0), empty
        for rows, k, g in runs:
            top = torch.topk(rows.abs(), k, dim=1, sorted=True).indices
            positions.append(top.reshape(-1))
            values.append(rows.gather(1, top).reshape(-1))
            groups.append((torch.arange(k, device=flat.device) * g // k).repeat(rows.shape[0]))
        return torch.cat(positions), torch.cat(values), torch.cat(groups)

    def compress(self, flat: Tensor) -> SparseLoCoPayload:
        layout = self._layout(flat.numel(), flat.device)
        positions, values, groups = self._select(flat.detach(), layout)
        # each group's mean |v|: summed in float64 in descending order, then rounded to the fp32 of the wire
        slot = layout.level_base + groups
        sums = torch.zeros(layout.levels, dtype=torch.float64, device=flat.device)
        sums.index_add_(0, slot, values.abs().to(torch.float64))
        members = torch.zeros(layout.levels, dtype=torch.float64, device=flat.device)
        members.index_add_(0, slot, torch.ones_like(sums[slot]))
        codes = (groups * 2 + (values < 0).to(groups.dtype)).to(torch.uint8)
        return SparseLoCoPayload(positions.to(torch.int16), self._pack(codes), (sums / members).to(torch.float32),
                                 flat.numel(), flat.dtype)

    def _pack(self, codes: Tensor) -> Tensor:
        shifts = torch.arange(self.bits, device=codes.device, dtype=torch.uint8)
        stream = ((codes[:, None] >> shifts) & 1).reshape(-1)
        stream = torch.cat([stream, stream.new_zeros(-stream.numel() % 8)])
        weights = torch.tensor([1 << b for b in range(8)], dtype=torch.int32, device=codes.device)
        return (stream.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)

    def _unpack(self, packed: Tensor, count: int) -> Tensor:
        shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
        stream = ((packed[:, None] >> shifts) & 1).reshape(-1)[:count * self.bits].view(count, self.bits)
        weights = torch.tensor([1 << b for b in range(self.bits)], dtype=torch.int64, device=packed.device)
        return (stream.to(torch.int64) * weights).sum(1)

    def _decode(self, payload: SparseLoCoPayload) -> tuple[Tensor, Tensor]:
        """(global positions, fp32 values) of one message."""
        layout = self._layout(payload.numel, payload.levels.device)
        codes = self._unpack(payload.packed, layout.kept)
        magnitude = payload.levels[layout.level_base + codes // 2]
        values = torch.where(codes % 2 == 1, -magnitude, magnitude)
        return layout.starts + payload.positions.to(torch.int64), values

    def decompress(self, payload: SparseLoCoPayload) -> Tensor:
        where, values = self._decode(payload)
        out = torch.zeros(payload.numel, dtype=payload.dtype, device=values.device)
        out[where] = values.to(payload.dtype)
        return out

    def accumulate(self, flat: Tensor, residual: Tensor) -> Tensor:
        """The accumulator rule: ``e <- decay * e + t`` in place; ``e`` is what is compressed (and what it did not
        send stays in it)."""
        return residual.mul_(self.decay).add_(flat)

    # ------------------------------------------------------------------ the collective
    def _wire(self, payloads: Sequence[SparseLoCoPayload]) -> Tensor:
        parts = []
        for p in payloads:
            parts += [p.positions.view(torch.uint8), p.packed, p.levels.view(torch.uint8)]
        return torch.cat(parts)

    def _message_bytes(self, numel: int) -> tuple[int, int, int]:
        layout = self._layout(numel, torch.device("cpu"))
        return 2 * layout.kept, math.ceil(layout.kept * self.bits / 8), _LEVEL_BYTES * layout.levels

    def exchange(self, payloads: Sequence[SparseLoCoPayload], *, group=None, average: bool = True,
                 stats: CommStats | None = None) -> list[Tensor]:
        world = world_size(group)
        if world == 1:
            return [self.decompress(p) for p in payloads]
        mine = self._wire(payloads)
        gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=mine.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        collective("all_gather(SparseLoCo positions+codes+levels)", gather, gathered, mine, group=group)
        stats_or_default(stats).add_compressed((world - 1) * mine.numel(), sum(p.numel for p in payloads), world)
        out = [torch.zeros(p.numel, dtype=torch.promote_types(p.dtype, torch.float32), device=mine.device)
               for p in payloads]
        for row in gathered.view(world, -1):
            offset = 0
            for p, dense in zip(payloads, out):
                sizes = self._message_bytes(p.numel)
                pieces = []
                for nbytes in sizes:  # clone: a slice at an odd offset cannot be viewed as a wider dtype
                    pieces.append(row[offset:offset + nbytes].clone())
                    offset += nbytes
                message = SparseLoCoPayload(pieces[0].view(torch.int16), pieces[1], pieces[2].view(torch.float32),
                                            p.numel, p.dtype)
                where, values = self._decode(message)
                dense.index_add_(0, where, values.to(dense.dtype))
        if average:
            for dense in out:
                dense.div_(world)
        return [dense.to(p.dtype) for dense, p in zip(out, payloads)]

    def bytes_sent(self, numels: Sequence[int], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        if world_size <= 1:
            return 0
        return (world_size - 1) * sum(sum(self._message_bytes(int(n))) for n in numels)
