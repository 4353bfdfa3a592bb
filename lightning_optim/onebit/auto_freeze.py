r"""``freeze_step="auto"``: OnebitAdam / OnebitLamb end their warmup when the variance has settled.

The compression stage divides by the variance frozen at the end of warmup, so it must have stopped
moving (1-bit Adam, Tang et al. 2021, sec. 4: the variance "becomes stable" after a share of the run
that users had to guess). After every warmup step :math:`t` the optimizer measures the norm of the
bias-corrected variance of the whole model,

.. math::
    n_t = \frac{\lVert v_t \rVert_2}{1 - \beta_2^{t}}
    \qquad(\lVert v_t\rVert_2^2 \text{ summed over all ranks in one 8-byte all-reduce}),

and ends the warmup at the first :math:`t > W` with

.. math::
    \frac{\max_{t-W \le s \le t} n_s - \min_{t-W \le s \le t} n_s}{\min_{t-W \le s \le t} n_s} < \tau ,

i.e. when the variance's norm stayed within a band of :math:`\tau` through the last :math:`W` steps
(``auto_freeze_window`` :math:`W` = 20, ``auto_freeze_tolerance`` :math:`\tau` = 0.15; a band, not the
change between the window's ends: early in training the norm rises, peaks and falls, and passes its
old value on the way down), or at step
``auto_freeze_max`` (the cap, default 100000: DeepSpeed's ``freeze_step``) whichever comes first. Where
the run's length is known (the Lightning strategies, the HF Trainer) and ``auto_freeze_max`` is not given,
the cap is 15% of the run (:meth:`AutoFreezeMixin.limit_auto_freeze`; DeepSpeed's guidance for
``freeze_step`` is 15-25%): on short runs the variance often keeps falling to the end (the HF example's
fell ~1% per step through all 240 steps) while an early switch trains as well or better.
Every rank computes the rule on the same all-reduced number, so all ranks switch at the same step
(also under FSDP, where each rank holds a shard of :math:`v`: the sum runs over the whole world).
:math:`\beta_2` is the first param group's. The chosen step is ``optimizer.freeze_step`` from then on,
and kept in checkpoints with the last :math:`W+1` norms, so a resumed run decides exactly as the
uninterrupted one (a loaded ``freeze_at`` must be a step already taken, the norms finite and >= 0).

The decision is announced once, on rank 0 of the group that votes, as an :class:`AutoFreezeDecision`
warning naming the step and the rule or cap that fired. A warning rather than a log record: Python
shows it in a plain script with no logging configured (a ``logging`` record below WARNING is
dropped there, and at WARNING it would read as a fault), pytest and ``warnings.catch_warnings`` see
it, and ``warnings.filterwarnings("ignore", category=AutoFreezeDecision)`` silences exactly it.
"""

from __future__ import annotations

import logging
import math
import numbers
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_optim.comm.dense import world_size
from lightning_optim.comm.stats import comm_stats, ring_allreduce_bytes
from lightning_optim.comm.timeouts import collective
from lightning_optim.onebit.layout import VARIANCE_FIRST, check_step_count

if TYPE_CHECKING:  # the optimizer this is mixed into (see onebit/host.py)
    from lightning_optim.onebit.host import OnebitHost as _Host
else:
    _Host = object

__all__ = ["AutoFreezeDecision", "AutoFreezeMixin", "DEFAULT_WINDOW", "DEFAULT_TOLERANCE", "DEFAULT_MAX",
           "check_schedule", "schedule_defaults"]

DEFAULT_WINDOW, DEFAULT_TOLERANCE, DEFAULT_MAX = 20, 0.15, 100000
RUN_SHARE = 0.15  # the cap where the run's length is known (DeepSpeed's 1-bit Adam guidance: 15-25% of the run)
_log = logging.getLogger("lightning_optim")


class AutoFreezeDecision(UserWarning):
    """``freeze_step="auto"`` chose the end of the warmup (shown once per decision, on one rank)."""


