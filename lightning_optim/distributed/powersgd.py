r"""mlbench-core's ``PowerSGD``: momentum SGD on gradients averaged by PowerSGD compression with error
feedback (Vogels, Karimireddy & Jaggi 2019, arXiv 1905.13727).

Per step, with ``world_size`` :math:`W > 1`: every trainable param's local gradient goes through
:class:`~lightning_optim.comm.compressors.PowerSGDCompressor` (matrices: :math:`M = G + E`, rank-:math:`r`
power iteration :math:`P = MQ`, all-reduce, orthogonalise, :math:`Q = M^\top P`, all-reduce,
:math:`\hat M = PQ^\top`, :math:`E \leftarrow M - \hat M`; vectors and biases all-reduced uncompressed),
the aggregate is written into ``p.grad``, and ``torch.optim.SGD`` takes its step:

.. math::
    d &= \hat g + \lambda p, \qquad b \leftarrow \mu b + (1 - \tau) d \;(b = d \text{ at the first step}), \\
    p &\leftarrow p - \eta\,(d + \mu b \text{ if nesterov else } b)

With :math:`W = 1` there is nothing to aggregate: the step is plain SGD (mlbench's rule), with no
compression and no error memory.

Bytes per step and rank: :math:`2(W-1)/W \cdot 4 \left(\sum_\text{matrices} (n + m) r + \sum_\text{vectors} d\right)`
for fp32 params (P and Q of every matrix, then every vector, in three all-reduces), plus the per-step
layout agreement (one all-gather of ``8 * 4`` bytes per peer).

Differences from mlbench, and why:

* ``average_world=False`` sums over ranks (the error memory still uses the mean approximation, which is
  what every rank shares); mlbench raises ``NotImplementedError``;
* ``by_layer=True`` compresses and all-reduces param by param (the same result, more and smaller
  collectives); mlbench's ``by_layer`` path fails;
* ``use_cuda`` is accepted and not acted on: tensors stay on their params' device (mlbench allocates its P/Q
  buffers on ``cuda:0`` whenever CUDA exists); ``use_cuda=True`` with params off CUDA warns;
* the query :math:`Q` is drawn from a ``torch.Generator`` seeded with ``seed`` on every rank (mlbench:
  numpy's ``RandomState(1)`` reseeding the global torch RNG, which it thereby changes);
* ``model`` may also be an iterable of params or param groups; params with ``requires_grad=False``
  take no part, and a param without a gradient on this rank counts as zeros;
* ``matrix_approximation_rank`` (mlbench's ``rank``, the name torch's ``PowerSGDState`` gives it; >= 1,
  clipped per matrix to :math:`\min(n, m)`) and ``world_size`` (equal to the process group's size) are checked
  on every rank at construction.

State (per rank, in ``state_dict``): ``momentum_buffer`` and ``memory`` (the error feedback, different
on every rank) per param, and under ``"powersgd"`` the query generator and, with ``reuse_query``, the
warm-start queries. A reload continues bitwise.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_optim.comm.agreement import agree
from lightning_optim.comm.compressors import PowerSGDCompressor
from lightning_optim.comm.timeouts import check_process_group
from lightning_optim.distributed.agreement import required
from lightning_optim.optim.hooks import (
    install_state,
    load_with_hooks,
    packed_state_dict,
    state_dict_with_hooks,
    step_without_hooks,
)
from lightning_optim.optim.state_dicts import check_state_tensor
from lightning_optim.optim.validation import (
    check_flag,
    check_int,
    check_non_negative,
    check_optional_flag,
    check_unit_interval,
    plain_numbers,
)
from lightning_optim.renames import Alias, argument_aliases

from .agreement import warn_use_cuda
from .communicating import CommunicatingOptimizer
from .compressed_checks import (
    check_distinct_params,
    check_float_params,
    check_world_size,
    grads_or_zeros,
    layout_fields,
    trainable,
)
from .loading import check_param_states, saved_groups

__all__ = ["PowerSGD"]

ARGUMENTS = ("model", "lr", "momentum", "weight_decay", "dampening", "nesterov", "average_world", "use_cuda",
             "by_layer", "reuse_query", "world_size", "matrix_approximation_rank", "seed")
_SETTINGS = ("world_size", "average_world", "by_layer", "matrix_approximation_rank", "reuse_query", "seed")
# mlbench's spelling: its ``rank`` is the approximation rank, beside world_size where it reads like the process's
ALIASES = (Alias("rank", "matrix_approximation_rank", "mlbench's PowerSGD",
                 deprecated="here it is the rank of the low-rank approximation, not the process's rank"),)
_LAYOUT = ("params", "elements", "shapes")
STATE_KEY = "powersgd"


def _params_of(model: object) -> list:
    if model is None:
        raise ValueError("model: required (an nn.Module, or an iterable of params or param groups), got None")
    if isinstance(model, nn.Module):
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model: has no parameter with requires_grad=True")
        return params
    if isinstance(model, Tensor) or not isinstance(model, Iterable):
        raise TypeError("model must be an nn.Module or an iterable of params or param groups, "
                        f"got {type(model).__name__}")
    return list(model)


def _check_sgd(lr: object, momentum: object, weight_decay: object, dampening: object, nesterov: object) -> None:
    """The SGD hyper-parameters, checked alike by the constructor, ``add_param_group`` and loading."""
    check_non_negative("lr", lr)
    mu = check_non_negative("momentum", momentum)
    check_non_negative("weight_decay", weight_decay)
    damp = check_unit_interval("dampening", dampening, closed_right=True)
    if check_flag("nesterov", nesterov) and (mu <= 0 or damp != 0):
        raise ValueError(f"nesterov=True needs momentum > 0 and dampening 0, got momentum={momentum}, "
                         f"dampening={dampening}")


def _as_param_state(p: Tensor, key: str, value: Any) -> Any:
    """A loaded state value as torch's SGD casts it (a copy on ``p``'s device, floating ones in ``p``'s dtype)."""
    if not isinstance(value, Tensor) or key == "step":
        return value
    return value.to(device=p.device, dtype=p.dtype if value.is_floating_point() else value.dtype, copy=True)


