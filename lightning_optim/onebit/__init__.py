"""Two-stage optimizers with 1-bit compressed communication (DeepSpeed's onebit family).

* :class:`OnebitAdam` (arXiv 2102.02888): Adam warmup, then frozen variance + 1-bit momentum.
* :class:`ZeroOneAdam` (arXiv 2202.06009): sparse variance updates, then 1-bit synchronised
  local steps.
* :class:`OnebitLamb` (arXiv 2104.06069): LAMB warmup, then 1-bit momentum with rescaled
  frozen trust ratios.

All three read :attr:`~OnebitOptimizer.needs_averaged_grads` out to the training loop (whether
the next backward must be allreduced in full precision) and keep per-rank state (save one
``state_dict()`` per rank).

:func:`onebit_fsdp` runs OnebitAdam/ZeroOneAdam on a model sharded by FSDP2 on a 2-D (replicate, shard)
mesh: the compression stage exchanges the momenta of each shard 1-bit compressed across its replicas
instead of HSDP's full-precision gradient all-reduce.
"""

from lightning_optim.onebit.adam import OnebitAdam
from lightning_optim.onebit.base import OnebitOptimizer
from lightning_optim.onebit.fsdp import OnebitFSDP, onebit_fsdp
from lightning_optim.onebit.fsdp_checkpoint import load_hsdp_adam_state, load_rank_state, rank_state
from lightning_optim.onebit.lamb import OnebitLamb
from lightning_optim.onebit.overlap import OverlapState, onebit_overlap_hook, overlap_with_ddp
from lightning_optim.onebit.zero_one_adam import ZeroOneAdam

__all__ = ["OnebitAdam", "ZeroOneAdam", "OnebitLamb", "OnebitOptimizer", "OverlapState", "onebit_overlap_hook",
           "overlap_with_ddp", "OnebitFSDP", "onebit_fsdp", "rank_state", "load_rank_state", "load_hsdp_adam_state"]
