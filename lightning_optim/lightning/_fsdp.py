"""``onebit_fsdp``: Lightning's FSDP2 strategy (``ModelParallelStrategy``) on a 2-D (replicate, shard) mesh,
HSDP, with the cross-replica gradient all-reduce replaced by 1-bit Adam's compressed momentum exchange in
the compression stage (:func:`lightning_optim.onebit.onebit_fsdp`, which holds the algorithm).

    trainer = Trainer(accelerator="cpu", devices=4, strategy=OnebitFSDPStrategy(replicate_size=2, freeze_step=100))
    trainer = Trainer(devices=8, num_nodes=4, strategy="onebit_fsdp")   # shard in a node, replicate across

What the strategy adds to ``ModelParallelStrategy``:

* the mesh ``(replicate, shard)`` (``replicate_size``: ``"auto"`` = the number of nodes; the shard size is
  the world divided by it), given to ``configure_model`` as ``self.device_mesh``; every rank reads its own
  data (all ranks are data-parallel under HSDP);
* without a ``configure_model`` that shards, it applies ``fully_shard`` itself: to every module of an
  ``nn.ModuleList`` (a model's layers), then to each direct child of the LightningModule that has params;
* ``configure_optimizers``' Adam/AdamW becomes ``OnebitAdam`` (or ``ZeroOneAdam``: ``optimizer=``) with the
  same param groups; the reduction of the next backward is set before every training step;
* ``gradient_clip_val`` (norm) in the compression stage clips every rank by one agreed norm
  :math:`N = \\sqrt{\\frac{1}{R}\\sum_w \\lVert g_w\\rVert^2}` over the replicas' shard means :math:`g_w`;
* checkpoints (a DCP folder, ``save_distributed_checkpoint=True`` only): the model as
  ``ModelParallelStrategy`` saves it, and every rank's own optimizer state (its shard's moments, its error
  buffers; ZeroOneAdam between synchronisations also its params) under ``optimizer_0.onebit_rank<r>``;
  a checkpoint of plain HSDP (``ModelParallelStrategy`` with Adam/AdamW) resumes too: torch's moments are
  loaded and the stage follows from the step count, as with DDP.
"""

from __future__ import annotations

import math
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lightning_optim.catalogue import OPTIMIZERS
from lightning_optim.comm import set_collective_timeout
from lightning_optim.comm.stats import ring_allreduce_bytes
from lightning_optim.lightning._bases import ModelParallelBase, attached
from lightning_optim.lightning._clipping import _AgreedClipMixin
from lightning_optim.lightning._failures import DEFAULT_TIMEOUT_S, _CommFailureMixin
from lightning_optim.lightning._telemetry import _ByteCountingMixin
from lightning_optim.onebit import OnebitAdam, OnebitOptimizer
from lightning_optim.onebit.auto_freeze import AutoFreezeMixin
from lightning_optim.onebit.convert import retarget_schedulers, to_onebit
from lightning_optim.onebit.fsdp import OnebitFSDP, install
from lightning_optim.onebit.fsdp_checkpoint import has_rank_state, load_hsdp_adam_state, load_rank_state, rank_state
from lightning_optim.onebit.fsdp_grads import FSDPModule
from lightning_optim.onebit.layout import local_tensor

__all__ = ["_OnebitFSDPMixin"]

_OPTIMIZERS = ("onebit_adam", "zero_one_adam")