def schedule_defaults() -> dict[str, Any]:
    """The schedule keys of the rule (also for checkpoints written before they existed)."""
    return {"freeze_at": None, "variance_norms": []}


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_schedule(schedule: dict[str, Any]) -> None:
    """The rule's keys of a loaded schedule (``step`` already checked): ``freeze_at`` None or a step taken,
    ``variance_norms`` a list of finite numbers >= 0, at most one per step taken. ``ValueError`` naming the key."""
    step = schedule.get("step", 0)
    chosen = schedule.get("freeze_at")
    if chosen is not None and not (_is_int(chosen) and 1 <= chosen <= step):
        raise ValueError(f"state_dict: onebit schedule freeze_at must be None (not chosen yet) or an int in "
                         f"[1, {step}] (a step already taken), got {chosen!r}")
    norms = schedule.get("variance_norms", [])
    if not isinstance(norms, (list, tuple)):
        raise ValueError(f"state_dict: onebit schedule variance_norms must be a list of numbers, got "
                         f"{type(norms).__name__}")
    if len(norms) > step:
        raise ValueError(f"state_dict: onebit schedule variance_norms holds {len(norms)} norms, more than the {step} "
                         "steps taken (one per warmup step)")
    for i, n in enumerate(norms):
        if isinstance(n, bool) or not isinstance(n, numbers.Real) or not math.isfinite(n) or n < 0:
            raise ValueError(f"state_dict: onebit schedule variance_norms[{i}] must be a finite number >= 0 (a "
                             f"variance's norm), got {n!r}")


