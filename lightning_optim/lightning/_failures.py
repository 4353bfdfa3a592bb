"""Failure handling of the distributed strategies: the collective timeout argument, and what a rank
does when a collective fails (a peer died or hung): say so in one line and stop its local ranks.

The ``timeout`` bounds both the process group (DDP's own bucket allreduce) and every collective of
lightning-optim (:func:`lightning_optim.comm.set_collective_timeout`).
"""

from __future__ import annotations

import re
import signal
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_optim.comm import CommunicationError, set_collective_timeout
from lightning_optim.comm.timeouts import check_seconds

__all__ = ["DEFAULT_TIMEOUT_S", "_CommFailureMixin", "check_timeout", "is_comm_failure"]

DEFAULT_TIMEOUT_S = 300.0
_COMM_FAILURE = re.compile(r"gloo|nccl|connection (closed|reset)|timed out|timeout|socket|broken pipe", re.I)


def check_timeout(value: Any, owner: str) -> float:
    """``value`` (seconds or a timedelta) as a finite number of seconds > 0."""
    try:
        return check_seconds(value, "timeout")
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{owner}: {exc}") from None


def is_comm_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is a failed collective."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, CommunicationError) or isinstance(exc, getattr(dist, "DistError", ())):
            return True
        if isinstance(exc, RuntimeError) and _COMM_FAILURE.search(str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class _CommFailureMixin:
    """Owns ``timeout``: pass ``timeout_s`` to :meth:`_init_timeout` before ``DDPStrategy.__init__``."""

    _timeout_s: float = DEFAULT_TIMEOUT_S

    def _init_timeout(self, timeout: float | timedelta) -> timedelta:
        self._timeout_s = check_timeout(timeout, type(self).__name__)
        return timedelta(seconds=self._timeout_s)

    @property
    def timeout_s(self) -> float:
        """The collective timeout in seconds (process group and lightning-optim collectives)."""
        return self._timeout_s

    def setup_environment(self) -> None:
        set_collective_timeout(self._timeout_s)
        super().setup_environment()

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if not is_comm_failure(exception):
            return
        first = (str(exception).strip().splitlines() or [""])[0][:300]
        print(
            f"[rank {self.global_rank}] {type(self).__name__}: a collective failed ({type(exception).__name__}: "
            f"{first}). Another rank has probably died or hung; collectives give up after the timeout of "
            f"{self._timeout_s:.0f}s (strategy argument `timeout`). Stopping this rank.",
            file=sys.stderr,
            flush=True,
        )
        launcher = self.launcher
        if launcher is not None and getattr(launcher, "procs", None):
            launcher.kill(getattr(signal, "SIGKILL", signal.SIGTERM))  # the local ranks this process started
