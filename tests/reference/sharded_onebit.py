"""A W-worker 1-bit reference run on a model sharded by rows over S ranks (FSDP's ``Shard(0)``), as HSDP
holds it: R = W replicas, each cut into S shards; shard s of every param lives on one rank per replica.

The element-wise math of the 1-bit optimizers is the same on a shard as on the whole param; what sharding
changes is the compression: the W ranks that hold shard s exchange their shard's momenta (or gradients)
among themselves, one flat buffer of the shard-s pieces of every param, one scale per piece. So the
reference is S independent W-worker references (any of ``tests/reference``'s 1-bit classes), reference s
over the shard-s pieces of the params, fed the shard-s pieces of each worker's gradient:

    params_s[j] = rows [s*c, (s+1)*c) of param j,  c = ceil(rows_j / S)   (possibly empty)

and the whole params of worker w are the pieces put back together. It never imports ``lightning_optim``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def shard_rows(t: Tensor, s: int, shards: int) -> Tensor:
    """Shard ``s`` of ``shards`` of ``t`` by rows, as ``torch.chunk`` cuts (the last ones may be short or empty)."""
    rows = -(-t.shape[0] // shards)
    return t[s * rows : (s + 1) * rows]


class ShardedReference:
    """``make(params, world_size)`` builds one reference per shard (e.g. ``lambda p, w: RefOnebitAdam(p, w,
    lr=..., freeze_step=...)``); :meth:`step` takes whole gradients per worker, :meth:`params` gives whole params."""

    def __init__(self, make: Callable[[list[Tensor], int], object], params: Sequence[Tensor], world_size: int,
                 shards: int) -> None:
        self.shards, self.count = shards, len(params)
        self.refs = [make([shard_rows(p.detach().float(), s, shards).clone() for p in params], world_size)
                     for s in range(shards)]

    def step(self, grads: Sequence[Sequence[Tensor]]) -> None:
        """``grads[w][j]``: worker w's whole gradient of param j."""
        for s, ref in enumerate(self.refs):
            ref.step([[shard_rows(g.float(), s, self.shards) for g in worker] for worker in grads])

    def params(self, w: int) -> list[Tensor]:
        """Worker w's whole params."""
        return [torch.cat([ref.params[w][j] for ref in self.refs]) for j in range(self.count)]
