r"""mlbench-core's ``DecentralizedSGD``: a local SGD step, then gossip averaging of the model's weights
with the neighbours in a graph (point-to-point; no global allreduce).

On rank :math:`i` with neighbours :math:`N(i)` and mixing weights :math:`M_{ij}`
(:mod:`lightning_optim.comm.topology`), each ``step()``:

.. math::
    x_i^{t+\frac12} &= \mathrm{SGD}(x_i^t, g_i^t) \quad \text{(torch.optim.SGD semantics: momentum,}
        \text{ dampening, L2 weight decay, Nesterov; per-rank momentum buffers)} \\
    x_i^{t+1} &= M_{ii} x_i^{t+\frac12} + \sum_{j \in N(i)} M_{ij} x_j^{t+\frac12}

where :math:`g_i^t` is rank :math:`i`'s *own* gradient: nothing averages gradients (mlbench's
``DecentralizedSGD`` aggregates the weights after the step, ``agg_model``, never the gradients).
The ranks' models differ between steps and meet at the mean only through repeated gossip.

mlbench semantics kept, and where this differs (and why):

* ``average_world=True`` is mlbench's ``avg_world`` op, which averages over the rank and its
  neighbours, :math:`M_{ij} = 1/(\deg(i)+1)` ("uniform" weights), *not* over the world size.
  ``average_world=False`` raises, as in mlbench (which raises NotImplementedError; here a
  ValueError naming the argument).
* ``rank``: mlbench requires it and, by a truthiness test, refuses rank 0; here None means this
  process's rank and 0 is accepted; a rank that is not this process's rank is refused.
* ``neighbors``: mlbench's list of this rank's neighbour ranks; None means a ring (mlbench refuses
  None). Also accepted: every rank's list, a name (``"ring"``, ``"torus"``, ``"torus:RxC"``,
  ``"exponential"``) or a :class:`~lightning_optim.comm.gossip.Topology` (e.g. with
  ``weights="metropolis"``, whose mixing matrix is doubly stochastic on irregular graphs too, where
  mlbench's uniform weights drive the ranks to a degree-weighted average instead of the mean).
  The ranks check their lists together (one bounded ``gather_rows``): lists that are not
  symmetric, name a missing rank or the rank itself, repeat a rank, differ or leave the graph
  disconnected raise the same error on every rank.
* mlbench replaces ``param.data`` with new tensors; here the params are updated in place (views,
  optimizer state keys and DDP buckets stay valid). Buffers (e.g. BatchNorm statistics) are not
  averaged, as in mlbench.
* ``use_cuda`` is accepted and not acted on: the tensors are sent from the params' own device
  (``use_cuda=True`` with params off CUDA warns).
* ``by_layer``: one exchange per parameter (True) or one flat buffer per dtype (False, default).
* Gradient release and optimizer accumulation are refused: the gossip belongs to a whole step.

Checkpoints: ``state_dict()`` is the SGD state of *this* rank (its momentum buffers). Because
the params also differ per rank, a decentralized run must save every rank's params too:
``rank_state_dict()`` bundles this rank's model state and optimizer state;
``load_rank_state_dict()`` restores it on the same rank (all ranks call it together) and the run
continues bitwise as if never interrupted. Recipe::

    torch.save(opt.rank_state_dict(), f"ckpt/rank{dist.get_rank()}.pt")          # every rank
    opt.load_rank_state_dict(torch.load(f"ckpt/rank{dist.get_rank()}.pt"))        # every rank
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_optim.comm.agreement import fingerprint, layout_signature, share_rows
from lightning_optim.comm.gossip import Topology, agree_topology, gossip_average
from lightning_optim.distributed.agreement import required
from lightning_optim.optim.hooks import step_without_hooks
from lightning_optim.optim.sgd import SGD
from lightning_optim.optim.validation import check_flag, check_non_negative, check_unit_interval, plain_numbers

from .agreement import warn_use_cuda
from .compressed_checks import check_distinct_params

__all__ = ["DecentralizedSGD"]


def _check_model(model: object) -> list[torch.Tensor]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module whose parameters are optimized, got {type(model).__name__}")
    params: list[torch.Tensor] = list(model.parameters())
    if not params:
        raise ValueError("model has no parameters: there is nothing to optimize or average")
    return params


def _check_arguments(model, lr, momentum, dampening, weight_decay, nesterov, average_world, use_cuda,
                     by_layer) -> tuple[str, BaseException] | None:
    """The first argument that fails its check, with the exception (None: all pass)."""
    def lr_check() -> None:
        if lr is required:
            raise TypeError("lr is required (a float in [0, inf)), as in mlbench's DecentralizedSGD")
        check_non_negative("lr", lr)

    def nesterov_check() -> None:
        check_flag("nesterov", nesterov)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov: needs momentum > 0 and dampening = 0")

    def average_world_check() -> None:
        check_flag("average_world", average_world)
        if not average_world:
            raise ValueError("average_world must be True: decentralized SGD only averages models with the "
                             "neighbours (mlbench raises NotImplementedError for False too)")

    checks: list[tuple[str, Callable[[], object]]] = [
        ("model", lambda: _check_model(model)),
        ("lr", lr_check),
        ("momentum", lambda: check_non_negative("momentum", momentum)),
        ("dampening", lambda: check_unit_interval("dampening", dampening, closed_right=True)),
        ("weight_decay", lambda: check_non_negative("weight_decay", weight_decay)),
        ("nesterov", nesterov_check),
        ("average_world", average_world_check),
        ("use_cuda", lambda: check_flag("use_cuda", use_cuda)),
        ("by_layer", lambda: check_flag("by_layer", by_layer)),
    ]
    for name, check in checks:
        try:
            check()
        except (TypeError, ValueError) as exc:
            return name, exc
    return None


class DecentralizedSGD(SGD):
    """Decentralized SGD with mlbench-core's constructor (see the module docstring for the equations).

    Args:
        rank: this process's rank in the default group (None: taken from torch.distributed).
        neighbors: this rank's neighbour ranks (mlbench), every rank's lists, a topology name or a
            ``Topology`` (None: ring).
        model: the ``nn.Module`` whose parameters are stepped and averaged.
        lr: learning rate, >= 0 (required).
        momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``.
        average_world: must be True (average with the neighbours, mlbench's ``avg_world``).
        use_cuda: accepted; the device is the params' (True off CUDA warns).
        by_layer: one exchange per parameter instead of one flat buffer.

    Construction is collective: every rank of the default group builds its optimizer together.
    """

    def __init__(self, rank: int | None = None, neighbors: Any = None, model: nn.Module | None = None,
                 lr: float = required, momentum: float = 0, dampening: float = 0, weight_decay: float = 0,
                 nesterov: bool = False, average_world: bool = True, use_cuda: bool = False,
                 by_layer: bool = False) -> None:
        refused = _check_arguments(model, lr, momentum, dampening, weight_decay, nesterov, average_world,
                                   use_cuda, by_layer)
        if refused is not None and not (dist.is_available() and dist.is_initialized()):
            raise refused[1]
        params = [] if refused is not None or model is None else list(model.parameters())
        agree = {"by_layer": int(bool(by_layer)) if refused is None else 0,
                 "the model's parameter layout (count, shapes, dtypes)": fingerprint(layout_signature(params))}
        self.topology: Topology = agree_topology(neighbors, rank=rank, agree=agree, refused=refused)
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov)
        self.model = cast(nn.Module, model)  # checked: agree_topology raised on every rank otherwise
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.neighbors = list(self.topology.neighbors[self.rank])
        self.average_world = average_world
        self.use_cuda = use_cuda
        warn_use_cuda(type(self).__name__, use_cuda, params)
        self.by_layer = by_layer
        self._gossip_params = params

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only the constructor adds params (the model's, gossiped with the neighbours). Later groups are
        checked like the constructor's arguments (named errors for bad values) and then refused: their params
        would be stepped but never averaged, and the ranks would drift apart without an error."""
        if getattr(self, "_gossip_params", None) is None:  # torch's __init__ adding the model's params
            super().add_param_group(param_group)
            return
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError("param_group must be a dict with 'params'")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group = {k: plain_numbers(v) for k, v in param_group.items() if k != "params"}
        self._validate_group({**self.defaults, **group, "params": params})
        check_distinct_params(params, self._gossip_params)
        raise ValueError("params: DecentralizedSGD steps and gossips the model's params, fixed at construction; "
                         "params added later would never be averaged with the neighbours (build the optimizer over "
                         "a model that holds them)")

    def _accumulation_blocker(self) -> str | None:
        return "DecentralizedSGD averages the weights with its neighbours after every step"

    def _release_blocker(self) -> str | None:
        return "DecentralizedSGD averages the whole model with its neighbours after the step"

    def step(self, closure: Callable[[], Any] | None = None, tracker: Any = None) -> Any:
        """The local SGD step, then one gossip round of the model's weights (collective: every rank steps).

        ``tracker``: mlbench's ``Tracker`` (or anything with ``record_batch_opt_step`` and
        ``record_batch_agg``); its hooks are called after the step and after the averaging.
        """
        loss = step_without_hooks(SGD)(self, closure)  # torch's hooks run once, around this step
        if tracker is not None:
            tracker.record_batch_opt_step()
        gossip_average(self._gossip_params, self.topology, by_layer=self.by_layer)
        if tracker is not None:
            tracker.record_batch_agg()
        return loss

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's whole state: its model's ``state_dict`` (the params differ per rank) and its
        optimizer ``state_dict`` (its momentum buffers), copied, with the rank and graph they belong to."""
        return {
            "rank": self.rank,
            "world_size": self.topology.world_size,
            "neighbors": [list(row) for row in self.topology.neighbors],
            "weights": self.topology.weights,
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.state_dict()),
        }

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``rank_state_dict`` saved on this same rank (collective: every rank calls it).

        Checked first (its rank and world size, the model's keys and shapes, the optimizer state);
        if any rank's check fails, every rank raises and nothing is changed on any rank.
        """
        problem: BaseException | None = None
        try:
            self._check_rank_state(state)
        except (TypeError, ValueError) as exc:
            problem = exc
        rows = share_rows("DecentralizedSGD.load_rank_state_dict", [int(problem is not None)], like=self._gossip_params)
        failed = [r for r, (bad,) in enumerate(rows) if bad]
        if problem is None and failed:
            raise ValueError(f"load_rank_state_dict: rank(s) {failed} refused their state (their own errors say why); "
                             "no rank loaded anything")
        if problem is not None:
            raise problem
        self.load_state_dict(state["optimizer"])
        self.model.load_state_dict(state["model"])

    def _check_rank_state(self, state: object) -> None:
        keys = {"rank", "world_size", "model", "optimizer"}
        if not isinstance(state, dict) or not keys <= set(state):
            raise ValueError(f"state: expected the dict of DecentralizedSGD.rank_state_dict() (keys {sorted(keys)})")
        if state["rank"] != self.rank or state["world_size"] != self.topology.world_size:
            raise ValueError(f"state: saved by rank {state['rank']} of {state['world_size']}, loaded on rank "
                             f"{self.rank} of {self.topology.world_size}; each rank must load its own state")
        own = self.model.state_dict()
        saved = state["model"]
        if set(saved) != set(own) or any(tuple(saved[k].shape) != tuple(own[k].shape) for k in own):
            raise ValueError("state: the saved model state does not match this model (keys or shapes differ)")
        from lightning_optim.optim.state_dicts import prepare_state_dict

        prepare_state_dict(self, state["optimizer"])  # raises on a bad optimizer state, changes nothing
