r"""The DiLoCo strategies (``diloco``, ``streaming_diloco``), written once for both Lightning packages.

``DDPStrategy`` whose DDP hook is ``"local"`` (no gradient all-reduce at all: every rank steps its own
optimizer on its own gradients), with the optimizer of ``configure_optimizers`` wrapped in
:class:`lightning_optim.DiLoCo`: every ``sync_every`` inner steps the ranks average their pseudo-gradients
:math:`\Delta_r = \theta_g - \theta_r` and take one outer Nesterov step together (equations:
``lightning_optim/distributed/diloco.py``). Between synchronisations nothing is sent. No math here.
"""

from __future__ import annotations

from typing import Any

from lightning_optim.distributed.diloco import check_diloco_arguments
from lightning_optim.distributed.diloco_exchange import resolve_compressor
from lightning_optim.lightning._comm_hook_strategies import _NO_BUFFER_SYNC, _CommHookStrategyMixin
from lightning_optim.lightning.convert import retarget_schedulers

__all__ = ["_DiLoCoMixin", "_StreamingDiLoCoMixin"]


class _DiLoCoMixin(_CommHookStrategyMixin):
    """DiLoCo (Douillard et al. 2023): local steps of any optimizer, an outer Nesterov step on the averaged
    parameter change every ``sync_every`` steps; no DDP gradient all-reduce at all.

    Args:
        sync_every: H >= 1, inner (optimizer) steps between two synchronisations of a fragment.
        outer_lr: the outer SGD's learning rate, > 0 (0.7, the paper's).
        outer_momentum: its momentum, in [0, 1) (0.9).
        nesterov: Nesterov momentum (needs outer_momentum > 0).
        fragments: F >= 1 dividing H: Streaming DiLoCo's fragments, one synchronised every H/F steps.
        overlap: start each exchange after its step and merge it one step later.
        mixing: alpha in [0, 1] of the overlapped merge (None: 0.5 with overlap; only with overlap).
        compressor: None, "int8", "int4", "onebit", "sign", "topk", "powersgd" or a Compressor (error feedback
            per rank).
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
    _defaults: dict[str, Any] = {"fragments": 1, "overlap": False}

    def __init__(self, sync_every: int = 100, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, fragments: int | None = None, overlap: bool | None = None,
                 mixing: float | None = None, compressor: Any = None, **kwargs: Any) -> None:
        name = type(self).__name__
        fragments = self._defaults["fragments"] if fragments is None else fragments
        overlap = self._defaults["overlap"] if overlap is None else overlap
        try:  # DiLoCo's own checks (those that need no params), before Lightning builds anything
            settings = check_diloco_arguments(sync_every, fragments, outer_lr, outer_momentum, nesterov, overlap,
                                              mixing)
            resolve_compressor(compressor)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        if "broadcast_buffers" not in kwargs and "forward_sync_buffers" not in kwargs:
            kwargs[_NO_BUFFER_SYNC] = False  # a per-forward broadcast would be a collective on every step
        super().__init__(hook_kwargs={}, **kwargs)
        self._diloco_kwargs = {**settings, "mixing": mixing, "compressor": compressor}
        self.diloco: Any = None

    def _step_skips_ddp_allreduce(self) -> bool:
        return True

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)  # refuses optimizers that communicate by themselves
        from lightning_optim.distributed.diloco import DiLoCo

        name = type(self).__name__
        if len(self.optimizers) != 1:
            raise ValueError(f"{name} needs exactly one optimizer from configure_optimizers, got {len(self.optimizers)}")
        inner = getattr(self.optimizers[0], "_optimizer", self.optimizers[0])
        try:
            self.diloco = DiLoCo(inner, **self._diloco_kwargs)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        retarget_schedulers([config.scheduler for config in self.lr_scheduler_configs], inner, self.diloco)
        self.optimizers = [self.diloco]

    def comm_summary(self) -> dict[str, Any]:
        d = self.diloco
        extra = {} if d is None else {"sync_every": d.sync_every, "fragments": d.fragments, "overlap": d.overlap,
                                      "compressor": d.compressor_name}
        return {**super().comm_summary(), **extra}


class _StreamingDiLoCoMixin(_DiLoCoMixin):
    """Streaming DiLoCo (Douillard et al. 2025): DiLoCo with the model in ``fragments`` parts (default 4), one
    synchronised every ``sync_every / fragments`` steps, its exchange overlapped with the next inner step
    (``overlap=True`` by default) - each exchange carries about 1/F of the model. Arguments: as
    :class:`DiLoCoStrategy`; ``compressor="int4"`` gives the paper's 4-bit outer gradients."""

    _defaults = {"fragments": 4, "overlap": True}
