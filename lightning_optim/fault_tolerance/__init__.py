"""Fault-tolerant training on torchft (``pip install 'lightning-optim[ft]'``).

torchft is the engine: its Lighthouse forms a quorum of replica groups, its ``Manager`` (one per replica group)
reconfigures the process group over each quorum, decides every step on all replicas and heals a replica that
starts late or returns from a healthy peer. This package builds them with the settings our optimizers need
and wraps the two ways of training across replicas:

* infrequent synchronisation: ``lightning_optim.DiLoCo(inner, sync_every=..., manager=manager)`` (every
  ``fragments``/``overlap``/``compressor`` setting): each synchronisation is one quorum step;
* per-step data parallelism: :func:`fault_tolerant_ddp` (torchft's DDP, our optimizers as the local optimizer,
  an fp16/bf16-compressing hook over the manager's all-reduce).

    lighthouse = local_lighthouse(min_replicas=1)        # or: torchft_lighthouse --min_replicas 1
    manager = replica_manager(replica_id="a", lighthouse=lighthouse.address())   # in every replica group
"""
from __future__ import annotations

from .ddp import FaultTolerantOptimizer, fault_tolerant_ddp
from .replicas import LIGHTHOUSE_ENV, local_lighthouse, replica_manager, require_torchft

__all__ = ["LIGHTHOUSE_ENV", "FaultTolerantOptimizer", "fault_tolerant_ddp", "local_lighthouse", "replica_manager",
           "require_torchft"]
