"""DDP communication hook that the two-stage 1-bit optimizers switch off after warmup.

    state = SwitchableAllreduceState(group=None, enabled=True)
    ddp_model.register_comm_hook(state, switchable_allreduce_hook)
    ...
    state.enabled = False   # compression stage: DDP hands back local gradients, no communication

Enabled: every bucket is averaged over the group exactly like ``allreduce_mean`` (fp32 reduction,
bf16/fp16 upcast, bytes added to ``state.stats`` or ``comm_stats()``). Disabled: the bucket is
returned untouched, so ``param.grad`` holds this rank's own gradient and the optimizer does its own
(compressed) communication. The switch must flip on every rank at the same step.

Works on CPU/gloo: register it yourself after wrapping the model (Lightning's ``DDPStrategy``
ignores ``ddp_comm_hook`` on CPU). ``register_switchable_allreduce`` does both steps.
"""
# no ``from __future__ import annotations``: DDP checks the hook's return annotation at runtime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .dense import allreduce_mean, world_size
from .stats import CommStats, comm_stats
from .timeouts import CommunicationError

__all__ = ["SwitchableAllreduceState", "switchable_allreduce_hook", "register_switchable_allreduce"]


@dataclass
class SwitchableAllreduceState:
    """State of ``switchable_allreduce_hook``: ``enabled`` turns the averaging on/off."""

    group: object = None
    enabled: bool = True
    stats: CommStats | None = None
    buckets_reduced: int = field(default=0)
    buckets_skipped: int = field(default=0)


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut = torch.futures.Future()
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
    if buffer.dtype in (torch.bfloat16, torch.float16):
        # gloo cannot reduce bf16: synchronous upcast path
        return _done(allreduce_mean(buffer, state.group, state.stats))
    stats = state.stats if state.stats is not None else comm_stats()
    stats.add_full_precision(buffer.numel(), w, buffer.element_size())
    work = dist.all_reduce(buffer, group=state.group, async_op=True)

    def average(fut):
        try:
            reduced = fut.value()[0]
        except Exception as exc:  # noqa: BLE001 - surfaced through the future
            raise CommunicationError(
                f"DDP bucket all_reduce failed: another rank may have died or hung ({exc})"
            ) from exc
        return reduced.div_(w)

    return work.get_future().then(average)


def register_switchable_allreduce(ddp_model, group=None, enabled: bool = True,
                                  stats: CommStats | None = None) -> SwitchableAllreduceState:
    """Register ``switchable_allreduce_hook`` on a ``DistributedDataParallel`` model; return its state."""
    state = SwitchableAllreduceState(group=group, enabled=enabled, stats=stats)
    ddp_model.register_comm_hook(state, switchable_allreduce_hook)
    return state
