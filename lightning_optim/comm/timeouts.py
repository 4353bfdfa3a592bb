"""Bounded failure of collectives: a dead peer becomes a ``CommunicationError``, not a hang.

The bound itself is the process group's timeout (``init_process_group(timeout=...)``; gloo honours
it for every collective). A peer that dies usually closes its sockets, so gloo fails at once with
"connection closed"; a peer that hangs or never arrives makes the collective fail when the timeout
expires. Either way the backend raises a ``RuntimeError`` (``DistBackendError``); ``collective``
re-raises it as ``CommunicationError`` naming the collective, the elapsed time and the likely cause.

Sub-groups carry their own timeout: ``dist.new_group(ranks)`` without ``timeout=`` was observed
(torch 2.13, gloo) to get the 30-minute default, not the default group's value; pass it explicitly.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["CommunicationError", "collective", "group_timeout"]


class CommunicationError(RuntimeError):
    """A collective failed (a peer rank died, hung, or the network broke)."""


def group_timeout(group=None) -> float | None:
    """The process group's collective timeout in seconds, when torch exposes it."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        value = pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - best effort, only used in messages
        return None
    return value.total_seconds() if isinstance(value, timedelta) else None


def collective(name: str, fn, *args, group=None, **kwargs):
    """Call ``fn(*args, group=group, **kwargs)`` (a blocking collective); wrap any backend failure."""
    start = time.monotonic()
    try:
        return fn(*args, group=group, **kwargs)
    except RuntimeError as exc:
        if isinstance(exc, CommunicationError):
            raise
        elapsed = time.monotonic() - start
        limit = group_timeout(group)
        limit_text = f" (process-group timeout {limit:.0f}s)" if limit is not None else ""
        raise CommunicationError(
            f"{name} failed after {elapsed:.1f}s{limit_text} on rank "
            f"{dist.get_rank(group) if dist.is_initialized() else '?'}: another rank may have died, "
            f"hung or left the job, or the network failed. Backend error: {exc}"
        ) from exc
