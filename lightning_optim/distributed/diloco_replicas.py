r"""DiLoCo's synchronisations as torchft quorum steps: replicas that die cost one synchronisation, not the job.

With ``DiLoCo(..., manager=manager)`` (a ``torchft.Manager`` made with ``use_async_quorum=False``) every
exchange of a fragment is one round of the manager:

1. **quorum** (``manager.start_quorum()``): the Lighthouse decides who takes part; the manager reconfigures its
   process group over them. Below the manager's ``min_replica_size`` the round is closed without a commit and
   asked again (one message, then a poll every ``poll_s``) until enough replicas are back. A replica whose
   committed step is behind the others' (it is new, it returns, or it missed a commit) is **healed** here from
   a healthy peer: global params, outer momentum, the inner step count, the inner optimizer's state, and
   the round in progress; its params become the global params.
2. **exchange**: each replica's pseudo-gradient goes through DiLoCo's usual exchange (every compressor) over
   the manager's current group; a replica healed in this round holds no progress of its own, and one whose
   healing failed holds stale params: both contribute :math:`\Delta = 0` with weight 0. The weights are
   summed in one small all-reduce so that the average is over the replicas that trained:
   :math:`\bar\Delta = \tfrac{1}{\sum_r w_r}\sum_r w_r \Delta_r` (the exchange's mean times
   :math:`W / \sum_r w_r`).
3. **commit** (``manager.should_commit()``): every replica of the round decides; any failure (a replica that
   died or was cut off mid-exchange, a timeout) is reported to the manager and the exchange is **discarded**
   on every replica that failed: no outer step, its residuals and compressor state rolled back, its params kept
   as they are, so the fragment's next pseudo-gradient covers the steps since its last committed
   synchronisation. A replica whose peers committed while it could not is behind by one step and is healed at
   the next quorum; the survivors never stop stepping.

Error feedback across membership changes: residuals are each replica's own unsent error and stay where they
are; when the set of replicas changes (a new process group), every replica restarts its compressors' own
state (1-bit server errors are tied to the rank layout, PowerSGD's basis must be equal on every replica) from
their initial, seeded state, and a healed replica starts with zero residuals.

Rules: ``manager`` excludes ``process_group``; no construction agreement runs over the replicas (they come and
go): launch them with the same arguments. A checkpoint also holds the manager's committed step and this
replica's params (the join at construction may have replaced them with a peer's): loaded after construction, as
every framework loads optimizer state, it resumes bitwise.
"""
from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim.comm.stats import comm_stats, ring_allreduce_bytes

__all__ = ["ReplicaRounds", "ReplicaSteps", "Round", "check_manager", "check_replicas_part", "STATE_KEY"]

STATE_KEY = "lightning_optim.DiLoCo"  # the name DiLoCo's state goes by in the manager's healing checkpoint
# what a dead, hung or cut-off replica raises here (gloo's errors, CommunicationError and timeouts are
# RuntimeErrors, sockets raise OSError, torchft's group asserts when its quorum could not configure it): a round
# that meets one fails and is discarded. Anything else is a bug or bad input and propagates.
LINK_FAILURES = (RuntimeError, TimeoutError, OSError, AssertionError)


def check_manager(manager: object) -> None:
    """``TypeError``/``ValueError`` unless ``manager`` is a torchft Manager with a synchronous quorum."""
    needed = ("start_quorum", "should_commit", "report_error", "register_state_dict_fn", "num_participants")
    missing = [name for name in needed if not callable(getattr(manager, name, None))]
    if missing:
        raise TypeError(f"manager must be a torchft.Manager (pip install 'lightning-optim[ft]'), got "
                        f"{type(manager).__name__} (no {', '.join(missing)})")
    if getattr(manager, "_use_async_quorum", False):
        raise ValueError("manager: DiLoCo needs a synchronous quorum (the healed state must be in place before the "
                         "exchange): make the torchft.Manager with use_async_quorum=False")
    if getattr(manager, "_pg", None) is None:
        raise ValueError("manager: the torchft.Manager has no process group (pass pg=ProcessGroupGloo() or "
                         "use lightning_optim.fault_tolerance.replica_manager)")


@dataclass
class Round:
    """One exchange of one fragment after inner step ``step`` (``final``: the end-of-run synchronisation)."""

    step: int
    fragment: int | None
    final: bool = False


@dataclass
class ReplicaExchange:
    """An exchange in a round: ``inner`` (DiLoCo's exchange, None when it could not start), the weights' sum
    (a 1-element tensor, None when unknown), the replicas' count and the state to restore if it is discarded."""

    rounds: ReplicaRounds
    inner: Any
    weights: Tensor | None
    world: int
    restore: Callable[[], None]
    agreed: bool = False  # loaded from a checkpoint: committed before the save


