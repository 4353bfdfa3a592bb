"""The bounded agreement on a gossip topology: every rank states what it was given, all ranks see all
statements in one ``gather_rows`` (``comm.agreement.share_rows``), and either all build the same
:class:`Topology` or all raise the same clear error (no rank waits for a peer that already gave up).
Unlike ``comm.agreement.agree``, where the rank at fault raises its own error, a rank's problem here
travels as a code so that every rank raises the very same message.

Each rank's row: ``[problem code, detail, weights code, graph digest, *text, *agree values, *own
neighbours as a bit set]``. ``text`` carries a short string (a bad name, a type name) so the other
ranks can quote it. The global checks run on the gathered rows, in a fixed order, so every rank
reaches the same verdict: the lowest rank's own problem, then disagreement on weights, on the graph
(digests of ranks given the whole graph), on the caller's ``agree`` values, then asymmetry (rank
``i`` lists ``j`` but ``j`` does not list ``i``) and connectivity.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TypeGuard

import torch.distributed as dist

from .agreement import differing, share_rows
from .topology import (
    WEIGHTS,
    Topology,
    asymmetric_pair,
    describe_row_problem,
    parse_name,
    row_problem,
    unreachable,
)

__all__ = ["TopologyError", "agree_topology"]

_TEXT_WORDS = 7  # 7 bytes per int64 word: 49 bytes of text
_BITS = 62  # neighbour bits per int64 word
_KINDS = ("entry", "range", "self", "duplicate")
(_OK, _TYPE, _NAME, _WORLD, _LENGTH, _RANK, _RANK_TYPE, _WEIGHTS, _REFUSED) = range(9)
_ROW = 20  # codes _ROW + i: row_problem kind _KINDS[i]


class TopologyError(ValueError):
    """The ranks were given neighbour lists that do not make one valid, agreed topology."""


def _encode(text: str) -> list[int]:
    raw = text.encode()[: 7 * _TEXT_WORDS].ljust(7 * _TEXT_WORDS, b"\0")
    return [int.from_bytes(raw[7 * k: 7 * k + 7], "little") for k in range(_TEXT_WORDS)]


def _decode(words: Sequence[int]) -> str:
    return b"".join(int(w).to_bytes(7, "little") for w in words).rstrip(b"\0").decode(errors="replace")


def _is_int(value: object) -> TypeGuard[int]:  # numpy ints too: they compare and convert as ints
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _nested(spec: Sequence[object]) -> bool:
    """Every rank's lists (a non-empty sequence of sequences) rather than one rank's own list."""
    return bool(spec) and all(isinstance(r, Sequence) and not isinstance(r, (str, bytes)) for r in spec)


def _claim(spec: object, rank: int, world: int, claimed_rank: object, weights: object):
    """What this rank was given: ``(problem code, detail, text, topology or None, own row)``."""
    if claimed_rank is not None:
        if not _is_int(claimed_rank):
            return _RANK_TYPE, 0, repr(claimed_rank), None, ()
        if claimed_rank != rank:
            return _RANK, int(claimed_rank), "", None, ()
    if weights is not None and weights not in WEIGHTS:
        return _WEIGHTS, 0, repr(weights), None, ()
    if spec is None:
        spec = "ring"
    topology = None
    if isinstance(spec, Topology):
        if spec.world_size != world:
            return _WORLD, spec.world_size, "", None, ()
        topology = spec if weights is None or weights == spec.weights else replace(spec, weights=weights)
    elif isinstance(spec, str):
        try:
            topology = parse_name(spec, world, weights or "uniform")
        except ValueError:
            return _NAME, 0, spec, None, ()
    elif isinstance(spec, Sequence) and not isinstance(spec, bytes):
        nested = _nested(spec)
        if nested and len(spec) != world:
            return _LENGTH, len(spec), "", None, ()
        own = tuple(spec[rank]) if nested else tuple(spec)  # mlbench's form: this rank's own neighbours
        problem = row_problem(rank, own, world)
        if problem is not None:
            kind, value = problem
            if kind == "entry":  # the bad entry's type name travels as text
                return _ROW + _KINDS.index(kind), 0, value, None, ()
            return _ROW + _KINDS.index(kind), value, "", None, ()
        if nested:
            try:  # a whole graph; if it is invalid the global checks on the rows say why
                topology = Topology.from_neighbors(spec, weights or "uniform")
            except (TypeError, ValueError):
                topology = None
        return _OK, 0, "", topology, tuple(sorted(int(j) for j in own))
    else:
        return _TYPE, 0, type(spec).__name__, None, ()
    return _OK, 0, "", topology, topology.neighbors[rank]


def _local_message(r: int, code: int, detail: int, text: str, world: int) -> tuple[type, str]:
    if code == _TYPE:
        return TypeError, (f"neighbors on rank {r} must be a topology name ('ring', 'torus', 'torus:RxC', "
                           f"'exponential'), a Topology, the rank's list of neighbour ranks or every rank's list; "
                           f"got {text}")
    if code == _NAME:
        try:
            parse_name(text, world)
        except ValueError as exc:
            return TopologyError, f"rank {r}: {exc}"
        return TopologyError, f"rank {r}: neighbors name {text!r} was refused"
    if code == _WORLD:
        return TopologyError, f"neighbors on rank {r}: the Topology has {detail} ranks, the group has {world}"
    if code == _LENGTH:
        return TopologyError, (f"neighbors on rank {r}: a list of every rank's neighbours must have one list per "
                               f"rank ({world}), got {detail}")
    if code == _RANK:
        return TopologyError, (f"rank: rank {r} was given rank={detail}; rank must be this process's rank in the "
                               f"group ({r}) or None")
    if code == _RANK_TYPE:
        return TypeError, f"rank: rank {r} was given rank={text}; rank must be an int (this process's rank) or None"
    if code == _WEIGHTS:
        return TopologyError, f"weights on rank {r} must be one of {WEIGHTS} or None, got {text}"
    if code == _REFUSED:
        return TopologyError, (f"rank {r} refused its argument {text!r} (its own error says why); every rank "
                               f"stops here so that none waits for it")
    kind = _KINDS[code - _ROW]
    return (TypeError if kind == "entry" else TopologyError), describe_row_problem(
        r, kind, text if kind == "entry" else detail, world)


def _own_lists(rows: Sequence[Sequence[int]], world: int) -> list[list[int]]:
    words = -(-world // _BITS)
    return [[j for j in range(world) if row[len(row) - words + j // _BITS] >> (j % _BITS) & 1] for row in rows]


def _verdict(rows: list[tuple[int, ...]], world: int, agree_names: Sequence[str]):
    """``(exception type, message)`` for the first problem in the gathered rows, or None."""
    text_at, agree_at = 4, 4 + _TEXT_WORDS
    for r, row in enumerate(rows):
        if row[0] != _OK:
            return _local_message(r, row[0], row[1], _decode(row[text_at:agree_at]), world)
    if len({row[2] for row in rows}) > 1:
        said = ", ".join(f"rank {r}: {WEIGHTS[row[2]]!r}" for r, row in enumerate(rows))
        return TopologyError, f"weights differ across ranks ({said}); every rank must mix with the same rule"
    digests = {row[3] for row in rows if row[3]}
    if len(digests) > 1:
        groups = [[r for r, row in enumerate(rows) if row[3] == d] for d in sorted(digests)]
        return TopologyError, f"neighbors: the ranks were given different topologies (ranks grouped by graph: {groups})"
    for name, values in differing(rows, agree_names, start=agree_at):  # the first one that differs
        if all(abs(v) < 1 << 20 for v in values):  # small values (flags, counts): quote them
            said = f"by rank: {values}"
        else:  # digests: say which ranks agree with which
            groups = [[r for r, v in enumerate(values) if v == u] for u in dict.fromkeys(values)]
            said = f"ranks grouped by value: {groups}"
        return TopologyError, f"{name} differs across ranks ({said}); it must be the same on every rank"
    lists = _own_lists(rows, world)
    pair = asymmetric_pair(lists)
    if pair is not None:
        i, j = pair
        return TopologyError, (f"neighbors are not symmetric: rank {i} lists rank {j} but rank {j} does not list "
                               f"rank {i} (rank {j} lists {lists[j]}); gossip averages in pairs, so both ends must "
                               f"list each other")
    missing = unreachable(lists) if world > 1 else []
    if missing:
        return TopologyError, (f"neighbors: the graph is not connected: ranks {missing} cannot reach rank 0 "
                               f"(lists by rank: {lists}), so the ranks never agree")
    return None


def agree_topology(neighbors: object = None, group=None, *, rank: object = None, weights: str | None = None,
                   agree: Mapping[str, int] | None = None,
                   refused: tuple[str, BaseException] | None = None) -> Topology:
    """The topology every rank of ``group`` agrees on, or the same exception on every rank.

    ``neighbors``: a name (``"ring"``, ``"torus"``, ``"torus:RxC"``, ``"exponential"``; None = ring), a
    :class:`Topology`, this rank's own neighbour list (mlbench's form) or every rank's list.
    ``rank``: the rank the caller believes it is (None: not checked). ``weights``: ``"uniform"`` or
    ``"metropolis"`` (None: the Topology's own, else uniform). ``agree``: ints that must be equal on
    every rank (e.g. a parameter layout digest), named in the message. ``refused``: ``(argument,
    exception)`` when the caller's own checks failed on this rank: it re-raises that exception after
    the gather and the other ranks raise a TopologyError naming the rank and argument.

    Cost: one ``gather_rows`` of ``11 + len(agree) + ceil(W / 62)`` int64 per rank (counted as control).
    """
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    me = dist.get_rank(group) if distributed else 0
    code, detail, text, topology, own = _claim(neighbors, me, world, rank, weights)
    if refused is not None:  # the caller's own refusal comes first (its checks ran first)
        code, detail, text = _REFUSED, 0, refused[0]
    agree = dict(agree or {})
    bits = [0] * -(-world // _BITS)
    for j in own:
        bits[j // _BITS] |= 1 << (j % _BITS)
    weights_code = WEIGHTS.index(topology.weights if topology else (weights or "uniform")) if code == _OK else 0
    row = [code, detail, weights_code, topology.fingerprint() if topology else 0, *_encode(text),
           *(int(v) for v in agree.values()), *bits]
    rows = share_rows("gossip topology agreement", row, group=group)  # bounded; the control device under NCCL
    if code == _REFUSED and refused is not None:  # only the caller's refusal sets that code
        raise refused[1]
    verdict = _verdict(rows, world, list(agree))
    if verdict is not None:
        kind, message = verdict
        raise kind(message)
    # every rank builds the graph from the same gathered rows (mlbench's per-rank lists: their union)
    agreed = Topology.from_neighbors(_own_lists(rows, world), WEIGHTS[rows[0][2]])
    return topology if topology is not None and topology.neighbors == agreed.neighbors else agreed
