"""Lightning callbacks of the 1-bit strategies (``lightning.pytorch``).

:class:`CommTelemetry` is added automatically by the strategies (``telemetry=True``); add it
yourself only to control its position among the callbacks. It logs per optimizer step, through
the LightningModule's logger (every ``log_every_n_steps``):

* ``comm/bytes_sent``: bytes this rank put on the wire in the step (DDP's switchable fp32
  allreduce in full-precision steps, the 1-bit collectives otherwise; ``comm_stats()``);
* ``comm/fp32_bytes``: what DDP's fp32 ring allreduce of the trained params sends per step;
* ``comm/compression_ratio``: ``fp32_bytes / bytes_sent`` of the step (steps that sent nothing,
  such as ZeroOneAdam's local steps, log no ratio);
* ``comm/compression_ratio_total``: the same over the fit so far.
"""

from __future__ import annotations

from lightning.pytorch import Callback

from lightning_optim.lightning._telemetry import _CommTelemetryMixin

__all__ = ["CommTelemetry"]


class CommTelemetry(_CommTelemetryMixin, Callback):
    """Log the 1-bit strategies' communication volume per step (see the module doc)."""