class _OnebitFSDPMixin(_AgreedClipMixin, _ByteCountingMixin, _CommFailureMixin, ModelParallelBase):
    """HSDP (FSDP2 on a replicate x shard mesh) + 1-bit Adam across the replicas.

    Args:
        replicate_size: ranks that hold the same shard (``"auto"``: ``num_nodes``); must divide the world
            and leave a shard group of at least 2.
        optimizer: ``"onebit_adam"`` or ``"zero_one_adam"``: what ``configure_optimizers``' Adam/AdamW becomes.
        freeze_step, auto_mask, auto_freeze_window, auto_freeze_tolerance, auto_freeze_max: ``OnebitAdam``'s;
            var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper, auto_mask: ``ZeroOneAdam``'s
            (None: the optimizer's default).
        timeout: collective timeout in seconds. telemetry: log ``comm/*`` per step (the cross-replica
            bytes: HSDP's all-reduce in warmup, the 1-bit exchange after; the shard group's
            reduce-scatter/all-gather, equal in both stages, are not counted).
        save_distributed_checkpoint: True only (each rank saves its own 1-bit state beside its shard).
        process_group_backend: ``ModelParallelStrategy``'s.
    """

    telemetry_callback_class: type
    optimizer_class: type[OnebitOptimizer] = OnebitAdam  # the default; ``optimizer=`` picks per instance
    fp32_baseline = "HSDP's fp32 all-reduce"

    def __init__(self, replicate_size: int | Literal["auto"] = "auto", optimizer: str = "onebit_adam",
                 freeze_step: int | Literal["auto"] | None = None, auto_mask: bool | float | None = None,
                 var_freeze_step: int | None = None, var_update_scaler: int | None = None,
                 local_step_scaler: int | None = None, local_step_clipper: int | None = None, *,
                 timeout: float | timedelta = DEFAULT_TIMEOUT_S, telemetry: bool = True,
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 auto_freeze_window: int | None = None, auto_freeze_tolerance: float | None = None,
                 auto_freeze_max: int | None = None) -> None:
        name = type(self).__name__
        knobs: dict[str, Any] = dict(freeze_step=freeze_step, auto_mask=auto_mask, var_freeze_step=var_freeze_step,
                     var_update_scaler=var_update_scaler, local_step_scaler=local_step_scaler,
                     local_step_clipper=local_step_clipper, auto_freeze_window=auto_freeze_window,
                     auto_freeze_tolerance=auto_freeze_tolerance, auto_freeze_max=auto_freeze_max)
        knobs = {k: v for k, v in knobs.items() if v is not None}
        if optimizer not in _OPTIMIZERS:
            raise ValueError(f"{name}: optimizer must be one of {list(_OPTIMIZERS)}, got {optimizer!r} (OnebitLamb's "
                             "trust ratio needs norms of whole params, which the shards split)")
        if not (replicate_size == "auto" or (isinstance(replicate_size, int) and not isinstance(replicate_size, bool)
                                            and replicate_size >= 2)):
            raise ValueError(f"{name}: replicate_size must be 'auto' (the number of nodes) or an int >= 2, got "
                             f"{replicate_size!r}")
        if save_distributed_checkpoint is not True:
            raise ValueError(f"{name}: save_distributed_checkpoint must be True: each rank saves its own 1-bit state "
                             "(error buffers) beside its shard")
        if not isinstance(telemetry, bool):
            raise TypeError(f"{name}: telemetry must be True or False, got {telemetry!r}")
        self.optimizer_class = OPTIMIZERS[optimizer].cls
        self._knobs = knobs
        try:  # the optimizer's own checks name the argument and its range
            self.optimizer_class([torch.zeros(1, requires_grad=True)], **knobs)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        self._replicate_size, self._telemetry = replicate_size, telemetry
        super().__init__(timeout=self._init_timeout(timeout), save_distributed_checkpoint=True,
                         process_group_backend=process_group_backend)
        self._onebit: OnebitOptimizer | None = None
        self._handle: OnebitFSDP | None = None
        self._init_counting()

    @property
    def onebit_optimizer(self) -> OnebitOptimizer | None:
        return self._onebit

    @property
    def onebit_handle(self) -> OnebitFSDP | None:
        """What :func:`lightning_optim.onebit.onebit_fsdp` installed (after ``setup``)."""
        return self._handle

    def comm_summary(self) -> dict[str, Any]:
        return {**super().comm_summary(),
                "optimizer": type(self._onebit).__name__ if self._onebit is not None else None}

    # ------------------------------------------------------------------ the mesh
    def check_world(self, processes_per_node: int, num_nodes: int) -> None:
        self._mesh_for(processes_per_node * num_nodes, num_nodes)
        super().check_world(processes_per_node, num_nodes)

    def _mesh_shape(self) -> tuple[int, int]:
        return self._mesh_for(self.world_size, self.num_nodes)

    def _mesh_for(self, world: int, num_nodes: int) -> tuple[int, int]:
        name = type(self).__name__
        replicas = num_nodes if self._replicate_size == "auto" else self._replicate_size
        if replicas < 2 or world % replicas or world // replicas < 2:
            raise ValueError(
                f"{name}: replicate_size={self._replicate_size!r} gives {replicas} replica(s) of a world of {world} "
                "ranks; HSDP with 1-bit needs at least 2 replicas, dividing the world, with a shard group of at least "
                "2 ranks (one node: pass replicate_size=2 or more; one rank per replica: use strategy='onebit_adam')")
        return replicas, world // replicas

    def setup_environment(self) -> None:
        # ModelParallelStrategy's, with our (replicate, shard) mesh instead of its (data, tensor) parallel one
        set_collective_timeout(self._timeout_s)
        self._setup_distributed()
        from torch.distributed.device_mesh import init_device_mesh

        self._device_mesh = init_device_mesh(self.root_device.type, self._mesh_shape(),
                                             mesh_dim_names=("replicate", "shard"))
        attached(self.lightning_module, "lightning_module")._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}  # every HSDP rank reads its own data

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: Any) -> None:
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(f"{type(self).__name__}: torch's GradScaler (precision='16-mixed') skips steps per rank; "
                             "use precision='bf16-mixed' or '32-true'")
        fitting = trainer.state.fn == "fit"
        if fitting and self._telemetry and not any(isinstance(cb, self.telemetry_callback_class)
                                                   for cb in trainer.callbacks):
            trainer.callbacks.append(self.telemetry_callback_class())
        # ModelParallelStrategy.setup, which needs a configure_model that shards; here sharding is automatic
        attached(self.accelerator, "accelerator").setup(trainer)
        self._shard_unless_sharded()
        _materialize = sys.modules[_model_parallel_base(self).__module__]._materialize_distributed_module
        _materialize(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(attached(self.model, "model"))
        self.model_to_device()
        self.barrier()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._agree_on_clipping()
        if fitting:
            self._start_counting()

    def _shard_unless_sharded(self) -> None:
        from torch.distributed.fsdp import fully_shard

        module = attached(self.lightning_module, "lightning_module")
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            return  # configure_model sharded it
        if any(True for _ in module.parameters(recurse=False)):
            raise ValueError(f"{type(self).__name__}: the LightningModule holds params itself; shard in "
                             "configure_model with fully_shard(..., mesh=self.device_mesh) instead")
        for m in module.modules():
            if isinstance(m, nn.ModuleList):
                for layer in m:
                    if any(True for _ in layer.parameters()):
                        fully_shard(layer, mesh=self._device_mesh)
        for child in module.children():
            if not isinstance(child, FSDPModule) and any(True for _ in child.parameters()):
                fully_shard(child, mesh=self._device_mesh)

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        name = type(self).__name__
        if len(self.optimizers) != 1:
            raise ValueError(
                f"{name} needs exactly one optimizer from configure_optimizers, got {len(self.optimizers)}")
        old = getattr(self.optimizers[0], "_optimizer", self.optimizers[0])
        if isinstance(old, OnebitOptimizer):
            new = old
        else:
            try:
                new = to_onebit(old, self.optimizer_class, self._knobs, average_grads=False)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{name}: {exc}") from None
            retarget_schedulers([config.scheduler for config in self.lr_scheduler_configs], old, new)
            self.optimizers = [new]
        module = attached(self.lightning_module, "lightning_module")
        try:
            self._handle = install(module, new, forward_hook=False)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        self._onebit = new
        self._trained_numel = sum(local_tensor(p).numel() for p in module.parameters() if p.requires_grad)

    def _fp32_step_bytes(self) -> int:
        """HSDP's full-precision all-reduce of this rank's shard over its replicas (what 1-bit replaces)."""
        return ring_allreduce_bytes(self._trained_numel, attached(self._device_mesh, "device_mesh").size(0))

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer, opt = attached(self.lightning_module, "lightning_module").trainer, self._onebit
        total = trainer.estimated_stepping_batches
        if opt is None or not math.isfinite(total):
            return
        run = opt.global_step + max(0, int(total) - trainer.global_step)
        if run >= 1 and isinstance(opt, AutoFreezeMixin):
            opt.limit_auto_freeze(run)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._handle is not None:
            self._handle.prepare_backward()
        return super().training_step(*args, **kwargs)

    def _step_skips_ddp_allreduce(self) -> bool:
        return self._onebit is not None and not self._onebit.needs_averaged_grads

    def _clip_norm_input(self, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Local shards and :math:`\\sqrt{S}\\lVert\\mathrm{shard}\\rVert`: ``agreed_norm``'s mean over the world
        is then the mean over the replicas of their shard means' squared norms."""
        local = [local_tensor(g) for g in grads]
        norm = nn.utils.get_total_norm(local) if local else torch.zeros(())
        return local, norm * math.sqrt(attached(self._device_mesh, "device_mesh").size(1))

    def teardown(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        super().teardown()

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        module = attached(self.lightning_module, "lightning_module")
        return rank_state(getattr(optimizer, "_optimizer", optimizer), module)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        module = attached(self.lightning_module, "lightning_module")
        fabric = sys.modules[_model_parallel_base(self).__module__]
        metadata = fabric._load_checkpoint(path=path, state={"state_dict": module}, strict=module.strict_loading,
                                           weights_only=weights_only)
        optimizer = attached(self._onebit, "the 1-bit optimizer")
        if has_rank_state(path, "optimizer_0"):
            load_rank_state(optimizer, module, path, "optimizer_0")
        else:  # plain HSDP (ModelParallelStrategy with Adam/AdamW): torch's sharded moments
            load_hsdp_adam_state(optimizer, module, path, "optimizer_0")
        metadata.pop("optimizer_states", None)
        return metadata


def _model_parallel_base(strategy: Any) -> type:
    return next(c for c in type(strategy).__mro__ if c.__name__ == "ModelParallelStrategy")
