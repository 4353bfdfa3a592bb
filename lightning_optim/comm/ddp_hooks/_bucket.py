"""What every DDP comm hook here shares: the names of a bucket's params, the state base class, and the
future a hook hands back.

Param names, not bucket indices, key per-rank state: DDP rebuilds its buckets after the first
iteration of every process (the bucket's params change order, and may change bucket), so state kept
by bucket index would be added to the wrong elements after the rebuild and after every resume. The
names come from ``ddp_model.module.named_parameters()`` (the keys of the module's ``state_dict``),
so a checkpoint written by one process fits the next one whatever its bucket layout.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...catalogue import STRATEGY_ALIASES
from ..dense import world_size
from ..stats import CommStats, comm_stats
from ..timeouts import CommunicationError, check_process_group

__all__ = ["HookState", "ParamNames", "bounded", "done", "stats_lock"]

# Future callbacks run on backend threads: counters they update are updated under this lock.
stats_lock = threading.Lock()


class ParamNames:
    """The names, positions and shapes of a DDP model's params, looked up by tensor identity."""

    def __init__(self, ddp_model: nn.Module) -> None:
        module = getattr(ddp_model, "module", ddp_model)
        if not isinstance(module, nn.Module):
            raise TypeError(f"ddp_model must be a torch.nn.Module (DistributedDataParallel), got "
                            f"{type(ddp_model).__name__}")
        named = list(module.named_parameters())  # shared (tied) params once, as DDP holds them
        self._by_id = {id(p): name for name, p in named}
        self.position = {name: i for i, (name, _) in enumerate(named)}
        self.shapes = {name: tuple(p.shape) for name, p in named}

    def of(self, bucket: Any) -> tuple[str, ...]:
        """The names of ``bucket``'s params, in the bucket's order."""
        try:
            return tuple(self._by_id[id(p)] for p in bucket.parameters())
        except KeyError:
            raise RuntimeError("a DDP bucket holds a parameter the hook state was not attached to: attach the "
                               "state to the DistributedDataParallel model it is registered on") from None


class HookState:
    """Base of the hook states: the group, where bytes are counted, the attached model's names."""

    hook_name = ""

    def __init__(self, group: Any = None, stats: CommStats | None = None) -> None:
        self.group = check_process_group("group", group)
        if stats is not None and not isinstance(stats, CommStats):
            raise TypeError(f"stats must be None (comm_stats()) or a CommStats, got {type(stats).__name__}")
        self._stats = stats
        self.names: ParamNames | None = None

    @property
    def stats(self) -> CommStats:
        return comm_stats() if self._stats is None else self._stats

    def attach(self, ddp_model: nn.Module) -> None:
        """Learn the names of ``ddp_model``'s params (before the first backward)."""
        self.names = ParamNames(ddp_model)

    def attached_names(self) -> ParamNames:
        """The names of the attached model's params; raises when no model is attached."""
        if self.names is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a model: register it with "
                               "lightning_optim.comm.ddp_hooks.register_comm_hook(ddp_model, ...), or call "
                               "state.attach(ddp_model) before ddp_model.register_comm_hook(state, hook)")
        return self.names

    def names_of(self, bucket: Any) -> tuple[str, ...]:
        return self.attached_names().of(bucket)

    def world_size(self) -> int:
        return world_size(self.group)

    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_available() and dist.is_initialized() else 0

    def _stamp(self) -> dict[str, Any]:
        """The fields every per-rank state_dict starts with (checked on load)."""
        return {"hook": self.hook_name, "rank": self.rank(), "world_size": self.world_size()}

    def _check_stamp(self, state: object) -> Mapping[str, Any]:
        saved = state.get("hook") if isinstance(state, Mapping) else None
        if isinstance(saved, str):  # a state saved under a hook's old name (STRATEGY_ALIASES: "signsgd") is its
            saved = STRATEGY_ALIASES.get(saved, saved)
        if not isinstance(state, Mapping) or saved != self.hook_name:
            got = state.get("hook") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"state: expected a {type(self).__name__}.state_dict() (hook {self.hook_name!r}), "
                             f"got {got!r}")
        if (state.get("rank"), state.get("world_size")) != (self.rank(), self.world_size()):
            raise ValueError(f"state: saved by rank {state.get('rank')} of {state.get('world_size')}, loaded on rank "
                             f"{self.rank()} of {self.world_size()}: each rank loads its own state")
        return state


def done(tensor: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def bounded(fut: torch.futures.Future, bound: float, what: str,
            on_success: Callable[[], None] | None = None) -> torch.futures.Future:
    """A future with ``fut``'s value that fails with ``CommunicationError`` after ``bound`` seconds.

    DDP waits on a hook's future with the process group's own timeout (30 minutes unless set); the
    bound is put on the future instead. ``on_success`` runs (once) when ``fut`` completes in time,
    e.g. to count the bytes the collectives sent.
    """
    result: torch.futures.Future = torch.futures.Future()
    lock = threading.Lock()

    def finish(value: Any = None, error: BaseException | None = None) -> None:
        with lock:  # the collective's callback and the timer race; the first one wins
            if result.done():
                return
            if error is not None:
                result.set_exception(error)
                return
            if on_success is not None:
                on_success()
            result.set_result(value)

    def on_done(f: torch.futures.Future) -> None:
        timer.cancel()
        try:
            value = f.value()
        except Exception as exc:  # noqa: BLE001 - surfaced through the future
            finish(error=CommunicationError(f"{what} failed: another rank may have died or hung ({exc})"))
            return
        finish(value)

    timer = threading.Timer(bound, lambda: finish(error=CommunicationError(
        f"{what} did not complete within the bound of {bound:.0f}s (lightning_optim.comm.set_collective_timeout "
        "sets it): another rank may have died, hung or skipped this backward")))
    timer.daemon = True
    timer.start()
    fut.add_done_callback(on_done)
    return result
