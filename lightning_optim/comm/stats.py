"""Byte counters for the collectives in ``lightning_optim.comm``.

Counting rule (per rank, payload bytes only; TCP/IP and backend framing are not counted):
* ``all_to_all_single`` with equal chunks: the chunks this rank sends to the *other* ranks,
  ``(W - 1) * chunk_bytes`` (its own chunk never leaves the process);
* ``all_gather``: this rank's contribution times ``W - 1`` (one copy to every other rank);
* full-precision ``all_reduce`` (``allreduce_mean``): the nominal ring cost,
  ``2 * (W - 1) / W * numel * element_size`` of the dtype actually sent (fp32 for bf16/fp16
  inputs, which are upcast because gloo cannot reduce bf16);
* reduce-scatter of an ``n``-element input (``n / W`` out), as the backend runs it: NCCL (and any backend
  with a reduce-scatter of its own) sends the ring's ``(W - 1) / W * n * element_size``; gloo has none: torch's
  gloo backend all-reduces the whole input and keeps this rank's chunk, so it sends a full all-reduce's
  ``2 * (W - 1) / W * n * element_size`` (measured with the kernel's socket counters: 1M fp32 on 2 ranks,
  4.19 MB on the wire, twice the ring's 2.10 MB); ``reduce_scatter_bytes(n, W, size, backend)`` is the rule;
* ``W == 1``: nothing is sent, nothing is counted.

``fp32_equivalent_bytes`` adds, for every reduced tensor, what a ring fp32 allreduce of it would
send per rank: ``2 * (W - 1) / W * numel * 4``, so ``bytes_sent / fp32_equivalent_bytes`` is the
compression ratio seen on the wire.

``unmanaged_steps`` counts steps where a 1-bit optimizer compressed on several ranks while nothing
switched DDP's allreduce off (no adapter, no ``ddp_allreduce_managed``): DDP's own fp32 allreduce
may have run beside it unseen, so from the first such step ``compression_ratio`` is NaN (unknown)
rather than a saving the wire never saw.

``intra_node_bytes``: the part of ``bytes_sent`` that stayed inside a node (the hierarchical exchanges of
``hierarchy.py``: fp32 reduce-scatter and all-gather among a node's ranks, the reduce-scatter counted by the
rule of the node group's backend); ``inter_node_bytes`` is the rest.

The counter is the process's, shared by its threads. A thread that is a rank of its own (ranks run as threads
of one process, or a replica's exchange on a thread of its own) counts into a counter of its own inside
``counting_for_this_thread()``.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields

__all__ = ["ALLREDUCE_REDUCE_SCATTER", "CommStats", "comm_stats", "reduce_scatter_bytes", "reset_comm_stats",
           "ring_allreduce_bytes"]

# backends whose reduce-scatter is an all-reduce of the whole input (this rank keeps its chunk)
ALLREDUCE_REDUCE_SCATTER = frozenset({"gloo"})


def ring_allreduce_bytes(numel: int, world_size: int, element_size: int = 4) -> int:
    """Bytes one rank sends in a ring allreduce of ``numel`` elements: ``2 (W-1)/W * numel * size``."""
    if world_size <= 1:
        return 0
    return (2 * (world_size - 1) * int(numel) * int(element_size)) // int(world_size)


def reduce_scatter_bytes(numel: int, world_size: int, element_size: int = 4, backend: str = "nccl") -> int:
    """Bytes one rank sends in a reduce-scatter of a ``numel``-element input over ``world_size`` ranks on
    ``backend``: the ring's ``(W-1)/W * numel * size``, or on a backend of ``ALLREDUCE_REDUCE_SCATTER`` (gloo)
    a ring all-reduce's ``2 (W-1)/W * numel * size``."""
    if world_size <= 1:
        return 0
    if backend.lower() in ALLREDUCE_REDUCE_SCATTER:
        return ring_allreduce_bytes(numel, world_size, element_size)
    return ((world_size - 1) * int(numel) * int(element_size)) // int(world_size)


