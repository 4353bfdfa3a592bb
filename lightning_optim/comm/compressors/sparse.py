r"""Sparsification: top-k, random-k and blockwise (mlbench's aligned random block), with error feedback.

Each keeps :math:`k` of a tensor's :math:`d` elements (``k``, or ``ratio``: :math:`k = \max(1,
\lfloor \text{ratio}\cdot d \rfloor)`), :math:`C(x) = x_S` on the set :math:`S` and zeros elsewhere:

* :class:`TopK`: :math:`S` = the :math:`k` largest :math:`|x_i|` (``torch.topk``; Stich et al. 2018).
  Ranks pick different sets, so values *and* indices are all-gathered.
* :class:`RandomK`: :math:`S` = ``torch.randperm(d, generator)[:k]``, one draw per tensor per call.
* :class:`Blockwise`: :math:`S = [bk, bk + k)` with ``b = torch.randint(0, d // k, (1,), generator)``
  (mlbench's block; the last ``d mod k`` elements are never picked).

Random selection and its bytes: with ``shared_indices=True`` (default) every rank seeds its generator
with ``seed`` and draws in the same order, so all ranks pick the *same* :math:`S`; then only the
:math:`k` values travel, in one sum all-reduce (ring: :math:`2(W-1)/W \cdot k \cdot 4` bytes for fp32),
instead of an all-gather of values and indices (:math:`(W-1) k (4 + 4)`). The first call with a new
layout checks that the ranks agree on it and on their first indices. ``shared_indices=False`` seeds
with ``seed + global rank`` (independent sets, an unbiased estimate of the full average in expectation)
and all-gathers.

Wire format of the all-gather: per tensor, the values in their dtype then the indices as int32
(int64 when :math:`d \ge 2^{31}`), or the block start as one int64; every tensor of a call in one
uint8 buffer, one ``all_gather`` per call. The aggregate adds every rank's values in rank order
(identical on every rank) and divides by :math:`W` when averaging.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim.optim.validation import check_flag, check_generator_state, check_int, check_unit_interval

from ..dense import world_size
from ..stats import CommStats, ring_allreduce_bytes
from ..timeouts import collective
from .base import LocalCompressor, group_rank, stats_or_default

__all__ = ["SparsePayload", "Sparsifier", "TopK", "RandomK", "Blockwise", "gather_sparse", "index_dtype",
           "sparse_wire_bytes"]

_INT32_MAX = 2**31 - 1
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def index_dtype(numel: int) -> torch.dtype:
    """How indices into ``numel`` elements travel: int32 when they fit, else int64."""
    return torch.int32 if numel <= _INT32_MAX else torch.int64


@dataclass
class SparsePayload:
    """``k`` values of a ``numel``-element tensor, at ``indices`` (int64) or, when None, at ``[start, start + k)``."""

    values: Tensor
    indices: Tensor | None
    start: int
    numel: int

    def dense(self) -> Tensor:
        out = torch.zeros(self.numel, dtype=self.values.dtype, device=self.values.device)
        if self.indices is None:
            out[self.start:self.start + self.values.numel()] = self.values
        else:
            out[self.indices] = self.values
        return out


def sparse_wire_bytes(numel: int, k: int, element_size: int, block: bool) -> int:
    """Bytes of one tensor's message in the all-gather: values, then indices or the block start."""
    return k * element_size + (8 if block else k * index_dtype(numel).itemsize)


def _wire(p: SparsePayload) -> list[Tensor]:
    parts = [p.values.reshape(-1).contiguous().view(torch.uint8)]
    if p.indices is None:
        parts.append(torch.tensor([p.start], dtype=torch.int64, device=p.values.device).view(torch.uint8))
    else:
        parts.append(p.indices.to(index_dtype(p.numel)).view(torch.uint8))
    return parts


def _take(row: Tensor, offset: int, nbytes: int, dtype: torch.dtype) -> Tensor:
    # clone: a slice at an odd offset cannot be viewed as a wider dtype
    return row[offset:offset + nbytes].clone().view(dtype)


