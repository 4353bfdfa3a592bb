"""Failure handling of the distributed strategies: the collective timeout argument, and what a rank
does when a collective fails (a peer died or hung): say so in one line and stop its local ranks.

The ``timeout`` bounds both the process group (DDP's own bucket allreduce) and every collective of
lightning-optim (:func:`lightning_optim.comm.set_collective_timeout`).

Lightning's training loop broadcasts a stop (SIGTERM) flag from rank 0 before every batch and swallows that
broadcast's failure: with a hung peer it first waits out the process group's timeout there, carries on, and the
next collective (DiLoCo's exchange, the 1-bit allreduce) waits another before anything is reported. So at fit
start the strategy puts its own version of that broadcast on the trainer's epoch loop (that object only, not
Lightning's class): the same flag and the same stop on a SIGTERM, but bounded like every collective of the
project and raising a ``CommunicationError`` that names the silent rank (``comm.roll_call``) within one timeout.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_optim.comm import CommunicationError, set_collective_timeout
from lightning_optim.comm.pending import start_collective
from lightning_optim.comm.roll_call import grace_for, named_failure
from lightning_optim.comm.timeouts import check_seconds
from lightning_optim.lightning._bases import ParallelBase, attached

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
        if isinstance(exc, (CommunicationError, getattr(dist, "DistError", ()))):
            return True
        if isinstance(exc, RuntimeError) and _COMM_FAILURE.search(str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _stop_signal_broadcast(trainer: Any, rounds: list[int]) -> None:
    """Rank 0's SIGTERM flag to every rank before a batch (what Lightning's epoch loop does there), bounded:
    a rank that does not join makes this raise a ``CommunicationError`` naming it, instead of being swallowed."""
    rounds[0] += 1
    flag = torch.tensor([1 if getattr(trainer, "received_sigterm", False) else 0], device=trainer.strategy.root_device)
    what = f"Lightning's stop-signal broadcast before training batch {rounds[0]}"
    pending = start_collective(what, dist.broadcast, flag, src=0)
    try:
        pending.wait(margin=grace_for(pending.bound))  # the rest of the bound is the roll call's
    except CommunicationError as exc:
        raise named_failure(exc, what, f"stop_signal/{rounds[0]}", until=pending.deadline) from exc
    if flag.item() == 1:  # as Lightning: meet once more, then stop every rank with its SIGTERM exception
        with contextlib.suppress(Exception):
            dist.barrier()
        package = "lightning.pytorch" if type(trainer).__module__.startswith("lightning.") else "pytorch_lightning"
        raise importlib.import_module(f"{package}.utilities.exceptions").SIGTERMException()


class _CommFailureMixin(ParallelBase):
    """Owns ``timeout``: pass ``timeout_s`` to :meth:`_init_timeout` before ``DDPStrategy.__init__``."""

    _timeout_s: float = DEFAULT_TIMEOUT_S

    def _init_timeout(self, timeout: float | timedelta) -> timedelta:
        self._timeout_s = check_timeout(timeout, type(self).__name__)
        return timedelta(seconds=self._timeout_s)

    def check_world(self, processes_per_node: int, num_nodes: int) -> None:
        """Raise ``ValueError`` naming the argument when this strategy cannot run on ``num_nodes`` nodes of
        ``processes_per_node`` ranks (what its setup would refuse once every rank has started); the main job's
        config check calls it before the Trainer is built. Nothing here: any world fits."""

    @property
    def timeout_s(self) -> float:
        """The collective timeout in seconds (process group and lightning-optim collectives)."""
        return self._timeout_s

    def setup_environment(self) -> None:
        set_collective_timeout(self._timeout_s)
        super().setup_environment()

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = attached(self.lightning_module, "lightning_module").trainer
        loop: Any = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if callable(getattr(loop, "_broadcast_sigterm_tensor", None)) and self.world_size > 1:
            loop._broadcast_sigterm_tensor = functools.partial(_stop_signal_broadcast, trainer, [0])

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
