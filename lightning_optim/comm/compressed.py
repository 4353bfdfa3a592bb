"""Error-compensated 1-bit allreduce (the communication of 1-bit Adam / 0/1 Adam / 1-bit LAMB).

Algorithm, for a tensor of ``n`` elements on ``W`` ranks, split into segments (``segments=None``:
one segment; the 1-bit optimizers use one per param). ``comm/plan.py`` lays the segments out in a
padded space of ``N`` elements (each segment starts on a multiple of 8, ``N`` a multiple of ``8W``,
``C = N / W``); the error buffers live in that space.

1. worker: ``z = x + worker_error``; per segment ``s``, ``scale_s = ||z_s|| / sqrt(len_s)``; the
   compressed value is ``scale_s * sign(z)`` (``sign(0) = +1``); ``worker_error = z - scale*sign(z)``
   (0 on the padding);
2. an ``all_gather`` checks that every rank passes the same ``n``, segments and dtype; the signs, packed 8
   per byte, are cut into ``W`` chunks of ``C`` positions and ``all_to_all`` sends chunk ``r``,
   followed by the worker's segment scales, to rank ``r``;
3. server (rank ``r`` owns chunk ``r``): ``z_s = mean_w(scale_w * sign_w) + server_error`` on the
   real positions; per piece (a segment's part of the chunk) ``t = ||z_s|| / sqrt(len)``;
   ``server_error = z_s - t * sign(z_s)`` (padding: never part of a scale, error 0);
4. an ``all_gather`` of the packed server signs (+ the piece scales) gives every rank the whole
   result, ``out = t * sign_s``, written into ``tensor``.

Every rank ends with bit-identical values. The result overwrites ``tensor`` (cast to its dtype) and
``tensor`` is returned, as DeepSpeed's backends do. With ``W == 1`` the tensor is returned unchanged
(no compression, error buffers untouched).

Per-rank bytes on the wire: ``(W-1) * (32 + 4 S + C/8 + C/8 + 4 P)`` (``S`` segments, ``P`` the most
pieces any chunk holds) against ``2 (W-1)/W * 4n`` for a ring fp32 allreduce, ~32x fewer at ``W = 2``.

The element-wise passes run as compiled kernels (``lightning_optim.ops``; ``comm/pieces.py`` holds
the torch fallback). Scratch space is allocated once per ``(N, W, device)`` and reused; the error
buffers belong to the caller (``make_error_buffers``), one pair per tensor, per rank.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import pieces as passes
from .dense import world_size as _world_size
from .groups import backend_name, group_rank
from .plan import CompressionPlan, plan_for
from .stats import CommStats, comm_stats
from .timeouts import check_process_group, collective, gather_rows

__all__ = ["compressed_allreduce", "error_buffer_sizes", "make_error_buffers", "compressed_bytes"]

_MAX_CACHED = 8
# torch >= 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_HEADER = 4  # (n, #segments, crc of the segment lengths, dtype code) as int64


def error_buffer_sizes(numel: int, world_size: int, segments: Sequence[int] | None = None) -> tuple[int, int]:
    """``(N, N // W)``: elements of ``worker_error`` and ``server_error`` for ``numel`` on ``W`` ranks."""
    return _sizes(plan_for(int(numel), int(world_size), segments))


def _sizes(plan: CompressionPlan) -> tuple[int, int]:
    return plan.padded, plan.chunk


def make_error_buffers(tensor: Tensor, group=None, segments: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
    """Zeroed fp32 ``(worker_error, server_error)`` for ``tensor`` on ``group`` (on its device)."""
    padded, chunk = error_buffer_sizes(tensor.numel(), _world_size(group), segments)
    return (
        torch.zeros(padded, dtype=torch.float32, device=tensor.device),
        torch.zeros(chunk, dtype=torch.float32, device=tensor.device),
    )


def compressed_bytes(numel: int, world_size: int, segments: Sequence[int] | None = None) -> int:
    """Bytes one rank sends in one ``compressed_allreduce`` (the rule of ``stats``)."""
    if world_size <= 1:
        return 0
    plan = plan_for(int(numel), int(world_size), segments)
    chunk_bytes = plan.chunk // 8
    scales = 4 * len(plan.lengths)
    return (world_size - 1) * (8 * _HEADER + scales + chunk_bytes + chunk_bytes + 4 * plan.max_pieces)


class _Scratch:
    """Buffers reused by every call with the same ``(N, W, #segments, server-scale slots, device)``
    (fresh buffers on every call would cost page faults on the step's hot path)."""

    def __init__(self, plan: CompressionPlan, device: torch.device):
        world, nseg, slots = plan.world, len(plan.lengths), plan.max_pieces
        self.cb = cb = plan.chunk // 8
        self.packed = torch.zeros(plan.padded // 8, dtype=torch.uint8, device=device)
        # all_to_all rows: a chunk's signs, then the sending worker's segment scales
        self.send = torch.empty(world, cb + 4 * nseg, dtype=torch.uint8, device=device)
        self.recv = torch.empty_like(self.send)
        # all_gather row: the server's signs, then its piece scales (bytes outside pieces stay 0)
        self.server_send = torch.zeros(cb + 4 * slots, dtype=torch.uint8, device=device)
        self.server_scales = torch.zeros(slots, dtype=torch.float32, device=device)
        self.gathered = torch.empty(world, cb + 4 * slots, dtype=torch.uint8, device=device)


_CACHE = threading.local()  # per thread: two exchanges running at once (ranks or replicas on threads of one
# process) must not write the same buffers


def _scratch(plan: CompressionPlan, device: torch.device) -> _Scratch:
    cache: OrderedDict[tuple, _Scratch] | None = getattr(_CACHE, "buffers", None)
    if cache is None:
        cache = _CACHE.buffers = OrderedDict()
    key = (plan.padded, plan.world, len(plan.lengths), plan.max_pieces, device)
    found = cache.get(key)
    if found is None:
        found = cache[key] = _Scratch(plan, device)
        while len(cache) > _MAX_CACHED:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return found


def _check(tensor, worker_error, server_error, plan: CompressionPlan) -> None:
    for name, buf, size in (("worker_error", worker_error, plan.padded), ("server_error", server_error, plan.chunk)):
        if not isinstance(buf, Tensor):
            raise ValueError(f"compressed_allreduce: {name} must be a Tensor, got {type(buf).__name__}")
        if buf.dtype != torch.float32 or buf.numel() != size or not buf.is_contiguous() \
                or buf.device != tensor.device:
            raise ValueError(
                f"compressed_allreduce: {name} must be a contiguous float32 tensor of {size} elements "
                f"on {tensor.device} (error_buffer_sizes({tensor.numel()}, {plan.world}, segments); see "
                f"make_error_buffers), got {buf.dtype} with {buf.numel()} elements on {buf.device}"
            )


_DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}


def _agree(plan: CompressionPlan, dtype: torch.dtype, device: torch.device, group) -> None:
    """Every rank must reduce the same tensor (size, segments, dtype): checked in one bounded
    all_gather before any data moves, and refused with the same figures on every rank."""
    code = _DTYPE_CODES.get(dtype, 9)
    on = device if backend_name(group) == "nccl" else torch.device("cpu")
    # its bytes are part of compressed_bytes(), counted with the call
    rows = gather_rows("all_gather(sizes)", (*plan.signature, code), group=group, device=on, stats=CommStats())
    if len(set(rows)) > 1:
        numels, nsegs = [r[0] for r in rows], [r[1] for r in rows]
        names = {v: str(k).replace("torch.", "") for k, v in _DTYPE_CODES.items()}
        dtypes = [names.get(r[3], "other") for r in rows]
        if len(set(numels)) > 1:
            what = "tensors of different sizes"
        elif len({r[1:3] for r in rows}) > 1:
            what = "different segments"
        else:
            what = "tensors of different dtypes"
        raise ValueError(
            f"compressed_allreduce: ranks passed {what} (numel by rank: {numels}, segments by rank: {nsegs}, "
            f"dtype by rank: {dtypes}); every rank must reduce the same tensor shapes, dtypes and segments "
            "in the same order"
        )


def _check_momentum(tensor: Tensor, momentum, plan: CompressionPlan) -> None:
    grads, w1 = momentum
    if tensor.dtype != torch.float32 or not tensor.is_contiguous():
        raise ValueError("compressed_allreduce: momentum needs a contiguous float32 tensor (it is updated in place)")
    if len(grads) != len(plan.lengths):
        raise ValueError(f"compressed_allreduce: momentum needs one gradient per non-empty segment "
                         f"({len(plan.lengths)}), got {len(grads)}")
    for i, (g, length) in enumerate(zip(grads, plan.lengths)):
        if not isinstance(g, Tensor) or g.numel() != length or g.device != tensor.device:
            raise ValueError(f"compressed_allreduce: momentum gradient {i} must be a tensor of {length} elements on "
                             f"{tensor.device}, got {g.numel() if isinstance(g, Tensor) else type(g).__name__}")
    if isinstance(w1, bool) or not isinstance(w1, (int, float)) or not 0.0 <= w1 <= 1.0:
        raise ValueError(f"compressed_allreduce: momentum weight (1 - beta1) must be a float in [0, 1], got {w1!r}")


def compressed_allreduce(tensor: Tensor, worker_error: Tensor, server_error: Tensor, group=None,
                         stats: CommStats | None = None, *, segments: Sequence[int] | None = None,
                         momentum: tuple[Sequence[Tensor], float] | None = None) -> Tensor:
    """Average ``tensor`` over ``group`` with error-compensated 1-bit compression, in place.

    ``worker_error`` (``N`` fp32) and ``server_error`` (``N / W`` fp32) come from
    ``make_error_buffers`` (with the same ``segments``) and are updated in place; keep one pair
    per tensor. ``segments``: lengths adding up to ``tensor.numel()`` (e.g. the sizes of the
    params flattened into ``tensor``), each compressed with its own scale; None: one scale for
    the whole tensor. Every rank must pass the same ``numel`` and segments (checked: a mismatch
    raises ``ValueError`` on every rank before any data is exchanged). Returns ``tensor`` holding
    the (identical on every rank) decompressed average. Bytes are added to ``stats`` (default
    ``comm_stats()``).

    ``momentum=(grads, w1)``: first move each segment ``s`` of ``tensor`` (fp32, contiguous) towards
    ``grads[s]`` (one per non-empty segment), ``tensor_s <- lerp(tensor_s, grads[s], w1)``: 1-bit Adam's
    local momentum update, done in the worker's first pass (one read of the gradients, no separate
    pass over the momenta); on one rank only this update happens.
    """
    if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
        raise TypeError(f"compressed_allreduce: tensor must be a floating-point Tensor, got "
                        f"{getattr(tensor, 'dtype', type(tensor))}")
    check_process_group("group", group)
    world = _world_size(group)
    plan = plan_for(tensor.numel(), world, segments)
    _check(tensor, worker_error, server_error, plan)
    if momentum is not None:
        _check_momentum(tensor, momentum, plan)
    if world == 1:
        if momentum is not None:
            passes.lerp_segments_(tensor.view(-1), momentum[0], momentum[1], plan.lengths)
        return tensor
    rank = group_rank(group)
    device = tensor.device
    s = _scratch(plan, device)
    _agree(plan, tensor.dtype, device, group)
    n = tensor.numel()
    if n == 0:
        return tensor
    fast = tensor.dtype == torch.float32 and tensor.is_contiguous()
    x = tensor.view(-1) if fast else tensor.reshape(-1).to(torch.float32)
    nseg, cb = len(plan.lengths), s.cb

    # 1. worker: one scale per segment; signs packed, the residual kept
    worker = plan.worker.on(device)
    if momentum is not None:
        sums = passes.momentum_sumsq(x, momentum[0], worker_error, worker, momentum[1], plan.lengths)
    else:
        sums = passes.sumsq(x, worker_error, worker)
    scales = worker.scales(sums)
    passes.compress(x, worker_error, s.packed, scales, worker, add_err=True)

    # 2. exchange chunks: rank r receives chunk r of every worker, each followed by that worker's
    # scales (one collective instead of an all_gather of the scales before it)
    s.send[:, :cb].copy_(s.packed.view(world, cb))
    s.send[:, cb:].copy_(scales.view(torch.uint8).expand(world, 4 * nseg))
    collective("all_to_all_single(signs)", dist.all_to_all_single, s.recv, s.send, group=group)
    all_scales = s.recv[:, cb:].contiguous().view(torch.float32)  # [W, S]

    # 3. server: average my chunk, add the server error, compress again, one scale per piece
    mine = plan.server[rank].on(device)
    ids = plan.ids_on(rank, device)
    worker_scales = all_scales.index_select(1, ids).contiguous()
    send = s.server_send
    if mine.count:
        sums = passes.server_mean(s.recv, worker_scales, server_error, mine)  # row w: worker w's signs
        s.server_scales[: mine.count] = mine.scales(sums)
        passes.compress(server_error, server_error, send[:cb], s.server_scales[: mine.count], mine, add_err=False)
    send[cb:].copy_(s.server_scales.view(torch.uint8))

    # 4. everyone gets every server chunk
    collective("all_gather(server signs)", _all_gather_single, s.gathered.view(-1), send, group=group)
    rows = s.gathered
    chunk_scales = rows[:, cb:].contiguous().view(torch.float32)  # [W, slots]
    for w in range(world):
        final = plan.final[w].on(device)
        if final.count:
            passes.unpack(rows[w, :cb], chunk_scales[w, : final.count].contiguous(), x, final)
    if not fast:
        tensor.copy_(x.view(tensor.shape))
    (stats if stats is not None else comm_stats()).add_compressed(compressed_bytes(n, world, segments), n, world)
    return tensor
