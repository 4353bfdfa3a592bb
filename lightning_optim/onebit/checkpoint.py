"""The 1-bit optimizers' state dicts: torch's plus an ``"onebit"`` entry (stage counters and this
rank's error buffers), loading from another rank or world size, from a full-precision Adam/LAMB
(``resume.py``), and the split of a state dict into what every rank shares and what is a rank's own
(for trainers that save the optimizer on rank 0 only: Lightning, Accelerate, the HF Trainer).
"""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Any

from lightning_optim.onebit.resume import plain_to_onebit
from lightning_optim.optim.validation import check_int

if TYPE_CHECKING:  # the optimizer this is mixed into (see onebit/host.py)
    from lightning_optim.onebit.host import OnebitHost as _Host
else:
    _Host = object

__all__ = ["OnebitStateDictMixin"]


class OnebitStateDictMixin(_Host):
    """State-dict methods of :class:`~lightning_optim.onebit.base.OnebitOptimizer` (mixed in first)."""

    def _drop_foreign_errors(self) -> None:
        """Error buffers restored from another rank or world size carry another rank's residue."""
        origin = self.compressor.origin  # set whenever there are error buffers to drop
        if origin is not None and not self.compressor.belongs_here(self.process_group):
            world, rank = origin
            if (world, rank) == self._world():
                now = self.compressor._per_node_now(self.process_group)
                self._warn_errors_reset(f"they were made for nodes of {self.compressor.made_per_node} rank(s) and "
                                        f"this run exchanges in nodes of {now}")
            else:
                self._warn_errors_reset(f"they were saved by rank {rank} of {world} and this is rank "
                                        f"{self._world()[1]} of {self._world()[0]}")

    # Compression units (units.py) keep their own error buffers; optimizers without units have none.
    def _units_state(self) -> dict[str, Any] | None:
        return None

    def _check_units_state(self, saved: dict[str, Any] | None) -> None:
        """Refuse a saved ``units`` entry this optimizer cannot take (called before anything is loaded)."""
        if saved is not None:
            raise ValueError(f"state_dict: holds per-bucket compression units, which {type(self).__name__} has not")

    def _load_units_state(self, saved: dict[str, Any] | None) -> None:
        self._check_units_state(saved)

    def _check_schedule(self, schedule: object) -> None:
        """The stage counters must be whole numbers >= 0 where this optimizer counts (a string or a float
        there would fail or mis-stage every later step); unknown keys are named by the caller."""
        if not isinstance(schedule, dict):
            raise ValueError(f"state_dict: onebit schedule must be a dict, got {type(schedule).__name__}")
        for key, value in schedule.items():
            current = self._sched.get(key)
            if isinstance(current, int) and not isinstance(current, bool):
                try:
                    check_int(key, value, 0)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"state_dict: onebit schedule {exc}") from None
            elif isinstance(current, list) and not isinstance(value, (list, tuple)):
                raise ValueError(f"state_dict: onebit schedule {key} must be a list, got {type(value).__name__}")

    def _warn_errors_reset(self, why: str) -> None:
        warnings.warn(
            f"{type(self).__name__}: the compression error buffers are re-initialised to zero because {why}; "
            "moments, step counters and the frozen variance carry over",
            UserWarning,
            stacklevel=4,
        )
        self.compressor.forget()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus ``"onebit"``: the stage counters and THIS rank's error buffers.

        The moments are equal on every rank except in ZeroOneAdam's local steps, but the error
        buffers are per rank: save one state dict per rank to restore behaviour bitwise. A dict
        from another rank or world size still loads (the error buffers restart from zero, with
        one warning). torch's state-dict hooks see the whole dict, ``"onebit"`` included.
        """
        return super().state_dict()  # BaseOptimizer's: its hooks around _state_dict

    def _state_dict(self) -> dict[str, Any]:
        sd = super()._state_dict()
        errors = self.compressor.state_dict()
        origin = self.compressor.origin
        if errors["worker_error"] is None or origin is None:  # no error buffers: stamped with this rank
            origin = self._world()
        sd["onebit"] = {
            "optimizer": type(self).__name__,
            "schedule": copy.deepcopy(self._sched),
            "world_size": origin[0],
            "rank": origin[1],
            "worker_error": errors["worker_error"],
            "server_error": errors["server_error"],
            "per_node": errors.get("per_node"),  # hierarchical: the node size the error buffers were made for
            "units": self._units_state(),  # per DDP bucket (units.py), None for the whole-model call
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from :meth:`state_dict`; the current ``exp_avg_mask`` of each group is kept
        (as DeepSpeed does: masks change with the training phase, e.g. the sequence length). torch's
        load pre-hooks see the dict as given, its post-hooks the optimizer with everything loaded."""
        super().load_state_dict(state_dict)  # BaseOptimizer's: its hooks around _load_state_dict

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise ValueError(f"state_dict: expected a dict with 'state' and 'param_groups', got "
                             f"{type(state_dict).__name__}")
        onebit = state_dict.get("onebit")
        if onebit is None:  # a full-precision Adam/AdamW/LAMB: start 1-bit from a running job
            state_dict = plain_to_onebit(self, state_dict)
            onebit = state_dict["onebit"]
        if not isinstance(onebit, dict):
            raise ValueError(f"state_dict: its 'onebit' entry is a {type(onebit).__name__}, not a dict")
        if onebit.get("optimizer") != type(self).__name__:
            raise ValueError(f"state_dict: saved by {onebit.get('optimizer')}, cannot load into {type(self).__name__}")
        # everything is checked before anything changes (torch's part first, then ours, would half-apply)
        self._check_schedule(onebit.get("schedule"))
        schedule = {**self._schedule_keys_added_since(onebit["schedule"]), **onebit["schedule"]}
        if set(schedule) != set(self._sched):
            raise ValueError(f"state_dict: schedule keys {sorted(schedule)} differ from {sorted(self._sched)}")
        errors = {key: onebit.get(key) for key in ("worker_error", "server_error", "world_size", "rank", "per_node")}
        try:
            self.compressor.check_state(errors)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state_dict: onebit {exc}") from None
        self._check_units_state(onebit.get("units"))
        masks = [group.get("exp_avg_mask") for group in self.param_groups]
        groups = [{k: v for k, v in g.items() if k != "exp_avg_mask"} for g in state_dict["param_groups"]]
        super()._load_state_dict({**state_dict, "param_groups": groups})
        for group, mask in zip(self.param_groups, masks):
            if mask is not None:
                group["exp_avg_mask"] = mask
        self._layout, self._flats = None, {}
        self._sched = copy.deepcopy(schedule)
        self.compressor.load_state_dict(errors)
        self._load_units_state(onebit.get("units"))

    # ------------------------------------------------------------------ per-rank parts
    @classmethod
    def rank_local_state(cls, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The part of ``state_dict`` (from :meth:`state_dict`) that is this rank's own: the
        ``"onebit"`` entry (error buffers), or the whole dict when the params and momenta differ
        per rank (ZeroOneAdam between synchronisations: ``steps_since_sync > 0``)."""
        onebit = state_dict.get("onebit") or {}
        if onebit.get("schedule", {}).get("steps_since_sync", 0) > 0:
            return state_dict
        return {"onebit": onebit}

    @classmethod
    def merge_rank_local_state(cls, shared: dict[str, Any], local: dict[str, Any]) -> dict[str, Any]:
        """``shared`` (rank 0's dict) with a rank's :meth:`rank_local_state` put back."""
        if "state" in local:
            return local
        return {**shared, "onebit": local["onebit"]}

    @classmethod
    def without_error_buffers(cls, state_dict: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """``state_dict`` with the error buffers dropped (they belong to one rank of one world
        size), and whether it had any."""
        onebit = state_dict.get("onebit")
        if not isinstance(onebit, dict):
            return state_dict, False
        had = onebit.get("worker_error") is not None or onebit.get("units") is not None
        return {**state_dict, "onebit": {**onebit, "worker_error": None, "server_error": None, "units": None}}, had