def _group_params(params: Tensor | Iterable[Any]) -> list[Any] | set[Any]:
    # torch's forms: one tensor or an ordered collection (a set is refused by torch's add_param_group)
    return [params] if isinstance(params, Tensor) else params if isinstance(params, set) else list(params)


@argument_aliases(*ALIASES)
class PowerSGD(CommunicatingOptimizer, torch.optim.SGD):
    """PowerSGD with error feedback, then momentum SGD (see the module docstring).

    Args:
        model: an ``nn.Module`` (its trainable params), or params / param groups (required).
        lr: learning rate, >= 0 (required).
        momentum: momentum factor, >= 0.
        weight_decay: L2 penalty, >= 0 (added to the aggregated gradient, as torch's SGD does).
        dampening: dampening for momentum, in [0, 1].
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0).
        average_world: average over ranks (False: sum).
        use_cuda: accepted; the params' device is used (True off CUDA warns).
        by_layer: one compression and its collectives per param instead of one for all.
        reuse_query: warm-start each power iteration from the previous step's Q.
        world_size: the number of ranks (must equal the process group's).
        matrix_approximation_rank: the rank of the low-rank approximation, an int >= 1.
        seed: the seed of the query generator, an int >= 0, the same on every rank (keyword only).
        process_group: the group to communicate in (keyword only; None: the default group).
    """

    def __init__(self, model: nn.Module | Iterable | None = None, lr: float = required, momentum: float = 0,
                 weight_decay: float = 0, dampening: float = 0, nesterov: bool = False, average_world: bool = True,
                 use_cuda: bool = False, by_layer: bool = False, reuse_query: bool = False, world_size: int = 1,
                 matrix_approximation_rank: int = 1, *, seed: int = 0, process_group: Any = None) -> None:
        self.process_group = check_process_group("process_group", process_group)
        error = None
        try:
            params = _params_of(model)
            if lr is required:
                raise TypeError("lr: required (a learning rate >= 0)")
            _check_sgd(lr, momentum, weight_decay, dampening, nesterov)
            self.average_world = check_flag("average_world", average_world)
            self.use_cuda = check_flag("use_cuda", use_cuda)
            self.by_layer = check_flag("by_layer", by_layer)
            self.world_size = check_world_size(world_size, process_group)
            rank = check_int("matrix_approximation_rank", matrix_approximation_rank, 1)
            self.compressor = PowerSGDCompressor(rank, check_flag("reuse_query", reuse_query), seed=seed)
            super().__init__(params, lr=float(lr), momentum=float(momentum), dampening=float(dampening),
                             weight_decay=float(weight_decay), nesterov=nesterov)
        except (TypeError, ValueError) as exc:
            error = exc
        agree(type(self).__name__, _SETTINGS + _LAYOUT, None if error else self._fields(), group=process_group,
              like=[] if error else trainable(self.param_groups), error=error, arguments=ARGUMENTS)
        warn_use_cuda(type(self).__name__, self.use_cuda, trainable(self.param_groups))

    # ------------------------------------------------------------------ param groups
    def _validate_group(self, group: dict[str, Any]) -> None:
        """A group (defaults merged in) as the constructor checks it, plus torch's SGD flags."""
        check_float_params(_group_params(group["params"]))
        _check_sgd(group["lr"], group["momentum"], group["weight_decay"], group["dampening"], group["nesterov"])
        for flag in ("maximize", "differentiable"):
            check_flag(flag, group.get(flag, False))
        for flag in ("foreach", "fused"):
            check_optional_flag(flag, group.get(flag))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, after the constructor's checks (a negative lr would ascend) and with a repeated param
        refused (torch only warns within a group): nothing is added when they fail."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group: dict[str, Any] = {k: v if k == "params" else plain_numbers(v) for k, v in param_group.items()}
        params = _group_params(group["params"])
        if not isinstance(params, set):  # torch refuses sets with its own message
            self._validate_group({**self.defaults, **group, "params": params})
            check_distinct_params(params, [p for g in self.param_groups for p in g["params"]])
        super().add_param_group({**group, "params": params})

    def _fields(self) -> dict[str, int]:
        c = self.compressor
        return {"world_size": self.world_size, "average_world": int(self.average_world), "by_layer": int(self.by_layer),
                "matrix_approximation_rank": c.rank, "reuse_query": int(c.reuse_query), "seed": c.seed,
                **layout_fields(trainable(self.param_groups))}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Aggregate the gradients (``world_size > 1``), then take torch's SGD step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = trainable(self.param_groups)
        error = None
        try:  # before any residual, generator or buffer moves; a refusal on one rank stops every rank
            self._check_step(params)
        except (TypeError, ValueError) as exc:
            error = exc
        if self.world_size > 1:
            agree(type(self).__name__, _LAYOUT, None if error else layout_fields(params), group=self.process_group,
                  like=params, error=error, arguments=ARGUMENTS)
            self._aggregate(params)
        elif error is not None:
            raise error
        step_without_hooks(torch.optim.SGD)(self)  # torch's hooks run once, around this step
        return loss

    def _check_step(self, params: list[Tensor]) -> None:
        """The groups (edited since?), the gradients and the states a step is about to use."""
        for group in self.param_groups:
            self._validate_group(group)
        for i, p in enumerate(params):
            if p.grad is not None and p.grad.is_sparse:  # torch itself keeps grads shaped and typed like p
                raise ValueError(f"grad: param {i} has a sparse gradient; PowerSGD compresses dense gradients")
            for key in ("momentum_buffer", "memory"):
                value = self.state.get(p, {}).get(key)
                if value is not None:
                    check_state_tensor(f"state of param {i}", key, value, [tuple(p.shape)], tuple(p.shape))

    def _aggregate(self, params: list[Tensor]) -> None:
        grads = grads_or_zeros(params)
        memories = []
        for p in params:
            state = self.state[p]
            if "memory" not in state:
                state["memory"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            memories.append(state["memory"])
        kwargs = dict(group=self.process_group, average=self.average_world)
        if self.by_layer:
            out = [self.compressor.reduce([g], [m], keys=[i], **kwargs)[0]
                   for i, (g, m) in enumerate(zip(grads, memories))]
        else:
            out = self.compressor.reduce(grads, memories, keys=list(range(len(params))), **kwargs)
        for p, aggregated in zip(params, out):
            if p.grad is None:
                p.grad = aggregated
            else:
                p.grad.copy_(aggregated)

    # ------------------------------------------------------------------ state dicts
    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        """torch's SGD state dict plus the compressor's; torch's state-dict hooks see (and may replace) the whole."""
        return state_dict_with_hooks(self, self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        state_dict = packed_state_dict(self)
        state_dict[STATE_KEY] = self.compressor.state_dict()
        return state_dict

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's SGD state (momentum, memory per param) and, when present, the compressor's.

        Everything is checked first (the groups as the constructor checks them, each state a real
        floating-point tensor shaped like its param, the compressor's part), so a refused dict changes nothing.
        torch's load hooks run as torch runs them: the pre-hooks on the given dict, before the checks; the
        post-hooks once the compressor's part is loaded too.
        """
        load_with_hooks(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for gi, group, old in saved_groups(self, state_dict):  # torch's SGD would take any value
            try:
                self._validate_group({**self.defaults, **old, "params": group["params"]})
            except (TypeError, ValueError) as exc:
                raise ValueError(f"state_dict: param group {gi}: {exc}") from None
        check_param_states(self, state_dict, lambda p, key, value: [tuple(p.shape)], keys={"momentum_buffer", "memory"})
        saved = state_dict.get(STATE_KEY)
        if saved is not None:
            check = PowerSGDCompressor(self.compressor.rank, self.compressor.reuse_query, seed=self.compressor.seed)
            try:
                check.load_state_dict(saved)
            except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: torch refused the generator state
                raise ValueError(f"state_dict: {STATE_KEY} {exc}") from None
        # torch's SGD loading: each state tensor on its param's device, in its dtype
        install_state(self, state_dict["param_groups"], state_dict["state"], cast=_as_param_state)
        if saved is not None:
            self.compressor.load_state_dict(saved)
