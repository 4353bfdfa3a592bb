"""Contiguous storage for a model's parameters and gradients.

A model's parameters are hundreds to thousands of separate allocations. The fused kernels stream
them one tensor after another: on 2000 tensors of 20 KB the CPU kernel runs at about 60% of the
speed it reaches on one large buffer, and the binding walks every tensor of every list per call.
:func:`flatten_parameters` rehomes the parameters (and, unless DDP owns them, the gradients) into
one buffer per (device, dtype), with each parameter a view into it. Our optimizers then see their
bucket as adjacent views (their states are packed per bucket already, ``bucket_states.py``) and hand
the kernel one flat tensor per list (``coalesce.py``): the same update, element for element.

    model = build_model()
    flat = lightning_optim.flatten_parameters(model)        # before the optimizer is made
    opt = lightning_optim.AdamW(model.parameters(), lr=1e-3)
    for batch in loader:
        loss(model, batch).backward()                       # autograd accumulates into the views
        opt.step()
        opt.zero_grad()                                     # zeroes the views in place (see below)

Gradients: autograd accumulates into an existing ``.grad`` in place, so grads preset to views of one
buffer stay there. ``set_to_none=True`` (torch's default) would drop them and the next backward would
allocate 2000 fresh tensors: our optimizers' ``zero_grad()`` zeroes flattened grads in place instead
(one ``zero_`` of the buffer); ``torch.nn.Module.zero_grad()`` and torch optimizers do drop them
(training stays correct, only the speed-up is lost for that step); ``flat.zero_grad()`` restores them.

DDP: with ``gradient_as_bucket_view=True`` DDP makes the grads views of its own buckets; call
``flatten_parameters(model, grads=False)`` before wrapping, so the parameters are flat and DDP owns the
gradient storage. DDP lays its buckets out in reverse parameter order, so the grads are not adjacent in
the optimizer's order and the kernel keeps getting one tensor per parameter there (correct, not faster).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

__all__ = ["FlatParameters", "flatten_parameters"]

# The attribute our optimizers' zero_grad() looks for: the grad view that must stay in place.
FLAT_GRAD_ATTR = "_lightning_optim_flat_grad"
# Set on every param flatten_parameters rehomed: its flat buffer (a second call is refused by name).
FLAT_BUFFER_ATTR = "_lightning_optim_flat_buffer"


class FlatParameters:
    """The buffers behind a model's flattened parameters and gradients (one per device and dtype)."""

    def __init__(self, params: list[Tensor], param_buffers: list[Tensor], grad_buffers: list[Tensor]) -> None:
        self.params = params
        self.param_buffers = param_buffers
        self.grad_buffers = grad_buffers

    def zero_grad(self) -> None:
        """Zero every flat gradient buffer and point each ``.grad`` back at its view."""
        for buffer in self.grad_buffers:
            buffer.zero_()
        for p in self.params:
            view = getattr(p, FLAT_GRAD_ATTR, None)
            if view is not None and p.grad is not view:
                p.grad = view

    def __repr__(self) -> str:
        sizes = ", ".join(f"{b.numel():,} {b.dtype} on {b.device}" for b in self.param_buffers)
        return f"FlatParameters({len(self.params)} params in {len(self.param_buffers)} buffers: {sizes})"


def flatten_parameters(module: nn.Module | Iterable[Tensor], *, grads: bool = True) -> FlatParameters:
    """Move every trainable parameter of ``module`` into one buffer per (device, dtype), as views.

    Values, shapes, ``requires_grad`` and the parameter objects are kept (optimizers and hooks built
    earlier still hold the same objects, but call this before making the optimizer: its cached state
    layout refers to the old storage). ``grads=True`` also presets each ``.grad`` to a view of one zeroed
    buffer per group (an existing gradient is copied in); ``grads=False`` leaves gradients alone (DDP
    with ``gradient_as_bucket_view=True``). Raises ValueError for a parameter that shares storage with
    another (tied weights) or is not a leaf: moving it would silently untie it.
    """
    params = list(module.parameters()) if isinstance(module, nn.Module) else list(module)
    if not isinstance(grads, bool):
        raise TypeError(f"grads must be True or False, got {grads!r}")
    trainable, seen = [], set()
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"module: parameter {i} is a {type(p).__name__}, not a tensor")
        if not p.requires_grad or id(p) in seen:
            continue
        if not p.is_leaf:
            raise ValueError(f"module: parameter {i} is not a leaf tensor; only leaves can be rehomed")
        buffer = getattr(p, FLAT_BUFFER_ATTR, None)
        if buffer is not None and p.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
            raise ValueError(f"module: parameter {i} is already flattened (flatten_parameters was called on it "
                             "before); flatten a model once, before making its optimizer")
        seen.add(id(p))
        trainable.append(p)
    storages: dict[int, int] = {}
    for i, p in enumerate(trainable):
        key = p.untyped_storage().data_ptr()
        if key in storages and p.numel() > 0:
            raise ValueError(f"module: parameters {storages[key]} and {i} share storage (tied weights?); "
                             "flattening would untie them")
        storages[key] = i
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for p in trainable:
        groups.setdefault((p.device, p.dtype), []).append(p)
    param_buffers, grad_buffers = [], []
    with torch.no_grad():
        for (device, dtype), members in groups.items():
            total = sum(p.numel() for p in members)
            flat = torch.empty(total, dtype=dtype, device=device)
            flat_grad = torch.zeros(total, dtype=dtype, device=device) if grads else None
            offset = 0
            for p in members:
                n = p.numel()
                view = flat[offset:offset + n].view(p.shape)
                view.copy_(p)
                p.data = view
                setattr(p, FLAT_BUFFER_ATTR, flat)
                if flat_grad is not None:
                    grad_view = flat_grad[offset:offset + n].view(p.shape)
                    if p.grad is not None:
                        grad_view.copy_(p.grad)
                    p.grad = grad_view
                    setattr(p, FLAT_GRAD_ATTR, grad_view)
                offset += n
            param_buffers.append(flat)
            if flat_grad is not None:
                grad_buffers.append(flat_grad)
    return FlatParameters(trainable, param_buffers, grad_buffers)