class ReplicaRounds:
    """The manager's side of one DiLoCo (see the module docstring). ``owner`` gives and takes the healing
    state: ``healing_state()``, ``take_healing_state(state)``, ``reset_compressors()``."""

    def __init__(self, manager: Any, owner: Any, poll_s: float = 0.5) -> None:
        check_manager(manager)
        self.manager = manager
        self.owner = owner
        self.poll_s = poll_s
        self.group: Any = None  # the process group of the last quorum (a new one: the replicas changed)
        self.round: Round | None = None
        self.healed = False
        self.contributes = True  # whether this replica's pseudo-gradient counts in the open round
        self.weights: Tensor | None = None  # the open round's sum of weights
        self.rounds_discarded = 0
        self.waits = 0
        manager.register_state_dict_fn(STATE_KEY, self._load, self._save)

    @property
    def min_replicas(self) -> int:
        return int(getattr(self.manager, "_min_replica_size", 1))

    # ------------------------------------------------------------------ healing (the manager calls these)
    def _save(self) -> dict[str, Any]:
        # called by the manager's quorum thread while this replica waits in start_quorum: copies, since the
        # peer fetches them later while this replica goes on
        state = copy.deepcopy(self.owner.healing_state())
        state["round"] = None if self.round is None else vars(self.round).copy()
        return state

    def _load(self, state: dict[str, Any]) -> None:
        round_ = state.pop("round", None)
        self.owner.take_healing_state(state)
        self.round = None if round_ is None else Round(**round_)
        self.healed = True

    # ------------------------------------------------------------------ one round
    def open(self, round_: Round) -> Any:
        """The quorum of ``round_`` and the sum of the replicas' weights (also the point where every healing
        replica has its state: a peer that sends one must not close the round before); returns the process
        group to exchange over."""
        self.round, self.healed = round_, False
        manager = self.manager
        while True:
            manager.start_quorum()
            # a replica healed in this quorum has no progress of its own; one whose healing failed holds stale
            # params: both send zero with weight 0 (the failed one cannot commit, its peers can)
            self.contributes = not self.healed and manager.errored() is None
            self.weights = self._sum_weights()
            if manager.num_participants() >= self.min_replicas:
                break
            manager.should_commit()  # not enough replicas: every replica of this quorum closes it uncommitted
            if self.waits == 0 or self.waits % 20 == 0:
                warnings.warn(f"DiLoCo: {manager.num_participants()} replica(s) in the quorum, fewer than the "
                              f"manager's min_replica_size={self.min_replicas}: waiting for replicas to return "
                              f"(asking every {self.poll_s:.1f}s)", RuntimeWarning, stacklevel=3)
            self.waits += 1
            time.sleep(self.poll_s)
        group = self._quorum_group()
        if group is not None and group is not self.group:
            if self.group is not None or self.healed:
                self.owner.reset_compressors()
            self.group = group
        return group

    def _quorum_group(self) -> Any:
        """The process group the manager configured for this quorum (None when that failed: reported)."""
        pg = self.manager._pg
        try:
            return pg.parent if hasattr(pg, "parent") else pg  # torchft's wrapper holds the group of the quorum
        except LINK_FAILURES as exc:  # a quorum whose group could not be made: the round fails
            self.manager.report_error(exc)
            return None

    def _sum_weights(self) -> Tensor | None:
        """All-reduce this replica's weight (0 when it was healed in this quorum: it holds no progress of its
        own); None when that failed (reported to the manager)."""
        group = self._quorum_group()
        if group is None:
            return None
        weights = torch.tensor([1.0 if self.contributes else 0.0], dtype=torch.float64)
        try:
            dist.all_reduce(weights, group=group)
        except LINK_FAILURES as exc:  # every failure of the link is the manager's to decide
            self.manager.report_error(exc)
            return None
        comm_stats().add_control(ring_allreduce_bytes(1, group.size(), 8))
        return weights

    def start(self, begin: Callable[[Any], Any], restore: Callable[[], None]) -> ReplicaExchange:
        """Start DiLoCo's exchange ``begin(group)`` in the open round; a failure is reported to the manager
        (the round then cannot commit on this replica)."""
        group, weights = self.group, self.weights
        if weights is None or group is None:
            return ReplicaExchange(self, None, None, 1, restore)
        world = group.size()
        try:
            inner = begin(group)
        except LINK_FAILURES as exc:
            self.manager.report_error(exc)
            return ReplicaExchange(self, None, None, world, restore)
        return ReplicaExchange(self, inner, weights, world, restore)

    def close(self, exchange: ReplicaExchange) -> list[Tensor] | None:
        """Wait for the exchange, decide the round with the other replicas; the average to merge, or None
        (discarded: the state is restored)."""
        averaged = None
        if exchange.inner is not None:
            try:
                averaged = exchange.inner.result()
            except LINK_FAILURES as exc:
                self.manager.report_error(exc)
        committed = True if exchange.agreed else self.manager.should_commit()
        if committed and averaged is not None and exchange.weights is not None and float(exchange.weights) > 0:
            scale = exchange.world / float(exchange.weights)
            if scale != 1.0:
                averaged = [a * scale for a in averaged]
            return averaged
        self.rounds_discarded += 1
        exchange.restore()
        return None

    def peek(self, exchange: ReplicaExchange) -> list[Tensor] | None:
        """The average an open round's exchange will merge if it commits (for a checkpoint taken while it is in
        flight; None when it failed). Taken into a checkpoint, it merges on reload without a new decision."""
        if exchange.inner is None or exchange.weights is None or float(exchange.weights) <= 0:
            return None
        try:
            averaged = exchange.inner.result()
        except LINK_FAILURES as exc:
            self.manager.report_error(exc)
            return None
        scale = exchange.world / float(exchange.weights)
        return averaged if scale == 1.0 else [a * scale for a in averaged]


