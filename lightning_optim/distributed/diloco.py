r"""DiLoCo and Streaming DiLoCo: any inner optimizer steps locally; every ``sync_every`` steps the ranks
average how far they moved and take one outer Nesterov step together.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105), on :math:`W` ranks of ``process_group``, :math:`H` =
``sync_every``: every rank :math:`r` starts from the global params :math:`\theta_g` and runs :math:`H` inner
steps of its own optimizer (Adam(W), SGD, ... ours or torch's: its state stays on the rank), reaching
:math:`\theta_r`. Then, identically on every rank:

.. math::
    \Delta_r = \theta_g - \theta_r, \qquad \bar\Delta = \tfrac1W \textstyle\sum_r \Delta_r \quad
    \text{(the pseudo-gradient, all-reduced: the only communication)} \\
    b \leftarrow \mu b + \bar\Delta, \qquad
    \theta_g \leftarrow \theta_g - \eta\,(\bar\Delta + \mu b) \;\text{(Nesterov; } \theta_g - \eta b \text{ without,}
    \ \theta_g - \eta\bar\Delta \text{ for } \mu = 0) \\
    \theta_r \leftarrow \theta_g

with :math:`\eta` = ``outer_lr`` (0.8), :math:`\mu` = ``outer_momentum`` (0.5), :math:`b_0 = 0`: the step
``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)`` takes with :math:`\bar\Delta` as
the gradient. Between synchronisations nothing is sent at all. (The outer arguments left None take the recipe's
defaults, ``diloco_checks.OUTER_DEFAULTS``: the numbers here for DiLoCo, others for SparseLoCo.)

SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706; ``compressor="sparseloco"`` or a
:class:`~lightning_optim.comm.compressors.SparseLoCo`): each rank keeps an error-feedback accumulator
:math:`e_r` (zeros at the start), decayed by :math:`\beta` = ``outer_momentum``, which takes the place of the
outer momentum (no :math:`b`, no Nesterov):

.. math::
    e_r \leftarrow \beta e_r + \Delta_r, \qquad C_r = Q(\mathrm{TopK}_\text{chunks}(e_r)), \qquad
    e_r \leftarrow e_r - C_r, \qquad \bar\Delta = \tfrac1W \textstyle\sum_r C_r, \qquad
    \theta_g \leftarrow \theta_g - \eta\bar\Delta, \qquad \theta_r \leftarrow \theta_g

with ``density`` of each chunk kept (its largest :math:`|e_i|`) and quantised to ``bits`` bits (the compressor's
module docstring: chunks, levels, wire); only positions and codes travel, in one all-gather.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512):

* ``fragments=F`` (:math:`F \mid H`): the params, in the inner optimizer's order, cut into :math:`F`
  contiguous fragments balanced by element count; fragment :math:`f` synchronises (the equations above on
  its params alone, with its own :math:`\theta_g` and :math:`b`) after inner step :math:`t` when
  :math:`t \bmod H = (f+1) H/F \bmod H` - one fragment every :math:`H/F` steps, each one every :math:`H`
  steps, so each exchange carries about :math:`1/F` of the model (``diloco_schedule.py``).
* ``overlap=True``: the exchange of the fragment that synchronises after step :math:`t` is started (the
  all-reduce in flight) and merged after step :math:`t+1` (the paper's delay :math:`\tau = 1`), the rank
  having trained one more step meanwhile; the merge mixes with :math:`\alpha` = ``mixing`` (0.5, the paper's):

  .. math:: \theta_g \leftarrow \mathrm{OuterSGD}(\theta_g, \bar\Delta^{(t)}), \qquad
            \theta_r^{(t+1)} \leftarrow \alpha\,\theta_r^{(t+1)} + (1-\alpha)\,\theta_g

  (:math:`\alpha = 0`: take the global params, dropping the step made meanwhile). A merge comes before the
  exchange that starts at the same step.

``compressor=``: the pseudo-gradients travel compressed, with this rank's error feedback
(:math:`c = \Delta_r + e_r,\ e_r \leftarrow c - C(c)`): ``"int8"``/``"int4"`` (per-chunk scaled integer
codes, in flight like the all-reduce), ``"onebit"`` (DeepSpeed's error-compensated 1-bit averaging),
``"sign"``, ``"topk"`` (1%), ``"powersgd"`` (rank 4), ``"sparseloco"`` (above: its accumulator is the error
feedback), or any :class:`~lightning_optim.comm.compressors.Compressor` (each fragment uses its own copy). Those
other than int8/int4 block while they exchange; with ``overlap`` their average still merges one step later. With
one rank nothing is sent and nothing compressed (SparseLoCo included: the outer step takes :math:`\Delta`).

Precision: :math:`\theta_g`, :math:`b`, :math:`\Delta` and the residuals are kept in fp32 for fp16/bf16
params, in the params' dtype otherwise. Bytes (``comm_stats()``): what the all-reduce (ring rule) or the
compressor puts on the wire, plus at construction one small agreement (the arguments and the params' layout), a
16-byte all-reduce of the params' checksum and, only where the ranks' params differ, one broadcast of group rank
0's params into every rank's :math:`\theta_g` (under DDP they are rank 0's already); and a compressor's first call.

The end of a run (``finish()``, which the Lightning strategies, the HF callback and ``enable_diloco``'s
``max_steps`` call for you): with ``final_sync=True`` (the default) an overlapped exchange still in flight is
merged and every fragment that some rank holds apart from :math:`\theta_g` is exchanged and taken by every rank
(the equations above, without mixing), so the run ends with one model on every rank; with ``final_sync=False``
nothing is sent and rank 0 warns where the ranks end apart. ``warn_if_no_sync(last_step)``: rank 0 warns when a
run that ends after inner step ``last_step`` would reach no synchronisation (``diloco_end.py``).

Checkpoints: ``state_dict()`` holds the inner optimizer's state (``state``, ``param_groups``: this rank's
own) and ``"diloco"`` (``diloco_state.py``: global params, outer momentum, step, residuals (SparseLoCo's
accumulators), compressor
states, an overlapped exchange still to merge - waited for first). A reload in a fresh object continues
bitwise. Failures: a rank that dies or hangs during an exchange makes the others raise ``CommunicationError``
naming it within ``lightning_optim.comm.collective_timeout()`` (``comm/roll_call.py``).

Fault tolerance (``manager=``, a ``torchft.Manager``; ``diloco_replicas.py``): the exchanges run between
replica groups as quorum steps of the manager; a replica that dies or is cut off costs the survivors the
exchange in progress (discarded everywhere it failed), a returning replica is healed from a peer and rejoins at
the next synchronisation.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_optim.comm.agreement import agree, fingerprint, layout_signature
from lightning_optim.comm.compressors import SparseLoCo
from lightning_optim.comm.dense import world_size
from lightning_optim.comm.timeouts import check_process_group
from lightning_optim.optim.hooks import init_wrapper_hooks

from .agreement import float_bits
from .diloco_checkpoint import CheckpointSteps
from .diloco_checks import check_diloco_arguments, check_inner, check_settings, compressor_code, show
from .diloco_end import apart_message, first_sync_after, fragments_apart, no_sync_message, settled_by_schedule
from .diloco_exchange import (
    Exchange,
    broadcast_global_,
    keeps_own_errors,
    start_exchange,
)
from .diloco_replicas import (
    ReplicaExchange,
    ReplicaRounds,
    ReplicaSteps,
    Round,
    check_manager,
)
from .diloco_schedule import fragment_bounds, outer_step_, pseudo_gradients, syncing_fragment, take_global_

__all__ = ["DiLoCo", "check_diloco_arguments"]

ARGUMENTS = ("inner", "params", "sync_every", "fragments", "outer_lr", "outer_momentum", "nesterov", "overlap",
             "mixing", "compressor", "final_sync", "manager", "density", "bits")
_FIELDS = ("sync_every", "fragments", "overlap", "nesterov", "outer_lr", "outer_momentum", "mixing", "compressor",
           "density", "bits", "final_sync", "params", "elements", "shapes")
_WIDENED = (torch.float16, torch.bfloat16)  # their global copy, momentum and residuals are fp32


class DiLoCo(CheckpointSteps, ReplicaSteps, torch.optim.Optimizer):
    """DiLoCo / Streaming DiLoCo over ``inner`` (see the module docstring for the equations).

    Args:
        inner: the local optimizer (any ``torch.optim.Optimizer`` that does not communicate by itself).
        sync_every: H >= 1, inner steps between two synchronisations of a fragment.
        outer_lr: the outer SGD's learning rate, > 0 (None: the recipe's default, ``diloco_checks.OUTER_DEFAULTS``).
        outer_momentum: its momentum, in [0, 1); with SparseLoCo the decay of its accumulator, in [0, 1] (None: the
            recipe's default; a SparseLoCo instance's own decay).
        nesterov: Nesterov momentum (needs outer_momentum > 0; None: the recipe's default). SparseLoCo keeps no
            outer momentum: False (or None) only.
        fragments: F >= 1 dividing H (and at most the number of params): Streaming DiLoCo's fragments.
        overlap: start each exchange after its step and merge it one inner step later.
        mixing: alpha in [0, 1] of the overlapped merge (None: 0.5 with overlap; only with overlap).
        compressor: None, a name ("int8", "int4", "onebit", "sign", "topk", "powersgd", "sparseloco") or a
            Compressor.
        density: with ``compressor="sparseloco"``: the share of each chunk sent, in (0, 1] (None: 1/64).
        bits: with ``compressor="sparseloco"``: bits per sent value, in [1, 8] (None: 2).
        final_sync: what :meth:`finish` does when the run ends between synchronisations. True (the default): one
            more synchronisation of what the ranks hold apart, so the run ends with one model on every rank - the
            one a main-process save writes and an evaluation scores - for one exchange of at most the whole model;
            the inner steps since the last synchronisation count as a shorter round. Checkpoints written before
            the end hold the state without it and resume bitwise. False: nothing is sent, every rank keeps its own
            params, and rank 0 warns; continuing the same objects afterwards then takes exactly the steps of one
            uninterrupted run.
        process_group: the ranks that average (None: the default group).
        manager: a ``torchft.Manager`` (``use_async_quorum=False``) whose replicas average, fault-tolerantly
            (see ``diloco_replicas.py``); excludes ``process_group``. Construction joins the replicas: it waits
            for a quorum and, on a replica that starts late or returns, takes the global state from a peer.
    """

    # the checked arguments (``_check_settings``), set together in ``__init__``
    sync_every: int
    outer_lr: float
    outer_momentum: float
    nesterov: bool
    fragments: int
    overlap: bool
    mixing: float | None
    final_sync: bool

    def __init__(self, inner: torch.optim.Optimizer, *, sync_every: int, outer_lr: float | None = None,
                 outer_momentum: float | None = None, nesterov: bool | None = None, fragments: int = 1,
                 overlap: bool = False, mixing: float | None = None, compressor: Any = None,
                 density: float | None = None, bits: int | None = None, final_sync: bool = True,
                 process_group: Any = None, manager: Any = None) -> None:
        check_process_group("process_group", process_group)
        if manager is not None:
            if process_group is not None:
                raise ValueError("process_group and manager exclude each other: with a torchft manager the replicas "
                                 "average over the manager's process group")
            check_manager(manager)
        error, row = None, None
        try:
            params = check_inner(inner, DiLoCo)
            settings, compressor_name, prototype = check_settings(
                params, sync_every, fragments, outer_lr, outer_momentum, nesterov, overlap, mixing, final_sync,
                compressor, density, bits)
            sparse = prototype if isinstance(prototype, SparseLoCo) else None
            row = {**{k: int(settings[k]) for k in ("sync_every", "fragments", "overlap", "nesterov", "final_sync")},
                   "outer_lr": float_bits(settings["outer_lr"]),
                   "outer_momentum": float_bits(settings["outer_momentum"]),
                   "mixing": float_bits(-1.0 if settings["mixing"] is None else settings["mixing"]),
                   "compressor": compressor_code(compressor_name),
                   "density": float_bits(-1.0 if sparse is None else sparse.density),
                   "bits": 0 if sparse is None else sparse.bits, "params": len(params),
                   "elements": sum(p.numel() for p in params), "shapes": fingerprint(layout_signature(params))}
        except (TypeError, ValueError) as exc:
            error = exc
        # every rank checked its own arguments; now all raise, or none does
        agree(type(self).__name__, _FIELDS, row, group=process_group, like=[] if error else params, error=error,
              arguments=ARGUMENTS, show=show)
        init_wrapper_hooks(self)  # torch's step hooks and profiler label, as Optimizer.__init__ does
        self.inner = inner
        self.process_group = process_group
        self.params = params
        self.__dict__.update(settings)
        # SparseLoCo: outer_momentum is its accumulator's decay; the outer step keeps no momentum of its own
        self.decay_is_momentum = isinstance(prototype, SparseLoCo)
        self.density = prototype.density if isinstance(prototype, SparseLoCo) else None
        self.bits = prototype.bits if isinstance(prototype, SparseLoCo) else None
        self.compressor_name = compressor_name
        self.bounds = fragment_bounds([p.numel() for p in params], self.fragments)
        self._prototype = prototype
        self.compressors = [None if prototype is None else copy.deepcopy(prototype) for _ in self.bounds]
        with torch.no_grad():
            self.global_params = [p.detach().to(torch.float32 if p.dtype in _WIDENED else p.dtype, copy=True)
                                  for p in params]
        # one global copy on every rank: group rank 0's (a rank that started elsewhere is pulled in at its first sync)
        broadcast_global_(self.global_params, process_group)
        self.outer_momenta = [torch.zeros_like(g) for g in self.global_params] if self._momentum else []
        self.residuals: list[Tensor | None] = [None] * len(params)
        self.inner_steps = 0
        self.pending: tuple[int, int, Any] | None = None  # (fragment, step it merges at, its exchange)
        self.replicas = None if manager is None else ReplicaRounds(manager, self)
        if self.replicas is not None:
            self._join(self.replicas)

    # ------------------------------------------------------------------ torch.optim.Optimizer face
    # read-only views of the inner optimizer's, where torch.optim.Optimizer declares plain attributes
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's groups (LR schedulers set the inner ``lr`` here)."""
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("DiLoCo: the synchronised params are fixed at construction (every rank agreed on them and "
                           "they hold a global copy); add the group to the inner optimizer before wrapping it")

    @property
    def _momentum(self) -> float:
        """The outer SGD's own momentum (0 under SparseLoCo, whose accumulator takes its place)."""
        return 0.0 if self.decay_is_momentum else self.outer_momentum

    def __repr__(self) -> str:
        sparse = f", density={self.density}, bits={self.bits}" if self.decay_is_momentum else ""
        return (f"DiLoCo(sync_every={self.sync_every}, outer_lr={self.outer_lr}, outer_momentum={self.outer_momentum}, "
                f"nesterov={self.nesterov}, fragments={self.fragments}, overlap={self.overlap}, mixing={self.mixing}, "
                f"compressor={self.compressor_name!r}{sparse}, final_sync={self.final_sync}, inner={self.inner!r})")

    # ------------------------------------------------------------------ stepping
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; then the overlapped merge due now, and the exchange of the fragment due now."""
        if closure is not None and not callable(closure):
            raise TypeError(f"closure must be None or a callable returning the loss, got {type(closure).__name__}")
        loss = self.inner.step() if closure is None else self.inner.step(closure)
        self.inner_steps += 1
        t = self.inner_steps
        with torch.no_grad():
            if self.pending is not None and self.pending[1] == t:
                merged, _, exchange = self.pending
                self.pending = None
                self._finish_exchange(merged, exchange, self.mixing)
            fragment = syncing_fragment(t, self.sync_every, self.fragments)
            if fragment is not None:
                exchange = self._start(fragment, t)
                if self.overlap:
                    self.pending = (fragment, t + 1, exchange)
                else:
                    self._finish_exchange(fragment, exchange, None)
        return loss

    def _start(self, fragment: int, t: int, final: bool = False) -> Exchange | ReplicaExchange:
        """Start the exchange of ``fragment`` after inner step ``t``; with a manager, in a new quorum round."""
        if self.replicas is None:
            return self._exchange(fragment, t, final, self.process_group)
        self.replicas.open(Round(t, fragment, final))
        return self._start_in_round(self.replicas, fragment, t, final)

    def _finish_exchange(self, fragment: int, exchange: Exchange | ReplicaExchange, mixing: float | None) -> None:
        if isinstance(exchange, ReplicaExchange):
            averaged = exchange.rounds.close(exchange)
            if averaged is not None:
                self._merge(fragment, averaged, mixing)
        else:
            self._merge(fragment, exchange.result(), mixing)

    def _exchange(self, fragment: int, t: int, final: bool, group: Any, zero: bool = False) -> Exchange:
        """Start averaging fragment ``fragment``'s pseudo-gradients over ``group`` (``zero``: this replica sends
        zero, without its error feedback)."""
        lo, hi = self.bounds[fragment]
        deltas = pseudo_gradients(self.global_params[lo:hi], self.params[lo:hi])
        if zero:
            deltas = [torch.zeros_like(d) for d in deltas]
        compressor = self.compressors[fragment]
        if zero and keeps_own_errors(compressor):  # its own error buffers would send what this replica owes
            compressor = copy.deepcopy(self._prototype)
        residuals: list[Tensor] | None = None
        if compressor is not None and not keeps_own_errors(compressor) and world_size(group) > 1 and not zero:
            residuals = []
            for i in range(lo, hi):
                residual = self.residuals[i]
                if residual is None:
                    residual = self.residuals[i] = torch.zeros_like(self.global_params[i])
                residuals.append(residual)
        kind = "final exchange" if final else "exchange"
        return start_exchange(deltas, compressor=compressor, residuals=residuals, group=group,
                              what=f"DiLoCo {kind} of fragment {fragment} after inner step {t}",
                              tag=f"diloco/{'final' if final else 'step'}{t}/fragment{fragment}",
                              roll_call=self.replicas is None)

    def _merge(self, fragment: int, averaged: list[Tensor], mixing: float | None) -> None:
        lo, hi = self.bounds[fragment]
        outer_step_(self.global_params[lo:hi], self.outer_momenta[lo:hi] if self.outer_momenta else [], averaged,
                    lr=self.outer_lr, momentum=self._momentum, nesterov=self.nesterov)
        take_global_(self.params[lo:hi], self.global_params[lo:hi], mixing)

    # ------------------------------------------------------------------ the ends of a run
    def warn_if_no_sync(self, last_step: int, caller: str = "DiLoCo") -> bool:
        """Whether a run that ends after inner step ``last_step`` (counted as ``inner_steps`` counts, from the
        start of training) reaches no synchronisation from here; rank 0 warns when so. No communication."""
        first = first_sync_after(self.inner_steps, self.sync_every, self.fragments)
        if not self.inner_steps < last_step < first:
            return False
        if self._origin()[1] == 0:
            warnings.warn(no_sync_message(caller, self.sync_every, self.fragments, first, last_step, self.final_sync),
                          UserWarning, stacklevel=2)
        return True

    def finish(self, caller: str = "DiLoCo") -> bool:
        """End the run (call it on every rank after the last step; the adapters do). ``final_sync=True``: merge
        an exchange still in flight, then synchronise every fragment some rank holds apart from the global copy
        (collective: one small all-reduce, then the exchanges), so that every rank holds the same params; a run
        that ends right after a synchronisation sends nothing. ``final_sync=False``: nothing is sent; rank 0
        warns where the ranks end apart. Returns whether it synchronised anything."""
        t = self.inner_steps
        if settled_by_schedule(t, self.sync_every, self.fragments, self.overlap) and self.pending is None:
            return False
        world, rank = self._origin()
        if not self.final_sync:
            synced_now = not self.overlap and syncing_fragment(t, self.sync_every, self.fragments) is not None
            if self.replicas is not None:  # the replicas of the last quorum, replica rank 0 warns
                world, rank = self.replicas.manager.num_participants(), self.replicas.manager.participating_rank()
            if t and world > 1 and rank == 0:
                warnings.warn(apart_message(caller, t, self.fragments - int(synced_now), self.fragments,
                                            self.sync_every), UserWarning, stacklevel=2)
            return False
        with torch.no_grad():
            if self.pending is not None:  # its merge would have followed the next step: it follows now
                fragment, _, exchange = self.pending
                self.pending = None
                self._finish_exchange(fragment, exchange, self.mixing)
            if self.replicas is not None:  # replicas come and go: every fragment not synchronised just now
                just_now = None if self.overlap else syncing_fragment(t, self.sync_every, self.fragments)
                apart = [f for f in range(self.fragments) if f != just_now]
                for fragment in apart:
                    self._finish_exchange(fragment, self._start(fragment, t, final=True), None)
                return bool(apart)
            apart = fragments_apart(self.params, self.global_params, self.bounds, self.process_group)
            for fragment in apart:
                self._finish_exchange(fragment, self._start(fragment, t, final=True), None)
        return bool(apart)

    # ------------------------------------------------------------------ checkpoints (diloco_checkpoint.py)
    def _origin(self) -> tuple[int, int]:
        world = world_size(self.process_group)
        return world, (torch.distributed.get_rank(self.process_group) if world > 1 else 0)
