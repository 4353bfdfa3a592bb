r"""1-bit communication for Hugging Face Accelerate: one call after ``accelerator.prepare``.

    optimizer = accel_plugins.to_onebit_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4),
                                                  "onebit_adam", freeze_step=100)   # before prepare
    # or one of your own: lightning_optim.OnebitAdam(model.parameters(), lr=3e-4, freeze_step=100)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    onebit = accel_plugins.enable_onebit(accelerator, model, optimizer)
    # the training loop stays as it is: accelerator.backward, accelerator.accumulate, clip_grad_norm_

What ``enable_onebit`` does (no math here; see :mod:`lightning_optim.onebit`):

* registers the switchable allreduce comm hook on the prepared DDP model and, before every
  forward, turns DDP's fp32 allreduce on exactly when the optimizer's next step needs averaged
  gradients (``needs_averaged_grads``): on in warmup, off in the compression stage, where the
  optimizer's own 1-bit allreduce is the only communication; an optimizer built with
  ``average_grads=True`` (the classes' default) that has not stepped yet is switched to
  ``average_grads=False`` (DDP averages its warmup steps), one that has stepped is refused;
* refuses what would silently break it: a process group of several ranks that Accelerate left
  single-process (``accelerate launch --cpu`` starts one process; ``torchrun`` without
  ``Accelerator(cpu=True)`` on a CPU-only torch leaves Accelerate at ``DistributedType.NO``), an
  fp16 GradScaler (it skips steps per rank; the compression stage needs all ranks to step
  together), a comm hook already registered (``DistributedDataParallelKwargs(comm_hook=...)``),
  an optimizer that is not 1-bit;
* per-rank checkpoints: Accelerate saves the optimizer from the main process only, but the error
  feedback buffers (and ZeroOneAdam's params between synchronisations) are each rank's own. A
  save-state hook makes every rank write ``onebit_rank<r>.pt`` next to Accelerate's files, and a
  registered checkpoint object merges it back after ``accelerator.load_state`` (bitwise resume).

Clipping in the compression stage: each rank holds its local gradient :math:`g_r` (the optimizer
averages afterwards, compressed), so ``accelerator.clip_grad_norm_`` (the HF Trainer's
``max_grad_norm`` too) scales every rank's gradient by the same :math:`\min(1, c / N)` with
:math:`N = \sqrt{\mathrm{mean}_r \lVert g_r \rVert^2}` agreed by one 4-byte all-reduce
(:func:`lightning_optim.comm.dense.agreed_norm`): the averaged update is clipped consistently on every
rank, at least as much as DDP would clip, and the returned (logged) norm is :math:`N`, equal on all
ranks. (DeepSpeed's 1-bit Adam clips each rank by its own norm.) In warmup DDP has averaged the
gradients, and ZeroOneAdam's local steps use each rank's own gradient: there the clip is Accelerate's
own. Call ``enable_master_weights`` before ``enable_onebit``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from accel_plugins._accelerator import (
    AcceleratorMethods,
    check_accelerator,
    check_ddp_ground,
    check_model,
    check_model_and_directory,
    check_owned_params,
    unwrap_model,
    unwrap_optimizer,
    world,
)
from accel_plugins.master_weights import MasterWeightsHandle, refuse_grad_scaler
from lightning_optim.catalogue import OPTIMIZERS
from lightning_optim.comm import SwitchableAllreduceState, comm_stats, register_switchable_allreduce
from lightning_optim.comm.dense import agreed_norm
from lightning_optim.onebit import OnebitOptimizer
from lightning_optim.onebit.convert import to_onebit
from lightning_optim.precision._checks import (
    check_count,
    check_keys,
    check_number,
    check_optimizer,
    check_optimizer_state,
    check_tensor_list,
    describe,
)

__all__ = ["ONEBIT_OPTIMIZERS", "OnebitHandle", "enable_onebit", "load_rank_state", "save_rank_state",
           "to_onebit_optimizer"]

ONEBIT_OPTIMIZERS: dict[str, type[OnebitOptimizer]] = {n: e.cls for n, e in OPTIMIZERS.items() if e.onebit}


def to_onebit_optimizer(optimizer: torch.optim.Optimizer, name: str = "onebit_adam", **knobs: Any) -> OnebitOptimizer:
    """The 1-bit variant of ``optimizer`` (torch/our Adam, AdamW -> ``onebit_adam``/``zero_one_adam``;
    our Lamb/FusedLamb -> ``onebit_lamb``), same param groups and hyper-parameters; ``knobs`` are
    the 1-bit arguments (``freeze_step``, ...). Call it before ``accelerator.prepare``."""
    check_optimizer("optimizer", optimizer)
    if not isinstance(name, str):
        raise TypeError(f"name: must be one of {sorted(ONEBIT_OPTIMIZERS)}, got {describe(name)}")
    if name not in ONEBIT_OPTIMIZERS:
        raise ValueError(f"name: must be one of {sorted(ONEBIT_OPTIMIZERS)}, got {name!r}")
    return to_onebit(optimizer, ONEBIT_OPTIMIZERS[name], knobs, average_grads=False)


def rank_state_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"onebit_rank{rank}.pt")


@dataclass
class OnebitHandle:
    """What :func:`enable_onebit` set up: the optimizer, DDP's switch and the checkpoint hooks."""

    optimizer: OnebitOptimizer
    model: nn.Module
    switch: SwitchableAllreduceState | None
    accelerator: Any = None
    _handles: list = field(default_factory=list)
    _load_dir: str | None = None
    _methods: AcceleratorMethods | None = None
    _previous_clip: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, OnebitOptimizer):
            raise TypeError(f"optimizer: expected a 1-bit optimizer, got {describe(self.optimizer)}")
        check_model(self.model)
        if self.switch is not None and not isinstance(self.switch, SwitchableAllreduceState):
            raise TypeError(f"switch: expected None or a SwitchableAllreduceState, got {describe(self.switch)}")
        if self.accelerator is not None:
            check_accelerator(self.accelerator)

    def close(self) -> None:
        """Remove the forward and checkpoint hooks (DDP keeps its comm hook: torch cannot unregister it).

        Known torch issue: a process that exits with a DDP model still alive after
        ``accelerator.end_training()`` can abort at interpreter shutdown ("terminate called without an
        active exception"); bare torch + gloo DDP does it too (docs/guides/accelerate.md has the counts). Free
        them first: ``onebit.close(); accelerator.free_memory(); del model, optimizer, onebit;
        gc.collect(); accelerator.end_training()`` (examples/accelerate_onebit.py).
        """
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._methods is not None:
            self._methods.restore()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``accelerator.clip_grad_norm_``: Accelerate's in warmup; a rank-agreed norm in the compression
        stage (see the module doc). Returns the norm the clip used."""
        params = _clip_arguments(parameters, max_norm, norm_type)
        previous = self._previous_clip
        if not self.optimizer.averages_local_grads or world()[0] == 1:
            return previous(params, max_norm, norm_type)
        scaler = getattr(self.accelerator, "scaler", None)
        holders = (scaler._masters_of(params) if isinstance(scaler, MasterWeightsHandle)  # unscaled fp32 grads
                   else [p for p in params if p.grad is not None])
        local = nn.utils.get_total_norm([g for t in holders if (g := t.grad) is not None], norm_type)  # all have one
        norm = agreed_norm(local, norm_type)
        nn.utils.clip_grads_with_norm_(holders, max_norm, norm)
        return norm

    def summary(self) -> dict[str, Any]:
        """Bytes this rank sent (``comm_stats()``: DDP's switchable allreduce and the 1-bit collectives)
        and DDP buckets reduced / skipped."""
        stats = comm_stats()
        return {"bytes_sent": stats.bytes_sent, "fp32_equivalent_bytes": stats.fp32_equivalent_bytes,
                "compressed_calls": stats.compressed_calls, "full_precision_calls": stats.full_precision_calls,
                "buckets_reduced": self.switch.buckets_reduced if self.switch else 0,
                "buckets_skipped": self.switch.buckets_skipped if self.switch else 0}

    # ------------------------------------------------------------------ checkpoint hooks
    def _save_hook(self, models: list, weights: list, output_dir: str) -> None:
        save_rank_state(self.optimizer, self.model, output_dir)

    def _load_hook(self, models: list, input_dir: str) -> None:
        self._load_dir = input_dir

    # a registered checkpoint object: Accelerate loads it after the optimizers
    def state_dict(self) -> dict[str, Any]:
        return {"format": 1, "world_size": world()[0]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_keys("state", state, {"format", "world_size"})
        if state["format"] != 1:
            raise ValueError(f"state['format']: this version reads format 1, got {state['format']!r}")
        check_count("state['world_size']", state["world_size"], minimum=1)  # another size: the buffers reset
        directory, self._load_dir = self._load_dir, None
        if directory is not None:
            load_rank_state(self.optimizer, self.model, directory)


def save_rank_state(optimizer: OnebitOptimizer, model: nn.Module, directory: str) -> None:
    """This rank's optimizer state (and its params between ZeroOneAdam's synchronisations) into
    ``directory/onebit_rank<r>.pt``: every rank calls it (trainers save the optimizer on rank 0 only)."""
    _check_rank_arguments(optimizer, model, directory)
    size, rank = world()
    os.makedirs(directory, exist_ok=True)
    local = not optimizer.params_synchronized
    payload = {"world_size": size, "rank": rank, "optimizer": optimizer.state_dict(),
               "model": {k: v.detach().clone() for k, v in unwrap_model(model).state_dict().items()} if local else None,
               # what the optimizer steps: the model's params, or their fp32 masters (enable_master_weights)
               "stepped": [p.detach().clone() for g in optimizer.param_groups for p in g["params"]] if local else None}
    torch.save(payload, rank_state_path(directory, rank))


def load_rank_state(optimizer: OnebitOptimizer, model: nn.Module, directory: str) -> bool:
    """After the trainer loaded rank 0's optimizer state: this rank's own, when its file is there and was
    written by this rank of this world size (else the optimizer's own rules reset the error buffers).
    The whole file is checked before anything loads."""
    _check_rank_arguments(optimizer, model, directory)
    size, rank = world()
    path = rank_state_path(directory, rank)
    if not os.path.exists(path):
        return False
    payload = torch.load(path, map_location="cpu", weights_only=False)
    check_keys(path, payload, {"world_size", "rank", "optimizer", "model", "stepped"})
    if payload["world_size"] != size or payload["rank"] != rank:
        return False
    _check_rank_payload(payload, optimizer, model, path)
    optimizer.load_state_dict(payload["optimizer"])
    if payload.get("model") is not None:
        unwrap_model(model).load_state_dict(payload["model"])
    if payload.get("stepped") is not None:
        with torch.no_grad():
            torch._foreach_copy_([p for g in optimizer.param_groups for p in g["params"]], payload["stepped"])
    return True


def enable_onebit(accelerator: Any, model: nn.Module, optimizer: Any) -> OnebitHandle:
    """Turn on 1-bit communication for a prepared model and 1-bit optimizer (see the module doc).

    An optimizer built with ``average_grads=True`` (the classes' default: ``OnebitAdam(model.parameters(),
    ...)``) that has not stepped yet is switched to ``average_grads=False`` here: DDP's switchable allreduce
    averages its warmup steps. Once it has stepped it is refused (call this before the first step)."""
    check_accelerator(accelerator)
    check_model(model)
    onebit = unwrap_optimizer(optimizer)
    if not isinstance(onebit, OnebitOptimizer):
        raise TypeError(
            f"optimizer: enable_onebit needs a 1-bit optimizer (OnebitAdam, ZeroOneAdam, OnebitLamb), got "
            f"{type(onebit).__name__}; convert it before accelerator.prepare with accel_plugins.to_onebit_optimizer")
    if onebit.average_grads and _has_stepped(onebit):
        raise ValueError(
            f"optimizer: this {type(onebit).__name__} was built with average_grads=True and has already stepped "
            f"(global_step {onebit.global_step}), averaging its gradients itself beside DDP; call enable_onebit "
            "right after accelerator.prepare, before the first step (it hands the averaging to DDP then)")
    if isinstance(getattr(vars(accelerator).get("clip_grad_norm_"), "__self__", None), OnebitHandle):
        raise RuntimeError("accelerator: 1-bit communication is already enabled on it")
    scaler = getattr(accelerator, "scaler", None)
    check_owned_params(onebit, model, scaler.masters.masters if isinstance(scaler, MasterWeightsHandle) else ())
    refuse_grad_scaler("enable_onebit", accelerator, "decides per rank whether to skip a step; the compression "
                       "stage needs every rank to step together")
    check_ddp_ground("enable_onebit", accelerator, model)
    handle = OnebitHandle(optimizer=onebit, model=model, switch=None, accelerator=accelerator)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        try:  # the first change: everything above only checked
            switch = register_switchable_allreduce(model, enabled=True)
        except RuntimeError as exc:
            raise ValueError(
                "model: its DDP already has a comm hook (DistributedDataParallelKwargs(comm_hook=...) or your own); "
                "enable_onebit registers the switchable allreduce hook itself: remove the other one") from exc
        handle.switch = switch
        onebit.ddp_allreduce_managed = True
        if onebit.hierarchical:  # the warmup's DDP average goes through the node hierarchy too
            switch.average = onebit.average_

        def set_switch(module: nn.Module, args: Any) -> None:
            switch.enabled = onebit.needs_averaged_grads

        handle._handles.append(model.register_forward_pre_hook(set_switch))
    onebit.average_grads = False  # DDP averages the full-precision steps; averaging again would double the bytes
    handle._methods = AcceleratorMethods(accelerator)
    handle._previous_clip = handle._methods.current("clip_grad_norm_")  # Accelerate's, or master weights'
    handle._methods.replace("clip_grad_norm_", handle.clip_grad_norm_)
    handle._handles.append(accelerator.register_save_state_pre_hook(handle._save_hook))
    handle._handles.append(accelerator.register_load_state_pre_hook(handle._load_hook))
    accelerator.register_for_checkpointing(handle)
    return handle


def _has_stepped(optimizer: OnebitOptimizer) -> bool:
    return optimizer.global_step > 0 or any(bool(state) for state in optimizer.state.values())


def _clip_arguments(parameters: Any, max_norm: Any, norm_type: Any) -> list[torch.Tensor]:
    """``clip_grad_norm_``'s arguments checked (torch checks none: max_norm 0 zeros the gradients, a negative
    one flips them); inf max_norm only measures the norm, as in torch."""
    params = check_tensor_list("parameters", [parameters] if isinstance(parameters, torch.Tensor) else parameters)
    check_number("max_norm", max_norm, above=0.0, allow_inf=True)
    check_number("norm_type", norm_type, above=0.0, allow_inf=True)
    return params


def _check_rank_arguments(optimizer: Any, model: Any, directory: Any) -> None:
    if not isinstance(optimizer, OnebitOptimizer):
        raise TypeError(f"optimizer: expected a 1-bit optimizer (unwrapped), got {describe(optimizer)}")
    check_model_and_directory(model, directory)


def _check_same_tensors(where: str, saved: Any, live: Mapping[Any, torch.Tensor]) -> None:
    """``saved`` holds exactly ``live``'s keys, each a tensor of the same shape and dtype."""
    check_keys(where, saved, set(live))
    for key, tensor in live.items():
        value = saved[key]
        if not isinstance(value, torch.Tensor) or value.dtype != tensor.dtype or value.shape != tensor.shape:
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else describe(value)
            raise ValueError(f"{where}[{key!r}]: expected {tensor.dtype} {tuple(tensor.shape)}, got {got}")


def _check_rank_payload(payload: dict[str, Any], optimizer: OnebitOptimizer, model: nn.Module, path: str) -> None:
    """Optimizer state, model state and stepped params of a rank file checked before any of them loads
    (torch's module load copies what matches and then refuses the rest)."""
    check_optimizer_state(optimizer, payload["optimizer"], f"{path}['optimizer']")
    if payload["model"] is not None:
        _check_same_tensors(f"{path}['model']", payload["model"], unwrap_model(model).state_dict())
    if payload["stepped"] is not None:
        stepped = [p for g in optimizer.param_groups for p in g["params"]]
        saved = payload["stepped"]
        if not isinstance(saved, (list, tuple)):
            raise TypeError(f"{path}['stepped']: expected a list of {len(stepped)} tensors, got {describe(saved)}")
        if len(saved) != len(stepped):
            raise ValueError(f"{path}['stepped']: expected {len(stepped)} tensors, got {len(saved)}")
        _check_same_tensors(f"{path}['stepped']", dict(enumerate(saved)), dict(enumerate(stepped)))
