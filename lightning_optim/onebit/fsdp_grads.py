r"""Gradient shards of an HSDP module when its cross-replica all-reduce is switched off.

FSDP2 reduces each ``fully_shard`` module's gradients in one reduce-scatter over the shard group
(mean over its :math:`S` ranks), then, under HSDP, one all-reduce of that flat shard over the replicate
group. ``FSDPModule.set_requires_all_reduce(False)`` skips the all-reduce, but torch then keeps the
reduce-scattered shard for a later backward (gradient accumulation) and writes no ``.grad`` at all.
The 1-bit compression stage wants exactly that shard as this rank's gradient,

.. math::
    g_{r} = \frac{1}{S}\sum_{s \in \mathrm{shard\ group}(r)} \nabla_{\mathrm{shard}(r)} L_s ,

so :class:`ShardGradients` is installed as the module's reduce-scatter (``set_custom_reduce_scatter``,
the public hook for it): it runs the same ``reduce_scatter_tensor`` torch would and, while ``capture``
is on, writes the module's ``.grad`` DTensors from the flat output itself. The output holds the
params in FSDP's order, each as its rank's chunk of the dim-0-padded param (``ceil(d0 / S)`` rows;
this rank's local shard is the chunk's first rows). :func:`flat_order` and :func:`padded_numel` compute
that layout; each call checks its size, and :meth:`ShardGradients.check_layout` compares it with the
gradients torch writes itself in a full-precision step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_optim.comm.stats import comm_stats
from lightning_optim.onebit.layout import local_tensor

try:  # public since torch 2.6; an older torch still imports lightning_optim (onebit_fsdp then refuses)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:
    FSDPModule = DTensor = Replicate = Shard = None  # type: ignore[assignment,misc]  # the names stay, as None

__all__ = ["ShardGradients", "flat_order", "missing_fsdp2_api", "padded_numel"]

# what onebit_fsdp calls on FSDP modules (set_custom_reduce_scatter, set_reduce_scatter_unused_params and
# reset_iter_state came with later torch releases than fully_shard itself)
_FSDP2_API = ("set_requires_all_reduce", "set_custom_reduce_scatter", "set_reduce_scatter_unused_params",
              "reset_iter_state")


def missing_fsdp2_api() -> list[str]:
    """The FSDP2 methods this torch lacks (all of them without a public ``FSDPModule``)."""
    return [name for name in _FSDP2_API if FSDPModule is None or not hasattr(FSDPModule, name)]


# torch's default reduce-scatter for FSDP (``reduce_scatter_tensor`` is its older, now deprecated name)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def flat_order(module: nn.Module) -> list[DTensor]:
    """The params ``fully_shard(module)`` manages, in its flat-buffer order: modules visited children
    first (post-order), skipping nested ``fully_shard`` modules, each module's own params in
    registration order, shared params once; params FSDP ignored stay plain tensors and are left out."""
    modules: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if m is not module and isinstance(m, FSDPModule):
            return
        seen.add(id(m))
        for child in m.children():
            if id(child) not in seen:
                visit(child)
        modules.append(m)

    visit(module)
    params: list[DTensor] = []
    taken: set[int] = set()
    for m in modules:
        for p in m.parameters(recurse=False):
            if id(p) not in taken and isinstance(p, DTensor):
                taken.add(id(p))
                params.append(p)
    return params


def padded_numel(p: DTensor) -> int:
    """Elements of one rank's chunk of ``p`` in the reduce-scatter output: dim 0 padded to a multiple of
    the shard group size (``Shard(0)``; FSDP shards other dims evenly, without padding)."""
    shards = [(i, pl) for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    mesh_dim, placement = shards[-1]
    size = p.device_mesh.size(mesh_dim)
    dim = placement.dim
    if dim != 0:
        return p.to_local().numel()
    return -(-p.shape[0] // size) * math.prod(p.shape[1:])  # shape only: no DTensor op runs


class ShardGradients:
    """A module's reduce-scatter (FSDP2's ``ReduceScatter`` interface: ``allocate`` and ``__call__``).

    ``capture``: write the module's gradients from the reduce-scattered shard (the all-reduce is off);
    otherwise a plain reduce-scatter, as torch's default (torch writes the gradients after its all-reduce,
    whose bytes are added to ``comm_stats()`` here).
    """

    def __init__(self, name: str, params: Sequence[DTensor], replicas: int) -> None:
        self.name = name
        self.params = list(params)
        self.replicas = replicas  # the all-reduce that follows a plain reduce-scatter spans them
        self.capture = False
        self.last_output: Tensor | None = None  # kept while a layout check is pending (full-precision steps)
        self.keep_output = False

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op: object,
                 async_op: bool = False) -> dist.Work | None:
        if op != dist.ReduceOp.AVG:
            # fp16 reduce dtypes, force_sum_reduction_for_comms and custom divide factors divide after the
            # all-reduce, which the compression stage skips: the shard would not be a mean
            raise RuntimeError(
                f"onebit_fsdp: FSDP reduce-scatters the gradients of {self.name!r} with {op} instead of an average "
                "(an fp16 reduce_dtype, set_force_sum_reduction_for_comms or set_gradient_divide_factor); the 1-bit "
                "compression stage needs FSDP's default mean: reduce in fp32 or bf16 with the default divide factor")
        work = _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if self.capture:
            if work is not None:
                work.wait()
            self._write_grads(output_tensor)
        else:
            # HSDP all-reduces this output over the replicas next (torch's collective: counted here, where its
            # tensor is known, so comm_stats sees the warmup's traffic as it sees the 1-bit exchange's)
            comm_stats().add_full_precision(output_tensor.numel(), self.replicas, output_tensor.element_size())
            if self.keep_output:
                self.last_output = output_tensor
        return work

    def _pieces(self, flat: Tensor) -> list[tuple[DTensor, Tensor]]:
        """(param, its shard's view of ``flat``) for the params that get a gradient, in flat order."""
        trained = [p for p in self.params if p.requires_grad]
        expected = sum(padded_numel(p) for p in trained)
        if flat.numel() != expected:
            raise RuntimeError(
                f"onebit_fsdp: FSDP reduce-scattered {flat.numel()} gradient elements for {self.name!r}, but its "
                f"{len(trained)} trained params take {expected} in FSDP's flat layout; params that FSDP manages "
                "differently (ignored_params, shard_placement_fn meshes, requires_grad changed after fully_shard) "
                "are not supported")
        pieces, offset = [], 0
        for p in trained:
            local = p.to_local()
            pieces.append((p, flat[offset : offset + local.numel()].view(local.shape)))
            offset += padded_numel(p)
        return pieces

    @torch.no_grad()
    def _write_grads(self, flat: Tensor) -> None:
        """``p.grad`` (accumulated, as FSDP does, when one exists) from the reduce-scattered shard; a copy:
        torch keeps ``flat`` as its partial result and adds later shards into it."""
        for p, piece in self._pieces(flat):
            if p.grad is None:
                local = piece.to(p.dtype, copy=True)
                p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                            stride=p.stride())
            else:
                local_tensor(p.grad).add_(piece)

    def check_layout(self) -> None:
        """After a full-precision backward, the gradients torch wrote must be the views of the (all-reduced)
        output that :meth:`_pieces` computes; raises where FSDP's layout is not the one assumed here."""
        flat, self.last_output = self.last_output, None
        if flat is None:
            return
        for p, piece in self._pieces(flat):
            g = None if p.grad is None else local_tensor(p.grad)
            if g is None or g.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                continue  # cast to another dtype, or accumulated: nothing to compare positions with
            if g.storage_offset() != piece.storage_offset() or g.shape != piece.shape:
                raise RuntimeError(
                    f"onebit_fsdp: FSDP placed the gradient shards of {self.name!r} otherwise than expected (a param "
                    f"of shape {tuple(p.shape)} at offset {g.storage_offset()}, expected {piece.storage_offset()}); "
                    "this torch version lays out its reduce-scatter differently, and the compression stage would read "
                    "wrong gradients")
