"""A collective issued now and waited on later (``async_op=True``), still bounded like ``timeouts.collective``.

    pending = start_collective("all_reduce(outer gradient)", dist.all_reduce, buf, group=group)
    ...                                  # compute meanwhile (Streaming DiLoCo's overlapped exchange)
    pending.wait()                       # done, or CommunicationError within the bound from the start

The bound is ``collective_timeout()`` when the collective starts, counted from that moment (a wait that
comes late has less of it left); ``wait(margin=s)`` gives up ``s`` seconds earlier, so that a caller can
still do something bounded before the bound ends (``comm.roll_call``). Any backend failure or the bound
becomes ``CommunicationError`` naming the collective, as ``timeouts.collective`` does.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .groups import is_group_object
from .timeouts import CommunicationError, collective_timeout, group_timeout

__all__ = ["PendingCollective", "start_collective"]

_MIN_WAIT_S = 1e-3  # a wait whose time is already up still asks the backend once


def _this_rank(group) -> str:
    try:
        return str(group.rank() if is_group_object(group) else dist.get_rank(group))
    except Exception:  # noqa: BLE001 - only for the message
        return "?"


class PendingCollective:
    """A collective in flight (``work`` None: nothing was sent, e.g. one rank). See the module docstring."""

    def __init__(self, name: str, work: Any, group=None, *, started: float | None = None,
                 bound: float | None = None) -> None:
        self.name, self.work, self.group = name, work, group
        self.started = time.monotonic() if started is None else started
        self.bound = collective_timeout() if bound is None else float(bound)
        self.done = work is None

    @property
    def deadline(self) -> float:
        """``time.monotonic()`` at which the bound ends."""
        return self.started + self.bound

    def wait(self, margin: float = 0.0) -> None:
        """Block until the collective completed (at most until ``deadline - margin``)."""
        if self.done:
            return
        limit = self.deadline - margin
        try:
            self.work.wait(timeout=timedelta(seconds=max(limit - time.monotonic(), _MIN_WAIT_S)))
        except RuntimeError as exc:
            raise self.failure(exc, ran_out=time.monotonic() >= limit - 1e-3) from exc
        self.done = True

    def failure(self, exc: BaseException, ran_out: bool = False) -> CommunicationError:
        """``exc`` as the ``CommunicationError`` to raise; ``ran_out``: the wait used all the time it had."""
        elapsed = time.monotonic() - self.started
        if ran_out or elapsed >= self.bound * 0.99:
            what = f"did not complete within the bound of {self.bound:.0f}s"
        else:
            own = group_timeout(self.group)
            what = f"failed after {elapsed:.1f}s" + (f" (process-group timeout {own:.0f}s)" if own is not None else "")
        return CommunicationError(
            f"{self.name} {what} on rank {_this_rank(self.group)} (lightning_optim.comm.set_collective_timeout "
            f"sets the bound): another rank may have died, hung, skipped this collective or left the job, or the "
            f"network failed. Backend error: {exc}")


def start_collective(name: str, fn: Callable[..., Any], *args: Any, group=None, **kwargs: Any) -> PendingCollective:
    """Issue ``fn(*args, group=group, async_op=True, **kwargs)`` and return it in flight."""
    started = time.monotonic()
    pending = PendingCollective(name, None, group, started=started)
    try:
        pending.work = fn(*args, group=group, async_op=True, **kwargs)
    except RuntimeError as exc:
        if isinstance(exc, CommunicationError):
            raise
        raise pending.failure(exc) from exc
    pending.done = pending.work is None
    return pending
