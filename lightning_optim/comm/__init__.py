"""Compressed collectives on torch.distributed (any backend; gloo on CPU, NCCL on GPU).

* ``compressed_allreduce(tensor, worker_error, server_error, group=None, segments=None)``:
  error-compensated 1-bit averaging allreduce, in place, identical result on every rank, one
  scale per segment (e.g. per param of a flat buffer); ``make_error_buffers`` /
  ``error_buffer_sizes`` give its per-tensor error buffers (``plan.py``: the layout,
  ``pieces.py``: the element-wise passes, compiled or in torch).
* ``allreduce_mean(tensor, group=None)``: full-precision average (bf16/fp16 upcast to fp32).
* ``pack_signs`` / ``unpack_signs``: 8 signs per byte (``sign(0) = +1``).
* ``comm_stats()`` / ``reset_comm_stats()`` / ``CommStats``: bytes put on the wire by this rank.
* ``SwitchableAllreduceState`` + ``switchable_allreduce_hook``: DDP comm hook with an on/off switch.
* ``CommunicationError``: a collective failed (a peer died/hung) or exceeded ``collective_timeout()``
  (``set_collective_timeout(seconds)``; default 300 s, also when the process group has none).
* ``gather_rows`` / ``check_process_group``: the bounded agreement check and the group argument check.
"""
from .compressed import compressed_allreduce, compressed_bytes, error_buffer_sizes, make_error_buffers
from .dense import allreduce_mean
from .hooks import SwitchableAllreduceState, register_switchable_allreduce, switchable_allreduce_hook
from .packing import pack_signs, unpack_signs
from .stats import CommStats, comm_stats, reset_comm_stats
from .timeouts import (
    CommunicationError,
    check_process_group,
    collective_timeout,
    gather_rows,
    set_collective_timeout,
)

__all__ = [
    "compressed_allreduce",
    "compressed_bytes",
    "make_error_buffers",
    "error_buffer_sizes",
    "allreduce_mean",
    "pack_signs",
    "unpack_signs",
    "CommStats",
    "comm_stats",
    "reset_comm_stats",
    "CommunicationError",
    "check_process_group",
    "collective_timeout",
    "gather_rows",
    "set_collective_timeout",
    "SwitchableAllreduceState",
    "switchable_allreduce_hook",
    "register_switchable_allreduce",
]
