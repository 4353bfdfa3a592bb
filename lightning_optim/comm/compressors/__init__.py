"""Compressors with error feedback, for optimizers (lists of per-param tensors or a flat buffer) and DDP
comm hooks (one bucket tensor), on any torch.distributed backend.

    from lightning_optim.comm.compressors import TopK, ErrorFeedback
    topk, feedback = TopK(ratio=0.01), ErrorFeedback()
    averaged = topk.reduce(grads, feedback.residuals(range(len(grads)), grads), group=None)

* :class:`Compressor` / :class:`LocalCompressor` (``base.py``): ``reduce(tensors, residuals, group,
  average, stats)``; local ones also ``compress`` / ``decompress`` / ``exchange``; ``bytes_sent``.
* :class:`ErrorFeedback`, :func:`compensate`, :func:`absorb_` (``feedback.py``): ``c = g + e``,
  ``e <- c - C(c)``.
* :class:`TopK`, :class:`RandomK`, :class:`Blockwise` (``sparse.py``); :func:`gather_sparse`.
* :class:`ScaledSign` (``sign.py``): EF-SignSGD's scaled sign; ``majority_vote=True``: signSGD's vote.
* :class:`PowerSGDCompressor`, :func:`orthogonalize_` (``powersgd.py``).
* :class:`Int8Quantizer`, :class:`Int4Quantizer`, :class:`Quantizer` (``quantize.py``): per-chunk scaled
  integer codes, nearest or stochastic rounding; ``start_reduce`` leaves the all-gather in flight.
* :class:`SparseLoCo` (``sparseloco.py``): SparseLoCo's chunk-wise top-k of a decayed error-feedback
  accumulator, quantised to 2 bits (DiLoCo's ``compressor="sparseloco"``).
* :class:`OnebitCompressor` (``onebit.py``): DeepSpeed's error-compensated 1-bit averaging (the 1-bit
  optimizers' compressor; it keeps its worker/server error buffers itself).
* :func:`agree`, :func:`fingerprint`, :func:`control_device`: re-exported from ``comm/agreement.py``
  (every rank raises, or none does).

Bytes: every collective adds what this rank sends to ``comm_stats()`` (rule in ``comm/stats.py``);
equations, bytes per step and when to use which: docs/guides/low_communication.md.
"""
from ..agreement import agree, control_device, fingerprint
from .base import Compressor, LocalCompressor
from .feedback import ErrorFeedback, absorb_, compensate
from .onebit import OnebitCompressor
from .powersgd import PowerSGDCompressor, orthogonalize_
from .quantize import Int4Quantizer, Int8Quantizer, Quantizer
from .sign import ScaledSign, SignPayload
from .sparse import Blockwise, RandomK, SparsePayload, Sparsifier, TopK, gather_sparse
from .sparseloco import SparseLoCo, SparseLoCoPayload

__all__ = [
    "Compressor",
    "LocalCompressor",
    "ErrorFeedback",
    "compensate",
    "absorb_",
    "TopK",
    "RandomK",
    "Blockwise",
    "Sparsifier",
    "SparsePayload",
    "gather_sparse",
    "SparseLoCo",
    "SparseLoCoPayload",
    "ScaledSign",
    "SignPayload",
    "PowerSGDCompressor",
    "OnebitCompressor",
    "Quantizer",
    "Int8Quantizer",
    "Int4Quantizer",
    "orthogonalize_",
    "agree",
    "control_device",
    "fingerprint",
]
