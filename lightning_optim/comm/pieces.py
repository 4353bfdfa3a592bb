"""Pieces of flat 1-bit buffers, and the four element-wise passes of the compressed allreduce over them.

A :class:`Pieces` table lists ``(pos, off, len)`` triples: piece ``p`` covers elements
``[pos, pos + len)`` of the packed-sign / error-buffer index space (``pos % 8 == 0``, so a piece's
signs start on a byte) and elements ``[off, off + len)`` of the unpacked values. Every piece has
its own scale. The passes run as one compiled kernel each (``lightning_optim.ops``) or, where the
extension is unavailable, as torch index operations with the same results (sums of squares may
differ in the last bits: the kernels add fp32 partial sums in double, torch adds in double
throughout):

* ``sumsq(x, err)``: per piece, ``sum_j (x[off + j] + err[pos + j])^2``;
* ``momentum_sumsq(x, grads, err, w1)``: first ``x[off + j] <- lerp(x[off + j], grads[p][j], w1)`` (1-bit
  Adam's local momentum update), then ``sumsq`` of the result: one pass on the CPU kernels;
* ``compress(x, err, packed, scales, add_err)``: ``z = x[off + j] (+ err[pos + j])``; bit ``pos + j``
  of ``packed`` is ``z >= 0``; ``err[pos + j] = z - scale * sign(z)``;
* ``unpack(packed, scales, out)``: ``out[off + j] = +-scale`` by bit ``pos + j``;
* ``server_mean(rows, scales, err)``: ``err[pos + j] += mean_w(+-scales[w, p] by bit pos + j of row w)``
  (summed in worker order, then divided), returning the per-piece sums of squares of the result.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_optim import ops

from .packing import sign_table, unpack_into


class Pieces:
    """An int64 ``[3, P]`` (pos, off, len) table over a ``total``-element pos space, per device."""

    def __init__(self, pos: list[int], off: list[int], lens: list[int], total: int) -> None:
        self.count = len(lens)
        self.total = int(total)
        self.table = torch.tensor([pos, off, lens], dtype=torch.int64).reshape(3, self.count)
        self.lens = self.table[2].to(torch.float64)
        self._on: dict[torch.device, Pieces] = {}
        self._expanded: tuple[Tensor, Tensor, Tensor, Tensor] | None = None

    def on(self, device: torch.device) -> Pieces:
        """This table with its tensors on ``device`` (cached)."""
        if device == self.table.device:
            return self
        found = self._on.get(device)
        if found is None:
            found = self._on[device] = Pieces.__new__(Pieces)
            found.count, found.total, found._on, found._expanded = self.count, self.total, {}, None
            found.table, found.lens = self.table.to(device), self.lens.to(device)
        return found

    def scales(self, sums: Tensor) -> Tensor:
        """``sqrt(sum / len)`` per piece, fp32 (the RMS of each piece)."""
        return (sums / self.lens).sqrt_().to(torch.float32)

    def expanded(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per element of every piece: (pos index, off index, piece index), and the bytes they touch."""
        if self._expanded is None:
            pos, off, lens = self.table
            piece = torch.repeat_interleave(torch.arange(self.count, device=lens.device), lens)
            start = torch.cumsum(lens, 0) - lens
            within = torch.arange(int(lens.sum()), device=lens.device) - start[piece]
            pos_idx = pos[piece] + within
            self._expanded = (pos_idx, off[piece] + within, piece, torch.unique(pos_idx // 8))
        return self._expanded


def _kernel(name: str, device: torch.device):
    return ops.raw_kernel(name, device)


def sumsq(x: Tensor, err: Tensor | None, pc: Pieces) -> Tensor:
    kernel = _kernel("onebit_seg_sumsq", x.device)
    if kernel is not None:
        return kernel(x, err, pc.table, pc.total)
    pos_idx, off_idx, piece, _ = pc.expanded()
    z = x[off_idx].float()
    if err is not None:
        z += err[pos_idx]
    z = z.double()
    return torch.zeros(pc.count, dtype=torch.float64, device=x.device).index_add_(0, piece, z * z)


def lerp_segments_(x: Tensor, grads: Sequence[Tensor], w1: float, lengths: Sequence[int]) -> None:
    """``x``'s consecutive segments (``lengths``) <- ``lerp(segment, grad, w1)``, torch's lerp."""
    if lengths:
        torch._foreach_lerp_(list(x.split(list(lengths))), [g.reshape(-1).to(x.dtype) for g in grads], w1)


def momentum_sumsq(x: Tensor, grads: Sequence[Tensor], err: Tensor, pc: Pieces, w1: float,
                   lengths: Sequence[int]) -> Tensor:
    """``lerp_segments_(x, grads, w1, lengths)`` then ``sumsq(x, err, pc)``; the worker pieces ``pc`` are
    the segments, in order. Fused into one pass where the CPU kernel takes the gradients (fp32, contiguous)."""
    kernel = _kernel("onebit_momentum_sumsq", x.device) if x.device.type == "cpu" else None
    if kernel is not None and all(g.dtype == torch.float32 and g.is_contiguous() for g in grads):
        return kernel(x, list(grads), err, pc.table, pc.total, w1)
    lerp_segments_(x, grads, w1, lengths)
    return sumsq(x, err, pc)


def _signs(packed: Tensor, pc: Pieces) -> Tensor:
    """+-1 (fp32) for every position of the pos space."""
    out = torch.empty(pc.total, dtype=torch.float32, device=packed.device)
    return unpack_into(packed[: pc.total // 8], out, sign_table(torch.float32, packed.device))


def compress(x: Tensor, err: Tensor | None, packed: Tensor, scales: Tensor, pc: Pieces, add_err: bool) -> None:
    kernel = _kernel("onebit_seg_compress", x.device)
    if kernel is not None:
        kernel(x, err, packed, pc.table, pc.total, scales, add_err)
        return
    pos_idx, off_idx, piece, touched = pc.expanded()
    z = x[off_idx].float()
    if add_err:
        if err is None:
            raise ValueError("compress: add_err=True needs the error buffer err")
        z += err[pos_idx]
    positive = z >= 0
    bits = torch.ones(pc.total, dtype=torch.bool, device=x.device)  # +1 bits pad a piece's last byte
    bits[pos_idx] = positive
    weights = 2 ** torch.arange(8, dtype=torch.int32, device=x.device)
    full = (bits.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)
    packed[touched] = full[touched]
    if err is not None:
        s = scales[piece]
        err[pos_idx] = z - torch.where(positive, s, -s)


def unpack(packed: Tensor, scales: Tensor, out: Tensor, pc: Pieces) -> None:
    kernel = _kernel("onebit_seg_unpack", out.device)
    if kernel is not None:
        kernel(packed, pc.table, pc.total, scales, out)
        return
    pos_idx, off_idx, piece, _ = pc.expanded()
    values = _signs(packed, pc)[pos_idx] * scales[piece]
    out.view(-1)[off_idx] = values.to(out.dtype)


def server_mean(rows: Tensor, scales: Tensor, err: Tensor, pc: Pieces) -> Tensor:
    kernel = _kernel("onebit_server_mean", err.device)
    if kernel is not None:
        return kernel(rows, scales, err, pc.table, pc.total)
    pos_idx, _, piece, _ = pc.expanded()
    total = _signs(rows[0], pc)[pos_idx] * scales[0][piece]
    for w in range(1, rows.shape[0]):
        total = total + _signs(rows[w], pc)[pos_idx] * scales[w][piece]
    z = total / rows.shape[0] + err[pos_idx]
    err[pos_idx] = z
    zd = z.double()
    return torch.zeros(pc.count, dtype=torch.float64, device=err.device).index_add_(0, piece, zd * zd)
