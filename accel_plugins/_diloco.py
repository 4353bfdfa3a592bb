"""What the Accelerate and HF Trainer DiLoCo adapters share (no math here: ``lightning_optim.DiLoCo``):

- :func:`check_settings`: DiLoCo's arguments (a torchft ``manager`` among them) checked before anything is built;
- :func:`install`: the checks on the accelerator, model and prepared optimizer, then DiLoCo built over the
  prepared optimizer's inner one (collective: every rank calls it), the DDP ``"local"`` comm hook registered
  (no gradient all-reduce at all) and the prepared optimizer pointed at DiLoCo. With a torchft manager
  (``lightning_optim.fault_tolerance``) the replica groups average instead of the ranks: each replica group is
  one process of its own launch (:func:`check_one_process_per_replica`), so there is no DDP and no hook, and
  building DiLoCo joins the replicas (it waits for a quorum; a replica that starts late is healed from a peer);
- :func:`save_rank_state` / :func:`load_rank_state`: this rank's DiLoCo state (inner state, global params,
  outer momentum, residuals) and its own params in ``diloco_rank<r>.pt`` (Accelerate and the HF Trainer save the
  optimizer and the model from rank 0 only, but both differ per rank between synchronisations);
- :func:`resume_rank_state`: that file, or where it is missing (or another world size wrote it) the optimizer
  state the trainer saved from rank 0, with a warning: never a silent restart at inner step 0.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from accel_plugins._accelerator import (
    check_accelerator,
    check_ddp_ground,
    check_model,
    check_model_and_directory,
    check_owned_params,
    unwrap_model,
    world,
)
from accel_plugins.accelerate import _check_same_tensors
from accel_plugins.master_weights import MasterWeightsHandle, refuse_grad_scaler
from lightning_optim.comm.ddp_hooks import LocalHookState, register_comm_hook
from lightning_optim.distributed.centralized import GenericCentralizedOptimizer
from lightning_optim.distributed.communicating import CommunicatingOptimizer
from lightning_optim.distributed.decentralized import DecentralizedSGD
from lightning_optim.distributed.diloco import DiLoCo, check_diloco_arguments
from lightning_optim.distributed.diloco_replicas import check_manager
from lightning_optim.precision._checks import check_keys, describe

__all__ = ["check_one_process_per_replica", "check_settings", "install", "load_rank_state", "rank_state_path",
           "resume_rank_state", "save_rank_state"]

_GRAD_SCALER_WHY = ("lets each rank skip a step alone on an overflow, but DiLoCo's ranks synchronise after the same "
                    "number of inner steps (one skipped step would desynchronise them)")


def check_settings(sync_every: Any, outer_lr: Any, outer_momentum: Any, nesterov: Any, fragments: Any, overlap: Any,
                   mixing: Any, compressor: Any, final_sync: Any = True, manager: Any = None, density: Any = None,
                   bits: Any = None) -> dict[str, Any]:
    """DiLoCo's keyword arguments, checked (``TypeError``/``ValueError`` naming the argument and its range;
    ``manager``: None or a ``torchft.Manager`` with a synchronous quorum and a process group); the outer
    arguments left None stay None (DiLoCo takes its recipe's defaults)."""
    check_diloco_arguments(sync_every, fragments, outer_lr, outer_momentum, nesterov, overlap, mixing, final_sync,
                           compressor, density, bits)
    if manager is not None:
        check_manager(manager)
    return dict(sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
                fragments=fragments, overlap=overlap, mixing=mixing, compressor=compressor, density=density,
                bits=bits, final_sync=final_sync, manager=manager)


def check_one_process_per_replica(caller: str, accelerator: Any, argument: str) -> None:
    """With a torchft manager (given as ``argument``) every replica group is one process, launched on its own
    (``python train.py``): refuse an Accelerate run of several processes, whose ranks DiLoCo would not average
    (a manager exchanges rank g of each replica group with rank g of the others only)."""
    size, _ = world()
    processes = getattr(accelerator, "num_processes", 1)
    if size > 1 or processes > 1:
        raise ValueError(f"{argument}: with a torchft manager {caller} runs one process per replica group (each "
                         f"replica group its own launch: python train.py ...), but this Accelerate run has "
                         f"{processes} process(es) in a process group of {size} rank(s); launch every replica group "
                         f"as one process, or leave {argument} out to run DiLoCo over the Accelerate ranks")


def _check_prepared_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """Accelerate's ``AcceleratedOptimizer`` over a local optimizer; its inner optimizer."""
    from accelerate.optimizer import AcceleratedOptimizer

    if not isinstance(optimizer, AcceleratedOptimizer):
        raise TypeError(f"optimizer: expected the optimizer accelerator.prepare returned (an AcceleratedOptimizer: "
                        f"its step() is the one that becomes DiLoCo's), got {describe(optimizer)}")
    inner = optimizer.optimizer
    if isinstance(inner, DiLoCo):
        raise ValueError("optimizer: it already steps through a DiLoCo (DiLoCo was enabled on it before)")
    if isinstance(inner, (CommunicatingOptimizer, GenericCentralizedOptimizer, DecentralizedSGD)):
        raise ValueError(f"optimizer: {type(inner).__name__} communicates at every step (1-bit, compressed or "
                         "gossip); DiLoCo needs a local optimizer (torch.optim.AdamW, lightning_optim.AdamW, ...) "
                         "and does the communication itself")
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"optimizer: its inner optimizer must be a torch.optim.Optimizer, got {describe(inner)}")
    return inner