class AutoFreezeMixin(_Host):
    """``freeze_step`` as an int or ``"auto"`` (see the module doc) for a 1-bit optimizer whose schedule
    (``self._sched``) gets the keys ``freeze_at`` and ``variance_norms``."""

    _auto: tuple[int, float, int] | None = None  # (window, tolerance, cap) with freeze_step="auto"
    _fixed_freeze_step: int = DEFAULT_MAX
    _cap_given = False
    _cap_source = f"the default cap auto_freeze_max={DEFAULT_MAX}"  # what set the cap, for the announcement
    freeze_vote_group: Any = None  # where the variance norm is summed (None: process_group); onebit_fsdp: the world

    def _init_freeze_step(self, freeze_step: object, window: int | None, tolerance: float | None,
                          cap: int | None) -> None:
        given = {k: v for k, v in (("auto_freeze_window", window), ("auto_freeze_tolerance", tolerance),
                                   ("auto_freeze_max", cap)) if v is not None}
        if freeze_step == "auto":
            window = check_step_count("auto_freeze_window", DEFAULT_WINDOW if window is None else window, 1)
            cap = check_step_count("auto_freeze_max", DEFAULT_MAX if cap is None else cap, 1)
            tolerance = DEFAULT_TOLERANCE if tolerance is None else tolerance
            if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not 0 < tolerance < 1:
                raise ValueError(f"auto_freeze_tolerance must be a number in (0, 1), got {tolerance!r}")
            self._auto = (window, float(tolerance), cap)
            self._cap_given = "auto_freeze_max" in given
            if self._cap_given:
                self._cap_source = f"the cap auto_freeze_max={cap}"
            return
        if isinstance(freeze_step, str):
            raise ValueError(f"freeze_step must be an integer >= 1 or 'auto', got {freeze_step!r}")
        if given:
            raise ValueError(f"{', '.join(given)}: only with freeze_step='auto' (freeze_step={freeze_step!r} is fixed)")
        self._fixed_freeze_step = check_step_count("freeze_step", freeze_step, 1, why=VARIANCE_FIRST)

    def _initial_schedule(self) -> dict[str, Any]:
        return {**super()._initial_schedule(), **schedule_defaults()}

    def _schedule_keys_added_since(self, schedule: dict[str, Any]) -> dict[str, Any]:
        missing = {k: v for k, v in schedule_defaults().items() if k not in schedule}
        return {**super()._schedule_keys_added_since(schedule), **missing}

    def _check_schedule(self, schedule: object) -> None:
        if not isinstance(schedule, dict):
            return super()._check_schedule(schedule)  # refuses it
        rest = {k: v for k, v in schedule.items() if k not in schedule_defaults()}
        super()._check_schedule(rest)  # the counters first: check_schedule reads the step
        check_schedule(schedule)

    def limit_auto_freeze(self, total_steps: int, share: float = RUN_SHARE) -> None:
        """Cap the automatic warmup at ``share`` of a run of ``total_steps`` optimizer steps (the trainers call
        this when they know the run's length: Lightning, the HF Trainer), unless ``auto_freeze_max`` was given
        or the step is already chosen. Nothing with a fixed ``freeze_step``."""
        total_steps = check_step_count("total_steps", total_steps, 1)
        if isinstance(share, bool) or not isinstance(share, numbers.Real):
            raise TypeError(f"share must be a number in (0, 1] (the part of the run), got {share!r}")
        if not 0 < share <= 1:
            raise ValueError(f"share must be a number in (0, 1] (the part of the run), got {share!r}")
        if self._auto is None or self._cap_given or self._sched["freeze_at"] is not None:
            return
        window, tolerance, _ = self._auto
        cap = max(1, round(share * total_steps))
        self._auto = (window, tolerance, cap)
        self._cap_source = f"the cap of {share:.0%} of the run's {total_steps} steps (step {cap})"
        _log.info("%s: freeze_step='auto' ends the warmup by step %d at the latest (%.0f%% of the run's %d steps)",
                  type(self).__name__, cap, share * 100, total_steps)

    @property
    def auto_freeze(self) -> bool:
        """Whether ``freeze_step="auto"`` chooses the end of warmup."""
        return self._auto is not None

    @property
    def auto_freeze_window(self) -> int | None:
        """The rule's window W (None with a fixed ``freeze_step``)."""
        return None if self._auto is None else self._auto[0]

    @property
    def auto_freeze_tolerance(self) -> float | None:
        """The rule's tolerance tau (None with a fixed ``freeze_step``)."""
        return None if self._auto is None else self._auto[1]

    @property
    def auto_freeze_max(self) -> int | None:
        """The cap: the last step the warmup may take (None with a fixed ``freeze_step``)."""
        return None if self._auto is None else self._auto[2]

    @property
    def freeze_step(self) -> int:
        """The last warmup step: the fixed one, or with ``"auto"`` the chosen one (the cap until chosen)."""
        if self._auto is None:
            return self._fixed_freeze_step
        chosen = getattr(self, "_sched", {}).get("freeze_at")
        return self._auto[2] if chosen is None else chosen

    def _decide_freeze(self, t: int) -> None:
        """After warmup step ``t`` (the variance updated): end the warmup here when the rule holds."""
        if self._auto is None or self._sched["freeze_at"] is not None:
            return
        window, tolerance, cap = self._auto
        norms = self._sched["variance_norms"]
        norms.append(self._variance_norm(t))
        del norms[: max(0, len(norms) - (window + 1))]
        low = min(norms)
        band = (max(norms) - low) / low if len(norms) == window + 1 and low > 0 else math.inf
        _log.debug("%s: step %d: variance norm %.6g, band over the window %.4g",
                   type(self).__name__, t, norms[-1], band)
        if band < tolerance or t >= cap:
            self._sched["freeze_at"] = t
            why = (f"the variance's norm stayed within {band:.1%} through the last {window} steps (< {tolerance:.0%})"
                   if band < tolerance else f"{self._cap_source} was reached before the variance settled")
            self._announce(f"{type(self).__name__}: freeze_step='auto' ends the warmup at step {t}: {why}; "
                           f"1-bit compression from step {t + 1}")

    def _announce(self, message: str) -> None:
        """Once per decision, from rank 0 of the voting group only (every rank decides the same)."""
        group = self.freeze_vote_group if self.freeze_vote_group is not None else self.process_group
        if world_size(group) == 1 or dist.get_rank(group) == 0:
            warnings.warn(message, AutoFreezeDecision, stacklevel=2)

    def _variance_norm(self, t: int) -> float:
        """:math:`n_t` of the module doc, the same on every rank."""
        flat = self._flat("exp_avg_sq")  # no float64 copy of the whole state: a dot product, then one float64
        squares = torch.dot(flat, flat).double().reshape(1)
        group = self.freeze_vote_group if self.freeze_vote_group is not None else self.process_group
        ranks = world_size(group)
        if ranks > 1:
            collective("all_reduce (variance norm)", dist.all_reduce, squares, group=group)
            comm_stats().add_control(ring_allreduce_bytes(1, ranks, 8))
        beta2 = self.param_groups[0]["betas"][1]
        bias = 1 - beta2**t if self.param_groups[0].get("bias_correction", True) else 1.0
        return float(squares.sqrt().item()) / bias if bias else float(squares.sqrt().item())

