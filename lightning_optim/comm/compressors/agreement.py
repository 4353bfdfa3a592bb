"""Every rank raises, or none does: one bounded all_gather of small integers, so a problem seen by one
rank (a refused argument) or only visible when the ranks compare notes (a different ``sparse_grad_size``,
layout or seed) stops every rank with a clear error instead of pairing one rank's collectives with
another's until the timeout.

    agree("CentralizedSparsifiedSGD", {"sparse_grad_size": 10, "random_sparse": 0}, group=g, error=exc)

Each rank sends ``1 + len(fields)`` int64 values (an error code first: 0, or which argument was
refused; fields are zeros on a rank that has an error); the bytes are counted as control bytes (``gather_rows``).
"""
from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..dense import world_size
from ..timeouts import gather_rows

__all__ = ["agree", "control_device", "fingerprint"]


def fingerprint(values: Iterable[object]) -> int:
    """A stable 32-bit number for a sequence of plain values (shapes, dtypes, modes): equal on every rank
    for equal inputs (``hash`` is salted per process; crc32 is not)."""
    return zlib.crc32(repr(tuple(values)).encode())


def control_device(group=None, like: Iterable[Tensor] = ()) -> torch.device:
    """Where the group's small control tensors must live: a CUDA device of ``like`` for NCCL, else CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        for t in like:
            if t.is_cuda:
                return t.device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _error_code(error: BaseException | None, arguments: Sequence[str]) -> int:
    """0: no error; 1 + i: the message starts with ``arguments[i]``; else ``len(arguments) + 1``."""
    if error is None:
        return 0
    text = str(error.args[0]) if error.args else ""
    for i, name in enumerate(arguments):
        if text.startswith(name) and text[len(name):len(name) + 1] in ("", " ", ":", "=", "[", "("):
            return 1 + i
    return len(arguments) + 1


def agree(what: str, fields: Mapping[str, int], *, group=None, device: torch.device | None = None,
          error: BaseException | None = None, arguments: Sequence[str] = ()) -> None:
    """Raise on every rank when any rank has ``error`` or any field differs between ranks.

    ``fields`` must have the same names, in the same order, on every rank (their number fixes the row
    length). A rank with ``error`` raises it; the others raise a ``ValueError`` naming the ranks that
    refused and, when the error message starts with one of ``arguments``, that argument. Differing
    fields give a ``ValueError`` listing each rank's value. One process (or no process group):
    ``error`` is raised, nothing is sent.
    """
    if world_size(group) == 1:
        if error is not None:
            raise error
        return
    values = [0] * len(fields) if error is not None else [int(v) for v in fields.values()]
    code = _error_code(error, arguments)
    rows = gather_rows(f"all_gather({what} agreement)", [code, *values], group=group, device=device)
    if error is not None:
        raise error
    refused = [(r, row[0]) for r, row in enumerate(rows) if row[0]]
    if refused:
        named = ", ".join(f"rank {r} ({arguments[c - 1] if c <= len(arguments) else 'see its error'})"
                          for r, c in refused)
        raise ValueError(
            f"{what}: refused on {named}; this rank stops with them rather than wait for a collective they "
            "will never join"
        )
    differ = []
    for i, name in enumerate(fields, start=1):
        if len({row[i] for row in rows}) > 1:
            differ.append(f"{name} (" + ", ".join(f"rank {r}: {row[i]}" for r, row in enumerate(rows)) + ")")
    if differ:
        raise ValueError(f"{what}: every rank must use the same values, but these differ: " + "; ".join(differ))
