r"""The 1-bit compressor across nodes only: fp32 inside a node, error-compensated 1-bit between nodes.

:class:`HierarchicalOnebitCompressor` averages as :func:`lightning_optim.comm.hierarchy.hierarchical_average_`
does, with the inter-node step the 1-bit average of :class:`OnebitCompressor` on this rank's shard:

.. math::
    y_{k,l} = \tfrac{1}{L}\sum_{j} x_{kL+j}[\text{shard } l],\qquad
    \bar y_l = \mathcal{C}_{e_w, e_s}\big(y_{\cdot,l}\big)\ \text{over the } K \text{ nodes},\qquad
    x \leftarrow \text{all-gather}_l(\bar y_l)

The worker and server errors :math:`e_w, e_s` are this rank's own: they belong to its shard of the node's
mean (one pair per (node, local rank)), sized for ``n / L`` elements on ``K`` ranks. Segments (one scale
each, e.g. one per param) are cut at the shard's edges, so a param split between two shards has one scale
per piece. :meth:`average_flat_` is the full-precision hierarchical mean (the warmup's).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from .. import pieces as passes
from ..dense import world_size
from ..hierarchy import (
    NodeGroups,
    _Scratch,
    check_hierarchical,
    hierarchical_average_,
    node_groups,
    ranks_per_node,
    shard_segments,
)
from ..plan import plan_for
from ..stats import CommStats
from .onebit import OnebitCompressor

__all__ = ["HierarchicalOnebitCompressor"]


class HierarchicalOnebitCompressor(OnebitCompressor):
    """1-bit averaging across nodes, fp32 inside them; ``hierarchical``: True (``LOCAL_WORLD_SIZE``) or the
    number of ranks per node. The node groups are made at the first call on a group (every rank calls)."""

    def __init__(self, hierarchical: bool | int = True) -> None:
        super().__init__()
        self.hierarchical = check_hierarchical(hierarchical)
        self._groups: NodeGroups | None = None
        self._groups_of: Any = None  # the process group they were made for (held: compared by identity)
        self._scratch = _Scratch()

    def node_groups(self, group=None, device=None) -> NodeGroups:
        """This rank's node groups in ``group`` (made once per group object; ``device``: the tensors')."""
        if self._groups is None or self._groups_of is not group:
            self._groups = node_groups(self.hierarchical, group, device)
            self._groups_of = group
        return self._groups

    def average_flat_(self, flat: Tensor, *, group=None, stats: CommStats | None = None) -> None:
        """Full-precision hierarchical mean of ``flat`` (fp32, 1-D) in place."""
        if world_size(group) > 1 and flat.numel():
            hierarchical_average_(flat, self.node_groups(group, flat.device), scratch=self._scratch, stats=stats)

    def reduce_flat_(self, flat: Tensor, *, group=None, segments: Sequence[int] | None = None,
                     on_reset: Callable[[str], None] | None = None, stats: CommStats | None = None,
                     momentum: tuple[Sequence[Tensor], float] | None = None) -> None:
        """As :meth:`OnebitCompressor.reduce_flat_`, compressed across nodes only (``momentum``: the lerp runs
        first, on the whole vector, before the node's reduce-scatter)."""
        n = flat.numel()
        if momentum is not None and n:
            passes.lerp_segments_(flat, momentum[0], momentum[1], plan_for(n, 1, segments).lengths)
        if world_size(group) == 1 or not n:
            return
        groups = self.node_groups(group, flat.device)
        size, start = groups.shard(n)
        pieces = shard_segments(segments, n, start, size)
        flat_reduce = super().reduce_flat_  # the 1-bit allreduce, across the nodes

        def across(shard: Tensor, inter: CommStats) -> None:
            flat_reduce(shard, group=groups.inter, segments=pieces, on_reset=on_reset, stats=inter)

        hierarchical_average_(flat, groups, scratch=self._scratch, across=across, stats=stats)
        if self.worker_error is not None:  # the buffers are this rank's of the whole group, for this node size
            self.origin, self.made_per_node = (groups.world, groups.rank), groups.per_node

    # ------------------------------------------------------------------ checkpoints
    def _per_node_now(self, group) -> int:
        """The node size on this rank without a collective (checkpoint code may run on one rank only)."""
        return ranks_per_node(self.hierarchical) if world_size(group) > 1 else 1
