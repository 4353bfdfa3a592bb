"""Alpha-beta model of one optimizer step's communication and compute, for 2 to 1024 ranks.

Used by ``benchmarks/scale_model.py`` (tables, plot, validation); the byte formulas are checked
against the project's own counters by ``tests/test_scale_model.py``.

A link sends one message of ``b`` bytes in ``alpha + b / bandwidth`` seconds. Every rank has its
own link at the link speed (``flat``); a ``hierarchical`` topology puts ``ranks_per_node`` ranks
in one node, joined by a faster intra-node link, and each rank keeps its own inter-node link
(one NIC per rank, as in GPU nodes with a NIC per device). Collectives, per rank:

* ring allreduce of ``B`` bytes: ``2 (W-1)`` messages, ``2 (W-1)/W B`` bytes (``stats.ring_allreduce_bytes``);
* 1-bit ``compressed_allreduce`` (``comm/compressed.py``): an ``all_gather`` of a 32-byte header,
  an ``all_to_all`` of packed sign chunks + the worker's segment scales, an ``all_gather`` of the
  server's packed chunk + its piece scales: ``3 (W-1)`` messages and
  ``(W-1) (32 + 4 S + C/8 + C/8 + 4 P)`` bytes (``compressed_bytes``), recomputed here from the
  segment lengths (``S`` segments, ``C`` the chunk, ``P`` the most pieces in a chunk);
* hierarchical: a fp32 reduce-scatter inside the node, the inter-node collective on the node's
  shard (``1/G`` of the tensor) among the ``W/G`` nodes, a fp32 all-gather inside the node. For
  1-bit this is a *variant the code does not have yet* (error feedback per node shard).

Nothing overlaps: the step is compute, then its collectives, one after the other (as the code
runs today: communication starts after backward). Forward/backward time is an input (default 0:
the step time modelled is the communication + optimizer part).
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

HEADER_BYTES = 8 * 4  # compressed.py: (n, #segments, crc, dtype) as int64, all_gathered first
FP32 = 4


@dataclass(frozen=True)
class Link:
    """Per-message latency ``alpha_s`` and bandwidth of one rank's link."""

    alpha_s: float
    bytes_per_s: float

    def seconds(self, messages: int, nbytes: float) -> float:
        return messages * self.alpha_s + nbytes / self.bytes_per_s


def gbit(rate_gbit_s: float, alpha_s: float) -> Link:
    return Link(alpha_s, rate_gbit_s * 1e9 / 8)


@dataclass(frozen=True)
class Topology:
    world: int
    inter: Link
    intra: Link | None = None  # None: flat (every hop at the inter-node link)
    ranks_per_node: int = 8

    @property
    def local(self) -> int:
        """Ranks per node taking part in the intra-node phases (1 when flat)."""
        return 1 if self.intra is None else min(self.ranks_per_node, self.world)

    @property
    def nodes(self) -> int:
        if self.world % self.local:
            raise ValueError(f"world {self.world} is not a multiple of ranks_per_node {self.local}")
        return self.world // self.local


@dataclass(frozen=True)
class ComputeRates:
    """Seconds per element of the optimizer-side passes (see ``MEASURED_HERE`` for where they come from)."""

    adam_s_per_param: float
    onebit_s_per_elem: float  # the whole compute of one compressed_allreduce, per element of the tensor
    stream_bytes_per_s: float  # memory stream rate, for passes priced by their bytes (PowerSGD, 0/1 accumulator)

    def scaled(self, speedup: float) -> "ComputeRates":
        return ComputeRates(self.adam_s_per_param / speedup, self.onebit_s_per_elem / speedup,
                            self.stream_bytes_per_s * speedup)


# Measured on the 2-core EPYC VM. AdamW: benchmarks/kernels.py (docs/benchmarks.md), fp32 40M params
# in 8 tensors 29.94 ms with 2 threads (28 B/param -> 37.4 GB/s, also the stream rate). 1-bit:
# compressed_allreduce's whole compute, 8M fp32 in one segment, 1 thread, collectives skipped
# (`scale_model.py --measure-compute`: 0.638 ns/element; replaced by a fresh measurement
# when that flag or --validate is given).
MEASURED_HERE = ComputeRates(adam_s_per_param=29.94e-3 / 40e6,
                             onebit_s_per_elem=0.638e-9,
                             stream_bytes_per_s=28 * 40e6 / 29.94e-3)