def gather_sparse(payloads: Sequence[SparsePayload], *, group=None, average: bool = True,
                  stats: CommStats | None = None) -> list[Tensor]:
    """All-gather every rank's sparse messages (one uint8 buffer per call) and add them up densely.

    Every rank must send messages of the same sizes (same numels, ``k`` and kinds). The sum runs in
    rank order, ``/ W`` when ``average``. Bytes: ``(W - 1)`` times this rank's buffer.
    """
    world = world_size(group)
    if world == 1:
        return [p.dense() for p in payloads]
    mine = torch.cat([part for p in payloads for part in _wire(p)])
    gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=mine.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    collective("all_gather(sparse values+indices)", gather, gathered, mine, group=group)
    stats_or_default(stats).add_compressed((world - 1) * mine.numel(), sum(p.numel for p in payloads), world)
    out = [torch.zeros(p.numel, dtype=p.values.dtype, device=p.values.device) for p in payloads]
    for row in gathered.view(world, -1):
        offset = 0
        for p, dense in zip(payloads, out):
            k, nbytes = p.values.numel(), p.values.numel() * p.values.element_size()
            values = _take(row, offset, nbytes, p.values.dtype)
            offset += nbytes
            if p.indices is None:
                start = int(_take(row, offset, 8, torch.int64))
                offset += 8
                dense[start:start + k] += values
            else:
                idx_dtype = index_dtype(p.numel)
                dense.index_add_(0, _take(row, offset, k * idx_dtype.itemsize, idx_dtype).long(), values)
                offset += k * idx_dtype.itemsize
    if average:
        for dense in out:
            dense.div_(world)
    return out


def _allreduce_shared(payloads: Sequence[SparsePayload], group, world: int, average: bool,
                      stats: CommStats | None) -> list[Tensor]:
    """Same positions on every rank: sum the values alone (low precision travels as fp32: gloo)."""
    dtype = payloads[0].values.dtype
    for p in payloads[1:]:
        dtype = torch.promote_types(dtype, p.values.dtype)
    if dtype in _LOW_PRECISION:
        dtype = torch.float32
    buf = torch.cat([p.values.reshape(-1).to(dtype) for p in payloads])
    collective("all_reduce(sparse values)", dist.all_reduce, buf, group=group)
    stats_or_default(stats).add_compressed(ring_allreduce_bytes(buf.numel(), world, buf.element_size()),
                                           sum(p.numel for p in payloads), world)
    out, offset = [], 0
    for p in payloads:
        k = p.values.numel()
        summed = SparsePayload(buf[offset:offset + k].to(p.values.dtype), p.indices, p.start, p.numel).dense()
        offset += k
        out.append(summed.div_(world) if average else summed)
    return out


def _check_k_ratio(k: object, ratio: object) -> None:
    if (k is None) == (ratio is None):
        raise ValueError(f"give exactly one of k (an int >= 1) and ratio (in (0, 1]), got k={k!r}, ratio={ratio!r}")
    if k is not None:
        check_int("k", k, 1)
        return
    # numpy scalars count as numbers (np.float32(0.01) from a config); a str or bool raises TypeError
    try:
        inside = check_unit_interval("ratio", ratio, closed_right=True) > 0  # 0 would keep nothing
    except ValueError:
        inside = False  # NaN, inf or out of range: one message with the whole range
    if not inside:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")


