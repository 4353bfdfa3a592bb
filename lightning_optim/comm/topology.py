"""Gossip topologies: who averages with whom, and with which weights (the mixing matrix).

A :class:`Topology` is the whole undirected graph over the ``W`` ranks of a group (the same object
on every rank) plus the rule that turns it into a mixing matrix :math:`M` (``W x W``). One gossip
round replaces every rank's vector by :math:`x_i \\leftarrow \\sum_j M_{ij} x_j`, where
:math:`M_{ij} > 0` only for ``j = i`` and the neighbours of ``i``.

Weights (``d_i`` is the number of neighbours of rank ``i``):

* ``"uniform"`` (mlbench's ``DecentralizedAggregation``, op ``avg_world``): rank ``i`` averages
  itself and its neighbours equally, :math:`M_{ij} = 1 / (d_i + 1)`. Doubly stochastic only when
  the graph is regular (ring, torus, exponential graph are): on an irregular graph the rows sum to 1
  but the columns do not, and the ranks agree on the average weighted by :math:`d_i + 1` instead of
  the plain mean.
* ``"metropolis"`` (Metropolis-Hastings): :math:`M_{ij} = 1 / (1 + \\max(d_i, d_j))` for a neighbour
  ``j``, :math:`M_{ii} = 1 - \\sum_{j \\ne i} M_{ij}`. Symmetric, hence doubly stochastic on any
  graph: the mean of the ranks is preserved. On a regular graph it equals ``"uniform"``.

Consensus rate: with a symmetric doubly stochastic :math:`M`, the deviation from the mean shrinks
per round by at most :math:`\\lambda = \\max(|\\lambda_2|, |\\lambda_W|)`, the second-largest
eigenvalue modulus (``consensus_rate``); ``1 - \\lambda`` is the spectral gap.

Built-in graphs (neighbour sets; duplicates and the rank itself are dropped):

* ``ring(W)``: ``i +- 1 (mod W)``;
* ``torus(rows, cols)``: rank ``i = r * cols + c`` has ``(r +- 1, c)`` and ``(r, c +- 1)`` (mod the
  shape); a side of length 2 contributes one neighbour, a side of length 1 none;
* ``exponential(W)``: ``i +- 2^k (mod W)`` for ``2^k <= W - 1``, the symmetric version of the
  exponential graph of Assran et al. (SGP, 2019), whose directed form sends to ``i + 2^k`` only;
  undirected averaging needs the symmetric one (a directed graph needs push-sum weights);
* ``from_neighbors(lists)``: every rank's list, checked (in range, no self, no duplicates,
  symmetric).
"""
from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

import torch

__all__ = ["WEIGHTS", "NAMES", "Topology", "near_square", "parse_name"]

WEIGHTS = ("uniform", "metropolis")
NAMES = ("ring", "torus", "exponential")  # "torus:ROWSxCOLS" picks the shape


def _is_int(value: object) -> TypeGuard[int]:  # numpy ints too: they compare and convert as ints
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_weights(weights: object) -> str:
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    return weights


