r"""DiLoCo's exchange of one fragment's pseudo-gradients, and the compressors it takes by name.

:func:`start_exchange` averages :math:`\Delta_r` over the ranks of the group, identically on every rank:

* no compressor: one flat all-reduce (sum, then :math:`/W`) in the global copy's dtype (fp32, or fp64 for
  fp64 params), issued with ``async_op`` and waited on by :meth:`Exchange.result`; bytes: the ring rule,
  :math:`2(W-1)/W \cdot n \cdot` element size;
* :class:`~lightning_optim.comm.compressors.Quantizer` (int8/int4): the all-gather of codes and scales in
  flight the same way (``start_reduce``), with this rank's error feedback;
* any other :class:`~lightning_optim.comm.compressors.Compressor` (1-bit, top-k, scaled sign, PowerSGD,
  SparseLoCo): its ``reduce``, which blocks until done (their collectives are not split in two); the 1-bit
  compressor keeps its own error buffers, the others get this rank's residuals (SparseLoCo's accumulators).

With one rank nothing is sent and nothing compressed: the average is :math:`\Delta` itself.

A failure (a rank died or hung) becomes ``CommunicationError`` naming the rank(s) that did not answer the
roll call of ``comm/roll_call.py``, within the collective timeout counted from the exchange's start (the
collective is waited on until ``bound - grace``, the roll call until the bound). The blocking compressors'
collectives keep their own full bound: their roll call ends ``grace`` after the bound (or after the failure).
``roll_call=False`` (a torchft manager's replicas: their membership is the manager's to find out) raises the
``CommunicationError`` as it comes, without a roll call.
"""
from __future__ import annotations

import ctypes
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim.comm.compressors import (
    Compressor,
    Int4Quantizer,
    Int8Quantizer,
    OnebitCompressor,
    PowerSGDCompressor,
    Quantizer,
    ScaledSign,
    SparseLoCo,
    TopK,
)
from lightning_optim.comm.dense import world_size
from lightning_optim.comm.pending import PendingCollective, start_collective
from lightning_optim.comm.roll_call import grace_for, named_failure
from lightning_optim.comm.stats import CommStats, comm_stats, ring_allreduce_bytes
from lightning_optim.comm.timeouts import CommunicationError, collective, collective_timeout

__all__ = ["COMPRESSORS", "Exchange", "broadcast_global_", "keeps_own_errors", "resolve_compressor", "start_exchange"]

# compressor= by name: the instance each name builds (pass an instance for other settings; "sparseloco" also
# takes DiLoCo's density, bits and, as its decay, outer_momentum)
COMPRESSORS: dict[str, Callable[[], Compressor]] = {
    "int8": Int8Quantizer,
    "int4": Int4Quantizer,
    "onebit": OnebitCompressor,
    "sign": ScaledSign,
    "topk": lambda: TopK(ratio=0.01),
    "powersgd": lambda: PowerSGDCompressor(rank=4),
    "sparseloco": SparseLoCo,
}


def _check_name(value: object) -> None:
    if isinstance(value, str):
        if value not in COMPRESSORS:
            raise ValueError(f"compressor must be None, a Compressor instance or one of "
                             f"{', '.join(map(repr, COMPRESSORS))}, got {value!r}")
    elif value is not None and not isinstance(value, Compressor):
        raise TypeError(f"compressor must be None, a name ({', '.join(map(repr, COMPRESSORS))}) or a "
                        f"lightning_optim.comm.compressors.Compressor, got {type(value).__name__}")


def resolve_compressor(value: object, density: object = None, bits: object = None,
                       decay: float | None = None) -> tuple[str, Compressor | None]:
    """``(name, instance)`` for ``compressor=``: None, a name of ``COMPRESSORS`` or a ``Compressor``.
    ``density``/``bits`` (None: SparseLoCo's defaults) and ``decay`` (None: its default) build
    ``"sparseloco"``; given with any other compressor, a ``ValueError`` names them."""
    _check_name(value)
    given = {k: v for k, v in (("density", density), ("bits", bits)) if v is not None}
    if given and value != "sparseloco":
        shown = " and ".join(f"{k}={v!r}" for k, v in given.items())
        if isinstance(value, SparseLoCo):
            raise ValueError(f"{shown}: the SparseLoCo instance given as compressor has its own ({value!r}); set "
                             "them on it, or pass compressor='sparseloco'")
        raise ValueError(f"{shown}: only used with compressor='sparseloco' (SparseLoCo's kept share per chunk and "
                         f"bits per value), got compressor={value!r}; leave them None")
    if value is None:
        return "none", None
    if value == "sparseloco":
        return "sparseloco", SparseLoCo(**given, **({} if decay is None else {"decay": decay}))  # type: ignore[arg-type]
    if isinstance(value, str):
        return value, COMPRESSORS[value]()
    return type(value).__name__, value  # type: ignore[return-value]  # _check_name: a Compressor


def keeps_own_errors(compressor: Compressor | None) -> bool:
    """Whether the compressor holds its error feedback itself (the 1-bit one) instead of taking residuals."""
    return isinstance(compressor, OnebitCompressor)


