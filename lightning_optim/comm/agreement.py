"""Every rank raises, or none does: the bounded cross-rank agreement of the project.

A problem seen by one rank only (a refused argument) or visible only when the ranks compare notes
(a different ``world_size``, layout, seed, ``k``) must stop *every* rank with a clear error, not pair
one rank's collectives with another's until the timeout. :func:`agree` does it in one bounded
``gather_rows``: each rank sends ``[error code, *values]`` (``1 + len(names)`` int64; a rank with an
error sends zeros for the values), then

* a rank with an error raises it (with one process it is raised at once, nothing is sent);
* the others raise a ``ValueError`` naming each refusing rank and the argument its message starts
  with (the error code is ``1 + i`` for ``arguments[i]``);
* values that differ give a ``ValueError`` listing each rank's value of each differing field.

    agree("CentralizedSparsifiedSGD", ("world_size", "k"), {"world_size": 2, "k": 10}, error=exc,
          arguments=("world_size", "k"))

Also here: :func:`fingerprint` (a stable checksum of plain values) and :func:`layout_signature` (what a
list of tensors must match across ranks), :func:`control_device` (CUDA for NCCL), :func:`share_rows`
and :func:`differing` for agreements with rows of their own (the gossip topology's).
"""
from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from .dense import world_size
from .groups import backend_name
from .timeouts import gather_rows

__all__ = ["agree", "control_device", "differing", "error_code", "fingerprint", "layout_signature", "share_rows"]

_LEADING_NAME = re.compile(r"[A-Za-z_]\w*")


def fingerprint(values: Iterable[object]) -> int:
    """A stable 32-bit checksum of a sequence of plain values (shapes, dtypes, modes): equal on every
    rank for equal inputs (``hash`` is salted per process; crc32 is not)."""
    return zlib.crc32(repr(tuple(values)).encode())


def layout_signature(tensors: Sequence[Tensor]) -> tuple[int, int, int, int]:
    """(count, elements, checksum of the shapes, checksum of the dtypes): equal for equal layouts."""
    return (len(tensors), sum(t.numel() for t in tensors), fingerprint(tuple(t.shape) for t in tensors),
            fingerprint(str(t.dtype) for t in tensors))


def control_device(group=None, like: Iterable[Tensor] = ()) -> torch.device:
    """Where the group's small control tensors must live: a CUDA device of ``like`` for NCCL, else CPU."""
    if backend_name(group) == "nccl":
        for t in like:
            if t.is_cuda:
                return t.device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def error_code(error: BaseException | None, arguments: Sequence[str]) -> int:
    """0: no error; ``1 + i``: the message starts with the name ``arguments[i]``; else ``len(arguments) + 1``."""
    if error is None:
        return 0
    match = _LEADING_NAME.match(str(error.args[0]) if error.args else "")
    name = match.group(0) if match else ""
    return arguments.index(name) + 1 if name in arguments else len(arguments) + 1


def share_rows(what: str, row: Sequence[int], *, group=None, like: Iterable[Tensor] = ()) -> list[tuple[int, ...]]:
    """Every rank's ``row`` (same length everywhere), in one bounded ``gather_rows`` on the group's
    control device, counted as control bytes; with one process, just this rank's row."""
    if world_size(group) == 1:
        return [tuple(int(v) for v in row)]
    return gather_rows(what, row, group=group, device=control_device(group, like))


def differing(rows: Sequence[Sequence[int]], names: Sequence[str], start: int = 0) -> list[tuple[str, list[int]]]:
    """``(name, each rank's value)`` for every field ``names[k]`` (column ``start + k``) that differs."""
    columns = ((name, [row[start + k] for row in rows]) for k, name in enumerate(names))
    return [(name, values) for name, values in columns if len(set(values)) > 1]


def agree(what: str, names: Sequence[str], values: Mapping[str, int] | Sequence[int] | None, *, group=None,
          like: Iterable[Tensor] = (), error: BaseException | None = None, arguments: Sequence[str] = (),
          show: Callable[[str, int], str] | None = None) -> None:
    """Raise on every rank of ``group`` when any rank has ``error`` or any value differs between ranks.

    ``names`` must be the same on every rank (their number fixes the row); ``values`` gives them by
    name or in order (ignored, sent as zeros, with ``error`` or when None). ``like``: tensors whose
    device serves under NCCL. ``show(name, value)`` renders a differing value (default ``str``).
    """
    if world_size(group) == 1:
        if error is not None:
            raise error
        return
    row = [0] * len(names)
    if error is None and values is not None:
        row = [int(values[n]) for n in names] if isinstance(values, Mapping) else [int(v) for v in values]
    rows = share_rows(f"all_gather({what} agreement)", [error_code(error, arguments), *row], group=group, like=like)
    if error is not None:
        raise error
    refused = [(r, theirs[0]) for r, theirs in enumerate(rows) if theirs[0]]
    if refused:
        named = ", ".join(f"rank {r} ({arguments[c - 1] if c <= len(arguments) else 'see its error'})"
                          for r, c in refused)
        raise ValueError(f"{what}: refused on {named}; this rank stops with them rather than wait for a collective "
                         "they will never join")
    render = show or (lambda _, value: str(value))
    differ = [f"{name} (" + ", ".join(f"rank {r}: {render(name, v)}" for r, v in enumerate(per_rank)) + ")"
              for name, per_rank in differing(rows, names, start=1)]
    if differ:
        raise ValueError(f"{what}: every rank must use the same values, but these differ: " + "; ".join(differ))
