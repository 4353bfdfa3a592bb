r"""Per-step data parallelism across replica groups on torchft: any local optimizer, steps every replica commits.

    manager = replica_manager(replica_id="a", lighthouse=address)
    model, optimizer = fault_tolerant_ddp(model, lightning_optim.AdamW(model.parameters()), manager,
                                          comm_hook="fp16_compress")
    for batch in loader:
        optimizer.zero_grad()          # opens this step's quorum (a returning replica is healed here)
        loss(model(batch)).backward()  # gradients averaged over the quorum's replicas, through the manager
        optimizer.step()               # steps only if every replica of the quorum commits

(``optimizer.step(closure)`` opens the quorum itself, as Lightning calls it.) Every step is one quorum step of
the manager: the gradient buckets are averaged over the replicas of the quorum,
:math:`g = \frac1W \sum_r g_r` (``comm_hook=None``: in the gradients' dtype; ``"fp16_compress"`` /
``"bf16_compress"``: sent as fp16/bf16, averaged and cast back, half the bytes); a step whose all-reduce failed
on some replica (it died or was cut off) is skipped where it failed, and the replicas of the next quorum go
on. A replica that starts late or returns takes the model and optimizer state from a healthy peer.

Refused by name, with the reason: optimizers that communicate by themselves (the 1-bit family and the other
compressed/decentralized ones, DiLoCo: their error feedback and server chunks are tied to one fixed set of
ranks; for compressed training across replicas use ``DiLoCo(compressor=...)`` with a manager), and compressing
hooks whose state spans steps (PowerSGD's factors and error feedback, the 1-bit hook's errors).
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_optim.distributed.diloco_replicas import check_manager
from lightning_optim.optim.hooks import init_wrapper_hooks

__all__ = ["FaultTolerantOptimizer", "fault_tolerant_ddp", "HOOKS"]

HOOKS = {None: None, "fp16_compress": torch.float16, "bf16_compress": torch.bfloat16}
_REFUSED_HOOKS = {
    "powersgd": "its factors P, Q and its error feedback carry over between steps and are all-reduced in rounds "
                "that a changing set of replicas would split",
    "onebit": "its worker and server errors are tied to one fixed set of ranks and their chunks",
    "local": "it sends nothing: use DiLoCo(..., manager=manager) for infrequent synchronisation",
}
STATE_KEY = "lightning_optim.fault_tolerant_ddp"


def _refuse_communicating(optimizer: object) -> None:
    from lightning_optim.distributed.centralized import GenericCentralizedOptimizer
    from lightning_optim.distributed.communicating import CommunicatingOptimizer
    from lightning_optim.distributed.decentralized import DecentralizedSGD
    from lightning_optim.distributed.diloco import DiLoCo

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (ours or torch's), got {type(optimizer).__name__}")
    if isinstance(optimizer, DiLoCo):
        raise ValueError("optimizer: DiLoCo synchronises by itself; give it the manager instead "
                         "(DiLoCo(inner, sync_every=..., manager=manager)) and do not wrap it in fault_tolerant_ddp")
    if isinstance(optimizer, (CommunicatingOptimizer, GenericCentralizedOptimizer, DecentralizedSGD)):
        raise ValueError(f"optimizer: {type(optimizer).__name__} communicates by itself, with error feedback tied to "
                         "one fixed set of ranks, which torchft's changing replicas would break; use a local "
                         "optimizer here, or DiLoCo(..., compressor='onebit', manager=manager) for compressed "
                         "exchanges across replicas")


def _hook_dtype(comm_hook: object) -> torch.dtype | None:
    if comm_hook in HOOKS:
        return HOOKS[comm_hook]
    if isinstance(comm_hook, str) and comm_hook in _REFUSED_HOOKS:
        raise ValueError(f"comm_hook={comm_hook!r} cannot run on torchft's replicas: {_REFUSED_HOOKS[comm_hook]}; "
                         f"use one of {sorted(k for k in HOOKS if k)} or None")
    raise ValueError(f"comm_hook must be None, 'fp16_compress' or 'bf16_compress', got {comm_hook!r}")


def _average_hook(dtype: torch.dtype | None) -> Callable[[Any, Any], torch.futures.Future]:
    """A DDP comm hook: the bucket averaged over the manager's replicas (sent as ``dtype`` when given)."""

    # unannotated: DDP checks a hook's annotations against its own classes, which postponed annotations are not
    def hook(manager, bucket):
        buffer = bucket.buffer()
        sent = buffer if dtype is None else buffer.to(dtype)
        work = manager.allreduce(sent, reduce_op=torch.distributed.ReduceOp.SUM)
        work.wait()  # a failure is the manager's: it reports it and this step cannot commit here
        if sent is not buffer:
            buffer.copy_(sent)
        buffer.div_(max(1, manager.num_participants()))
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    return hook