class Exchange:
    """One fragment's exchange in flight; :meth:`result` is the average (the same on every rank)."""

    def __init__(self, what: str, tag: str, group: Any, started: float, bound: float) -> None:
        self.what, self.tag, self.group, self.started, self.bound = what, tag, group, started, bound
        self.roll_call = True
        self._wait: Callable[[float], list[Tensor]] | None = None
        self._values: list[Tensor] | None = None

    @classmethod
    def ready(cls, values: Sequence[Tensor]) -> Exchange:
        exchange = cls("", "", None, time.monotonic(), 0.0)
        exchange._values = list(values)
        return exchange

    @property
    def done(self) -> bool:
        return self._values is not None

    def result(self) -> list[Tensor]:
        if self._values is None:
            wait = self._wait
            if wait is None:  # only a ready exchange has none, and it has its values
                raise RuntimeError(f"{self.what}: the exchange was never started")
            try:
                self._values = wait(grace_for(self.bound))
            except CommunicationError as exc:
                if not self.roll_call:
                    raise
                raise named_failure(exc, self.what, self.tag, self.group, until=self.started + self.bound) from exc
        return self._values


def _flat_allreduce(deltas: Sequence[Tensor], exchange: Exchange, world: int, stats: CommStats) -> None:
    dtype = deltas[0].dtype
    for d in deltas[1:]:
        dtype = torch.promote_types(dtype, d.dtype)
    flat = torch.cat([d.reshape(-1).to(dtype) for d in deltas])
    pending: PendingCollective = start_collective(f"all_reduce({exchange.what})", dist.all_reduce, flat,
                                                  group=exchange.group)
    stats.add_full_precision(flat.numel(), world, flat.element_size())

    def finish(margin: float) -> list[Tensor]:
        pending.wait(margin)
        flat.div_(world)
        pieces = flat.split([d.numel() for d in deltas])
        return [piece.view(d.shape).to(d.dtype) for piece, d in zip(pieces, deltas)]

    exchange._wait = finish


def start_exchange(deltas: Sequence[Tensor], *, compressor: Compressor | None, residuals: Sequence[Tensor] | None,
                   group: Any, what: str, tag: str, stats: CommStats | None = None,
                   roll_call: bool = True) -> Exchange:
    """Start averaging ``deltas`` over ``group`` (see the module docstring); ``tag`` names the roll call."""
    stats = comm_stats() if stats is None else stats
    world = world_size(group)
    if world == 1:
        return Exchange.ready([d.clone() for d in deltas])
    started, bound = time.monotonic(), collective_timeout()
    exchange = Exchange(what, tag, group, started, bound)
    exchange.roll_call = roll_call
    try:
        if compressor is None:
            _flat_allreduce(deltas, exchange, world, stats)
        elif isinstance(compressor, Quantizer):
            handle = compressor.start_reduce(deltas, residuals, group=group, stats=stats)
            exchange._wait = handle.wait
        else:
            exchange._values = compressor.reduce(deltas, None if keeps_own_errors(compressor) else residuals,
                                                 group=group, stats=stats)
    except CommunicationError as exc:
        if not roll_call:
            raise
        # a blocking compressor's collective has the full bound: survivors that only time out answer just after it
        until = max(started + bound, time.monotonic()) + grace_for(bound)
        raise named_failure(exc, what, tag, group, until=until) from exc
    return exchange


def _checksum(tensors: Sequence[Tensor]) -> int:
    """crc32 of the tensors' bytes (31 bits: fits an int64 and its negation)."""
    crc = 0
    for t in tensors:
        flat = t.detach().reshape(-1).cpu().contiguous()
        if flat.numel():  # read in place (numpy, which torch.Tensor.numpy needs, is not a dependency)
            crc = zlib.crc32((ctypes.c_char * (flat.numel() * flat.element_size())).from_address(flat.data_ptr()), crc)
    return crc


def _same_everywhere(tensors: Sequence[Tensor], group: Any, stats: CommStats | None) -> bool:
    """Whether every rank holds the same bytes (one 16-byte all-reduce of the checksum and its negation):
    under DDP (the strategies, Accelerate) the params are rank 0's already, and a broadcast would cost a
    whole model's bytes for nothing."""
    crc = _checksum(tensors)
    both = torch.tensor([crc, -crc], dtype=torch.int64, device=tensors[0].device)
    collective("all_reduce(DiLoCo params checksum)", dist.all_reduce, both, op=dist.ReduceOp.MAX, group=group)
    (comm_stats() if stats is None else stats).add_control(ring_allreduce_bytes(2, world_size(group), 8))
    return int(both[0]) == -int(both[1])


def broadcast_global_(tensors: Sequence[Tensor], group: Any, stats: CommStats | None = None) -> None:
    """Group rank 0's ``tensors`` on every rank, in place (one flat broadcast; the root sends ``W - 1`` copies),
    unless every rank holds the same already (a checksum all-reduce)."""
    world = world_size(group)
    if world == 1 or _same_everywhere(tensors, group, stats):
        return
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    root = 0 if group is None else dist.get_global_rank(group, 0)
    collective("broadcast(DiLoCo global params)", dist.broadcast, flat, root, group=group)
    sent = (world - 1) * flat.numel() * flat.element_size() if dist.get_rank() == root else 0
    (comm_stats() if stats is None else stats).add_point_to_point(sent, flat.numel(), world)
    for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(piece.view(t.shape))
