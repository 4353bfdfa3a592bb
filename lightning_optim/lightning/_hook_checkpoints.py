"""Per-rank DDP comm-hook state next to Lightning's checkpoint (error-feedback residuals, PowerSGD's error
and Q memory; for the decentralized strategy also each rank's params and optimizer state).

The mechanism of ``_rank_checkpoints.py``: Lightning writes the checkpoint on rank 0 only, so rank 0's
hook state goes into it under :data:`HOOK_CHECKPOINT_KEY` and every other rank writes its own to
``<checkpoint>.rank<r>.pt`` (:func:`rank_file`) and reads it back on resume. The state is restored
into the hook when the strategy registers it (Lightning loads checkpoints before ``setup``).
A checkpoint saved by another hook or world size, or a missing rank file, restarts the hook state
with one warning; a checkpoint without our entry (plain DDP) loads as it is.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from lightning_optim.catalogue import STRATEGY_ALIASES
from lightning_optim.lightning._rank_checkpoints import _RestoresPerRankModel, rank_file

__all__ = ["HOOK_CHECKPOINT_KEY", "_HookCheckpointMixin"]

HOOK_CHECKPOINT_KEY = "lightning_optim_comm_hook"


def _current(hook: object) -> object:
    """A hook name as saved, under its current name (a checkpoint of ``"signsgd"`` is ``"sign_sgd"``'s)."""
    return STRATEGY_ALIASES.get(hook, hook) if isinstance(hook, str) else hook


class _HookCheckpointMixin(_RestoresPerRankModel):
    """For ``class X(_HookCheckpointMixin, DDPStrategy)`` with ``hook_name`` and ``_hook_state``."""

    hook_name: ClassVar[str]
    _per_rank_params: ClassVar[bool] = False  # the ranks' params differ (decentralized): keep each rank's
    _hook_state: Any = None
    _pending_hook_state: dict[str, Any] | None = None

    def _restore_hook_state(self) -> None:
        if self._hook_state is not None and self._pending_hook_state is not None:
            self._hook_state.load_state_dict(self._pending_hook_state)
            self._pending_hook_state = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self._hook_state is not None:
            world, rank, state = self.world_size, self.global_rank, self._hook_state.state_dict()
            checkpoint[HOOK_CHECKPOINT_KEY] = {"format": 1, "hook": self.hook_name, "world_size": world,
                                               "per_rank_params": self._per_rank_params, "state": state}
            if world > 1 and rank != 0:
                own = self._per_rank_params
                payload = {"format": 1, "rank": rank, "world_size": world, "hook": self.hook_name, "state": state,
                           "state_dict": checkpoint.get("state_dict") if own else None,
                           "optimizer_states": checkpoint.get("optimizer_states") if own else None}
                self.checkpoint_io.save_checkpoint(payload, rank_file(filepath, rank), storage_options=storage_options)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.world_size > 1 and self.global_rank != 0:
            self.checkpoint_io.remove_checkpoint(rank_file(filepath, self.global_rank))

    def _restart_warning(self, why: str) -> None:
        extra = (" Every rank continues from rank 0's params and optimizer state." if self._per_rank_params else "")
        warnings.warn(f"{type(self).__name__}: {why}; the {self.hook_name!r} hook state (error feedback, warm "
                      f"starts, step counters) restarts.{extra}", UserWarning, stacklevel=3)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._pending_hook_state = self._per_rank_model_state = None
        meta, world, rank = checkpoint.get(HOOK_CHECKPOINT_KEY), self.world_size, self.global_rank
        if not isinstance(meta, dict):
            return checkpoint
        if _current(meta.get("hook")) != self.hook_name or meta.get("world_size") != world:
            if rank == 0:
                self._restart_warning(f"the checkpoint was saved with hook {meta.get('hook')!r} on "
                                      f"{meta.get('world_size')} ranks, training resumes with {self.hook_name!r} on "
                                      f"{world}")
            return checkpoint
        if rank == 0:
            self._pending_hook_state = meta["state"]
        else:
            path = rank_file(checkpoint_path, rank)
            try:
                payload = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
            except FileNotFoundError:
                payload = None
            if not payload or (payload.get("rank"), payload.get("world_size"), _current(payload.get("hook"))) != (
                    rank, world, self.hook_name):
                self._restart_warning(f"[rank {rank}] {path} is missing or belongs to another rank")
                return checkpoint
            self._pending_hook_state = payload["state"]
            if meta.get("per_rank_params") and payload.get("state_dict") is not None:
                checkpoint["state_dict"] = self._per_rank_model_state = payload["state_dict"]
                checkpoint["optimizer_states"] = payload["optimizer_states"]
        self._restore_hook_state()  # when the hook is already registered
        return checkpoint