@dataclass
class CommStats:
    """Running totals for this process. See the module docstring for the counting rule (per collective, and
    per backend where the backends send different bytes for the same call: gloo's reduce-scatter)."""

    bytes_sent: int = 0
    fp32_equivalent_bytes: int = 0
    compressed_calls: int = 0
    full_precision_calls: int = 0
    control_calls: int = 0  # small agreement checks (sizes, layouts): bytes sent, no fp32 equivalent
    unmanaged_steps: int = 0  # 1-bit steps beside a DDP allreduce nobody switched off: bytes may be missing
    intra_node_bytes: int = 0  # part of bytes_sent sent to ranks of the same node (hierarchical exchanges)

    def add_compressed(self, bytes_sent: int, numel: int, world_size: int) -> None:
        self.bytes_sent += int(bytes_sent)
        self.fp32_equivalent_bytes += ring_allreduce_bytes(numel, world_size)
        self.compressed_calls += 1

    def add_full_precision(self, numel: int, world_size: int, element_size: int) -> None:
        self.bytes_sent += ring_allreduce_bytes(numel, world_size, element_size)
        self.fp32_equivalent_bytes += ring_allreduce_bytes(numel, world_size)
        self.full_precision_calls += 1

    def add_point_to_point(self, bytes_sent: int, numel: int, world_size: int) -> None:
        """A full-precision exchange with neighbours (gossip): the bytes sent to all of them; its fp32
        equivalent is what a ring allreduce of the same ``numel`` would send."""
        self.bytes_sent += int(bytes_sent)
        self.fp32_equivalent_bytes += ring_allreduce_bytes(numel, world_size)
        self.full_precision_calls += 1

    def add_hierarchical(self, intra_bytes: int, inter: CommStats, numel: int, world_size: int) -> None:
        """One hierarchical average of ``numel`` elements over ``world_size`` ranks: ``intra_bytes`` inside the
        node plus what the inter-node exchange (counted in ``inter``) sent; its fp32 equivalent is the flat
        ring allreduce's over the whole world."""
        self.bytes_sent += int(intra_bytes) + inter.bytes_sent
        self.intra_node_bytes += int(intra_bytes)
        self.fp32_equivalent_bytes += ring_allreduce_bytes(numel, world_size)
        self.compressed_calls += inter.compressed_calls
        self.full_precision_calls += inter.full_precision_calls or (0 if inter.compressed_calls else 1)
        self.control_calls += inter.control_calls

    @property
    def inter_node_bytes(self) -> int:
        """``bytes_sent`` that left the node (all of it outside hierarchical exchanges)."""
        return self.bytes_sent - self.intra_node_bytes

    def add_control(self, bytes_sent: int) -> None:
        self.bytes_sent += int(bytes_sent)
        self.control_calls += 1

    @property
    def compression_ratio(self) -> float:
        """``fp32_equivalent_bytes / bytes_sent`` (``1.0`` when nothing was sent; NaN after unmanaged steps)."""
        if self.unmanaged_steps:
            return float("nan")
        return self.fp32_equivalent_bytes / self.bytes_sent if self.bytes_sent else 1.0

    def copy(self) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __sub__(self, other: CommStats) -> CommStats:
        """Delta between two snapshots: ``now - before`` (e.g. per training step)."""
        return CommStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["compression_ratio"] = self.compression_ratio
        d["inter_node_bytes"] = self.inter_node_bytes
        return d


_DEFAULT = CommStats()
_THIS_THREAD = threading.local()


def comm_stats() -> CommStats:
    """The counter that the collectives add to (a live object, not a copy): the process's, or this thread's own
    inside ``counting_for_this_thread()``."""
    return getattr(_THIS_THREAD, "stats", None) or _DEFAULT


def reset_comm_stats() -> None:
    """Zero the counter ``comm_stats()`` returns."""
    comm_stats().reset()


@contextlib.contextmanager
def counting_for_this_thread(stats: CommStats | None = None) -> Iterator[CommStats]:
    """Count the collectives this thread runs into ``stats`` (a new counter by default, yielded) instead of the
    process's, until the block ends."""
    own = CommStats() if stats is None else stats
    before = getattr(_THIS_THREAD, "stats", None)
    _THIS_THREAD.stats = own
    try:
        yield own
    finally:
        _THIS_THREAD.stats = before