def install(caller: str, accelerator: Any, model: nn.Module, optimizer: Any, settings: dict[str, Any], *,
            make_manager: Callable[[], Any] | None = None,
            argument: str = "manager") -> tuple[DiLoCo, LocalHookState | None]:
    """Refuse what cannot work, then build DiLoCo over ``optimizer``'s inner optimizer, leave DDP's gradients
    local and make ``optimizer`` step through DiLoCo. Collective (DiLoCo's construction agrees on the arguments
    and broadcasts rank 0's params into the global copy): every rank calls it, before the first backward.

    Fault-tolerant: ``settings["manager"]`` (a torchft manager), or ``make_manager`` (builds one, called once
    every check has passed); ``argument`` names the one the caller took, in the one-process refusal. Building
    DiLoCo then waits for a quorum of the replicas."""
    check_accelerator(accelerator)
    if settings.get("manager") is not None or make_manager is not None:
        check_one_process_per_replica(caller, accelerator, argument)
    check_model(model)
    inner = _check_prepared_optimizer(optimizer)
    if isinstance(getattr(accelerator, "scaler", None), MasterWeightsHandle):
        raise ValueError(f"{caller}: fp32 master weights (enable_master_weights) are not supported with DiLoCo: "
                         "use Accelerator(mixed_precision='bf16') or fp32 params")
    refuse_grad_scaler(caller, accelerator, _GRAD_SCALER_WHY)
    check_ddp_ground(caller, accelerator, model)
    check_owned_params(inner, model)
    ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
    if ddp is not None and getattr(ddp, "_comm_hooks", None):  # torch takes one hook per model
        raise ValueError("model: its DDP already has a comm hook (DistributedDataParallelKwargs(comm_hook=...) or "
                         f"your own); {caller} registers the 'local' hook itself (no gradient all-reduce): remove the "
                         "other one")
    if make_manager is not None:
        settings = {**settings, "manager": make_manager()}
    diloco = DiLoCo(inner, **settings)  # collective; refuses what the local checks above cannot see
    hook = None
    if ddp is not None:  # the first change: everything above only checked
        try:
            hook = cast(LocalHookState, register_comm_hook(ddp, "local"))  # the "local" hook's state
        except RuntimeError as exc:
            raise ValueError(f"model: its DDP already has a comm hook; {caller} registers the 'local' hook itself: "
                             "remove the other one") from exc
        ddp.broadcast_buffers = False  # buffers stay each rank's own: a per-forward broadcast would be a collective
        if ddp.find_unused_parameters:
            warnings.warn(f"{caller}: this DDP model was built with find_unused_parameters=True, so DDP all-reduces "
                          "its used-parameter map (4 bytes per parameter tensor) after every backward, between "
                          "DiLoCo's synchronisations too; build it with find_unused_parameters=False (HF Trainer: "
                          "ddp_find_unused_parameters=False) unless some parameters really get no gradient",
                          stacklevel=3)
    optimizer.optimizer = diloco
    return diloco, hook


