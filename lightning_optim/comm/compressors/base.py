"""The compressor interface shared by the optimizers (a list of per-param tensors, or one flat buffer)
and the DDP comm hooks (one bucket tensor).

Every compressor offers one call that does everything:

    out = compressor.reduce(tensors, residuals, group=None, average=True)

``tensors`` are this rank's inputs (gradients; any shapes, one device), ``residuals`` (optional) their
error-feedback residuals (same shapes, updated in place, see ``feedback.py``). Every rank of ``group``
must call it with the same layout; each gets the aggregate over ranks, mean (``average=True``) or sum,
as new tensors shaped and typed like ``tensors``. Bytes this rank puts on the wire are added to
``stats`` (default ``comm_stats()``) by the rule of ``comm/stats.py``, with the fp32 ring-allreduce
cost of the same elements as ``fp32_equivalent_bytes``; ``bytes_sent(numels, world_size, dtype)``
predicts the figure.

Compressors whose compression is local (sparsification, sign) are :class:`LocalCompressor`\\ s and also
expose the three steps ``reduce`` is made of: ``compress(flat) -> payload`` and
``decompress(payload) -> flat`` (this rank's own message, what error feedback subtracts), and
``exchange(payloads, group, average) -> list of flat aggregates`` (the collective). PowerSGD has no
local payload (its compression needs two all-reduces) and implements ``reduce`` directly.

Compressors with random state (random-k, blockwise, PowerSGD's query) save it in ``state_dict``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_optim.optim.validation import check_flag

from ..agreement import agree, fingerprint, layout_signature
from ..groups import group_rank
from ..stats import CommStats, comm_stats
from ..timeouts import check_process_group
from .feedback import absorb_, compensate

__all__ = ["Compressor", "LocalCompressor", "agree_layout", "check_reduce_args", "group_rank", "stats_or_default"]


def check_reduce_args(tensors: Sequence[Tensor], residuals: Sequence[Tensor] | None, group: Any,
                      average: object) -> tuple[list[Tensor], list[Tensor] | None]:
    """The checks every ``reduce`` starts with (nothing is touched before they pass)."""
    check_process_group("group", group)
    check_flag("average", average)
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence) or not tensors:
        raise TypeError(f"tensors must be a non-empty list of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor) or not t.is_floating_point() or t.is_sparse:
            raise TypeError(f"tensors[{i}] must be a dense floating-point tensor, got {t!r:.80}")
        if t.device != tensors[0].device:
            raise ValueError(f"tensors[{i}] is on {t.device}, tensors[0] on {tensors[0].device}: one device per call")
    if residuals is None:
        return tensors, None
    if isinstance(residuals, Tensor) or not isinstance(residuals, Sequence) or len(residuals) != len(tensors):
        raise TypeError(f"residuals must be None or a list of {len(tensors)} tensors (one per tensor)")
    residuals = list(residuals)
    for i, (t, e) in enumerate(zip(tensors, residuals)):
        if not isinstance(e, Tensor) or not e.is_floating_point():
            raise TypeError(f"residuals[{i}] must be a floating-point tensor, got {type(e).__name__}")
        if e.shape != t.shape or e.device != t.device or not e.is_contiguous():
            raise ValueError(f"residuals[{i}] must be contiguous, shaped {tuple(t.shape)} on {t.device}, "
                             f"got {tuple(e.shape)} on {e.device}")
    return tensors, residuals


class Compressor(ABC):
    """A compressed, error-compensated averaging (or summing) collective. See the module docstring."""

    @abstractmethod
    def reduce(self, tensors: Sequence[Tensor], residuals: Sequence[Tensor] | None = None, *, group=None,
               average: bool = True, stats: CommStats | None = None) -> list[Tensor]:
        """Aggregate ``tensors`` over the ranks of ``group`` (error feedback into ``residuals``)."""

    @abstractmethod
    def bytes_sent(self, numels: Sequence[int], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes one ``reduce`` of tensors with ``numels`` elements adds to ``bytes_sent`` on each rank."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's compressor state (random generators, warm starts); empty when there is none."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping (from state_dict()), got {type(state).__name__}")


class LocalCompressor(Compressor):
    """A compressor with a local message: ``reduce`` = error feedback + ``compress`` + ``exchange``."""

    def check_numel(self, numel: int, index: int) -> None:
        """Refuse a tensor this compressor cannot take (``tensors[index]``, ``numel`` elements); runs for
        every tensor before anything is compressed or any residual changes."""

    def agreement_fields(self, tensors: Sequence[Tensor]) -> dict[str, int]:
        """What every rank's call must match (same names on every rank of the same configuration)."""
        return {"tensors": len(tensors), "elements": sum(t.numel() for t in tensors),
                "layout": fingerprint(layout_signature(tensors))}

    @abstractmethod
    def compress(self, flat: Tensor) -> Any:
        """This rank's message for the 1-D tensor ``flat``."""

    @abstractmethod
    def decompress(self, payload: Any) -> Tensor:
        """The dense 1-D tensor the message stands for (what error feedback subtracts)."""

    @abstractmethod
    def exchange(self, payloads: Sequence[Any], *, group=None, average: bool = True,
                 stats: CommStats | None = None) -> list[Tensor]:
        """Every rank's messages combined, one dense 1-D aggregate per payload (mean or sum)."""

    def compress_all(self, tensors: Sequence[Tensor], residuals: Sequence[Tensor] | None) -> list[Any]:
        """This rank's message per tensor; with ``residuals``, error feedback: compress ``c = accumulate(t, e)``
        (``t + e``) and keep in ``e`` what the message lost (``e <- c - decompress(message)``)."""
        payloads = []
        for i, t in enumerate(tensors):
            flat = t.detach().reshape(-1)
            if residuals is None:
                payloads.append(self.compress(flat))
                continue
            e = residuals[i].view(-1)
            corrected = self.accumulate(flat, e)
            payload = self.compress(corrected)
            absorb_(e, corrected, self.decompress(payload))
            payloads.append(payload)
        return payloads

    def accumulate(self, flat: Tensor, residual: Tensor) -> Tensor:
        """What error feedback compresses: ``t + e`` (a compressor with another rule, e.g. a decayed accumulator,
        overrides it)."""
        return compensate(flat, residual)

    def reduce(self, tensors: Sequence[Tensor], residuals: Sequence[Tensor] | None = None, *, group=None,
               average: bool = True, stats: CommStats | None = None) -> list[Tensor]:
        tensors, residuals = check_reduce_args(tensors, residuals, group, average)
        error = None
        try:
            for i, t in enumerate(tensors):
                self.check_numel(t.numel(), i)
        except ValueError as exc:
            error = exc
        # before any residual moves: every rank agrees on the call (or raises)
        agree_layout(self, self.agreement_fields(tensors), group, tensors, error)
        out = self.exchange(self.compress_all(tensors, residuals), group=group, average=average, stats=stats)
        return [o.view(t.shape).to(t.dtype) for o, t in zip(out, tensors)]


def stats_or_default(stats: CommStats | None) -> CommStats:
    return comm_stats() if stats is None else stats


def agree_layout(owner: object, fields: dict[str, int], group, like: Sequence[Tensor],
                 error: BaseException | None = None) -> None:
    """The bounded agreement (``comm.agreement.agree``) of ``owner``'s call: always when this rank refused the
    call (``error``: sent as zeros in place of ``fields``, then raised on every rank), else once per
    layout this rank has not seen.

    So a rank whose layout, ``k``, seed or arguments differ from its peers' at the first call with that
    layout raises on every rank instead of exchanging mismatched buffers. A rank that changes alone
    later meets its peers' next collective instead, and fails within ``collective_timeout()``.
    """
    seen = owner.__dict__.setdefault("_agreed_layouts", set())
    key = (id(group), tuple(fields.items()))
    if error is None and key in seen:
        return
    agree(type(owner).__name__, tuple(fields), fields, group=group, like=like, error=error,
          arguments=("k", "tensors", "residuals", "keys"))
    seen.add(key)
