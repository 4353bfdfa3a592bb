"""Bounded collectives: every collective the project issues completes or raises
``CommunicationError`` within ``collective_timeout()`` seconds.

The bound is ours, not the process group's: a group created without ``timeout=`` waits 30 minutes
(torch's default) for a peer that never arrives. ``collective`` therefore issues the collective with
``async_op=True`` and waits on the work object with the bound (gloo and NCCL both honour
``Work.wait(timeout)``). A peer that dies usually closes its sockets and the backend fails at once;
a peer that hangs or never calls makes the wait expire. Either way ``CommunicationError`` names the
collective, the elapsed time and the bound. After a timeout the group is unusable (the late peer may
still arrive): stop the job, as the Lightning strategies do.

The bound: ``set_collective_timeout(seconds)``; default ``DEFAULT_COLLECTIVE_TIMEOUT_S``, or the
environment variable ``LIGHTNING_OPTIM_COLLECTIVE_TIMEOUT`` (seconds) when set. The Lightning
strategies set it from their ``timeout`` argument.

The DDP comm hook's bucket allreduce is waited on by DDP itself, inside backward: the hook hands
DDP a future of its own that fails with ``CommunicationError`` at the bound (``hooks.py``).
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .groups import is_group_object

__all__ = [
    "CommunicationError",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "ENV_TIMEOUT",
    "check_process_group",
    "check_seconds",
    "collective",
    "collective_timeout",
    "gather_rows",
    "group_timeout",
    "set_collective_timeout",
]

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
ENV_TIMEOUT = "LIGHTNING_OPTIM_COLLECTIVE_TIMEOUT"
_timeout_s: float | None = None  # set_collective_timeout; None: environment or default


class CommunicationError(RuntimeError):
    """A collective failed or exceeded ``collective_timeout()`` (a peer died, hung, or the network broke)."""

    failed_ranks: list[int] | None  # set by a roll call after the failure: the ranks that did not answer


def check_seconds(value: object, name: str) -> float:
    """A number of seconds (int, float, numpy scalar or timedelta), finite and > 0."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy scalars
        seconds = float(value.item())
    else:
        raise TypeError(f"{name} must be a number of seconds or a datetime.timedelta, got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a finite number of seconds in (0, inf), got {seconds}")
    return seconds


def set_collective_timeout(seconds: float | timedelta) -> None:
    """Bound every collective of lightning-optim to ``seconds`` (> 0; a float or a timedelta)."""
    global _timeout_s
    _timeout_s = check_seconds(seconds, "seconds")


def collective_timeout() -> float:
    """The current bound in seconds (``set_collective_timeout``, else the environment, else 300)."""
    if _timeout_s is not None:
        return _timeout_s
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if raw:
        try:
            return check_seconds(float(raw), ENV_TIMEOUT)
        except ValueError as exc:
            raise ValueError(f"{ENV_TIMEOUT}={raw!r}: {exc}") from None
    return DEFAULT_COLLECTIVE_TIMEOUT_S


def check_process_group(name: str, value: Any) -> Any:
    """``value`` must be None (the default group) or a ``torch.distributed.ProcessGroup``."""
    if value is None:
        return None
    process_group = getattr(dist, "ProcessGroup", None)
    if process_group is None or not isinstance(value, process_group):
        raise TypeError(
            f"{name} must be None (the default process group) or a torch.distributed.ProcessGroup "
            f"(e.g. from dist.new_group), got {type(value).__name__} ({value!r})"
        )
    return value


def group_timeout(group=None) -> float | None:
    """The process group's own collective timeout in seconds, when torch exposes it."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        value = pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - best effort, only used in messages
        return None
    return value.total_seconds() if isinstance(value, timedelta) else None


def _rank(group) -> str:
    try:
        return str(group.rank() if is_group_object(group) else dist.get_rank(group))
    except Exception:  # noqa: BLE001 - only for the message
        return "?"


def collective(name: str, fn: Callable[..., Any], *args: Any, group=None, **kwargs: Any) -> None:
    """Run the torch.distributed collective ``fn(*args, group=group, **kwargs)`` to completion within
    ``collective_timeout()``; any backend failure or the bound becomes ``CommunicationError``."""
    bound = collective_timeout()
    start = time.monotonic()
    try:
        work = fn(*args, group=group, async_op=True, **kwargs)
        if work is not None:
            work.wait(timeout=timedelta(seconds=bound))
    except RuntimeError as exc:
        if isinstance(exc, CommunicationError):
            raise
        elapsed = time.monotonic() - start
        if elapsed >= bound * 0.99:
            what = f"did not complete within the bound of {bound:.0f}s"
        else:
            own = group_timeout(group)
            what = f"failed after {elapsed:.1f}s" + (f" (process-group timeout {own:.0f}s)" if own is not None else "")
        raise CommunicationError(
            f"{name} {what} on rank {_rank(group)} (lightning_optim.comm.set_collective_timeout sets the bound): "
            f"another rank may have died, hung, skipped this collective or left the job, or the network failed. "
            f"Backend error: {exc}"
        ) from exc


def gather_rows(name: str, values: Sequence[int], group=None, device: torch.device | None = None,
                stats=None) -> list[tuple[int, ...]]:
    """Every rank's ``values`` (equal lengths, int64), gathered in one bounded collective.
    The bytes this rank sends, ``(W - 1) * 8 * len(values)``, go to ``stats`` (default ``comm_stats()``).

    The building block of the agreement checks (sizes, layouts, dtypes): each rank sees the same
    rows and can report the same, real figures. ``device`` must be the group's (CUDA for NCCL).
    """
    world = dist.get_world_size(group)
    mine = torch.tensor(list(values), dtype=torch.int64, device=device or torch.device("cpu"))
    out = torch.empty(world * mine.numel(), dtype=torch.int64, device=mine.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    collective(name, gather, out, mine, group=group)
    from .stats import comm_stats  # stats imports nothing from here; keep the import graph flat

    (stats if stats is not None else comm_stats()).add_control((world - 1) * 8 * mine.numel())
    return [tuple(int(v) for v in row) for row in out.view(world, -1).tolist()]