def near_square(world_size: int) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows * cols == world_size`` and ``rows`` the largest divisor <= sqrt."""
    rows = max(d for d in range(1, math.isqrt(world_size) + 1) if world_size % d == 0)
    return rows, world_size // rows


def parse_name(name: str, world_size: int, weights: str = "uniform") -> Topology:
    """A topology from its name: ``"ring"``, ``"exponential"``, ``"torus"`` (near-square shape) or
    ``"torus:ROWSxCOLS"``. Raises ValueError naming the valid names or the bad shape."""
    key = name.strip().lower()
    if key == "ring":
        return Topology.ring(world_size, weights)
    if key == "exponential":
        return Topology.exponential(world_size, weights)
    if key == "torus":
        return Topology.torus(*near_square(world_size), weights=weights)
    if key.startswith("torus:"):
        parts = key[len("torus:"):].split("x")
        if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
            rows, cols = (int(p) for p in parts)
            if rows * cols != world_size:
                raise ValueError(f"neighbors: torus {rows}x{cols} has {rows * cols} ranks, the group has {world_size}")
            return Topology.torus(rows, cols, weights=weights)
    raise ValueError(f"neighbors: unknown topology name {name!r}; valid: 'ring', 'exponential', 'torus', "
                     f"'torus:ROWSxCOLS'")


def row_problem(rank: int, row: Sequence[object], world_size: int) -> tuple[str, object] | None:
    """What is wrong with ``rank``'s neighbour list on its own, as ``(kind, value)`` (None: nothing):
    kinds ``entry`` (not an int), ``range`` (not in [0, W)), ``self``, ``duplicate``."""
    seen = set()
    for j in row:
        if not _is_int(j):
            return "entry", type(j).__name__
        if not 0 <= j < world_size:
            return "range", int(j)
        if j == rank:
            return "self", int(j)
        if j in seen:
            return "duplicate", int(j)
        seen.add(int(j))
    return None


def describe_row_problem(rank: int, kind: str, value: object, world_size: int) -> str:
    """The message for :func:`row_problem`'s finding (the same text on every rank)."""
    return {
        "entry": f"neighbors of rank {rank} must be ints, got an entry of type {value}",
        "range": f"neighbors of rank {rank} name rank {value}, which is not in the group of {world_size} "
                 f"ranks (valid: 0 .. {world_size - 1})",
        "self": f"neighbors of rank {rank} list the rank itself (a rank always keeps its own share; "
                f"list only the other ranks)",
        "duplicate": f"neighbors of rank {rank} list rank {value} twice",
    }[kind]


