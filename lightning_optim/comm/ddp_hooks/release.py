"""Gradient release under DistributedDataParallel: step each bucket's params inside DDP's comm hook.

A per-parameter post-accumulate hook sees the local, un-averaged gradient, so under DDP the update
must wait until the bucket is averaged. The hook here averages the bucket as plain DDP does
(``g * (1 / world)``, then a sum all-reduce: results equal DDP without a hook, bitwise on CPU) and,
in the future's callback, steps the bucket's params with the averaged gradients while the backward
of earlier layers goes on: the optimizer step overlaps communication and backward.

Rules this follows (found by running it on gloo):

* callbacks run on the backend's worker threads: every step takes one lock (the optimizer's plans
  and state dict are shared);
* DDP's finalize writes the averaged bucket back into ``param.grad`` *after* the hook: those grads
  must be gone before the next forward, or the next backward accumulates onto them. The optimizer's
  ``zero_grad()`` drops them and a forward pre-hook drops any left (a training loop that never
  calls ``zero_grad`` stays correct);
* ``no_sync()`` (gradient accumulation) calls no hook: the grads accumulate as in plain DDP and the
  synced backward steps on their average, exactly like DDP + a step after backward;
* bf16/fp16 buckets are averaged in fp32 (gloo has no bf16 all-reduce), fp32 ones asynchronously and
  bounded by ``collective_timeout()``.

Under DDP release saves no memory (DDP's bucket buffers persist); its gain is overlap.

``prepare_for_gradient_release(ddp_model, opt)`` (``optim/release.py``, one floor down) reaches
:func:`register_ddp_release` through its per-model-type dispatch, which this module extends.
"""
# no ``from __future__ import annotations``: DDP checks the hook's return annotation at runtime
import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_optim.comm.dense import allreduce_mean, world_size
from lightning_optim.comm.hooks import _bounded, _done
from lightning_optim.comm.stats import comm_stats
from lightning_optim.comm.timeouts import collective_timeout
from lightning_optim.optim.release import release_handles

__all__ = ["ReleaseHookState", "release_hook", "register_ddp_release"]


class StepsOneParam(Protocol):
    """An optimizer that steps one param with a given gradient (``BaseOptimizer.step_param``)."""

    def step_param(self, p: Tensor, grad: Tensor | None = None) -> None: ...


@dataclass
class ReleaseHookState:
    """State of :func:`release_hook`: the optimizer and what the last backward stepped."""

    optimizer: StepsOneParam
    group: object = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    stepped: list = field(default_factory=list)
    buckets_stepped: int = 0
    active: bool = True  # False after remove_gradient_release: plain averaging (a hook cannot be unregistered)
    forward_hook: RemovableHandle | None = None

    def remove(self) -> None:
        """Back to plain averaging (DDP keeps its comm hook: one cannot be unregistered)."""
        self.active = False
        if self.forward_hook is not None:  # register_ddp_release sets it
            self.forward_hook.remove()
        self.drop_stepped_grads()

    def drop_stepped_grads(self) -> None:
        with self.lock:
            stepped, self.stepped = self.stepped, []
        for p in stepped:
            p.grad = None


def release_hook(state: ReleaseHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket like DDP, then step its params with the averaged grads."""
    buffer = bucket.buffer()
    w = world_size(state.group)
    if w == 1:
        reduced = _done(buffer)
    elif buffer.dtype in (torch.bfloat16, torch.float16):
        reduced = _done(allreduce_mean(buffer, state.group))
    else:
        buffer.mul_(1.0 / w)  # DDP's own order: scale the local grads, then sum
        comm_stats().add_full_precision(buffer.numel(), w, buffer.element_size())
        work = dist.all_reduce(buffer, group=state.group, async_op=True)
        reduced = _bounded(work.get_future(), 1, collective_timeout())
    if not state.active:
        return reduced
    params = list(bucket.parameters())

    def step(fut: torch.futures.Future) -> Tensor:
        flat = fut.value()
        if isinstance(flat, list):
            flat = flat[0]
        offset = 0
        with state.lock:
            for p in params:
                n = p.numel()
                state.optimizer.step_param(p, flat[offset:offset + n].view_as(p))
                offset += n
                state.stepped.append(p)
            state.buckets_stepped += 1
        return flat

    return reduced.then(step)


def register_ddp_release(ddp_model: nn.parallel.DistributedDataParallel, optimizer, group=None) -> ReleaseHookState:
    """Register :func:`release_hook` and the forward pre-hook that drops stepped grads."""
    state = ReleaseHookState(optimizer=optimizer, group=group if group is not None else ddp_model.process_group)
    ddp_model.register_comm_hook(state, release_hook)
    state.forward_hook = ddp_model.register_forward_pre_hook(lambda module, args: state.drop_stepped_grads())
    return state


@release_handles.register
def _ddp_release_handles(model: nn.parallel.DistributedDataParallel, optimizer, params) -> list:
    return [register_ddp_release(model, optimizer)]