class ReplicaSteps:
    """DiLoCo's side of the rounds (mixed into :class:`~lightning_optim.distributed.diloco.DiLoCo`): joining the
    replicas, an exchange inside an open round, and the healing state."""

    # DiLoCo's, which these methods use
    bounds: list[tuple[int, int]]
    params: list[Tensor]
    global_params: list[Tensor]
    outer_momenta: list[Tensor]
    residuals: list[Tensor | None]
    compressors: list[Any]
    _prototype: Any
    inner: torch.optim.Optimizer
    inner_steps: int
    overlap: bool
    pending: tuple[int, int, Any] | None

    def _exchange(self, fragment: int, t: int, final: bool, group: Any, zero: bool = False) -> Any:
        raise NotImplementedError

    def _finish_exchange(self, fragment: int, exchange: Any, mixing: float | None) -> None:
        raise NotImplementedError

    def _start_in_round(self, replicas: ReplicaRounds, fragment: int, t: int, final: bool) -> ReplicaExchange:
        lo, hi = self.bounds[fragment]
        residuals = [None if e is None else e.clone() for e in self.residuals[lo:hi]]
        compressor = copy.deepcopy(self.compressors[fragment])

        def restore() -> None:  # the exchange is discarded: its error feedback never happened
            self.residuals[lo:hi] = residuals
            self.compressors[fragment] = compressor

        zero = not replicas.contributes
        return replicas.start(lambda group: self._exchange(fragment, t, final, group, zero=zero), restore)

    def _join(self, replicas: ReplicaRounds) -> None:
        """Join the replicas (construction with a manager): a quorum; a replica healed in it takes part in the
        round its peers are in, with weight 0."""
        replicas.open(Round(self.inner_steps, None))
        round_ = replicas.round
        if not replicas.healed or round_ is None or round_.fragment is None:
            replicas.manager.should_commit()
            return
        with torch.no_grad():
            exchange = self._start_in_round(replicas, round_.fragment, round_.step, round_.final)
            if self.overlap and not round_.final:
                self.pending = (round_.fragment, round_.step + 1, exchange)
            else:
                self._finish_exchange(round_.fragment, exchange, None)

    def healing_state(self) -> dict[str, Any]:
        """What a healing replica takes from this one: the global params, outer momentum, inner step count and
        the inner optimizer's state (not copied: the rounds copy it)."""
        return {"step": self.inner_steps, "global_params": list(self.global_params),
                "outer_momentum": list(self.outer_momenta), "inner": self.inner.state_dict()}

    def take_healing_state(self, state: dict[str, Any]) -> None:
        """Take a healthy peer's ``healing_state``: its global params become this replica's params too;
        residuals start at zero, the compressors from their initial state."""
        for key, ours in (("global_params", self.global_params), ("outer_momentum", self.outer_momenta)):
            theirs = state[key]
            if len(theirs) != len(ours) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(theirs, ours)):
                raise ValueError(f"DiLoCo: the healing peer's {key} do not match this replica's (was every replica "
                                 "launched with the same model and DiLoCo arguments?)")
        with torch.no_grad():
            for g, peer in zip(self.global_params, state["global_params"]):
                g.copy_(peer)
            for b, peer in zip(self.outer_momenta, state["outer_momentum"]):
                b.copy_(peer)
            for p, g in zip(self.params, self.global_params):
                p.copy_(g)
        self.inner.load_state_dict(state["inner"])
        self.inner_steps = int(state["step"])
        self.residuals = [None] * len(self.params)
        self.pending = None
        self.reset_compressors()

    def reset_compressors(self) -> None:
        """The compressors' own state back to its initial, seeded one (the replicas changed)."""
        self.compressors = [None if self._prototype is None else copy.deepcopy(self._prototype) for _ in self.bounds]



def check_replicas_part(part: object, params: list[Tensor]) -> tuple[list[Tensor], dict[str, int]]:
    """A checkpoint's ``["diloco"]["replicas"]`` (the manager's step and this replica's params), checked
    before anything is loaded: ``(params, manager_state)``."""
    if not isinstance(part, dict) or "params" not in part or "step" not in part:
        raise ValueError("state_dict: diloco 'replicas' must hold the manager's 'step' and this replica's "
                         "'params' (a checkpoint of DiLoCo with a manager)")
    saved = part["params"]
    if not isinstance(saved, (list, tuple)) or len(saved) != len(params) or any(
            not isinstance(t, Tensor) or t.shape != p.shape or t.dtype != p.dtype for t, p in zip(saved, params)):
        raise ValueError(f"state_dict: diloco 'replicas' 'params' must be {len(params)} tensors shaped and typed "
                         "like the optimizer's params")
    return list(saved), {k: int(v) for k, v in part.items() if k != "params"}
