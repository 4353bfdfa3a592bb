r"""All-reduce aggregation of gradients or weights for the centralized optimizers (mlbench-core's
``AllReduceAggregation``), on torch.distributed's default group.

For the tensors :math:`x_r` of rank :math:`r = 0..W-1` (a gradient or a weight) and a divisor
:math:`D` (:math:`W`, a custom denominator, or none: a plain sum):

.. math::
    \bar x = \frac{1}{D}\sum_r x_r \quad\text{(divide after)}, \qquad
    \bar x = \sum_r \frac{x_r}{D} \quad\text{(divide\_before: smaller partial sums, e.g. fp16)}

* **flat** (``by_layer=False``): every param packed into one buffer per (device, reduce dtype),
  one collective each (one in all for a single-dtype model); buffers are made once and reused.
* **by layer**: one collective per param (fp32/fp64 gradients are reduced in place).
* **reduce dtype**: fp32 for bf16/fp16/fp32, fp64 for fp64 (gloo has no bf16 sum, and fp32 avoids
  low-precision partial sums); results are rounded back to the param dtype once.
* **missing gradients**: a rank whose param has no gradient sends zeros; a count of the ranks that
  had one travels with the data (appended to the flat buffer, or one small collective before the
  per-layer ones). Every rank then gives the aggregate to each param some rank had a gradient
  for, and leaves ``grad = None`` where no rank had one (so the local step skips it, as torch's
  optimizers and DDP do). The layout is the same on every rank, so the collectives always pair.

Bytes are counted in ``comm_stats()`` by the ring rule: the data as full-precision allreduces of
the dtype sent, the gradient counts as control messages.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim.comm.agreement import control_device
from lightning_optim.comm.stats import comm_stats, ring_allreduce_bytes
from lightning_optim.comm.timeouts import collective

__all__ = ["AllReduceAggregation", "reduce_dtype"]


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a param of ``dtype`` is summed in: fp32, or fp64 for fp64 params."""
    return torch.promote_types(dtype, torch.float32)


def _all_reduce_sum(buf: Tensor, name: str) -> None:
    collective(name, dist.all_reduce, buf)


