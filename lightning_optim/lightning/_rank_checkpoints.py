"""Per-rank optimizer state next to Lightning's checkpoint, for optimizers whose state differs per
rank (the 1-bit error buffers; ZeroOneAdam's params and momenta between synchronisations).

Lightning saves the checkpoint on rank 0 only. Here every other rank also writes its own part to
``<checkpoint>.rank<r>.pt`` and merges it back on resume, so training continues bitwise. The
optimizer owns its format: :meth:`_per_rank_format` returns the class that knows it (asked before
the optimizer exists: Lightning restores checkpoints before ``setup``), with ``rank_local_state``,
``merge_rank_local_state`` and ``without_error_buffers``, and :meth:`_per_rank_optimizer` the
optimizer in use (its ``params_synchronized``); see
:class:`lightning_optim.onebit.checkpoint.OnebitStateDictMixin`.
A checkpoint without our entry (plain DDP, e.g. torch AdamW) loads as it is.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_optim.lightning._bases import DDPBase, attached

__all__ = ["CHECKPOINT_KEY", "_PerRankCheckpointMixin", "rank_file"]

CHECKPOINT_KEY = "lightning_optim_onebit"  # in the main checkpoint: how the per-rank files were written


def rank_file(checkpoint_path: Any, rank: int) -> str:
    """Where rank ``rank`` (>= 1) keeps its own optimizer state next to the checkpoint."""
    return f"{checkpoint_path}.rank{rank}.pt"


class _RestoresPerRankModel(DDPBase):
    """After the optimizer states load, this rank's own params (saved when they differ per rank) come back:
    DDP broadcast rank 0's when it wrapped the model. Set ``_per_rank_model_state`` while loading."""

    _per_rank_model_state: dict[str, Any] | None = None

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._per_rank_model_state is not None:
            attached(self.lightning_module, "lightning_module").load_state_dict(self._per_rank_model_state)
            self._per_rank_model_state = None


class _PerRankCheckpointMixin(_RestoresPerRankModel):
    """For ``class X(_PerRankCheckpointMixin, DDPStrategy)``."""


    def _per_rank_optimizer(self) -> Any:
        """The optimizer whose state is partly per rank (None: none)."""
        return None

    def _per_rank_format(self) -> Any:
        """The class that splits and merges that optimizer's state dicts (None: nothing per rank)."""
        return None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        states, opt = checkpoint.get("optimizer_states"), self._per_rank_optimizer()
        if states and opt is not None:
            per_rank = not opt.params_synchronized
            world, rank = self.world_size, self.global_rank
            checkpoint[CHECKPOINT_KEY] = {"format": 1, "world_size": world, "per_rank_params": per_rank}
            if world > 1 and rank != 0:
                payload = {
                    "format": 1,
                    "rank": rank,
                    "world_size": world,
                    "optimizer_states": [self._per_rank_format().rank_local_state(s) for s in states],
                    "state_dict": checkpoint.get("state_dict") if per_rank else None,
                }
                self.checkpoint_io.save_checkpoint(payload, rank_file(filepath, rank), storage_options=storage_options)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.world_size > 1 and self.global_rank != 0:
            self.checkpoint_io.remove_checkpoint(rank_file(filepath, self.global_rank))

    def _drop_error_buffers(self, states: list[dict[str, Any]]) -> bool:
        dropped = False
        for i, state in enumerate(states):
            states[i], had = self._per_rank_format().without_error_buffers(state)
            dropped = dropped or had
        return dropped

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._per_rank_model_state = None
        meta, states, fmt = checkpoint.get(CHECKPOINT_KEY), checkpoint.get("optimizer_states"), self._per_rank_format()
        if not isinstance(meta, dict) or not states or fmt is None:
            return checkpoint  # e.g. plain DDP: the optimizer takes the full-precision state as is
        name, world, rank = type(self).__name__, self.world_size, self.global_rank
        if meta["world_size"] != world:
            dropped = self._drop_error_buffers(states)
            if rank == 0 and (dropped or meta.get("per_rank_params")):
                extra = (" It was saved between two ZeroOneAdam synchronisations: every rank continues from rank 0's "
                         "params and momentum." if meta.get("per_rank_params") else "")
                warnings.warn(
                    f"{name}: the checkpoint was saved on {meta['world_size']} ranks and training resumes on {world}; "
                    "the compression error buffers are re-initialised to zero (moments, step counters and the "
                    f"frozen variance carry over).{extra}",
                    UserWarning,
                    stacklevel=2,
                )
            return checkpoint
        if rank == 0:
            return checkpoint
        path = rank_file(checkpoint_path, rank)
        try:
            payload = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        except FileNotFoundError:
            payload = None
        if not payload or payload.get("rank") != rank or payload.get("world_size") != world:
            self._drop_error_buffers(states)
            warnings.warn(
                f"[rank {rank}] {name}: {path} is missing or belongs to another rank; this rank's compression error "
                "buffers are re-initialised to zero",
                UserWarning,
                stacklevel=2,
            )
            return checkpoint
        merge = fmt.merge_rank_local_state
        for i, local in enumerate(payload["optimizer_states"][: len(states)]):
            states[i] = merge(states[i], local)
        if payload.get("state_dict") is not None:
            checkpoint["state_dict"] = payload["state_dict"]
            self._per_rank_model_state = payload["state_dict"]
        return checkpoint