def asymmetric_pair(neighbors: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """The first ``(i, j)`` with ``j`` in ``neighbors[i]`` but ``i`` not in ``neighbors[j]``."""
    sets = [set(row) for row in neighbors]
    for i, row in enumerate(neighbors):
        for j in sorted(row):
            if i not in sets[j]:
                return i, j
    return None


def unreachable(neighbors: Sequence[Sequence[int]]) -> list[int]:
    """The ranks that rank 0 cannot reach (empty: the graph is connected)."""
    seen, todo = {0}, [0]
    while todo:
        for j in neighbors[todo.pop()]:
            if j not in seen:
                seen.add(j)
                todo.append(j)
    return [r for r in range(len(neighbors)) if r not in seen]


@dataclass(frozen=True)
class Topology:
    """An undirected graph over the ranks ``0 .. W-1`` and its mixing weights (see the module doc).

    ``neighbors[i]`` holds rank ``i``'s neighbours, sorted, without ``i`` and without duplicates;
    the constructor checks that, that the lists are symmetric and that the graph is connected.
    """

    neighbors: tuple[tuple[int, ...], ...]
    weights: str = "uniform"
    name: str = "explicit"

    def __post_init__(self) -> None:
        check_weights(self.weights)
        rows = tuple(tuple(sorted(int(j) for j in row)) for row in self.neighbors)
        world = len(rows)
        if world < 1:
            raise ValueError("neighbors: a topology needs at least one rank")
        for i, row in enumerate(self.neighbors):
            problem = row_problem(i, row, world)
            if problem is not None:
                raise ValueError(describe_row_problem(i, *problem, world))
        pair = asymmetric_pair(rows)
        if pair is not None:
            i, j = pair
            raise ValueError(f"neighbors are not symmetric: rank {i} lists rank {j} but rank {j} does not list "
                             f"rank {i} (gossip averages in pairs: both ends must list each other)")
        missing = unreachable(rows)
        if missing:
            raise ValueError(f"neighbors: the graph is not connected: ranks {missing} cannot reach rank 0, so the "
                             f"ranks never agree")
        object.__setattr__(self, "neighbors", rows)

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_neighbors(cls, neighbors: Sequence[Sequence[int]], weights: str = "uniform") -> Topology:
        """Every rank's neighbour list (``neighbors[i]`` for rank ``i``)."""
        if isinstance(neighbors, (str, bytes)) or not isinstance(neighbors, Sequence):
            raise TypeError(f"neighbors must be a sequence of per-rank sequences, got {type(neighbors).__name__}")
        for i, row in enumerate(neighbors):
            if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
                raise TypeError(f"neighbors[{i}] must be a sequence of ranks, got {type(row).__name__}")
        return cls(tuple(tuple(row) for row in neighbors), weights)

    @classmethod
    def ring(cls, world_size: int, weights: str = "uniform") -> Topology:
        """``i`` is joined to ``i - 1`` and ``i + 1`` (mod ``W``)."""
        w = _world(world_size)
        return cls(tuple(_others(i, ((i - 1) % w, (i + 1) % w)) for i in range(w)), weights, "ring")

    @classmethod
    def torus(cls, rows: int, cols: int, weights: str = "uniform") -> Topology:
        """A ``rows x cols`` 2-D torus, rank ``r * cols + c`` at row ``r``, column ``c``."""
        rows, cols = _world(rows, "rows"), _world(cols, "cols")

        def at(r: int, c: int) -> int:
            return (r % rows) * cols + c % cols

        lists = []
        for i in range(rows * cols):
            r, c = divmod(i, cols)
            lists.append(_others(i, (at(r - 1, c), at(r + 1, c), at(r, c - 1), at(r, c + 1))))
        return cls(tuple(lists), weights, f"torus:{rows}x{cols}")

    @classmethod
    def exponential(cls, world_size: int, weights: str = "uniform") -> Topology:
        """``i`` is joined to ``i +- 2^k`` (mod ``W``) for every ``2^k <= W - 1``."""
        w = _world(world_size)
        hops = [1 << k for k in range(max(w - 1, 1).bit_length()) if (1 << k) <= w - 1]
        lists = [_others(i, [(i + s * h) % w for h in hops for s in (1, -1)]) for i in range(w)]
        return cls(tuple(lists), weights, "exponential")

    # ---------------------------------------------------------------- queries
    @property
    def world_size(self) -> int:
        return len(self.neighbors)

    def degree(self, rank: int) -> int:
        return len(self.neighbors[rank])

    @property
    def is_regular(self) -> bool:
        return len({len(row) for row in self.neighbors}) == 1

    def mixing_row(self, rank: int) -> dict[int, float]:
        """``{j: M[rank, j]}`` for ``rank`` itself and each neighbour (the weights this rank applies)."""
        d_i = self.degree(rank)
        if self.weights == "uniform":
            share = 1.0 / (d_i + 1)
            row = dict.fromkeys(self.neighbors[rank], share)
            row[rank] = share
            return row
        row = {j: 1.0 / (1 + max(d_i, self.degree(j))) for j in self.neighbors[rank]}
        row[rank] = 1.0 - math.fsum(row.values())
        return row

    def mixing_matrix(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The ``W x W`` mixing matrix ``M`` (rows sum to 1)."""
        m = torch.zeros(self.world_size, self.world_size, dtype=torch.float64)
        for i in range(self.world_size):
            for j, w in self.mixing_row(i).items():
                m[i, j] = w
        return m.to(dtype)

    def consensus_rate(self) -> float:
        """The second-largest eigenvalue modulus of ``M`` (0 for one rank): the factor by which gossip
        shrinks the distance to consensus per round (asymptotically; exactly when ``M`` is symmetric
        and all other eigenvalues share that modulus)."""
        if self.world_size == 1:
            return 0.0
        moduli = torch.linalg.eigvals(self.mixing_matrix()).abs().sort(descending=True).values
        return float(moduli[1])

    def fingerprint(self) -> int:
        """A 62-bit digest of the graph and weights (equal topologies, equal digests), never 0."""
        text = repr((self.neighbors, self.weights)).encode()
        return (int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2) | 1


def _world(value: object, name: str = "world_size") -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def _others(rank: int, candidates) -> tuple[int, ...]:
    return tuple(sorted({int(j) for j in candidates} - {rank}))
