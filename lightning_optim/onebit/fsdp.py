r"""1-bit Adam for models sharded by FSDP2 on a 2-D mesh (HSDP): one call after ``fully_shard``.

    mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = lightning_optim.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=1000)
    handle = lightning_optim.onebit.onebit_fsdp(model, optimizer)   # before the first step
    # the training loop stays as it is: loss.backward(); optimizer.step(); optimizer.zero_grad()

HSDP reduces gradients in two collectives: a reduce-scatter over the shard group (every rank gets the
mean of its shard over the :math:`S` ranks of its replica), then a full-precision all-reduce of that
shard over the replicate group (the :math:`R` ranks that hold the same shard). With this call:

* **warmup** (``optimizer.needs_averaged_grads``, e.g. OnebitAdam's steps :math:`t \le T` =
  ``freeze_step``): HSDP runs as it is; the optimizer steps every shard with the fully averaged gradient
  :math:`\bar g = \frac{1}{RS}\sum_r g_r` (Adam, the variance estimated);
* **compression stage**: the all-reduce is switched off (``FSDPModule.set_requires_all_reduce``) and each
  rank's ``.grad`` is its replica's shard mean :math:`g_w` (``fsdp_grads.py``); the optimizer, whose
  ``process_group`` is the replicate group, updates :math:`m_w \leftarrow \beta_1 m + (1-\beta_1) g_w`
  and exchanges the momenta 1-bit compressed with error feedback across the replicas,
  :math:`m \leftarrow C(m_1..m_R)`, about 1/32 of the all-reduce's bytes. The math is
  :class:`~lightning_optim.onebit.OnebitAdam`'s own, run on each DTensor's local shard.

The stage is read from the optimizer before every forward of ``model`` (a forward pre-hook), so it is the
same on every rank. Each shard is compressed with its own scale per param (the compression is 1-bit Adam
run independently on each shard of the model, by the :math:`R` replicas of that shard); the automatic
zero mask (``auto_mask``) compares each element with the mean variance of its param's local shard.

Checkpoints: every rank saves its own ``optimizer.state_dict()`` (its shard's moments and its error
buffers; ``torch.distributed.checkpoint`` can carry it under a per-rank key) beside the model's DCP state
dict, and loads it back on the same mesh after calling this: the run continues bitwise. Not with
``get_state_dict(model, optimizer)``: it keeps only torch's keys (drops the ``onebit`` entry: stage counters
and error buffers) and the moments are plain local tensors, which DCP would store once for all ranks.
ZeroOneAdam's replicas differ between synchronisations, and DCP keeps one copy of a replicated shard: save
where ``optimizer.params_synchronized``.

How the shard gradient is obtained (``fsdp_grads.py``): without its all-reduce, torch (2.13) writes no
``.grad`` at all (it keeps the reduce-scattered shard for a later all-reduced backward), so this installs
its own reduce-scatter on every FSDP module (``set_custom_reduce_scatter``), which writes the gradients from
the flat shard in FSDP's layout, and drops torch's kept partial result before the next forward
(``reset_iter_state``). Every trained param takes part in every reduce-scatter
(``set_reduce_scatter_unused_params(True)``: zeros where unused), so the layout is fixed.

Supported: :class:`OnebitAdam` and :class:`ZeroOneAdam` over fp32 sharded params, FSDP's default gradient
mean (fp32/bf16 ``reduce_dtype``). Refused, with the argument named: a model without ``fully_shard`` on its
root, params not on a 2-D (replicate, shard) mesh, a replicate or shard dimension of size 1, an optimizer
that is not 1-bit, :class:`OnebitLamb` (its trust ratio needs norms of whole params, across shards),
``hierarchical``, per-bucket compression (``overlap``), ``exp_avg_mask``, an optimizer that has stepped.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_optim.onebit.base import OnebitOptimizer
from lightning_optim.onebit.fsdp_grads import (
    DTensor,
    FSDPModule,
    Replicate,
    Shard,
    ShardGradients,
    flat_order,
    missing_fsdp2_api,
)
from lightning_optim.onebit.lamb import OnebitLamb

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["OnebitFSDP", "onebit_fsdp"]

_INSTALLED: weakref.WeakSet = weakref.WeakSet()  # models with a live handle


class OnebitFSDP:
    """What :func:`onebit_fsdp` installed; :meth:`remove` undoes it (HSDP's all-reduce back on for good)."""

    def __init__(self, model: nn.Module, optimizer: OnebitOptimizer, replicate_group: dist.ProcessGroup) -> None:
        self.model, self.optimizer, self.replicate_group = model, optimizer, replicate_group
        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.roots = _fsdp_roots(model)  # where FSDP's iteration state lives (``model`` itself for onebit_fsdp)
        names = {id(m): name or "<root>" for name, m in model.named_modules()}
        replicas = dist.get_world_size(replicate_group)
        self.comms = [ShardGradients(names[id(m)], flat_order(m), replicas) for m in self.modules]
        self.all_reduce_skipped = False  # a backward ran without the all-reduce since the last forward
        self._saved = {key: getattr(optimizer, key, None) for key in ("process_group", "average_grads",
                                                                        "ddp_allreduce_managed", "freeze_vote_group")}
        self._hooks: list[Any] = []

    # ------------------------------------------------------------------ install / remove
    def _install(self, *, forward_hook: bool = True) -> None:
        for module, comm in zip(self.modules, self.comms):
            if comm.params:
                # duck-types torch's ReduceScatter interface (a private class, in newer torches only)
                module.set_custom_reduce_scatter(comm)  # type: ignore[arg-type]
            # every trained param in every reduce-scatter (zeros where unused), so its flat layout is fixed
            module.set_reduce_scatter_unused_params(True, recurse=False)
        opt = self.optimizer
        opt.process_group = self.replicate_group  # the momenta are exchanged among the holders of one shard
        opt.average_grads = False  # HSDP's own all-reduce averages the warmup's gradients
        opt.ddp_allreduce_managed = True
        # freeze_step="auto" sums the variance's squares over every shard: the whole world votes
        opt.freeze_vote_group = dist.group.WORLD
        if forward_hook:  # else the caller calls prepare_backward() (Lightning: the strategy, per training step)
            self._hooks.append(self.model.register_forward_pre_hook(lambda *_: self.prepare_backward(), prepend=True))
        self._hooks.append(opt.register_step_pre_hook(self._before_step))
        _INSTALLED.add(self.model)

    def remove(self) -> None:
        """Remove the hooks, switch HSDP's all-reduce back on, give the optimizer its own settings back
        (``process_group``, ``average_grads``); the reduce-scatter stays a plain one (as torch's default)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._drop_partial_reduction()
        for module, comm in zip(self.modules, self.comms):
            comm.capture = comm.keep_output = False
            module.set_requires_all_reduce(True, recurse=False)
        for key, value in self._saved.items():
            setattr(self.optimizer, key, value)
        _INSTALLED.discard(self.model)

    # ------------------------------------------------------------------ per step
    def prepare_backward(self) -> None:
        """Set the next backward's reduction from the optimizer's stage (equal on every rank); runs before
        every forward of the model (a forward pre-hook) unless installed for a caller that runs it."""
        self._drop_partial_reduction()
        averaged = self.optimizer.needs_averaged_grads
        check = averaged and self.optimizer.global_step == 0  # the first full-precision backward checks the layout
        for m, comm in zip(self.modules, self.comms):
            m.set_requires_all_reduce(averaged, recurse=False)
            comm.capture, comm.keep_output = not averaged, check
        self.all_reduce_skipped = self.all_reduce_skipped or not averaged

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for comm in self.comms:
            comm.check_layout()

    def _drop_partial_reduction(self) -> None:
        """Without its all-reduce, FSDP keeps each reduce-scattered shard to add it into the next all-reduced
        one (gradient accumulation). The shards were already handed to the optimizer: drop them
        (``reset_iter_state`` discards them, the root being idle between iterations), so a later all-reduce
        (ZeroOneAdam's variance steps, :meth:`remove`) averages only its own backward."""
        if self.all_reduce_skipped:
            for root in self.roots:
                root.reset_iter_state()
            self.all_reduce_skipped = False


def _fsdp_roots(model: nn.Module) -> list[FSDPModule]:
    """The FSDP modules of ``model`` with no FSDP module above them (each holds one iteration state)."""
    roots: list[FSDPModule] = []

    def visit(m: nn.Module) -> None:
        if isinstance(m, FSDPModule):
            roots.append(m)
            return
        for child in m.children():
            visit(child)

    visit(model)
    return roots


def _mesh_of(params: list[torch.Tensor]) -> Any:
    """The one 2-D (replicate, shard) mesh all ``params`` live on; raises naming what is wrong."""
    meshes: list[DeviceMesh] = []
    for i, p in enumerate(params):
        if not isinstance(p, DTensor):
            raise ValueError(f"params: optimizer param {i} (shape {tuple(p.shape)}) is not sharded by fully_shard "
                             "(not a DTensor); onebit_fsdp needs every optimized param sharded")
        if p.device_mesh.ndim != 2:
            raise ValueError(f"mesh: the params are on a {p.device_mesh.ndim}-D mesh; onebit_fsdp needs HSDP, "
                             "fully_shard on a 2-D mesh (replicate, shard), to compress across the replicas (a 1-D "
                             "mesh shards the whole model over every rank: nothing is replicated to compress across)")
        if not (isinstance(p.placements[0], Replicate) and isinstance(p.placements[1], Shard)):
            raise ValueError(f"mesh: param placements {p.placements}, expected (Replicate(), Shard(d)) as fully_shard "
                             "makes on a 2-D mesh")
        if all(p.device_mesh != m for m in meshes):
            meshes.append(p.device_mesh)
    if len(meshes) != 1:
        raise ValueError(f"mesh: the params are on {len(meshes)} different meshes; onebit_fsdp needs one")
    mesh = meshes[0]
    for dim, what in ((0, "replicate"), (1, "shard")):
        if mesh.size(dim) < 2:
            why = ("nothing to compress across" if dim == 0 else
                   "nothing is sharded: use DDP with the 1-bit comm hook (register_switchable_allreduce)")
            raise ValueError(f"mesh: the {what} dimension (dim {dim}) has size 1: {why}")
    return mesh


def _check_optimizer(optimizer: object) -> OnebitOptimizer:
    if not isinstance(optimizer, OnebitOptimizer):
        raise TypeError(f"optimizer: onebit_fsdp needs a lightning_optim 1-bit optimizer (OnebitAdam, ZeroOneAdam), "
                        f"got {type(optimizer).__name__}")
    name = type(optimizer).__name__
    if isinstance(optimizer, OnebitLamb):
        raise ValueError("optimizer: OnebitLamb is not supported with onebit_fsdp: its trust ratio needs the norms of "
                         "whole params, which FSDP splits across the ranks of a shard group; use OnebitAdam")
    if optimizer.global_step > 0:
        raise ValueError(f"optimizer: {name} has already taken {optimizer.global_step} step(s) (or loaded a "
                         "checkpoint of them); call onebit_fsdp after fully_shard and before the first step (load "
                         "checkpoints after it)")
    if optimizer.hierarchical:
        raise ValueError("hierarchical: not supported with onebit_fsdp (the replicate group is the exchange)")
    if getattr(optimizer, "uses_units", False):
        raise ValueError("overlap: per-bucket compression units are not supported with onebit_fsdp")
    if any(group.get("exp_avg_mask") is not None for group in optimizer.param_groups):
        raise ValueError("exp_avg_mask: not supported with onebit_fsdp (the mask has the whole param's shape, the "
                         "optimizer holds one shard of it)")
    return optimizer


def onebit_fsdp(model: nn.Module, optimizer: OnebitOptimizer) -> OnebitFSDP:
    """Replace HSDP's cross-replica gradient all-reduce by ``optimizer``'s 1-bit momentum exchange in its
    compression stage (see the module docstring). Call after ``fully_shard`` (root included), before the
    first step; returns the handle whose :meth:`OnebitFSDP.remove` undoes it.

    ``optimizer.process_group`` becomes the mesh's replicate group (given, it must hold those ranks) and
    ``average_grads`` False (HSDP averages the warmup); both are restored by ``remove()``.
    """
    missing = missing_fsdp2_api()
    if missing:
        raise RuntimeError(f"onebit_fsdp needs FSDP2's {', '.join(missing)}, which torch {torch.__version__} lacks; "
                           "use a newer torch (tested with 2.13)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module sharded by fully_shard, got {type(model).__name__}")
    if not isinstance(model, FSDPModule) and any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("model: apply fully_shard to the root module too (onebit_fsdp switches the reduction from "
                         "the root, before every forward)")
    return install(model, optimizer, forward_hook=True)


def install(model: nn.Module, optimizer: OnebitOptimizer, *, forward_hook: bool) -> OnebitFSDP:
    """:func:`onebit_fsdp` for a ``model`` that contains FSDP modules; without ``forward_hook`` the caller
    runs :meth:`OnebitFSDP.prepare_backward` before every forward (the Lightning strategy: its
    LightningModule is not the module that is called)."""
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("model: has no FSDP modules; apply torch.distributed.fsdp.fully_shard (on a 2-D replicate x "
                         "shard mesh) to its layers and to the model itself first")
    if model in _INSTALLED:
        raise ValueError("model: onebit_fsdp is already installed on it; call .remove() on the first handle first")
    optimizer = _check_optimizer(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    owned = {id(p) for p in model.parameters()}
    foreign = [i for i, p in enumerate(params) if id(p) not in owned]
    if foreign:
        raise ValueError(f"params: optimizer params {foreign[:5]} are not params of model (build the optimizer over "
                         "model.parameters() after fully_shard)")
    low = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if low:
        raise TypeError(f"params: sharded params must be float32 with onebit_fsdp, got {low}; compute in 16 bits with "
                        "fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))")
    mesh = _mesh_of(params)
    replicate = mesh.get_group(0)
    if optimizer.process_group is not None:
        given = dist.get_process_group_ranks(optimizer.process_group)
        wanted = dist.get_process_group_ranks(replicate)
        if sorted(given) != sorted(wanted):
            raise ValueError(f"process_group: holds ranks {sorted(given)}, but this rank's replicas of its shard are "
                             f"ranks {sorted(wanted)} (the mesh's replicate dimension); pass process_group=None")
    handle = OnebitFSDP(model, optimizer, replicate)
    handle._install(forward_hook=forward_hook)
    return handle
