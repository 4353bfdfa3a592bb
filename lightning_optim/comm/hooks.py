"""DDP communication hook that the two-stage 1-bit optimizers switch off after warmup.

    state = SwitchableAllreduceState(group=None, enabled=True)
    ddp_model.register_comm_hook(state, switchable_allreduce_hook)
    ...
    state.enabled = False   # compression stage: DDP hands back local gradients, no communication

Enabled: every bucket is averaged over the group exactly like ``allreduce_mean`` (fp32 reduction,
bf16/fp16 upcast, bytes added to ``state.stats`` or ``comm_stats()``). Disabled: the bucket is
returned untouched, so ``param.grad`` holds this rank's own gradient and the optimizer does its own
(compressed) communication. The switch must flip on every rank at the same step.

Bounded: each bucket's future fails with ``CommunicationError`` after ``collective_timeout()``
seconds, also when the process group has torch's 30-minute default.

``average``: a function that averages a flat fp32 tensor in place over the group in its own way (a
hierarchical 1-bit optimizer's ``average_``: reduce-scatter in the node, mean across nodes, all-gather in the
node); the bucket is then averaged by it, synchronously, instead of by one flat allreduce.

Works on CPU/gloo: register it yourself after wrapping the model (Lightning's ``DDPStrategy``
ignores ``ddp_comm_hook`` on CPU). ``register_switchable_allreduce`` does both steps.
"""
# no ``from __future__ import annotations``: DDP checks the hook's return annotation at runtime
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .dense import allreduce_mean, world_size
from .stats import CommStats, comm_stats
from .timeouts import CommunicationError, collective_timeout

__all__ = ["SwitchableAllreduceState", "switchable_allreduce_hook", "register_switchable_allreduce"]


@dataclass
class SwitchableAllreduceState:
    """State of ``switchable_allreduce_hook``: ``enabled`` turns the averaging on/off."""

    group: object = None
    enabled: bool = True
    stats: CommStats | None = None
    average: Callable[[torch.Tensor], object] | None = None  # in place, flat fp32 (e.g. hierarchical)
    buckets_reduced: int = field(default=0)
    buckets_skipped: int = field(default=0)


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def switchable_allreduce_hook(state: SwitchableAllreduceState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket when ``state.enabled``, else return it unchanged."""
    buffer = bucket.buffer()
    if not state.enabled:
        state.buckets_skipped += 1
        return _done(buffer)
    state.buckets_reduced += 1
    w = world_size(state.group)
    if w == 1:
        return _done(buffer)
    if state.average is not None:
        flat = buffer.view(-1) if buffer.dtype == torch.float32 and buffer.is_contiguous() else buffer.float().view(-1)
        state.average(flat)
        if flat.data_ptr() != buffer.data_ptr():
            buffer.copy_(flat.view(buffer.shape))
        return _done(buffer)
    if buffer.dtype in (torch.bfloat16, torch.float16):
        # gloo cannot reduce bf16: synchronous upcast path
        return _done(allreduce_mean(buffer, state.group, state.stats))
    stats = state.stats if state.stats is not None else comm_stats()
    stats.add_full_precision(buffer.numel(), w, buffer.element_size())
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    return _bounded(work.get_future(), w, collective_timeout())


def _bounded(reduced: torch.futures.Future, world: int, bound: float) -> torch.futures.Future:
    """A future that completes with the averaged bucket, or fails with ``CommunicationError`` after
    ``bound`` seconds: DDP waits on the hook's future itself (with the process group's own timeout,
    30 minutes unless the group was created with one), so the bound is put on the future instead."""
    result: torch.futures.Future = torch.futures.Future()
    lock = threading.Lock()

    def finish(value=None, error: BaseException | None = None) -> None:
        with lock:  # the allreduce's callback and the timer race; the first one wins
            if result.done():
                return
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(value)

    def on_reduced(fut) -> None:
        timer.cancel()
        try:
            reduced_tensor = fut.value()[0]
            finish(reduced_tensor if world == 1 else reduced_tensor.div_(world))  # 1: already averaged (release hook)
        except Exception as exc:  # noqa: BLE001 - surfaced through the future
            finish(error=CommunicationError(
                f"DDP bucket all_reduce failed: another rank may have died or hung ({exc})"))

    timer = threading.Timer(bound, lambda: finish(error=CommunicationError(
        f"DDP bucket all_reduce did not complete within the bound of {bound:.0f}s "
        "(lightning_optim.comm.set_collective_timeout sets it): another rank may have died, hung or skipped "
        "this backward")))
    timer.daemon = True
    timer.start()
    reduced.add_done_callback(on_reduced)
    return result


def register_switchable_allreduce(ddp_model, group=None, enabled: bool = True,
                                  stats: CommStats | None = None) -> SwitchableAllreduceState:
    """Register ``switchable_allreduce_hook`` on a ``DistributedDataParallel`` model; return its state."""
    state = SwitchableAllreduceState(group=group, enabled=enabled, stats=stats)
    ddp_model.register_comm_hook(state, switchable_allreduce_hook)
    return state
