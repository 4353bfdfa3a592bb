"""Checkpoints of :func:`~lightning_optim.onebit.onebit_fsdp` runs through ``torch.distributed.checkpoint``.

A 1-bit optimizer's state is per rank (its shard's moments, its error buffers; ZeroOneAdam between
synchronisations also its params, which differ across the replicas): :func:`rank_state` packs it under a
key of its own rank, which DCP stores beside the model's sharded state dict, and :func:`load_rank_state`
reads it back on the same mesh. :func:`load_hsdp_adam_state` starts a 1-bit run from a checkpoint of plain
HSDP with torch's Adam/AdamW (saved with ``get_optimizer_state_dict``, as Lightning's
``ModelParallelStrategy`` does): the moments are taken as saved and the stage follows from the step count.

    dcp.save({"model": model.state_dict(), "optim": rank_state(optimizer, model)}, checkpoint_id=path)
    ...  # a new run: fully_shard, OnebitAdam, onebit_fsdp, then
    state = {"model": model.state_dict()}; dcp.load(state, checkpoint_id=path); model.load_state_dict(state["model"])
    load_rank_state(optimizer, model, path, key="optim")
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_optim.onebit.base import OnebitOptimizer
from lightning_optim.onebit.layout import local_tensor

__all__ = ["rank_key", "rank_state", "load_rank_state", "load_hsdp_adam_state"]


def rank_key(rank: int | None = None) -> str:
    """The key of a rank's own 1-bit state inside the optimizer's entry (this rank's by default)."""
    return f"onebit_rank{dist.get_rank() if rank is None else rank}"


def rank_state(optimizer: OnebitOptimizer, model: nn.Module) -> dict[str, io.BytesIO]:
    """``{rank_key(): blob}``: this rank's ``optimizer.state_dict()`` (and its params' local shards when the
    replicas' params differ, ZeroOneAdam between synchronisations: DCP keeps one replica's shard)."""
    own: dict[str, Any] = {"optimizer": optimizer.state_dict(), "params": None}
    if not optimizer.params_synchronized:
        own["params"] = [local_tensor(p).detach().clone() for p in model.parameters()]
    blob = io.BytesIO()
    torch.save(own, blob)
    blob.seek(0)
    return {rank_key(): blob}


def load_rank_state(optimizer: OnebitOptimizer, model: nn.Module, checkpoint_id: Any, key: str) -> None:
    """Load what :func:`rank_state` saved under ``key`` at ``checkpoint_id`` into ``optimizer`` (and the params)."""
    from torch.distributed.checkpoint import load

    state = {key: {rank_key(): io.BytesIO()}}
    load(state, checkpoint_id=checkpoint_id)
    blob = state[key][rank_key()]
    blob.seek(0)
    own = torch.load(blob, weights_only=True)
    optimizer.load_state_dict(own["optimizer"])
    if own["params"] is not None:
        with torch.no_grad():
            for p, saved in zip(model.parameters(), own["params"]):
                local_tensor(p).copy_(saved)


def has_rank_state(checkpoint_id: Any, key: str) -> bool:
    """Whether the DCP checkpoint holds this rank's 1-bit state under ``key``."""
    from torch.distributed.checkpoint import FileSystemReader

    return f"{key}.{rank_key()}" in FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata


def load_hsdp_adam_state(optimizer: OnebitOptimizer, model: nn.Module, checkpoint_id: Any, key: str) -> None:
    """Load plain HSDP's Adam/AdamW state (``get_optimizer_state_dict(model, adam)`` saved under ``key``; moments
    as DTensors keyed by param name) into ``optimizer``, over the same param groups: this rank's shards of the
    moments, the 1-bit stage from the saved step count."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    groups = [{**{k: v for k, v in g.items() if k in ("lr", "betas", "eps", "weight_decay")}, "params": g["params"]}
              for g in optimizer.param_groups]
    stand_in = torch.optim.AdamW(groups)  # its state template has the DTensor moments the checkpoint holds
    state = {key: get_optimizer_state_dict(model, stand_in)}
    load(state, checkpoint_id=checkpoint_id)
    set_optimizer_state_dict(model, stand_in, optim_state_dict=state[key])
    loaded = stand_in.state_dict()
    # the 1-bit optimizers keep their shard's moments as plain tensors
    loaded["state"] = {pid: {k: local_tensor(v) for k, v in entry.items()} for pid, entry in loaded["state"].items()}
    optimizer.load_state_dict(loaded)
