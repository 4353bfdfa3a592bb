r"""PowerSGD compression (Vogels, Karimireddy & Jaggi 2019, arXiv 1905.13727), with error feedback.

Every tensor with two or more dimensions is a matrix :math:`M \in \mathbb{R}^{n \times m}` (reshaped
as ``(shape[0], -1)``, as mlbench does) approximated with rank :math:`r = \min(n, m, \text{rank})`; the
others (vectors, biases, scalars) are sent uncompressed in one sum all-reduce. Per call, on each rank:

.. math::
    M &= G + E \qquad (E: \text{this rank's residual}) \\
    P &= M Q \qquad Q \in \mathbb{R}^{m \times r}: \text{drawn } \mathcal{N}(0, 1) \text{, identically on every rank,
        or last call's } Q \text{ (``reuse_query``)} \\
    P &\leftarrow \textstyle\sum_{\text{ranks}} P, \qquad P \leftarrow \operatorname{orthogonalise}(P) \\
    Q &= M^\top P, \qquad Q \leftarrow \tfrac1W \textstyle\sum_{\text{ranks}} Q \\
    \hat M &= P Q^\top \qquad (\text{the same on every rank: } P P^\top \tfrac1W \textstyle\sum_r M_r) \\
    E &\leftarrow M - \hat M

and the result is :math:`\hat M` (``average=True``) or :math:`W \hat M` (the sum). All P's of a call
travel in one all-reduce and all Q's in another: :math:`2(W-1)/W \cdot (n + m) r` elements per matrix
instead of :math:`2(W-1)/W \cdot nm`. P is summed rather than averaged, as mlbench does: the
orthogonalisation removes the scale.

``orthogonalise`` is modified Gram-Schmidt over the columns with :math:`\varepsilon = 10^{-16}` added
to each norm (mlbench's ``orthogonalize``; a zero column stays zero instead of becoming NaN).

Randomness contract: one ``torch.Generator`` seeded with ``seed`` (the same on every rank; checked with
the layout on the first call); per call, in tensor order, each matrix that needs a fresh query draws
``torch.randn((m, r), generator=gen, dtype=torch.float32)``, cast to the compute dtype. mlbench draws
from numpy's ``RandomState(1)`` through the global torch seed; the distribution is the same.
Compute dtype: the tensors' (fp32 for fp16/bf16: gloo has no bf16 all-reduce).
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim.optim.validation import check_flag, check_generator_state, check_int

from ..agreement import fingerprint
from ..dense import world_size
from ..stats import CommStats, ring_allreduce_bytes
from ..timeouts import collective
from .base import Compressor, agree_layout, check_reduce_args, stats_or_default
from .feedback import absorb_, compensate

__all__ = ["PowerSGDCompressor", "orthogonalize_"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
ORTHOGONALIZE_EPS = 1e-16


def orthogonalize_(matrix: Tensor, eps: float = ORTHOGONALIZE_EPS) -> Tensor:
    """Modified Gram-Schmidt on the columns of ``matrix`` (n x r), in place: each column is normalised
    (``/ (norm + eps)``), then its projection is removed from the columns after it."""
    columns = matrix.shape[1]
    for i in range(columns):
        col = matrix[:, i:i + 1]
        col.div_(col.pow(2).sum().sqrt().add_(eps))
        if i + 1 < columns:
            rest = matrix[:, i + 1:]
            rest.sub_((col * rest).sum(dim=0, keepdim=True) * col)
    return matrix


def _allreduce_sum(buf: Tensor, what: str, group, world: int) -> None:
    if world > 1 and buf.numel():
        collective(f"all_reduce({what})", dist.all_reduce, buf, group=group)


class PowerSGDCompressor(Compressor):
    """Rank-``rank`` PowerSGD with optional warm start (``reuse_query``). See the module docstring."""

    def __init__(self, rank: int = 1, reuse_query: bool = False, *, seed: int = 0) -> None:
        self.rank = check_int("rank", rank, 1)
        self.reuse_query = check_flag("reuse_query", reuse_query)
        self.seed = check_int("seed", seed, 0)
        self.generator = torch.Generator().manual_seed(self.seed)
        self._queries: dict[Hashable, Tensor] = {}

    def reduce(self, tensors: Sequence[Tensor], residuals: Sequence[Tensor] | None = None, *, group=None,
               average: bool = True, stats: CommStats | None = None,
               keys: Sequence[Hashable] | None = None) -> list[Tensor]:
        """``keys`` name each tensor's warm-start query (default: its position in ``tensors``)."""
        tensors, residuals = check_reduce_args(tensors, residuals, group, average)
        error = None
        keys = list(range(len(tensors))) if keys is None else list(keys)
        if len(keys) != len(tensors) or len(set(keys)) != len(keys):
            error = ValueError(f"keys must name each of the {len(tensors)} tensors once, got {keys!r}")
        world = world_size(group)
        corrected = tensors if residuals is None else [compensate(t, e) for t, e in zip(tensors, residuals)]
        dtype = corrected[0].dtype
        for c in corrected[1:]:
            dtype = torch.promote_types(dtype, c.dtype)
        dtype = torch.float32 if dtype in _LOW_PRECISION else dtype
        device = tensors[0].device
        mats = [i for i, c in enumerate(corrected) if c.dim() > 1]
        vecs = [i for i, c in enumerate(corrected) if c.dim() <= 1]
        matrices = {i: corrected[i].reshape(corrected[i].shape[0], -1).to(dtype) for i in mats}
        ranks = {i: min(*matrices[i].shape, self.rank) for i in mats}
        p_sizes = [matrices[i].shape[0] * ranks[i] for i in mats]
        q_sizes = [matrices[i].shape[1] * ranks[i] for i in mats]
        agree_layout(self, {"tensors": len(tensors), "matrices": len(mats), "p_elements": sum(p_sizes),
                            "q_elements": sum(q_sizes), "rank": self.rank, "reuse_query": int(self.reuse_query),
                            "seed": self.seed, "layout": fingerprint((tuple(c.shape), str(dtype)) for c in corrected)},
                     group, tensors, error)

        queries = [self._query(keys[i], matrices[i].shape[1], ranks[i], dtype, device) for i in mats]
        p_flat = torch.empty(sum(p_sizes), dtype=dtype, device=device)
        ps = [v.view(matrices[i].shape[0], ranks[i]) for i, v in zip(mats, p_flat.split(p_sizes))]
        for i, q, p in zip(mats, queries, ps):
            torch.matmul(matrices[i], q, out=p)
        _allreduce_sum(p_flat, "PowerSGD P", group, world)
        vec_flat = torch.cat([corrected[i].reshape(-1).to(dtype) for i in vecs]) if vecs else None
        if vec_flat is not None:
            _allreduce_sum(vec_flat, "uncompressed vectors", group, world)
        for p in ps:
            orthogonalize_(p)
        q_flat = torch.empty(sum(q_sizes), dtype=dtype, device=device)
        qs = [v.view(matrices[i].shape[1], ranks[i]) for i, v in zip(mats, q_flat.split(q_sizes))]
        for i, p, q in zip(mats, ps, qs):
            torch.matmul(matrices[i].t(), p, out=q)
        _allreduce_sum(q_flat, "PowerSGD Q", group, world)
        q_flat.div_(world)
        self._count(stats, world, dtype, (sum(p_sizes), sum(q_sizes)), sum(matrices[i].numel() for i in mats),
                    0 if vec_flat is None else vec_flat.numel())

        out: dict[int, Tensor] = {}  # every tensor is a matrix or a vector
        for i, p, q in zip(mats, ps, qs):
            approx = (p @ q.t()).view(corrected[i].shape)
            if residuals is not None:
                absorb_(residuals[i], corrected[i], approx)
            out[i] = approx if average else approx * world
            if self.reuse_query:
                self._queries[keys[i]] = q.clone()
        if vec_flat is not None:
            offset = 0
            for i in vecs:
                n = corrected[i].numel()
                summed = vec_flat[offset:offset + n].view(corrected[i].shape)
                offset += n
                if residuals is not None:  # sent exactly: nothing is left over
                    residuals[i].zero_()
                out[i] = summed / world if average else summed
        return [out[i].to(t.dtype) for i, t in enumerate(tensors)]

    def _query(self, key: Hashable, m: int, r: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        q = self._queries.get(key) if self.reuse_query else None
        if q is not None and q.shape == (m, r):
            return q.to(device=device, dtype=dtype)
        return torch.randn((m, r), generator=self.generator, dtype=torch.float32).to(device=device, dtype=dtype)

    @staticmethod
    def _count(stats: CommStats | None, world: int, dtype: torch.dtype, low_rank: tuple[int, int],
               matrix_elements: int, vector_elements: int) -> None:
        if world <= 1:
            return
        stats = stats_or_default(stats)
        size = torch.empty((), dtype=dtype).element_size()
        if matrix_elements:  # P and Q travel in two all-reduces, each at its own ring cost
            sent = sum(ring_allreduce_bytes(n, world, size) for n in low_rank)
            stats.add_compressed(sent, matrix_elements, world)
        if vector_elements:
            stats.add_full_precision(vector_elements, world, size)

    def ranks_of(self, shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, int, int] | None]:
        """``(n, m, r)`` per shape, None for the uncompressed ones."""
        out: list[tuple[int, int, int] | None] = []
        for shape in shapes:
            if len(shape) <= 1:
                out.append(None)
                continue
            n = shape[0]
            m = 1
            for s in shape[1:]:
                m *= s
            out.append((n, m, min(n, m, self.rank)))
        return out

    def bytes_sent(self, numels: Sequence[int] | Sequence[tuple[int, ...]], world_size: int,
                   dtype: torch.dtype = torch.float32) -> int:
        """Bytes of one ``reduce``; pass *shapes* (PowerSGD's cost depends on them, not on numels)."""
        if world_size <= 1:
            return 0
        size = 4 if dtype in _LOW_PRECISION else torch.empty((), dtype=dtype).element_size()
        shapes = [tuple(s) if isinstance(s, (tuple, list, torch.Size)) else (int(s),) for s in numels]
        p_elements, q_elements, vec = 0, 0, 0
        for shape, nmr in zip(shapes, self.ranks_of(shapes)):
            if nmr is None:
                vec += int(torch.Size(shape).numel())
            else:
                n, m, r = nmr
                p_elements, q_elements = p_elements + n * r, q_elements + m * r
        return sum(ring_allreduce_bytes(n, world_size, size) for n in (p_elements, q_elements, vec))

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "queries": {k: q.clone() for k, q in self._queries.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        generator, queries = state.get("generator"), state.get("queries", {})
        if not isinstance(queries, Mapping) or not all(isinstance(q, Tensor) and q.dim() == 2 and q.is_floating_point()
                                                       for q in queries.values()):
            raise ValueError("state: 'queries' must map keys to 2-D real floating-point tensors")
        saved = check_generator_state("generator", generator)
        self.generator.set_state(saved.clone())
        self._queries = {k: q.clone() for k, q in queries.items()}
