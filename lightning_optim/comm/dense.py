"""Full-precision averaging allreduce, counted in ``comm_stats()``."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .groups import backend_name, group_rank, is_group_object, world_size
from .stats import CommStats, comm_stats, ring_allreduce_bytes
from .timeouts import check_process_group, collective

__all__ = ["allreduce_mean", "agreed_norm", "backend_name", "group_rank", "is_group_object", "world_size"]

_UPCAST = (torch.bfloat16, torch.float16)


def allreduce_mean(tensor: Tensor, group=None, stats: CommStats | None = None) -> Tensor:
    """Average ``tensor`` over the ranks of ``group`` in place (and return it).

    The reduction runs in the tensor's dtype for fp32/fp64 and in fp32 for bf16/fp16 (gloo has no
    bf16 allreduce; fp32 also avoids low-precision summation), then is cast back. World size 1 is a
    no-op. Bytes are added to ``stats`` (default: ``comm_stats()``) by the ring rule, see ``stats``.
    """
    check_process_group("group", group)
    if not tensor.is_floating_point():
        raise TypeError(f"allreduce_mean: tensor must be floating point, got {tensor.dtype}")
    w = world_size(group)
    if w == 1:
        return tensor
    direct = tensor.dtype not in _UPCAST and tensor.is_contiguous()
    buf = tensor if direct else tensor.to(torch.float32 if tensor.dtype in _UPCAST else tensor.dtype,
                                           memory_format=torch.contiguous_format, copy=True)
    collective("all_reduce", dist.all_reduce, buf, group=group)
    buf.div_(w)
    if not direct:
        tensor.copy_(buf)
    (stats if stats is not None else comm_stats()).add_full_precision(buf.numel(), w, buf.element_size())
    return tensor


def agreed_norm(local: Tensor, norm_type: float = 2.0, group=None) -> Tensor:
    r"""The ranks' local gradient norms combined into one value every rank holds:
    :math:`N = (\frac{1}{W}\sum_r N_r^p)^{1/p}` (``inf``: :math:`\max_r N_r`).

    For the local gradients :math:`g_r` of a step whose average is taken afterwards (the 1-bit
    compression stage), :math:`N \ge \lVert \frac{1}{W}\sum_r g_r \rVert` (convexity): scaling
    every :math:`g_r` by the same :math:`\min(1, c/N)` clips the average at least as much as DDP's
    clip of the averaged gradient would. One fp32 scalar all-reduce, counted as a control message.
    """
    w = world_size(group)
    value = local.detach().to(torch.float32).reshape(1).clone()
    if w == 1:
        return value[0]
    p = float(norm_type)
    if p == float("inf"):
        collective("all_reduce (norm)", dist.all_reduce, value, group=group, op=dist.ReduceOp.MAX)
    else:
        value.pow_(p)
        collective("all_reduce (norm)", dist.all_reduce, value, group=group)
        value.div_(w).pow_(1.0 / p)
    comm_stats().add_control(ring_allreduce_bytes(1, w))
    return value[0]
