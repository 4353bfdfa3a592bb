r"""The 1-bit compressor: DeepSpeed's error-compensated 1-bit averaging as a :class:`Compressor`.

One call (:func:`lightning_optim.comm.compressed_allreduce`, one scale per segment) averages with two
error feedbacks: every rank compresses its chunk-padded input plus its *worker error*, each rank
averages the chunk it serves and compresses it again plus its *server error*:

.. math::
    c = x + e_w,\ \ s = \tfrac{\lVert c \rVert_1}{d}\,\mathrm{sign}(c),\ \ e_w \leftarrow c - s;\qquad
    \bar c_j = \tfrac{1}{W}\sum_r s_{r,j} + e_{s,j},\ \ \bar s_j = \tfrac{\lVert \bar c_j \rVert_1}{d_j}
    \mathrm{sign}(\bar c_j),\ \ e_{s,j} \leftarrow \bar c_j - \bar s_j

(Tang et al. 2021, 1-bit Adam, arXiv 2102.02888). Both errors are padded to the chunk layout, so
unlike the other compressors it keeps them itself (``residuals`` stays ``None``) and saves them in
:meth:`state_dict`, with the (world size, rank) they belong to: they are this rank's own.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_optim.optim.validation import check_int

from .. import pieces as passes
from ..compressed import compressed_allreduce, compressed_bytes, error_buffer_sizes, make_error_buffers
from ..dense import world_size
from ..plan import plan_for
from ..stats import CommStats
from .base import Compressor, check_reduce_args, group_rank

__all__ = ["OnebitCompressor"]


class OnebitCompressor(Compressor):
    """Error-compensated 1-bit averaging; ``worker_error``/``server_error``: this rank's residuals."""

    def __init__(self) -> None:
        self.worker_error: Tensor | None = None
        self.server_error: Tensor | None = None
        self.origin: tuple[int, int] | None = None  # (world size, rank) the error buffers belong to
        self.made_per_node: int | None = None  # the node size they were made for (1: flat; hierarchical.py)

    def reduce_flat_(self, flat: Tensor, *, group=None, segments: Sequence[int] | None = None,
                     on_reset: Callable[[str], None] | None = None, stats: CommStats | None = None,
                     momentum: tuple[Sequence[Tensor], float] | None = None) -> None:
        """Average ``flat`` (fp32, 1-D) over the ranks in place; one scale per ``segments`` piece.
        Error buffers that no longer fit are dropped (``on_reset(why)`` is told) and start again at zero.
        ``momentum=(grads, w1)``: lerp each segment towards its gradient first (see ``compressed_allreduce``)."""
        world = world_size(group)
        if world == 1 or not flat.numel():
            if momentum is not None and flat.numel():
                passes.lerp_segments_(flat, momentum[0], momentum[1], plan_for(flat.numel(), 1, segments).lengths)
            return
        if self.worker_error is not None and self.server_error is not None:  # both or neither
            sizes = (self.worker_error.numel(), self.server_error.numel())
            if sizes != tuple(error_buffer_sizes(flat.numel(), world, segments)):
                self.forget()
                if on_reset is not None:
                    on_reset(f"their sizes {sizes} do not fit {flat.numel()} elements on {world} ranks")
            elif self.worker_error.device != flat.device:
                self.worker_error = self.worker_error.to(flat.device)
                self.server_error = self.server_error.to(flat.device)
        if self.worker_error is None or self.server_error is None:
            self.worker_error, self.server_error = make_error_buffers(flat, group, segments)
            self.origin, self.made_per_node = (world, group_rank(group)), 1
        compressed_allreduce(flat, self.worker_error, self.server_error, group=group, stats=stats, segments=segments,
                             momentum=momentum)

    def reduce(self, tensors: Sequence[Tensor], residuals: Sequence[Tensor] | None = None, *, group=None,
               average: bool = True, stats: CommStats | None = None) -> list[Tensor]:
        tensors, residuals = check_reduce_args(tensors, residuals, group, average)
        if residuals is not None:
            raise ValueError("residuals: the 1-bit compressor keeps its own error buffers (padded to its chunk "
                             "layout); pass None")
        if not average:
            raise ValueError("average: the 1-bit allreduce averages; a sum is not offered")
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        self.reduce_flat_(flat, group=group, segments=[t.numel() for t in tensors], stats=stats)
        return [piece.view(t.shape).to(t.dtype) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]

    def bytes_sent(self, numels: Sequence[int], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        return compressed_bytes(sum(numels), world_size, list(numels)) if world_size > 1 else 0

    # ------------------------------------------------------------------ the residuals' life
    def reset(self) -> None:
        """Zero the residuals (e.g. when what is compressed changes meaning: gradients -> momenta)."""
        if self.worker_error is not None and self.server_error is not None:
            self.worker_error.zero_()
            self.server_error.zero_()

    def forget(self) -> None:
        self.worker_error = self.server_error = self.origin = self.made_per_node = None

    def _per_node_now(self, group) -> int:
        """The node size this compressor exchanges with (1: flat, every rank one node)."""
        return 1

    def belongs_here(self, group=None) -> bool:
        """Whether the residuals (if any) were made by this rank of this world size, for this node size."""
        here = (world_size(group), group_rank(group))
        return self.worker_error is None or (self.origin == here and self.made_per_node == self._per_node_now(group))

    def state_dict(self) -> dict[str, Any]:
        return {"worker_error": self.worker_error, "server_error": self.server_error,
                "world_size": self.origin[0] if self.origin else None, "rank": self.origin[1] if self.origin else None,
                "per_node": self.made_per_node}

    @staticmethod
    def check_state(state: Mapping[str, Any]) -> None:
        """Raise (naming the key) unless ``state`` is a loadable :meth:`state_dict`; changes nothing."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping (from state_dict()), got {type(state).__name__}")
        worker, server = state.get("worker_error"), state.get("server_error")
        if worker is None and server is None:  # none yet, or dropped for another rank (without_error_buffers)
            return
        if not (isinstance(worker, Tensor) and isinstance(server, Tensor)):
            raise TypeError("state: worker_error and server_error must be tensors, or both None")
        for key, buf in (("worker_error", worker), ("server_error", server)):
            if not buf.is_floating_point() or buf.dim() != 1:  # int/bool/complex residuals cannot be added back
                raise ValueError(f"state: {key} must be a 1-D real floating-point tensor, got a {buf.dtype} tensor "
                                 f"of shape {tuple(buf.shape)}")
        for key in ("world_size", "rank"):
            check_int(key, state.get(key), 1 if key == "world_size" else 0)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        worker, server = state.get("worker_error"), state.get("server_error")
        if worker is None or server is None:
            self.forget()
            return
        self.worker_error, self.server_error = worker.clone(), server.clone()
        self.origin = (int(state["world_size"]), int(state["rank"]))
        per_node = state.get("per_node")  # absent in checkpoints from before hierarchical: flat
        self.made_per_node = 1 if per_node is None else int(per_node)
