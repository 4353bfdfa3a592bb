"""Error-compensated 1-bit allreduce (the communication of 1-bit Adam / 0/1 Adam / 1-bit LAMB).

Algorithm, for a tensor of ``n`` elements on ``W`` ranks (``N = ceil(n / 8W) * 8W``, ``C = N / W``):

1. worker: ``z = x + worker_error`` (fp32, zero-padded to ``N``); ``scale = ||z[:n]|| / sqrt(n)``;
   the compressed value is ``scale * sign(z)`` (``sign(0) = +1``); ``worker_error = z - scale*sign(z)``
   on the first ``n`` positions, 0 on the padding;
2. the signs are packed 8 per byte and cut into ``W`` chunks of ``C`` elements; ``all_to_all`` sends
   chunk ``r`` to rank ``r``; an ``all_gather`` shares the worker scales (with ``n``, to catch ranks
   that disagree on the size before anything else is exchanged);
3. server (rank ``r`` owns chunk ``r``): ``avg = sum_w scale_w * sign_w / W`` (padding positions are
   0, never ``+scale``), ``z_s = avg + server_error``, ``scale_s = ||z_s[real]|| / sqrt(#real)``,
   ``server_error = z_s - scale_s * sign(z_s)`` (0 on padding);
4. an ``all_gather`` of the packed server signs (+ ``scale_s``) gives every rank the whole result,
   ``out[chunk r] = scale_s(r) * sign_s(r)``, written into ``tensor``.

Every rank ends with bit-identical values. The result overwrites ``tensor`` (cast to its dtype) and
``tensor`` is returned, as DeepSpeed's backends do. With ``W == 1`` the tensor is returned unchanged
(no compression, error buffers untouched).

Per-rank bytes on the wire: ``(W-1) * (16 + C/8 + C/8 + 4)`` against ``2 (W-1)/W * 4n`` for a ring
fp32 allreduce, i.e. ~32x fewer at ``W = 2``.

Scratch space (~10 bytes per element of ``N``) is allocated once per ``(N, W, device)`` and reused;
the error buffers belong to the caller (``make_error_buffers``), one pair per tensor, per rank.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim import ops

from .dense import world_size as _world_size
from .packing import pack_bits_, sign_table, unpack_into
from .stats import CommStats, comm_stats
from .timeouts import collective

__all__ = ["compressed_allreduce", "error_buffer_sizes", "make_error_buffers", "compressed_bytes"]

_MAX_CACHED = 8
# torch >= 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCALE_BYTES = 4  # the server scale travels as fp32 after the packed server signs


def error_buffer_sizes(numel: int, world_size: int) -> tuple[int, int]:
    """``(N, N // W)``: elements of ``worker_error`` and ``server_error`` for ``numel`` on ``W`` ranks."""
    numel, world_size = int(numel), int(world_size)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    unit = 8 * world_size
    padded = -(-numel // unit) * unit
    return padded, padded // world_size


def make_error_buffers(tensor: Tensor, group=None) -> tuple[Tensor, Tensor]:
    """Zeroed fp32 ``(worker_error, server_error)`` for ``tensor`` on ``group`` (on its device)."""
    padded, chunk = error_buffer_sizes(tensor.numel(), _world_size(group))
    return (
        torch.zeros(padded, dtype=torch.float32, device=tensor.device),
        torch.zeros(chunk, dtype=torch.float32, device=tensor.device),
    )


def compressed_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank sends in one ``compressed_allreduce`` (the rule of ``stats``)."""
    if world_size <= 1:
        return 0
    chunk_bytes = error_buffer_sizes(numel, world_size)[1] // 8
    meta = 2 * 8  # (scale, numel) as fp64
    return (world_size - 1) * (meta + chunk_bytes + chunk_bytes + _SCALE_BYTES)


class _Scratch:
    """Buffers reused by every call with the same ``(N, W, device)``."""

    def __init__(self, padded: int, world: int, device: torch.device):
        chunk = padded // world
        self.z = torch.empty(padded, dtype=torch.float32, device=device)
        self.bits = torch.empty(padded, dtype=torch.bool, device=device)
        self.packed = torch.empty(padded // 8, dtype=torch.uint8, device=device)
        self.recv = torch.empty(padded // 8, dtype=torch.uint8, device=device)
        self.index = torch.empty(padded // 8, dtype=torch.int64, device=device)
        self.send = torch.empty(chunk // 8 + _SCALE_BYTES, dtype=torch.uint8, device=device)
        self.gathered = torch.empty(world * self.send.numel(), dtype=torch.uint8, device=device)
        self.meta = torch.empty(2, dtype=torch.float64, device=device)
        self.metas = torch.empty(2 * world, dtype=torch.float64, device=device)
        self.server_scale = torch.empty(1, dtype=torch.float32, device=device)
        self.server_scales = torch.empty(world, dtype=torch.float32, device=device)


_CACHE: "OrderedDict[tuple, _Scratch]" = OrderedDict()


def _scratch(padded: int, world: int, device: torch.device) -> _Scratch:
    key = (padded, world, device)
    found = _CACHE.get(key)
    if found is None:
        found = _CACHE[key] = _Scratch(padded, world, device)
        while len(_CACHE) > _MAX_CACHED:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return found


def _check(tensor, worker_error, server_error, world: int) -> tuple[int, int]:
    if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
        raise TypeError(f"compressed_allreduce: tensor must be a floating-point Tensor, got "
                        f"{getattr(tensor, 'dtype', type(tensor))}")
    padded, chunk = error_buffer_sizes(tensor.numel(), world)
    for name, buf, size in (("worker_error", worker_error, padded), ("server_error", server_error, chunk)):
        if not isinstance(buf, Tensor):
            raise ValueError(f"compressed_allreduce: {name} must be a Tensor, got {type(buf).__name__}")
        if buf.dtype != torch.float32 or buf.numel() != size or not buf.is_contiguous() \
                or buf.device != tensor.device:
            raise ValueError(
                f"compressed_allreduce: {name} must be a contiguous float32 tensor of {size} elements "
                f"on {tensor.device} (error_buffer_sizes({tensor.numel()}, {world}); see "
                f"make_error_buffers), got {buf.dtype} with {buf.numel()} elements on {buf.device}"
            )
    return padded, chunk


def _norm_scale(values: Tensor) -> Tensor:
    """``||values|| / sqrt(len)`` as a 0-d fp32 tensor (0 for an empty slice)."""
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=values.device)
    return torch.linalg.vector_norm(values) / math.sqrt(values.numel())


def _compress_into(values: Tensor, real: int, scale: Tensor, bits: Tensor, packed: Tensor,
                   error: Tensor, index: Tensor) -> None:
    """Pack sign(values) into ``packed`` and set ``error = values - scale*sign`` (0 past ``real``)."""
    kernel = ops.kernel("onebit_compress", values.device)
    if kernel is not None:  # compiled: signs, packing and residual in one pass (bit-identical)
        kernel(values, error, packed, float(scale), add_err=False)
    else:
        torch.ge(values, 0, out=bits)
        pack_bits_(bits, packed)
        unpack_into(packed, error, sign_table(torch.float32, values.device) * scale, index)
        torch.sub(values, error, out=error)
    error[real:].zero_()


def compressed_allreduce(tensor: Tensor, worker_error: Tensor, server_error: Tensor, group=None,
                         stats: CommStats | None = None) -> Tensor:
    """Average ``tensor`` over ``group`` with error-compensated 1-bit compression, in place.

    ``worker_error`` (``N`` fp32) and ``server_error`` (``N / W`` fp32) come from
    ``make_error_buffers`` and are updated in place; keep one pair per tensor. Every rank must pass
    the same ``numel`` (checked: a mismatch raises ``ValueError`` on every rank before any data is
    exchanged). Returns ``tensor`` holding the (identical on every rank) decompressed average.
    Bytes are added to ``stats`` (default ``comm_stats()``).
    """
    world = _world_size(group)
    padded, chunk = _check(tensor, worker_error, server_error, world)
    if world == 1:
        return tensor
    n = tensor.numel()
    rank = dist.get_rank(group)
    device = tensor.device
    s = _scratch(padded, world, device)
    cb = chunk // 8
    fast = tensor.dtype == torch.float32 and tensor.is_contiguous()
    flat = tensor.reshape(-1)

    # 1. worker compression (worker_error is only touched once the sizes are known to agree)
    z = s.z
    if fast:
        torch.add(flat, worker_error[:n], out=z[:n])
    else:
        z[:n].copy_(flat)
        z[:n].add_(worker_error[:n])
    z[n:].zero_()
    scale = _norm_scale(z[:n])
    s.meta[0] = scale
    s.meta[1] = n
    collective("all_gather(scales)", _all_gather_single, s.metas, s.meta, group=group)
    metas = s.metas.view(world, 2)
    numels = [int(v) for v in metas[:, 1].tolist()]
    if any(v != n for v in numels):
        raise ValueError(
            f"compressed_allreduce: ranks passed tensors of different sizes (numel by rank: {numels}); "
            "every rank must reduce the same tensor shape in the same order"
        )
    if n == 0:
        return tensor
    worker_scales = metas[:, 0].to(torch.float32)
    _compress_into(z, n, scale, s.bits, s.packed, worker_error, s.index)

    # 2. exchange chunks: rank r receives chunk r of every worker
    collective("all_to_all_single(signs)", dist.all_to_all_single, s.recv, s.packed, group=group)

    # 3. server: average my chunk, add server error, compress again
    base = sign_table(torch.float32, device)
    avg, tmp = z[:chunk], z[chunk:2 * chunk]
    recv = s.recv.view(world, cb)
    for w in range(world):
        unpack_into(recv[w], avg if w == 0 else tmp, base * worker_scales[w], s.index)
        if w:
            avg.add_(tmp)
    avg.div_(world)
    real = max(0, min(chunk, n - rank * chunk))
    avg[real:].zero_()
    avg.add_(server_error)
    server_scale = _norm_scale(avg[:real])
    _compress_into(avg, real, server_scale, s.bits[:chunk], s.send[:cb], server_error, s.index)
    s.server_scale[0] = server_scale
    s.send[cb:].copy_(s.server_scale.view(torch.uint8))

    # 4. everyone gets every server chunk
    collective("all_gather(server signs)", _all_gather_single, s.gathered, s.send, group=group)
    rows = s.gathered.view(world, cb + _SCALE_BYTES)
    s.server_scales.view(torch.uint8).view(world, _SCALE_BYTES).copy_(rows[:, cb:])
    target = flat if fast else z
    for w in range(world):
        start = w * chunk
        stop = min(start + chunk, n)
        if stop <= start:
            break
        table = base * s.server_scales[w]
        if fast and stop - start < chunk:  # last, partial chunk: decode the bytes it needs
            nbytes = -(-(stop - start) // 8)
            part = z[:8 * nbytes]
            unpack_into(rows[w, :nbytes], part, table, s.index)
            target[start:stop].copy_(part[:stop - start])
        else:
            unpack_into(rows[w, :cb], target[start:start + chunk], table, s.index)
    if not fast:
        tensor.copy_(z[:n].view(tensor.shape))
    elif flat.data_ptr() != tensor.data_ptr():  # pragma: no cover - reshape of contiguous is a view
        tensor.copy_(flat.view(tensor.shape))
    (stats if stats is not None else comm_stats()).add_compressed(compressed_bytes(n, world), n, world)
    return tensor
