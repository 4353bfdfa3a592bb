"""Byte counting of the communicating strategies and the callback that logs it.

After every optimizer step the strategy records the bytes this rank put on the wire
(``comm_stats()`` delta: DDP's switchable allreduce and the optimizer's own collectives) and what
DDP's fp32 ring allreduce of the trained params would have sent; the callback logs them.
"""

from __future__ import annotations

from typing import Any

from lightning_optim.comm import comm_stats
from lightning_optim.comm.stats import CommStats, ring_allreduce_bytes
from lightning_optim.lightning._bases import ParallelBase

__all__ = ["_ByteCountingMixin", "_CommTelemetryMixin"]

_TOTALS = ("steps", "steps_without_ddp_allreduce", "bytes_sent", "fp32_bytes", "inter_node_bytes")


class _ByteCountingMixin(ParallelBase):
    """For ``class X(_ByteCountingMixin, DDPStrategy)``; call :meth:`_start_counting` when a fit starts."""

    _trained_numel: int = 0
    fp32_baseline: str = "DDP's fp32 allreduce"  # what fp32_bytes prices, in words (reports say it)

    def _init_counting(self) -> None:
        self._comm_before = CommStats()
        self.comm_totals = dict.fromkeys(_TOTALS, 0)
        self.comm_last_step: dict[str, Any] = {}

    def _start_counting(self) -> None:
        self._comm_before = comm_stats().copy()
        self.comm_totals = dict.fromkeys(_TOTALS, 0)
        self.comm_last_step = {}

    def _step_skips_ddp_allreduce(self) -> bool:
        """Whether the coming optimizer step's backward ran without DDP's allreduce."""
        return False

    def _fp32_step_bytes(self) -> int:
        """What DDP's fp32 ring allreduce of the trained params sends per step (the baseline)."""
        return ring_allreduce_bytes(self._trained_numel, self.world_size)

    def comm_summary(self) -> dict[str, Any]:
        """Totals of this fit, per rank: bytes sent (DDP's switchable allreduce plus the optimizer's own
        collectives) and what DDP's fp32 ring allreduce would have sent."""
        t = self.comm_totals
        return {
            **t,
            "compression_ratio": t["fp32_bytes"] / t["bytes_sent"] if t["bytes_sent"] else None,
            "world_size": self.world_size,
            "baseline": self.fp32_baseline,
        }

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        local = self._step_skips_ddp_allreduce()
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        now = comm_stats()
        delta = now - self._comm_before
        sent = delta.bytes_sent
        self._comm_before = now.copy()
        fp32 = self._fp32_step_bytes()
        # inter_node_bytes: what left the node (all of bytes_sent unless the exchange is hierarchical)
        self.comm_last_step = {"bytes_sent": sent, "fp32_bytes": fp32, "ddp_allreduce": not local,
                               "inter_node_bytes": delta.inter_node_bytes}
        totals = self.comm_totals
        totals["steps"] += 1
        totals["steps_without_ddp_allreduce"] += int(local)
        totals["bytes_sent"] += sent
        totals["fp32_bytes"] += fp32
        totals["inter_node_bytes"] += delta.inter_node_bytes
        return output


class _CommTelemetryMixin:
    """Logs, after every optimizer step: ``comm/bytes_sent`` (this rank, this step),
    ``comm/fp32_bytes`` (what DDP's fp32 ring allreduce of the trained params sends per step),
    ``comm/compression_ratio`` (their ratio, on steps that sent anything) and
    ``comm/compression_ratio_total`` (since the start of the fit)."""

    def __init__(self) -> None:
        super().__init__()
        self._seen_steps = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._seen_steps = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        totals = getattr(strategy, "comm_totals", None)
        if not totals or totals["steps"] == self._seen_steps:
            return
        self._seen_steps = totals["steps"]
        last = strategy.comm_last_step
        metrics = {"comm/bytes_sent": float(last["bytes_sent"]), "comm/fp32_bytes": float(last["fp32_bytes"])}
        if last["inter_node_bytes"] != last["bytes_sent"]:  # hierarchical: the slow link's share
            metrics["comm/inter_node_bytes"] = float(last["inter_node_bytes"])
        if last["bytes_sent"]:
            metrics["comm/compression_ratio"] = last["fp32_bytes"] / last["bytes_sent"]
        if totals["bytes_sent"]:
            metrics["comm/compression_ratio_total"] = totals["fp32_bytes"] / totals["bytes_sent"]
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, logger=True, batch_size=1)
