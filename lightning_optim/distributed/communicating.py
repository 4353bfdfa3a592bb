"""What every optimizer that communicates by itself shares: the 1-bit family (``lightning_optim.onebit``)
and mlbench's compressed optimizers (``PowerSGD``, ``CentralizedSparsifiedSGD``).

* ``process_group`` and :meth:`_world`: the ranks it averages over;
* ``compressor``: a :class:`lightning_optim.comm.compressors.Compressor` (1-bit, PowerSGD, sparsification),
  whose error-feedback residuals are this rank's own (in ``state_dict``, per rank);
* the contract with DDP, step by step: :attr:`needs_averaged_grads` (the gradients must arrive averaged,
  e.g. a full-precision warmup step) and :attr:`averages_local_grads` (the optimizer averages this rank's
  local gradients itself, compressed: DDP's allreduce can be off, and a gradient clip must use one norm
  agreed by the ranks); adapters that switch DDP by it set ``ddp_allreduce_managed``, and a step that
  compresses on several ranks with nobody managing DDP is counted in ``comm_stats().unmanaged_steps``
  and warned about once (DDP's own fp32 allreduce would run beside it, unseen by ``comm_stats``).

Subclasses answer :meth:`_needs_average` / :meth:`_local_step` for a step number and :meth:`_steps_taken`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

from lightning_optim.comm import comm_stats

__all__ = ["CommunicatingOptimizer"]


class CommunicatingOptimizer:
    """Mixin, listed before the optimizer class: ``class X(CommunicatingOptimizer, torch.optim.SGD)``."""

    process_group: Any = None
    compressor: Any = None
    average_grads = False  # True: the optimizer averages full-precision steps itself (no DDP)
    # Set by the adapters that switch DDP's allreduce by ``needs_averaged_grads`` (the Lightning
    # strategies, accel_plugins.enable_onebit); set it yourself after register_switchable_allreduce.
    ddp_allreduce_managed = False
    _warned_unmanaged = False

    # ------------------------------------------------------------------ for subclasses
    def _steps_taken(self) -> int:
        return 0

    def _needs_average(self, t: int) -> bool:
        """Whether step ``t`` (1-based) consumes gradients averaged over ranks in full precision."""
        return False

    def _local_step(self, t: int) -> bool:
        """Whether step ``t`` updates with this rank's gradients alone (no averaging of them)."""
        return False

    # ------------------------------------------------------------------ the contract
    def _world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.process_group), dist.get_rank(self.process_group)
        return 1, 0

    @property
    def needs_averaged_grads(self) -> bool:
        """Whether the NEXT ``step()`` consumes gradients averaged over ranks in full precision.

        True: the gradients of the next backward must be averaged over ranks, by DDP (its allreduce
        switched on, ``average_grads=False``) or by this optimizer (``average_grads=True``). False: the
        optimizer communicates by itself and wants this rank's local gradients; DDP's allreduce can be
        switched off for the next backward. Equal on every rank.
        """
        return self._needs_average(self._steps_taken() + 1)

    @property
    def averages_local_grads(self) -> bool:
        """Whether the NEXT ``step()`` averages this rank's local gradients itself (compressed): then a
        gradient clip must use one norm agreed by the ranks (``comm.dense.agreed_norm``). False when the
        gradients arrive averaged (warmup) and in steps that stay local (ZeroOneAdam's local stage)."""
        t = self._steps_taken() + 1
        return not self._needs_average(t) and not self._local_step(t)

    def _warn_if_ddp_unmanaged(self, t: int) -> None:
        """At each step that wants local gradients on several ranks with nobody switching DDP: counted in
        ``comm_stats().unmanaged_steps`` (its ratio becomes unknown) and warned about once."""
        if self.ddp_allreduce_managed or self.average_grads or self._needs_average(t):
            return
        world, _ = self._world()
        if world > 1:
            comm_stats().unmanaged_steps += 1
        if world > 1 and not self._warned_unmanaged:
            self._warned_unmanaged = True
            warnings.warn(
                f"{type(self).__name__}: compressing on {world} ranks, but nothing switches DDP's allreduce off: if "
                "the model is wrapped in DistributedDataParallel, DDP's fp32 allreduce still runs every step beside "
                "the compressed one (more bytes than plain DDP; comm_stats() cannot see DDP's own allreduce, so its "
                "compression_ratio is NaN from now on). Use accel_plugins.enable_onebit, "
                "Trainer(strategy='onebit_adam'), or register_switchable_allreduce and set "
                "optimizer.ddp_allreduce_managed = True", UserWarning, stacklevel=4)
