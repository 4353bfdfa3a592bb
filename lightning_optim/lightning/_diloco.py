r"""The DiLoCo strategies (``diloco``, ``streaming_diloco``), written once for both Lightning packages.

``DDPStrategy`` whose DDP hook is ``"local"`` (no gradient all-reduce at all: every rank steps its own
optimizer on its own gradients), with the optimizer of ``configure_optimizers`` wrapped in
:class:`lightning_optim.DiLoCo`: every ``sync_every`` inner steps the ranks average their pseudo-gradients
:math:`\Delta_r = \theta_g - \theta_r` and take one outer Nesterov step together (equations:
``lightning_optim/distributed/diloco.py``). Between synchronisations nothing is sent. No math here.

The ends of a fit: at its start rank 0 warns when no synchronisation falls within it (``max_steps`` shorter
than ``sync_every``); at its end (``on_train_end``, after the callbacks' checkpoints) ``DiLoCo.finish`` takes
the last synchronisation (``final_sync=True``) or warns that the ranks end apart.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from lightning_optim.comm.stats import comm_stats
from lightning_optim.distributed.diloco import check_diloco_arguments
from lightning_optim.lightning._bases import attached
from lightning_optim.lightning._comm_hook_strategies import _NO_BUFFER_SYNC, _CommHookStrategyMixin
from lightning_optim.onebit.convert import retarget_schedulers

__all__ = ["_DiLoCoMixin", "_StreamingDiLoCoMixin"]


class _DiLoCoMixin(_CommHookStrategyMixin):
    """DiLoCo (Douillard et al. 2023): local steps of any optimizer, an outer Nesterov step on the averaged
    parameter change every ``sync_every`` steps; no DDP gradient all-reduce at all.

    Args:
        sync_every: H >= 1, inner (optimizer) steps between two synchronisations of a fragment (None: 25; Streaming
            DiLoCo: 40).
        outer_lr: the outer SGD's learning rate, > 0 (None: the recipe's default, as ``lightning_optim.DiLoCo``).
        outer_momentum: its momentum, in [0, 1); with ``compressor="sparseloco"`` the decay of its accumulator, in
            [0, 1] (None: the recipe's default).
        nesterov: Nesterov momentum (needs outer_momentum > 0; not with SparseLoCo; None: the recipe's default).
        fragments: F >= 1 dividing H: Streaming DiLoCo's fragments, one synchronised every H/F steps.
        overlap: start each exchange after its step and merge it one step later.
        mixing: alpha in [0, 1] of the overlapped merge (None: 0.5 with overlap; only with overlap).
        compressor: None, "int8", "int4", "onebit", "sign", "topk", "powersgd", "sparseloco" or a Compressor
            (error feedback per rank).
        density, bits: with ``compressor="sparseloco"`` only: the share of each chunk sent, in (0, 1], and bits
            per value, in [1, 8] (None: SparseLoCo's 1/64 and 2).
        final_sync: a fit that ends between synchronisations takes one more (True, the default: every rank ends
            with the same model; the checkpoints written during the fit hold the state before it and resume
            bitwise), or ends with each rank's own params and a warning (False). See ``lightning_optim.DiLoCo``.
        timeout, telemetry: as :class:`PowerSGDStrategy`.
        **kwargs: ``DDPStrategy`` arguments; buffers stay each rank's own (no broadcast at every forward).

    The optimizer of ``configure_optimizers`` (one, any local one: torch's or ours) becomes DiLoCo's inner
    optimizer; schedulers keep driving its param groups. The ranks' params differ between synchronisations:
    checkpoints keep each rank's params and optimizer state (inner state, global params, outer momentum,
    residuals), and validation scores each rank's own model (the synchronised one right after a sync with
    ``fragments=1`` and no overlap: choose ``val_check_interval`` a multiple of ``sync_every``).
    A rank that dies or hangs during an exchange makes the others raise ``CommunicationError`` naming it
    within ``timeout``.
    """

    hook_name = "local"
    _per_rank_params = True
    _grad_scaler_refusal = ("lets each rank skip a step alone on an overflow, but DiLoCo's ranks synchronise after "
                            "the same number of steps (a skipped step on one rank would desynchronise them)")
    # sync_every: the recipe's (benchmarks/diloco_sweep.py: the loss rises with H; 25 with int4 sends ~190x fewer bytes
    # than DDP for +3.6%, fewer bytes and a lower loss than 50 without)
    _defaults: ClassVar[dict[str, Any]] = {"sync_every": 25, "fragments": 1, "overlap": False}

    def __init__(self, sync_every: int | None = None, outer_lr: float | None = None,
                 outer_momentum: float | None = None, nesterov: bool | None = None, fragments: int | None = None,
                 overlap: bool | None = None,
                 mixing: float | None = None, compressor: Any = None, final_sync: bool = True,
                 density: float | None = None, bits: int | None = None, **kwargs: Any) -> None:
        name = type(self).__name__
        sync_every = self._defaults["sync_every"] if sync_every is None else sync_every
        fragments = self._defaults["fragments"] if fragments is None else fragments
        overlap = self._defaults["overlap"] if overlap is None else overlap
        try:  # DiLoCo's own checks (those that need no params), before Lightning builds anything
            settings = check_diloco_arguments(sync_every, fragments, outer_lr, outer_momentum, nesterov, overlap,
                                              mixing, final_sync, compressor, density, bits)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        if "broadcast_buffers" not in kwargs and "forward_sync_buffers" not in kwargs:
            kwargs[_NO_BUFFER_SYNC] = False  # a per-forward broadcast would be a collective on every step
        super().__init__(hook_kwargs={}, **kwargs)
        self._diloco_kwargs = {**settings, "mixing": mixing, "compressor": compressor}
        self.diloco: Any = None
        self.final_sync_bytes = 0  # what the last synchronisation at the end of the fit sent
        self.params_changed_at_end = False  # the end of the fit synchronised (or merged) after its last step

    def _step_skips_ddp_allreduce(self) -> bool:
        return True

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)  # refuses optimizers that communicate by themselves
        from lightning_optim.distributed.diloco import DiLoCo

        name = type(self).__name__
        if len(self.optimizers) != 1:
            raise ValueError(
                f"{name} needs exactly one optimizer from configure_optimizers, got {len(self.optimizers)}")
        inner = getattr(self.optimizers[0], "_optimizer", self.optimizers[0])
        try:
            self.diloco = DiLoCo(inner, **self._diloco_kwargs)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        retarget_schedulers([config.scheduler for config in self.lr_scheduler_configs], inner, self.diloco)
        self.optimizers = [self.diloco]

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = attached(self.lightning_module, "lightning_module").trainer
        total = trainer.estimated_stepping_batches
        if self.diloco is not None and math.isfinite(total):  # every rank (rank 0 warns)
            last = self.diloco.inner_steps + max(0, int(total) - trainer.global_step)
            self.diloco.warn_if_no_sync(last, type(self).__name__)

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.diloco is None:
            return
        before = comm_stats().copy()
        merges = self.diloco.pending is not None and self.diloco.final_sync  # an overlapped exchange in flight
        # collective with final_sync: every rank ends its fit here
        self.params_changed_at_end = self.diloco.finish(type(self).__name__) or merges
        sent = comm_stats() - before
        self.final_sync_bytes = sent.bytes_sent
        self.comm_totals["bytes_sent"] += sent.bytes_sent  # sent during the fit, after its last step
        self.comm_totals["inter_node_bytes"] += sent.inter_node_bytes

    def comm_summary(self) -> dict[str, Any]:
        d = self.diloco
        extra = {} if d is None else {"sync_every": d.sync_every, "fragments": d.fragments, "overlap": d.overlap,
                                      "compressor": d.compressor_name, "density": d.density, "bits": d.bits,
                                      "final_sync": d.final_sync,
                                      "final_sync_bytes": self.final_sync_bytes}
        return {**super().comm_summary(), **extra}


class _StreamingDiLoCoMixin(_DiLoCoMixin):
    """Streaming DiLoCo (Douillard et al. 2025): DiLoCo with the model in ``fragments`` parts (default 4), one
    synchronised every ``sync_every / fragments`` steps, its exchange overlapped with the next inner step
    (``overlap=True`` by default) - each exchange carries about 1/F of the model. Arguments: as
    :class:`DiLoCoStrategy`; ``compressor="int4"`` gives the paper's 4-bit outer gradients."""

    _defaults: ClassVar[dict[str, Any]] = {"sync_every": 40, "fragments": 4, "overlap": True}