class Sparsifier(LocalCompressor):
    """What top-k, random-k and blockwise share: ``k`` per tensor, the payload, the exchange."""

    block = False  # the message is a block start, not indices
    shared_indices = False  # every rank picks the same positions (values are all-reduced)

    def __init__(self, k: int | None = None, ratio: float | None = None) -> None:
        _check_k_ratio(k, ratio)
        self.k = None if k is None else int(k)
        self.ratio = None if ratio is None else float(ratio)

    def k_for(self, numel: int) -> int:
        """Elements kept of a ``numel``-element tensor."""
        if self.k is not None:
            return self.k
        return max(1, int(cast(float, self.ratio) * numel))  # _check_k_ratio: ratio is set when k is not

    def check_numel(self, numel: int, index: int) -> None:
        if self.k is not None and self.k > numel:
            raise ValueError(f"k={self.k} exceeds tensors[{index}]'s {numel} elements: k must be in [1, numel]")

    def decompress(self, payload: SparsePayload) -> Tensor:
        return payload.dense()

    def agreement_fields(self, tensors: Sequence[Tensor]) -> dict[str, int]:
        return {**super().agreement_fields(tensors), "k": self.k or 0,
                "ratio_ppm": 0 if self.ratio is None else round(self.ratio * 1e6),
                "shared_indices": int(self.shared_indices)}

    def exchange(self, payloads: Sequence[SparsePayload], *, group=None, average: bool = True,
                 stats: CommStats | None = None) -> list[Tensor]:
        world = world_size(group)
        if world == 1:
            return [p.dense() for p in payloads]
        if self.shared_indices:
            return _allreduce_shared(payloads, group, world, average, stats)
        return gather_sparse(payloads, group=group, average=average, stats=stats)

    def bytes_sent(self, numels: Sequence[int], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        if world_size <= 1:
            return 0
        ks = [self.k_for(n) for n in numels]
        if self.shared_indices:
            size = 4 if dtype in _LOW_PRECISION else torch.empty((), dtype=dtype).element_size()
            return ring_allreduce_bytes(sum(ks), world_size, size)
        element = torch.empty((), dtype=dtype).element_size()
        return (world_size - 1) * sum(sparse_wire_bytes(n, k, element, self.block) for n, k in zip(numels, ks))


class TopK(Sparsifier):
    """Keep the ``k`` (or ``ratio`` of the) largest-magnitude elements of each tensor."""

    def compress(self, flat: Tensor) -> SparsePayload:
        idx = torch.topk(flat.abs(), self.k_for(flat.numel())).indices
        return SparsePayload(flat[idx], idx, 0, flat.numel())


class _Seeded(Sparsifier):
    def __init__(self, k: int | None = None, ratio: float | None = None, *, seed: int = 0,
                 shared_indices: bool = True) -> None:
        super().__init__(k, ratio)
        self.seed = check_int("seed", seed, 0)
        self.shared_indices = check_flag("shared_indices", shared_indices)
        self.generator = torch.Generator().manual_seed(self.seed if shared_indices else self.seed + group_rank())

        self.draws = 0  # positions drawn so far: equal on every rank while they share positions

    def agreement_fields(self, tensors: Sequence[Tensor]) -> dict[str, int]:
        fields = super().agreement_fields(tensors)
        if self.shared_indices:  # same seed and as many draws so far, or summing values is meaningless
            fields.update(seed=self.seed, draws=self.draws)
        return fields

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "draws": self.draws}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        saved = check_generator_state("generator", state.get("generator"))
        draws = state.get("draws", 0)
        if isinstance(draws, bool) or not isinstance(draws, numbers.Integral) or draws < 0:
            raise ValueError(f"state: 'draws' must be an int >= 0, got {draws!r}")
        self.generator.set_state(saved.clone())
        self.draws = int(draws)


class RandomK(_Seeded):
    """Keep ``k`` (or ``ratio``) elements drawn uniformly without replacement (see the module docstring)."""

    def compress(self, flat: Tensor) -> SparsePayload:
        idx = torch.randperm(flat.numel(), generator=self.generator)[:self.k_for(flat.numel())].to(flat.device)
        self.draws += 1
        return SparsePayload(flat[idx], idx, 0, flat.numel())


class Blockwise(_Seeded):
    """Keep one aligned block of ``k`` (or ``ratio``) consecutive elements, drawn uniformly (mlbench)."""

    block = True

    def compress(self, flat: Tensor) -> SparsePayload:
        k = self.k_for(flat.numel())
        start = int(torch.randint(0, flat.numel() // k, (1,), generator=self.generator)) * k
        self.draws += 1
        return SparsePayload(flat[start:start + k].clone(), None, start, flat.numel())
