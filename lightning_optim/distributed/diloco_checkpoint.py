"""DiLoCo's ``state_dict`` / ``load_state_dict`` (mixed into :class:`~lightning_optim.distributed.diloco.DiLoCo`):
the inner optimizer's state dict plus DiLoCo's own section, whose layout and checks are ``diloco_state.py``'s."""
from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import Tensor

from lightning_optim.optim.hooks import load_with_hooks, state_dict_with_hooks

from .diloco_exchange import Exchange
from .diloco_replicas import check_replicas_part
from .diloco_state import check_section
from .loading import check_local_state_dict

__all__ = ["CheckpointSteps"]


class CheckpointSteps:
    """DiLoCo's checkpoints: what a reload in fresh objects needs to continue bitwise."""

    # DiLoCo's, which these methods use
    inner: torch.optim.Optimizer
    params: list[Tensor]
    bounds: list[tuple[int, int]]
    global_params: list[Tensor]
    outer_momenta: list[Tensor]
    residuals: list[Tensor | None]
    compressors: list[Any]
    inner_steps: int
    pending: tuple[int, int, Any] | None
    replicas: Any
    sync_every: int
    fragments: int
    overlap: bool
    compressor_name: str

    def _origin(self) -> tuple[int, int]:
        """(world size, this rank) of the group: DiLoCo's own (a mixin stand-in, not a stub)."""
        raise NotImplementedError

    def _settings(self) -> dict[str, Any]:
        return {"sync_every": self.sync_every, "fragments": self.fragments, "overlap": self.overlap,
                "compressor": self.compressor_name}

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus ``"diloco"`` (see ``diloco_state.py``); an overlapped exchange
        in flight is waited for (it was issued on every rank: no other rank needs to join). State-dict hooks
        registered on DiLoCo run around the whole, as torch runs them."""
        return state_dict_with_hooks(cast(torch.optim.Optimizer, self), self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        out = self.inner.state_dict()
        pending = None
        if self.pending is not None:
            fragment, merge_at, exchange = self.pending
            deltas = exchange.result() if isinstance(exchange, Exchange) else exchange.rounds.peek(exchange)
            pending = None if deltas is None else {"fragment": fragment, "merge_at": merge_at,
                                                   "deltas": [d.clone() for d in deltas]}
        world, rank = self._origin()
        out["diloco"] = {
            "step": self.inner_steps,
            "global_params": [g.clone() for g in self.global_params],
            "outer_momentum": [b.clone() for b in self.outer_momenta],
            "residuals": [None if e is None else e.clone() for e in self.residuals],
            "compressors": [{} if c is None else copy.deepcopy(c.state_dict()) for c in self.compressors],
            "pending": pending,
            "settings": self._settings(),
            "world_size": world,
            "rank": rank,
        }
        if self.replicas is not None:  # the join at construction may replace the params: the checkpoint keeps them
            out["diloco"]["replicas"] = {**self.replicas.manager.state_dict(),
                                         "params": [p.detach().clone() for p in self.params]}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check everything (naming the key), load the inner optimizer's part, then take DiLoCo's. Load hooks
        registered on DiLoCo run as torch runs them: the pre-hooks before the checks, the post-hooks after."""
        load_with_hooks(cast(torch.optim.Optimizer, self), state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise ValueError(f"state_dict must be a dict from DiLoCo.state_dict(), got {type(state_dict).__name__}")
        section = state_dict.get("diloco")
        replicas_part = None
        if isinstance(section, dict) and "replicas" in section:
            section = {k: v for k, v in section.items() if k != "replicas"}
            replicas_part = check_replicas_part(state_dict["diloco"]["replicas"], self.params)
        loaded = check_section(section, settings=self._settings(), bounds=self.bounds,
                               global_params=self.global_params, outer_momentum=self.outer_momenta,
                               compressors=self.compressors, origin=self._origin())
        inner_part = {k: v for k, v in state_dict.items() if k != "diloco"}
        check_local_state_dict(self.inner, inner_part)
        self.inner.load_state_dict(inner_part)
        self.inner_steps = loaded.step
        self.global_params = loaded.global_params
        self.outer_momenta = loaded.outer_momentum
        self.residuals = loaded.residuals
        self.compressors = loaded.compressors
        self.pending = None
        if loaded.pending is not None:
            fragment, merge_at, deltas = loaded.pending
            self.pending = (fragment, merge_at, Exchange.ready(deltas))
        if replicas_part is not None:
            params, step = replicas_part
            with torch.no_grad():
                for p, saved in zip(self.params, params):
                    p.copy_(saved)
            if self.replicas is not None:
                self.replicas.manager.load_state_dict(step)