POWERSGD_BYTES_PER_MATRIX_ELEM = 32  # assumed: M=G+E (12), MQ (4), M^T P (4), E=M-PQ^T and result (12)
ZERO_ONE_ACCUMULATOR_BYTES = 12  # assumed: u = decay*u + a*m, read u, m, write u


# ----------------------------------------------------------------------------- bytes
def ring_allreduce_bytes(numel: int, world: int, element_size: int = FP32) -> int:
    """``stats.ring_allreduce_bytes``: ``2 (W-1)/W * numel * element_size`` (floor), 0 for one rank."""
    return 0 if world <= 1 else (2 * (world - 1) * numel * element_size) // world


def _align8(v: int) -> int:
    return -(-v // 8) * 8


def onebit_bytes(segments: Sequence[int], world: int) -> int:
    """Bytes one rank sends in one ``compressed_allreduce`` of a tensor cut into ``segments``."""
    lengths = [int(s) for s in segments if s]
    if world <= 1:
        return 0
    starts, ends, pos = [], [], 0
    for length in lengths:
        starts.append(pos)
        ends.append(pos + length)
        pos += _align8(length)
    unit = 8 * world
    chunk = (-(-pos // unit) * unit) // world
    pieces = max([bisect.bisect_left(starts, (r + 1) * chunk) - bisect.bisect_right(ends, r * chunk)
                  for r in range(world)] + [1])
    return (world - 1) * (HEADER_BYTES + 4 * len(lengths) + 2 * (chunk // 8) + 4 * pieces)


def shard_segments(segments: Sequence[int], shards: int) -> list[list[int]]:
    """The segment lengths each of ``shards`` equal contiguous slices of the flat tensor holds."""
    total = sum(segments)
    bounds = [total * k // shards for k in range(shards + 1)]
    out: list[list[int]] = []
    for lo, hi in zip(bounds, bounds[1:]):
        cut, start = [], 0
        for length in segments:
            a, b = max(lo, start), min(hi, start + length)
            if a < b:
                cut.append(b - a)
            start += length
        out.append(cut)
    return out


def powersgd_elements(shapes: Sequence[tuple[int, ...]], rank: int) -> tuple[int, int, int]:
    """``(P, Q, vector)`` elements of one PowerSGD reduce (``PowerSGDCompressor.ranks_of``'s rule)."""
    p = q = vec = 0
    for shape in shapes:
        if len(shape) <= 1:
            vec += math.prod(shape)
            continue
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, rank)
        p, q = p + n * r, q + m * r
    return p, q, vec


# ----------------------------------------------------------------------------- collectives
@dataclass(frozen=True)
class Comm:
    seconds: float
    inter_bytes: float  # bytes this rank sends on its inter-node (or flat) link
    intra_bytes: float = 0.0

    def __add__(self, other: "Comm") -> "Comm":
        return Comm(self.seconds + other.seconds, self.inter_bytes + other.inter_bytes,
                    self.intra_bytes + other.intra_bytes)

    def times(self, k: float) -> "Comm":
        return Comm(self.seconds * k, self.inter_bytes * k, self.intra_bytes * k)


def _ring_allreduce(numel: int, world: int, link: Link) -> Comm:
    if world <= 1:
        return Comm(0.0, 0)
    sent = ring_allreduce_bytes(numel, world)
    return Comm(link.seconds(2 * (world - 1), sent), sent)


def _onebit(segments: Sequence[int], world: int, link: Link) -> Comm:
    if world <= 1:
        return Comm(0.0, 0)
    sent = onebit_bytes(segments, world)
    return Comm(link.seconds(3 * (world - 1), sent), sent)


def _intra_phases(numel: int, topo: Topology) -> Comm:
    """fp32 reduce-scatter + all-gather inside the node (the two halves of a ring allreduce)."""
    g = topo.local
    if g <= 1 or topo.intra is None:
        return Comm(0.0, 0)
    sent = ring_allreduce_bytes(numel, g)
    return Comm(topo.intra.seconds(2 * (g - 1), sent), 0, sent)


def allreduce(numel: int, topo: Topology) -> Comm:
    """fp32 allreduce: one ring (flat) or reduce-scatter / inter-node ring on the shard / all-gather."""
    if topo.local <= 1:
        return _ring_allreduce(numel, topo.world, topo.inter)
    return _intra_phases(numel, topo) + _ring_allreduce(-(-numel // topo.local), topo.nodes, topo.inter)


def onebit_allreduce(segments: Sequence[int], topo: Topology) -> Comm:
    """1-bit compressed allreduce; hierarchical: on each node shard among the nodes (slowest shard)."""
    if topo.local <= 1:
        return _onebit(segments, topo.world, topo.inter)
    shard = max((_onebit(s, topo.nodes, topo.inter) for s in shard_segments(segments, topo.local)),
                key=lambda c: c.seconds)
    return _intra_phases(sum(segments), topo) + shard


# ----------------------------------------------------------------------------- steps
@dataclass(frozen=True)
class ModelShape:
    name: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def segments(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]


@dataclass(frozen=True)
class Step:
    method: str
    seconds: float
    compute_s: float
    comm: Comm


def _onebit_compute(numel: int, topo: Topology, rates: ComputeRates) -> float:
    # hierarchical: the 1-bit passes run on the node shard; the intra-node reduction is one stream pass
    shard = numel / topo.local
    local_sum = 0.0 if topo.local <= 1 else 3 * FP32 * numel / rates.stream_bytes_per_s
    return rates.onebit_s_per_elem * shard + local_sum


def step_times(model: ModelShape, topo: Topology, rates: ComputeRates, *, powersgd_rank: int = 4,
               zero_one_interval: int = 4, fwd_bwd_s: float = 0.0) -> dict[str, Step]:
    """Modelled step of each method (compression / local stage for the 1-bit ones)."""
    n = model.numel
    adam = rates.adam_s_per_param * n
    out: dict[str, Step] = {}
    ddp = allreduce(n, topo)
    out["ddp"] = Step("ddp", fwd_bwd_s + adam + ddp.seconds, adam, ddp)
    ob = onebit_allreduce(model.segments, topo)
    ob_compute = adam + _onebit_compute(n, topo, rates)
    out["onebit_adam"] = Step("onebit_adam", fwd_bwd_s + ob_compute + ob.seconds, ob_compute, ob)
    h = zero_one_interval
    zo = ob.times(1 / h)
    zo_compute = adam + ZERO_ONE_ACCUMULATOR_BYTES * n / rates.stream_bytes_per_s + _onebit_compute(n, topo, rates) / h
    out["zero_one_adam"] = Step("zero_one_adam", fwd_bwd_s + zo_compute + zo.seconds, zo_compute, zo)
    p, q, vec = powersgd_elements(model.shapes, powersgd_rank)
    ps = allreduce(p, topo) + allreduce(q, topo) + allreduce(vec, topo)
    ps_compute = adam + POWERSGD_BYTES_PER_MATRIX_ELEM * (n - vec) / rates.stream_bytes_per_s
    out["powersgd"] = Step("powersgd", fwd_bwd_s + ps_compute + ps.seconds, ps_compute, ps)
    return out


def comm_break_even_world(model: ModelShape, link: Link, limit: int = 1 << 20) -> int | None:
    """Smallest W (flat) where the 1-bit allreduce's time reaches the fp32 ring's, or None up to ``limit``.

    Both send ~constant bytes per rank as W grows (``n/4`` against ``8n``); the 1-bit side adds
    ``W-1`` messages more and ``4 S + 32`` bytes per peer, so it loses once those outgrow the saving.
    """
    def onebit_loses(world: int) -> bool:
        flat = Topology(world, link)
        return onebit_allreduce(model.segments, flat).seconds >= allreduce(model.numel, flat).seconds

    if not onebit_loses(limit):
        return None
    lo, hi = 2, limit
    while lo < hi:
        mid = (lo + hi) // 2
        if onebit_loses(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


# ----------------------------------------------------------------------------- model shapes
def gpt_shapes(n_layer: int, d_model: int, vocab: int, context: int, mlp_ratio: int = 4) -> tuple[tuple[int, ...], ...]:
    """Parameter shapes of a GPT like ``lightning_optim.model.ByteGPT`` (tied head, biases, LayerNorms)."""
    d, f = d_model, mlp_ratio * d_model
    shapes: list[tuple[int, ...]] = [(vocab, d), (context, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,),
                   (d,), (d,), (f, d), (f,), (d, f), (d,)]
    shapes += [(d,), (d,)]
    return tuple(shapes)


def default_models() -> list[ModelShape]:
    """GPT-2 medium (~355M), GPT-3 XL (~1.3B), and the main job's model (conf/model/tiny.yaml, seq 128)."""
    return [
        ModelShape("gpt-350M", gpt_shapes(24, 1024, 50257, 1024)),
        ModelShape("gpt-1.3B", gpt_shapes(24, 2048, 50257, 2048)),
        ModelShape("main-job tiny", gpt_shapes(4, 128, 256, 128)),
    ]
