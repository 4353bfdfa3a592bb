"""1-bit Adam's exchange overlapped with backward: a DDP comm hook per bucket.

    ddp_model = DistributedDataParallel(model)
    opt = lightning_optim.OnebitAdam(ddp_model.parameters(), freeze_step=100, average_grads=False)
    handle = lightning_optim.onebit.overlap_with_ddp(ddp_model, opt)
    for batch in loader:
        loss(ddp_model(batch)).backward()   # compression stage: each bucket's momenta are exchanged
        opt.step()                          # while backward still runs; step() then only updates
        opt.zero_grad()

Warmup (``opt.needs_averaged_grads``): every bucket is averaged in fp32 as DDP does (the hook of
``comm/hooks.py``), and the hook learns DDP's buckets. Compression stage: DDP's allreduce is off; the
hook hands each bucket, as soon as DDP has it, to one communication thread that runs the bucket's
compression unit (``units.py``: momentum update from the bucket's gradients, error-compensated 1-bit
average, per-param scales) while autograd goes on with the earlier layers; the bucket itself goes back
to DDP unchanged (local gradients). DDP waits for every bucket before ``backward()`` returns, and
``opt.step()`` compresses only what no bucket covered, then applies the update.

One thread runs the units in the order DDP hands the buckets over (the same on every rank), so the
collectives pair up across ranks. ``overlap=False`` runs the same units at ``step()`` time instead (the
reference the overlapped path equals bit for bit).
"""

# no ``from __future__ import annotations``: DDP checks the hook's return annotation at runtime
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_optim.comm.hooks import SwitchableAllreduceState, switchable_allreduce_hook

__all__ = ["OverlapState", "bind_overlap", "check_trains_ddp_params", "onebit_overlap_hook", "overlap_with_ddp"]


@dataclass
class OverlapState:
    """State of :func:`onebit_overlap_hook` (``overlap_with_ddp`` makes it). Until an optimizer is bound
    (:func:`bind_overlap`) the hook averages every bucket as DDP does."""

    optimizer: Any = None
    overlap: bool = True
    allreduce: SwitchableAllreduceState = field(default_factory=SwitchableAllreduceState)
    units_overlapped: int = 0
    _step: int = -1  # the optimizer step the ready/submitted sets belong to
    _ready: set = field(default_factory=set)
    _submitted: set = field(default_factory=set)
    _executor: ThreadPoolExecutor | None = None

    def executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-optim-1bit")
        return self._executor

    def close(self) -> None:
        """Stop the communication thread (a later backward starts it again)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def onebit_overlap_hook(state: OverlapState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: fp32 average in warmup; in the compression stage, every compression unit this bucket
    completes runs on the communication thread (``overlap=False``: at ``step()`` time); the bucket goes
    back unchanged (this rank's gradients)."""
    opt = state.optimizer
    if opt is None or opt.needs_averaged_grads:
        return switchable_allreduce_hook(state.allreduce, bucket)
    buffer = bucket.buffer()
    if not state.overlap:
        return _done(buffer)
    layout = opt._layout if opt._layout is not None else opt._prepare_layout()  # None: just restored
    if state._step != opt.global_step:
        state._step, state._ready, state._submitted = opt.global_step, set(), set()
    units = opt._units_completed_by(layout, bucket.parameters(), state._ready)
    if state._submitted & set(units):
        raise RuntimeError("backward: a second backward reached DDP's buckets before optimizer.step(); with 1-bit "
                           "compression per bucket, accumulate gradients inside ddp_model.no_sync()")
    if not units:
        return _done(buffer)
    state._submitted.update(units)
    grads = [[layout.params[i].grad for i in unit] for unit in units]
    w1 = opt.momentum_weight()
    result: torch.futures.Future = torch.futures.Future()

    def run() -> None:
        try:
            for unit, unit_grads in zip(units, grads):
                opt._compress_unit(layout, unit, unit_grads, w1)
                opt._units_done.add(unit)
                state.units_overlapped += 1
            result.set_result(buffer)
        except BaseException as exc:  # noqa: BLE001 - surfaced through DDP's wait on the future
            result.set_exception(exc)

    state.executor().submit(run)
    return result


def check_trains_ddp_params(ddp_model: torch.nn.Module, optimizer: Any) -> None:
    """ValueError unless ``optimizer`` trains every trainable param of ``ddp_model`` (the hook reads the
    gradients of DDP's buckets as the optimizer's own)."""
    module = getattr(ddp_model, "module", ddp_model)
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in trained]
    if missing:
        raise ValueError(f"optimizer: it does not train {len(missing)} of the DDP model's params "
                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); the overlap hook needs the "
                         "optimizer over the model's own params (master weights keep separate fp32 copies)")


def bind_overlap(state: OverlapState, ddp_model: torch.nn.parallel.DistributedDataParallel, optimizer: Any,
                 unit_mb: float | None = None) -> None:
    """Bind ``optimizer`` (an ``OnebitAdam`` over ``ddp_model``'s params, ``average_grads=False``) to the
    hook ``state``; its compression units become ``unit_mb`` MB of fp32 momenta (None: DDP's bucket size).

    Raises ValueError, before anything changes, for another optimizer, ``average_grads=True``, param
    groups with different ``beta1`` or ``unit_mb`` <= 0."""
    from lightning_optim.onebit.adam import OnebitAdam

    if not isinstance(optimizer, OnebitAdam):
        raise ValueError(f"optimizer: the overlap hook drives OnebitAdam, got {type(optimizer).__name__}")
    if optimizer.average_grads:
        raise ValueError("optimizer: build OnebitAdam with average_grads=False; the hook averages the warmup "
                         "gradients in DDP's buckets")
    optimizer.momentum_weight()  # one beta1 for every group (raises otherwise)
    check_trains_ddp_params(ddp_model, optimizer)
    if unit_mb is not None and (isinstance(unit_mb, bool) or not isinstance(unit_mb, (int, float)) or unit_mb <= 0):
        raise ValueError(f"unit_mb must be a positive number of MB, got {unit_mb!r}")
    cap_bytes = ddp_model.bucket_bytes_cap if unit_mb is None else unit_mb * 1024 * 1024
    optimizer.set_compression_units(max(1, int(cap_bytes) // 4))
    optimizer.ddp_allreduce_managed = True
    state.allreduce.group = optimizer.process_group
    state.optimizer = optimizer


def overlap_with_ddp(ddp_model: torch.nn.parallel.DistributedDataParallel, optimizer: Any, *,
                     overlap: bool = True, unit_mb: float | None = None) -> OverlapState:
    """Register :func:`onebit_overlap_hook` on ``ddp_model`` for ``optimizer`` (see :func:`bind_overlap`);
    return its state. ``overlap=False`` compresses the same units at ``step()`` time instead."""
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be True or False, got {overlap!r}")
    state = OverlapState(overlap=overlap)
    bind_overlap(state, ddp_model, optimizer, unit_mb)
    ddp_model.register_comm_hook(state, onebit_overlap_hook)
    return state
