r"""Sign compression: scaled sign with error feedback (EF-SignSGD) and signSGD with majority vote.

* ``ScaledSign()`` (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD", arXiv 1901.09847):

  .. math:: C(x) = \frac{\|x\|_1}{d}\,\operatorname{sign}(x)

  one scale per tensor; the aggregate is :math:`\frac1W \sum_r C(x_r)` (or the sum).
* ``ScaledSign(majority_vote=True)`` (Bernstein et al. 2018, "signSGD with Majority Vote", arXiv
  1810.05291): :math:`C(x) = \operatorname{sign}(x)`, unscaled, and the aggregate is the vote
  :math:`\operatorname{sign}(\sum_r \operatorname{sign}(x_r))` on every rank (``average`` does not
  apply; a tie, possible for even :math:`W`, gives 0). The paper uses no error feedback; passing
  residuals still works (the identity holds) but is not the paper's method.

Signs follow ``comm.packing``: :math:`\operatorname{sign}(0) = +1`, 8 per byte. Wire: per tensor the
packed signs (:math:`\lceil d/8 \rceil` bytes), then the scales (fp32; fp64 for fp64 tensors) of the
call, in one uint8 all-gather; every rank decodes every rank's message and adds in rank order.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim.optim.validation import check_flag

from ..dense import world_size
from ..packing import pack_signs, packed_size, unpack_signs
from ..stats import CommStats
from ..timeouts import collective
from .base import LocalCompressor, stats_or_default

__all__ = ["ScaledSign", "SignPayload"]


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class SignPayload:
    """Packed signs of a ``numel``-element tensor of ``dtype``, and its scale (None: majority vote)."""

    packed: Tensor
    scale: Tensor | None
    numel: int
    dtype: torch.dtype

    def signs(self) -> Tensor:
        return unpack_signs(self.packed, self.numel, self.dtype)


class ScaledSign(LocalCompressor):
    """Scaled sign (EF-SignSGD) or, with ``majority_vote=True``, signSGD's vote. See the module docstring."""

    def __init__(self, majority_vote: bool = False) -> None:
        self.majority_vote = check_flag("majority_vote", majority_vote)

    def agreement_fields(self, tensors: Sequence[Tensor]) -> dict[str, int]:
        return {**super().agreement_fields(tensors), "majority_vote": int(self.majority_vote)}

    def compress(self, flat: Tensor) -> SignPayload:
        scale = None
        if not self.majority_vote:
            scale = flat.abs().sum(dtype=scale_dtype(flat.dtype)).div(flat.numel()).reshape(1)
        return SignPayload(pack_signs(flat), scale, flat.numel(), flat.dtype)

    def decompress(self, payload: SignPayload) -> Tensor:
        signs = payload.signs()
        return signs if payload.scale is None else signs.mul_(payload.scale.to(payload.dtype))

    def exchange(self, payloads: Sequence[SignPayload], *, group=None, average: bool = True,
                 stats: CommStats | None = None) -> list[Tensor]:
        world = world_size(group)
        if world == 1:
            out = [self.decompress(p) for p in payloads]
            return [torch.sign(o) for o in out] if self.majority_vote else out
        parts = [p.packed for p in payloads]
        parts += [p.scale.view(torch.uint8) for p in payloads if p.scale is not None]
        mine = torch.cat(parts)
        gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=mine.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        collective("all_gather(signs)", gather, gathered, mine, group=group)
        stats_or_default(stats).add_compressed((world - 1) * mine.numel(), sum(p.numel for p in payloads), world)
        out = [torch.zeros(p.numel, dtype=p.dtype, device=p.packed.device) for p in payloads]
        for row in gathered.view(world, -1):
            offset, decoded = 0, []
            for p in payloads:
                nbytes = p.packed.numel()
                decoded.append(SignPayload(row[offset:offset + nbytes], None, p.numel, p.dtype))
                offset += nbytes
            for p, message in zip(payloads, decoded):
                if p.scale is not None:  # clone: an odd offset cannot be viewed as fp32/fp64
                    nbytes = p.scale.element_size()
                    message.scale = row[offset:offset + nbytes].clone().view(p.scale.dtype)
                    offset += nbytes
            for dense, message in zip(out, decoded):
                dense += self.decompress(message)
        if self.majority_vote:
            return [torch.sign(dense) for dense in out]
        if average:
            for dense in out:
                dense.div_(world)
        return out

    def bytes_sent(self, numels: Sequence[int], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        if world_size <= 1:
            return 0
        scale = 0 if self.majority_vote else torch.empty((), dtype=scale_dtype(dtype)).element_size()
        return (world_size - 1) * sum(packed_size(n) + scale for n in numels)