class FaultTolerantOptimizer(torch.optim.Optimizer):
    """``optimizer`` stepped only on the steps every replica of the quorum commits (see the module docstring).

    Args:
        optimizer: the local optimizer (any ``torch.optim.Optimizer`` that does not communicate by itself).
        manager: the replica group's ``torchft.Manager`` (``replica_manager``).
        model: the module whose params ``optimizer`` steps: with the optimizer's state, what a healing replica
            takes from a peer (None: the optimizer's state only).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, manager: Any, model: nn.Module | None = None) -> None:
        _refuse_communicating(optimizer)
        check_manager(manager)
        init_wrapper_hooks(self)
        self.optimizer, self.manager, self.model = optimizer, manager, model
        self._quorum_open = False
        self.steps_committed = 0
        self.steps_discarded = 0
        manager.register_state_dict_fn(STATE_KEY, self._take_healing_state, self._healing_state)

    # torch.optim.Optimizer's face: the local optimizer's groups and state
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"FaultTolerantOptimizer({self.optimizer!r})"

    def _healing_state(self) -> dict[str, Any]:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.model is not None:
            state["model"] = self.model.state_dict()
        return copy.deepcopy(state)  # the peer fetches it while this replica goes on

    def _take_healing_state(self, state: dict[str, Any]) -> None:
        if self.model is not None and "model" in state:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def begin_step(self) -> None:
        """Open this step's quorum (once per step; ``zero_grad`` and ``step(closure)`` call it)."""
        if not self._quorum_open:
            self.manager.start_quorum()
            self._quorum_open = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.begin_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (forward and backward) in this step's quorum, then step the local optimizer if every
        replica commits."""
        self.begin_step()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._quorum_open = False
        if self.manager.should_commit():
            self.optimizer.step()
            self.steps_committed += 1
        else:
            self.steps_discarded += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {**self.optimizer.state_dict(), "replicas": dict(self.manager.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner = {k: v for k, v in state_dict.items() if k != "replicas"}
        self.optimizer.load_state_dict(inner)
        if isinstance(state_dict.get("replicas"), dict):
            self.manager.load_state_dict(state_dict["replicas"])


def fault_tolerant_ddp(model: nn.Module, optimizer: torch.optim.Optimizer, manager: Any, *,
                       comm_hook: str | None = None) -> tuple[nn.Module, FaultTolerantOptimizer]:
    """``(ddp_model, optimizer)`` for per-step data parallelism over the manager's replicas (module docstring).

    Args:
        model: this replica's model (the same architecture on every replica).
        optimizer: a local optimizer over ``model``'s params (ours or torch's; refused if it communicates).
        manager: the replica group's ``torchft.Manager``.
        comm_hook: None (full precision), ``"fp16_compress"`` or ``"bf16_compress"``.
    """
    dtype = _hook_dtype(comm_hook)
    wrapped = FaultTolerantOptimizer(optimizer, manager, model)
    from torchft.process_group import ProcessGroupDummy

    # torchft's way: a one-rank dummy group soaks up DDP's own collectives, the hook sends through the manager;
    # unused-parameter search keeps DDP from rebuilding buckets (a healed replica must keep the same buckets)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=ProcessGroupDummy(0, 1),
                                              find_unused_parameters=True)
    ddp.register_comm_hook(manager, _average_hook(dtype))
    return ddp, wrapped
