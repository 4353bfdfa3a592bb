r"""Int8 and int4 quantization with one scale per chunk, and error feedback: the 4-bit outer gradients of
Streaming DiLoCo (Douillard et al. 2025), as a compressor for anything that averages tensors.

Per flattened tensor :math:`x` (:math:`d` elements) cut into chunks of ``chunk`` elements (the last one
may be shorter), :math:`b` bits, :math:`L = 2^{b-1} - 1` (127 for int8, 7 for int4), all in fp32:

.. math::
    s_j = \max_{i \in j} |x_i| \,/\, L, \qquad y_i = x_i / s_j \quad (y_i = 0 \text{ where } s_j = 0) \\
    q_i = \operatorname{round}(y_i) \;\text{(nearest, half to even)} \quad\text{or}\quad
    q_i = \lfloor y_i + u_i \rfloor,\ u_i \sim U[0, 1) \;\text{(stochastic: } E[q_i] = y_i) \\
    q_i \leftarrow \operatorname{clamp}(q_i, -L, L), \qquad C(x)_i = q_i\, s_j

``rounding="nearest"`` (default) or ``"stochastic"``. Stochastic draws: ``torch.rand(d, generator=gen,
dtype=torch.float32)`` per tensor per call, in tensor order, from a generator seeded ``seed + rank`` (this
process's global rank when the quantizer is built: each rank draws its own); its state is in :meth:`state_dict`.
With error feedback (the
``residuals`` of ``reduce``), what rounding drops comes back in the next call: :math:`e \leftarrow c - C(c)`.

Wire: one uint8 buffer per call, all-gathered. Per tensor: the codes (int8: one byte each, two's
complement; int4: two per byte, :math:`q + 8` in the low nibble for even positions and the high nibble for
odd ones, an odd last element padded with 8, i.e. 0), then its :math:`\lceil d/\text{chunk} \rceil` scales
as fp32. Every rank decodes every rank's message, adds them in rank order in ``promote(dtype, fp32)``, and
divides by :math:`W` (``average``). Bytes per rank and call (the all-gather rule of ``comm/stats.py``):
:math:`(W-1) \sum (\text{codes} + 4\lceil d/\text{chunk} \rceil)`, codes :math:`= d` (int8) or
:math:`\lceil d/2 \rceil` (int4). A ring fp32 all-reduce sends :math:`8(W-1)/W` bytes per element: the
all-gather of int8 codes costs less while :math:`W < 8`, of int4 codes while :math:`W < 16`.

:meth:`Quantizer.start_reduce` issues the all-gather without waiting (``async_op``) and returns a handle whose
``wait()`` decodes: DiLoCo's overlapped exchange computes while the bytes travel.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim.optim.validation import check_generator_state, check_int

from ..dense import world_size
from ..pending import PendingCollective, start_collective
from ..stats import CommStats
from .base import LocalCompressor, agree_layout, check_reduce_args, group_rank, stats_or_default

__all__ = ["Int4Quantizer", "Int8Quantizer", "QuantizedPayload", "Quantizer", "PendingQuantized", "ROUNDINGS"]

ROUNDINGS = ("nearest", "stochastic")
_SCALE_BYTES = 4  # fp32


@dataclass
class QuantizedPayload:
    """The codes (int8 values, or int4 packed two per byte, as uint8) and fp32 scales of one tensor."""

    codes: Tensor
    scales: Tensor
    numel: int
    dtype: torch.dtype


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class Quantizer(LocalCompressor):
    """``bits``-bit (8 or 4) symmetric quantization, one fp32 scale per ``chunk`` elements. See the module."""

    def __init__(self, bits: int = 8, *, chunk: int = 256, rounding: str = "nearest", seed: int = 0) -> None:
        bits = check_int("bits", bits, 1)
        if bits not in (4, 8):
            raise ValueError(f"bits must be 8 or 4, got {bits}")
        self.bits = bits
        self.chunk = check_int("chunk", chunk, 1)
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(map(repr, ROUNDINGS))}, got {rounding!r}")
        self.rounding = rounding
        self.seed = check_int("seed", seed, 0)
        self.levels = 2 ** (bits - 1) - 1
        self.generator = torch.Generator().manual_seed(self.seed + group_rank())

    # ------------------------------------------------------------------ one tensor
    def compress(self, flat: Tensor) -> QuantizedPayload:
        x = flat.detach().to(torch.float32)
        d = x.numel()
        chunks = math.ceil(d / self.chunk)
        padded = torch.zeros(chunks * self.chunk, dtype=torch.float32, device=x.device)
        padded[:d] = x
        rows = padded.view(chunks, self.chunk)
        scales = rows.abs().amax(dim=1) / self.levels
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        y = (rows / safe[:, None]).reshape(-1)[:d]
        if self.rounding == "stochastic":
            u = torch.rand(d, generator=self.generator, dtype=torch.float32).to(x.device)
            q = torch.floor(y + u)
        else:
            q = torch.round(y)
        q = q.clamp_(-self.levels, self.levels).to(torch.int8)
        return QuantizedPayload(self._pack(q), scales, d, flat.dtype)

    def _pack(self, q: Tensor) -> Tensor:
        if self.bits == 8:
            return q.view(torch.uint8)
        nibbles = (q.to(torch.int16) + 8).to(torch.uint8)
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
        pairs = nibbles.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)

    def _unpack(self, codes: Tensor, numel: int) -> Tensor:
        if self.bits == 8:
            return codes.view(torch.int8).to(torch.float32)
        low = (codes & 0x0F).to(torch.float32) - 8
        high = (codes >> 4).to(torch.float32) - 8
        return torch.stack([low, high], dim=1).reshape(-1)[:numel]

    def dequantize(self, codes: Tensor, scales: Tensor, numel: int) -> Tensor:
        """:math:`q_i s_j` in fp32."""
        return self._unpack(codes, numel) * scales.repeat_interleave(self.chunk)[:numel]

    def decompress(self, payload: QuantizedPayload) -> Tensor:
        return self.dequantize(payload.codes, payload.scales, payload.numel).to(payload.dtype)

    def code_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else math.ceil(numel / 2)

    def payload_bytes(self, numel: int) -> int:
        """Bytes of one tensor's message: its codes and scales."""
        return self.code_bytes(numel) + _SCALE_BYTES * math.ceil(numel / self.chunk)

    # ------------------------------------------------------------------ the call
    def agreement_fields(self, tensors: Sequence[Tensor]) -> dict[str, int]:
        return {**super().agreement_fields(tensors), "bits": self.bits, "chunk": self.chunk,
                "rounding": ROUNDINGS.index(self.rounding), "seed": self.seed}

    def start_reduce(self, tensors: Sequence[Tensor], residuals: Sequence[Tensor] | None = None, *, group=None,
                     average: bool = True, stats: CommStats | None = None) -> PendingQuantized:
        """``reduce`` with the all-gather left in flight: ``.wait()`` returns what ``reduce`` would."""
        tensors, residuals = check_reduce_args(tensors, residuals, group, average)
        agree_layout(self, self.agreement_fields(tensors), group, tensors)
        return self.start_exchange(self.compress_all(tensors, residuals), group=group, average=average, stats=stats,
                                   like=tensors)

    def reduce(self, tensors: Sequence[Tensor], residuals: Sequence[Tensor] | None = None, *, group=None,
               average: bool = True, stats: CommStats | None = None) -> list[Tensor]:
        return self.start_reduce(tensors, residuals, group=group, average=average, stats=stats).wait()

    def start_exchange(self, payloads: Sequence[QuantizedPayload], *, group=None, average: bool = True,
                       stats: CommStats | None = None, like: Sequence[Tensor] | None = None) -> PendingQuantized:
        world = world_size(group)
        mine = torch.cat([part for p in payloads for part in (p.codes, p.scales.view(torch.uint8))])
        if world == 1:
            return PendingQuantized(self, payloads, mine.view(1, -1), None, 1, average, like)
        gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=mine.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        pending = start_collective(f"all_gather(int{self.bits} codes+scales)", gather, gathered, mine, group=group)
        stats_or_default(stats).add_compressed((world - 1) * mine.numel(), sum(p.numel for p in payloads), world)
        return PendingQuantized(self, payloads, gathered.view(world, -1), pending, world, average, like)

    def exchange(self, payloads: Sequence[QuantizedPayload], *, group=None, average: bool = True,
                 stats: CommStats | None = None) -> list[Tensor]:
        return self.start_exchange(payloads, group=group, average=average, stats=stats).wait()

    def decode_row(self, row: Tensor, payloads: Sequence[QuantizedPayload]) -> list[Tensor]:
        """One rank's message (a row of the all-gather) as dense fp32 tensors, laid out like ``payloads``."""
        out, offset = [], 0
        for p in payloads:
            codes = row[offset:offset + p.codes.numel()]
            offset += p.codes.numel()
            nbytes = p.scales.numel() * _SCALE_BYTES
            scales = row[offset:offset + nbytes].clone().view(torch.float32)  # clone: odd offsets
            offset += nbytes
            out.append(self.dequantize(codes, scales, p.numel))
        return out

    def bytes_sent(self, numels: Sequence[int], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        if world_size <= 1:
            return 0
        return (world_size - 1) * sum(self.payload_bytes(int(n)) for n in numels)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        saved = check_generator_state("generator", state.get("generator"))
        self.generator.set_state(saved.clone())


class PendingQuantized:
    """A quantized all-gather in flight; ``wait()`` decodes every rank's message and aggregates."""

    def __init__(self, quantizer: Quantizer, payloads: Sequence[QuantizedPayload], rows: Tensor,
                 pending: PendingCollective | None, world: int, average: bool,
                 like: Sequence[Tensor] | None) -> None:
        self.quantizer, self.payloads, self.rows, self.pending = quantizer, list(payloads), rows, pending
        self.world, self.average, self.like = world, average, like

    @property
    def deadline(self) -> float | None:
        return None if self.pending is None else self.pending.deadline

    def wait(self, margin: float = 0.0) -> list[Tensor]:
        if self.pending is not None:
            self.pending.wait(margin)
        totals = [torch.zeros(p.numel, dtype=_sum_dtype(p.dtype), device=p.codes.device) for p in self.payloads]
        for row in self.rows:  # rank order: the same sum on every rank
            for total, part in zip(totals, self.quantizer.decode_row(row, self.payloads)):
                total += part
        if self.average and self.world > 1:
            for total in totals:
                total.div_(self.world)
        if self.like is None:
            return [t.to(p.dtype) for t, p in zip(totals, self.payloads)]
        return [t.view(x.shape).to(x.dtype) for t, x in zip(totals, self.like)]


class Int8Quantizer(Quantizer):
    """8-bit codes, one fp32 scale per ``chunk`` elements (see the module)."""

    def __init__(self, *, chunk: int = 256, rounding: str = "nearest", seed: int = 0) -> None:
        super().__init__(8, chunk=chunk, rounding=rounding, seed=seed)


class Int4Quantizer(Quantizer):
    """4-bit codes, two per byte, one fp32 scale per ``chunk`` elements (see the module)."""

    def __init__(self, *, chunk: int = 256, rounding: str = "nearest", seed: int = 0) -> None:
        super().__init__(4, chunk=chunk, rounding=rounding, seed=seed)
