r"""mlbench-core's ``CentralizedSparsifiedSGD``: sparsified SGD with memory, exchanging sparse vectors.

Per param tensor, on each rank :math:`r` (gradient :math:`g_r`, memory :math:`e_r`, zeros at the start;
:math:`k` = ``sparse_grad_size``; everything up to the selection is :class:`~lightning_optim.optim.SparsifiedSGD`):

.. math::
    e_r &\leftarrow e_r + \eta\, g_r \\
    S_r &= k \text{ positions (blockwise, random or top-}k\text{)}, \qquad s_r = (e_r)_{S_r},
        \quad (e_r)_{S_r} \leftarrow 0 \\
    u &= \textstyle\sum_{r} s_r \quad (\div\, W \text{ with ``average_world``})
        \qquad \text{(all-gather of values and positions)} \\
    p &\leftarrow p - u - \lambda p

so every rank applies the same update ``u`` and the params stay equal on every rank. As in mlbench the
decay :math:`\lambda p` is not scaled by the learning rate, and ``random_sparse`` picks random (True) or
blockwise (False) positions; ``mode="topk"`` selects the :math:`k` largest :math:`|e_r|` instead.

Bytes per step and rank: :math:`(W-1) \sum_\text{params} (4k + 4k)` for random/top-:math:`k` (fp32
values, int32 positions), :math:`(W-1) \sum_\text{params} (4k + 8)` for blockwise (values and the
block start), plus the per-step agreement (see below); ``fp32_equivalent_bytes`` is the fp32 ring
all-reduce of every param.

Differences from mlbench, and why:

* one all-gather per param of one uint8 buffer holding the values in their dtype and the positions
  as int32 (mlbench sends positions as float32 values, exact only below :math:`2^{24}`), and any
  param shape (mlbench indexes ``[0, i]``: params of shape ``[1, d]`` only; for those it is the same);
* ``sparse_grad_size`` must lie in ``[1, numel]`` for every trainable param (mlbench would fail on an
  empty block or draw); a param without a gradient on this rank counts as zeros (mlbench would fail);
* mlbench's own update is written into ``p.grad``; here ``p.grad`` is left as the local gradient;
* random draws come from ``generator`` (a ``torch.Generator``; the global torch RNG when None; mlbench:
  numpy's global RNG). Ranks may draw different positions: the all-gather carries them. Pass a
  generator for a bitwise resume (its state is in the state dict);
* ``world_size`` must equal the process group's size and the arguments must agree on every rank
  (checked at construction; the layout and ``optimizer_accumulation`` at every step, with one
  bounded all-gather of ``8 * 10`` bytes per peer): a refusal on any rank stops every rank.

State (per rank, in ``state_dict``): each param's ``memory`` (the error feedback; different on every
rank), ``estimated_w`` and ``step``, and ``generator_state`` when a generator is given.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_optim.comm.agreement import agree, fingerprint
from lightning_optim.comm.compressors import SparsePayload, gather_sparse
from lightning_optim.comm.timeouts import check_process_group
from lightning_optim.distributed.agreement import required
from lightning_optim.optim.base import Batch, ParamsT
from lightning_optim.optim.batch import TensorList
from lightning_optim.optim.sparsified_sgd import SparsifiedSGD
from lightning_optim.optim.state_dicts import check_state_tensor
from lightning_optim.optim.validation import check_flag

from .communicating import CommunicatingOptimizer
from .compressed_checks import check_distinct_params, check_world_size, grads_or_zeros, layout_fields, trainable

__all__ = ["CentralizedSparsifiedSGD"]

ARGUMENTS = ("params", "lr", "weight_decay", "sparse_grad_size", "random_sparse", "world_size", "average_world",
             "mode", "generator")
_FIELDS = ("world_size", "average_world", "params", "elements", "shapes", "sparse_grad_size",
           "largest_sparse_grad_size", "selection", "optimizer_accumulation")


class CentralizedSparsifiedSGD(CommunicatingOptimizer, SparsifiedSGD):
    """Sparsified SGD with memory on every rank, the sparse vectors averaged over ranks (see the module).

    Args:
        params: the params or param groups (required).
        lr: learning rate, >= 0 (required).
        weight_decay: decay coefficient, >= 0 (applied as ``p <- p - wd * p``, not scaled by lr).
        sparse_grad_size: k, an int in [1, numel of the smallest trainable param].
        random_sparse: random (True) or blockwise (False) positions.
        world_size: the number of ranks (must equal the process group's).
        average_world: divide the summed sparse vectors by ``world_size`` (False: sum).
        mode: "random", "blockwise" or "topk"; overrides ``random_sparse`` (keyword only).
        generator: a ``torch.Generator`` for the random draws (keyword only; None: the global RNG).
        process_group: the group to communicate in (keyword only; None: the default group).
    """

    def __init__(self, params: ParamsT | None = None, lr: float = required, weight_decay: float = 0,
                 sparse_grad_size: int = 10, random_sparse: bool = False, world_size: int = 1,
                 average_world: bool = True, *, mode: str | None = None, generator: torch.Generator | None = None,
                 process_group: Any = None) -> None:
        self.process_group = check_process_group("process_group", process_group)
        self._selection: Tensor | slice | None = None
        error = None
        try:
            if params is None:
                raise ValueError("params: required (an iterable of params or param groups), got None")
            if lr is required:
                raise TypeError("lr: required (a learning rate >= 0)")
            self.average_world = check_flag("average_world", average_world)
            self.world_size = check_world_size(world_size, process_group)
            super().__init__(params, lr, weight_decay, sparse_grad_size, random_sparse, mode=mode,
                             generator=generator)
        except (TypeError, ValueError) as exc:
            error = exc
        agree(type(self).__name__, _FIELDS, None if error else self._fields(), group=process_group,
              like=[] if error else trainable(self.param_groups), error=error, arguments=ARGUMENTS)

    # ------------------------------------------------------------------ checks
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The base's checks (as the constructor's), and a repeated param refused (torch only warns within
        a group; its sparse vector would be sent twice): nothing is added when they fail."""
        if isinstance(param_group, dict) and "params" in param_group and not isinstance(param_group["params"], set):
            params = param_group["params"]  # a set: torch refuses it with its own message
            params = [params] if isinstance(params, Tensor) else list(params)  # a generator is read once
            check_distinct_params(params, [p for group in self.param_groups for p in group["params"]])
            param_group = {**param_group, "params": params}
        super().add_param_group(param_group)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        k = group["sparse_grad_size"]
        params = [group["params"]] if isinstance(group["params"], Tensor) else group["params"]
        for i, p in enumerate(params):
            if p.requires_grad and p.numel() < k:
                raise ValueError(
                    f"sparse_grad_size={k} exceeds the {p.numel()} elements of param {i} (shape {tuple(p.shape)}) "
                    f"of this group: sparse_grad_size must be in [1, numel of the smallest trainable param]"
                )

    def _fields(self) -> dict[str, int]:
        params = trainable(self.param_groups)
        sizes, modes = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    sizes.append(group["sparse_grad_size"])
                    modes.append(group["mode"] or ("random" if group["random_sparse"] else "blockwise"))
        return {"world_size": self.world_size, "average_world": int(self.average_world), **layout_fields(params),
                "sparse_grad_size": min(sizes), "largest_sparse_grad_size": max(sizes), "selection": fingerprint(modes),
                "optimizer_accumulation": int(self.optimizer_accumulation)}

    def _release_blocker(self) -> str | None:
        return ("it exchanges every param's sparse vector with the other ranks in step(); per-param steps "
                "from backward hooks would run those collectives in each rank's own order")

    # ------------------------------------------------------------------ stepping
    def _params_with_grad(self, group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor], bool]:
        # every trainable param, every step: the ranks must run the same collectives
        params = [p for p in group["params"] if p.requires_grad]
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError("grad: sparse gradients are not supported; use dense gradients")
        return params, grads_or_zeros(params), False

    def _before_step(self, work: list[tuple[dict[str, Any], list[Tensor]]]) -> None:
        error = None
        try:
            for group in self.param_groups:  # a group edited since construction
                self._validate_group(group)
            # a state set by hand: refused here, before any step count moves
            for i, p in enumerate(trainable(self.param_groups)):
                for key, value in self.state.get(p, {}).items():
                    if isinstance(value, Tensor) and key != "step":  # step: the 0-d count torch keeps
                        check_state_tensor(f"state of param {i}", key, value, [tuple(p.shape)], tuple(p.shape))
        except (TypeError, ValueError) as exc:
            error = exc
        agree(type(self).__name__, _FIELDS, None if error else self._fields(), group=self.process_group,
              like=trainable(self.param_groups), error=error, arguments=ARGUMENTS)

    def _select(self, group: dict[str, Any], p: Tensor, flat: Tensor, k: int) -> Tensor | slice:
        # SparsifiedSGD picks the positions; _apply below, called next for the same param, sends them
        self._selection = super()._select(group, p, flat, k)
        return self._selection

    def _apply(self, batch: Batch, deltas: TensorList, decay: float | list[float] = 0.0) -> None:
        # SparsifiedSGD hands over -s for one param (per_tensor): exchange s, apply -u instead
        selection, self._selection = self._selection, None
        (delta,) = deltas
        flat = delta.view(-1)
        if isinstance(selection, slice):
            payload = SparsePayload(-flat[selection], None, selection.start, flat.numel())
        else:
            payload = SparsePayload(-flat[selection], selection, 0, flat.numel())
        (update,) = gather_sparse([payload], group=self.process_group, average=self.average_world)
        super()._apply(batch, [update.neg_().view_as(delta)], decay)