class AllReduceAggregation:
    """Sums ``params``' gradients or the params themselves over the default group's ``world_size``
    ranks, dividing by ``divisor`` (before or after the sum). ``params`` must be the same list
    (count, shapes, dtypes, order) on every rank; the optimizers check that at construction."""

    def __init__(self, params: list[Tensor], world_size: int, *, by_layer: bool, divide_before: bool) -> None:
        self.params = list(params)
        self.world_size = int(world_size)
        self.by_layer = bool(by_layer)
        self.divide_before = bool(divide_before)
        self._buffers: dict[tuple, Tensor] = {}

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def grads(self, divisor: float | None) -> bool:
        """Replace every param's gradient by the aggregate; returns whether anything was sent.
        With one rank nothing is sent and the gradients are only divided (``divisor`` not 1)."""
        for p in self.params:  # refuse before anything moved
            if p.grad is not None and p.grad.is_sparse:
                raise TypeError("grad: sparse gradients are not supported by the centralized optimizers "
                                "(use a dense layer, e.g. nn.Embedding(sparse=False))")
        if self.world_size == 1:
            if divisor is not None and divisor != 1:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.div_(divisor)
            return False
        if self.by_layer:
            self._grads_by_layer(divisor)
        else:
            for key, index in self._buckets().items():
                self._grads_flat(key, index, divisor)
        return True

    @torch.no_grad()
    def weights(self, divisor: float | None) -> bool:
        """Replace every param (in place: its identity and optimizer state stay) by the aggregate."""
        if self.world_size == 1:
            return False
        if self.by_layer:
            for p in self.params:
                inplace = p.dtype == reduce_dtype(p.dtype) and p.is_contiguous()
                buf = p.detach() if inplace else self._upcast(p)
                self._reduce(buf, divisor, "all_reduce(weights)")
                if not inplace:
                    p.copy_(buf)
        else:
            for key, index in self._buckets().items():
                buf, views = self._packed(key, index, extra=0)
                torch._foreach_copy_(views, [self.params[i].detach() for i in index])
                self._reduce(buf, divisor, "all_reduce(weights)")
                for i, view in zip(index, views):
                    self.params[i].copy_(view)
        return True

    # ------------------------------------------------------------------ gradients
    def _grads_flat(self, key: tuple, index: list[int], divisor: float | None) -> None:
        n = len(index)
        buf, views = self._packed(key, index, extra=n)
        data, counts = buf[:-n], buf[-n:]
        present = []
        for i, view in zip(index, views):
            grad = self.params[i].grad
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            present.append(0.0 if grad is None else 1.0)
        counts.copy_(torch.tensor(present, dtype=buf.dtype))
        self._reduce(data, divisor, "all_reduce(grads)", whole=buf)
        comm_stats().add_control(ring_allreduce_bytes(n, self.world_size, buf.element_size()))
        for i, view, count in zip(index, views, counts.tolist()):
            if count > 0:
                self._set_grad(self.params[i], view)

    def _grads_by_layer(self, divisor: float | None) -> None:
        present = [0.0 if p.grad is None else 1.0 for p in self.params]
        counts = torch.tensor(present, dtype=torch.float32, device=control_device(like=self.params))
        _all_reduce_sum(counts, "all_reduce(grad counts)")
        comm_stats().add_control(ring_allreduce_bytes(counts.numel(), self.world_size, 4))
        for p, count in zip(self.params, counts.tolist()):
            if count == 0:
                continue  # no rank has a gradient for it: every rank skips it
            grad = p.grad
            if grad is not None and grad.dtype == reduce_dtype(p.dtype) and grad.is_contiguous():
                self._reduce(grad, divisor, "all_reduce(grads)")  # mlbench reduces the gradient in place
                continue
            if grad is None:
                buf = torch.zeros(p.shape, dtype=reduce_dtype(p.dtype), device=p.device)
            else:
                buf = self._upcast(grad, reduce_dtype(p.dtype))
            self._reduce(buf, divisor, "all_reduce(grads)")
            self._set_grad(p, buf)

    # ------------------------------------------------------------------ pieces
    def _reduce(self, data: Tensor, divisor: float | None, name: str, whole: Tensor | None = None) -> None:
        """Sum ``whole`` (default ``data``) over the ranks; ``data`` is divided before or after."""
        whole = data if whole is None else whole
        if divisor is not None and self.divide_before:
            data.div_(divisor)
        _all_reduce_sum(whole, name)
        if divisor is not None and not self.divide_before:
            data.div_(divisor)
        comm_stats().add_full_precision(data.numel(), self.world_size, data.element_size())

    def _buckets(self) -> dict[tuple, list[int]]:
        """Param indices by (device, reduce dtype), in param order (recomputed: params may move)."""
        buckets: dict[tuple, list[int]] = {}
        for i, p in enumerate(self.params):
            buckets.setdefault((p.device, reduce_dtype(p.dtype)), []).append(i)
        return buckets

    def _packed(self, key: tuple, index: list[int], extra: int) -> tuple[Tensor, list[Tensor]]:
        """The reusable flat buffer of a bucket (``extra`` trailing slots) and its per-param views."""
        shapes = [self.params[i].shape for i in index]
        numel = sum(s.numel() for s in shapes) + extra
        device, dtype = key
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        views, offset = [], 0
        for shape in shapes:
            views.append(buf[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()
        return buf, views

    @staticmethod
    def _upcast(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        return t.detach().to(dtype or reduce_dtype(t.dtype), memory_format=torch.contiguous_format, copy=True)

    @staticmethod
    def _set_grad(p: Tensor, value: Tensor) -> None:
        if p.grad is None:
            p.grad = torch.empty_like(p, memory_format=torch.preserve_format)
        p.grad.copy_(value)