def rank_state_path(directory: str | os.PathLike, rank: int) -> str:
    return os.path.join(directory, f"diloco_rank{rank}.pt")


def _check_arguments(diloco: Any, model: Any, directory: Any) -> None:
    if not isinstance(diloco, DiLoCo):
        raise TypeError(f"diloco: expected a lightning_optim.DiLoCo, got {describe(diloco)}")
    check_model_and_directory(model, directory)


def save_rank_state(diloco: DiLoCo, model: nn.Module, directory: str | os.PathLike) -> None:
    """This rank's DiLoCo state and its model state (params and buffers differ per rank between
    synchronisations) into ``directory/diloco_rank<r>.pt``; every rank calls it."""
    _check_arguments(diloco, model, directory)
    size, rank = world()
    os.makedirs(directory, exist_ok=True)
    payload = {"world_size": size, "rank": rank, "optimizer": diloco.state_dict(),
               "model": {k: v.detach().clone() for k, v in unwrap_model(model).state_dict().items()}}
    torch.save(payload, rank_state_path(directory, rank))


def load_rank_state(diloco: DiLoCo, model: nn.Module, directory: str | os.PathLike) -> bool:
    """This rank's file, when it is there and was written by this rank of this world size (else ``False``:
    nothing loaded). Everything is checked before anything changes."""
    _check_arguments(diloco, model, directory)
    size, rank = world()
    path = rank_state_path(directory, rank)
    if not os.path.exists(path):
        return False
    payload = torch.load(path, map_location="cpu", weights_only=True)
    check_keys(path, payload, {"world_size", "rank", "optimizer", "model"})
    saved_size, saved_rank = payload["world_size"], payload["rank"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (saved_size, saved_rank)) or not (
            0 <= saved_rank < saved_size):
        raise ValueError(f"{path}: 'world_size' and 'rank' must be an int >= 1 and a rank in [0, world_size), got "
                         f"{saved_size!r} and {saved_rank!r}")
    if saved_size != size or saved_rank != rank:
        return False
    module = unwrap_model(model)
    _check_same_tensors(f"{path}['model']", payload["model"], module.state_dict())
    try:
        diloco.load_state_dict(payload["optimizer"])  # checks all of it before it changes anything
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{path}['optimizer']: {exc}") from None
    module.load_state_dict(payload["model"])
    return True


def resume_rank_state(caller: str, diloco: DiLoCo, model: nn.Module, directory: str | os.PathLike,
                      saved: dict[str, Any] | None) -> None:
    """Resume from ``directory``: this rank's own file (:func:`load_rank_state`); where it is missing or was
    written by another rank or world size, ``saved`` (the optimizer state dict the trainer saved from rank 0:
    its inner state and DiLoCo's section: step, global params, outer momentum), with a warning, since this rank
    then continues from rank 0's inner state and params instead of its own (the same right after a
    synchronisation); ``saved`` None too: a warning that DiLoCo starts anew at inner step 0."""
    if load_rank_state(diloco, model, directory):
        return
    path = rank_state_path(directory, world()[1])
    why = "is missing" if not os.path.exists(path) else "was written by another rank or world size"
    if saved is None:
        warnings.warn(f"{caller}: {path} {why} and the checkpoint holds no optimizer state: DiLoCo starts anew at "
                      "inner step 0 from the loaded params (its global params, outer momentum and schedule restart)",
                      UserWarning, stacklevel=3)
        return
    diloco.load_state_dict(saved)  # checks all of it first; refuses another rank's error-feedback state
    if world()[1] != 0:  # rank 0's own state is the one saved: nothing lost there
        warnings.warn(f"{caller}: {path} {why}: this rank resumes DiLoCo (inner step {diloco.inner_steps}) from "
                      "the optimizer state saved by rank 0, with rank 0's inner state and params instead of its own "
                      "(the same right after a synchronisation)", UserWarning, stacklevel=3)
