"""fp32 master weights for a model trained in fp16/bf16.

The model keeps 16-bit params (forward and backward run in 16 bits); the optimizer steps fp32
copies (the masters), so small updates are not lost to rounding. One step:

1. ``grads_to_masters(scale)``: ``m.grad <- float(p.grad) / S`` and the inf/NaN check, one fused
   pass over the master grads (torch's AMP kernel); the 16-bit grads are freed. Clipping and the
   global-norm optimizers (LAMB) see these unscaled fp32 gradients.
2. the optimizer steps the masters (skipped on overflow).
3. ``p <- round16(m)``. Our optimizers write it in the same pass as their update (``param_copies``:
   the compiled Adam/AdamW kernel reads the master once and writes both; the others copy each
   bucket right after its update); for any other optimizer ``masters_to_model`` copies afterwards.

fp32 params of the model (norms kept in fp32, say) are their own masters: no copy, no extra memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_optim.precision._checks import (
    check_keys,
    check_label,
    check_number,
    check_optimizer,
    clip_norm,
    describe,
)
from lightning_optim.precision.loss_scaler import DynamicLossScaler, found_non_finite

__all__ = ["MasterWeights"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def _labelled(label: str, item: Any) -> tuple[str, Tensor]:
    """``(label, tensor)`` of one entry: a tensor, or a ``(name, tensor)`` pair as ``named_parameters()`` gives."""
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Tensor):
        return item[0], item[1]
    if not isinstance(item, Tensor):
        raise TypeError(f"params: {label} is {describe(item)}, expected a Tensor (or a (name, Tensor) pair)")
    return label, item


def _flatten(params: Any) -> list[tuple[str, Tensor]]:
    """Every entry of ``params`` (tensors, ``(name, tensor)`` pairs or torch-style group dicts), labelled."""
    if isinstance(params, Tensor):
        raise TypeError(f"params: expected an iterable of Tensors (e.g. model.parameters()), got a single Tensor of "
                        f"shape {tuple(params.shape)}: iterating it would give its rows "
                        "(as torch.optim, pass [tensor])")
    if isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Iterable):
        raise TypeError(f"params: expected an iterable of Tensors (e.g. model.parameters()), got {describe(params)}")
    out = []
    for i, item in enumerate(params):
        if not isinstance(item, Mapping):
            out.append(_labelled(f"params[{i}]", item))
            continue
        inner = item.get("params")
        inner = [inner] if isinstance(inner, Tensor) else inner  # torch allows a lone tensor in a group
        if isinstance(inner, (str, bytes, Mapping)) or not isinstance(inner, Iterable):
            raise TypeError(f"params: group {i} needs 'params', an iterable of Tensors, got {describe(inner)}")
        out += [_labelled(f"group {i} params[{j}]", p) for j, p in enumerate(inner)]
    return out


def _check_params(labelled: list[tuple[str, Tensor]]) -> None:
    """Refuse what would train wrongly without an error: a param given twice (the master the optimizer
    steps would never get its gradient), a non-leaf tensor (it never gets a .grad), a non-float one."""
    seen: dict[int, str] = {}
    for label, p in labelled:
        if id(p) in seen:
            raise ValueError(f"params: {seen[id(p)]} and {label} are the same tensor (shape {tuple(p.shape)}); "
                             "give each param once")
        seen[id(p)] = label
        if not p.requires_grad:
            continue
        if not p.is_leaf:
            raise ValueError(f"params: {label} is not a leaf tensor (a view or a result of an operation); pass the "
                             "model's parameters themselves")
        if not p.is_floating_point():
            raise TypeError(f"params: {label} is {p.dtype}; only floating-point parameters can have masters")


class MasterWeights:
    """fp32 masters of ``params`` (the trainable params of a 16-bit model) and the copies between them.

    ``params``: an iterable of tensors as torch.optim takes it (tensors, ``(name, tensor)`` pairs or
    group dicts); params with ``requires_grad=False`` are left out. A bare tensor, a param given
    twice, a non-leaf tensor are refused.
    """

    def __init__(self, params: Iterable[Tensor]) -> None:
        labelled = _flatten(params)
        _check_params(labelled)
        trained = [(label, p) for label, p in labelled if p.requires_grad]
        if not trained:
            raise ValueError("params: no trainable parameters (none has requires_grad=True)")
        self.model_params = [p for _, p in trained]
        self._labels = [label for label, _ in trained]
        self.masters: list[Tensor] = [
            nn.Parameter(p.detach().float().clone()) if p.dtype in LOW_PRECISION else p for p in self.model_params
        ]
        self._copied = [(p, m) for p, m in zip(self.model_params, self.masters) if m is not p]
        self._copied_labels = [label for label, (p, m) in zip(self._labels, zip(self.model_params, self.masters))
                               if m is not p]  # names the masters of a state dict in messages
        self._master_of = {id(p): m for p, m in zip(self.model_params, self.masters)}
        self._master_ids = {id(m) for m in self.masters}
        self._grad_buffers: dict[int, Tensor] = {}

    # ------------------------------------------------------------------ wiring into an optimizer
    def master_of(self, p: Tensor) -> Tensor:
        """The master of the model param ``p`` (``p`` itself for an fp32 param); KeyError for another tensor."""
        if not isinstance(p, Tensor):
            raise TypeError(f"p: expected a Tensor, got {describe(p)}")
        try:
            return self._master_of[id(p)]
        except KeyError:
            raise KeyError(f"p: a tensor of shape {tuple(p.shape)} that is not one of these params") from None

    def _foreign(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """The trainable params of ``optimizer`` that are neither these params nor their masters."""
        return [f"group {gi} param {i} (shape {tuple(p.shape)})"
                for gi, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])
                if p.requires_grad and id(p) not in self._master_of and id(p) not in self._master_ids]

    def _refuse_foreign(self, optimizer: torch.optim.Optimizer) -> None:
        foreign = self._foreign(optimizer)
        if foreign:
            raise ValueError(f"optimizer: {len(foreign)} of its params are not params of this MasterWeights "
                             f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); build it over the "
                             "same model's parameters (a param it steps outside the masters would get the scaled "
                             "16-bit gradient)")

    def swap_into(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer`` (built over the model's params) step the masters instead.

        Params that have no master (frozen ones) are left as they are. Existing per-param state
        moves with its param. Our optimizers also learn where to write the rounded 16-bit copies.
        An optimizer over other params is refused (nothing would train the model). Calling it again
        on the same optimizer changes nothing.
        """
        check_optimizer("optimizer", optimizer)
        self._refuse_foreign(optimizer)
        for group in optimizer.param_groups:
            swapped = []
            for p in group["params"]:
                m = self._master_of.get(id(p), p)
                if m is not p and p in optimizer.state:
                    optimizer.state[m] = optimizer.state.pop(p)
                swapped.append(m)
            group["params"] = swapped
        if getattr(optimizer, "writes_param_copies", False):
            # duck-typed: an optimizer that writes param copies takes them (BaseOptimizer is one)
            optimizer.set_param_copies([(m, p) for p, m in self._copied])  # type: ignore[attr-defined]
        for attr in ("_group_index", "_layout"):
            if getattr(optimizer, attr, None) is not None:
                setattr(optimizer, attr, None)  # lookups keyed by the old params
        getattr(optimizer, "_plans", {}).clear()

    def check_steps_masters(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an ``optimizer`` that would not move the model in :meth:`step`: one still stepping the
        16-bit params (``swap_into`` forgotten: their grads are freed before the step, so they never move)
        or other params."""
        check_optimizer("optimizer", optimizer)
        stepped_ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if stepped_ids and stepped_ids <= self._master_ids:
            return  # the usual case, every step: masters only (one set comparison)
        self._refuse_foreign(optimizer)
        stepped = [p for g in optimizer.param_groups for p in g["params"]]
        if any(id(p) in self._master_of and id(p) not in self._master_ids for p in stepped):
            raise RuntimeError("optimizer: it steps the model's 16-bit params, not their fp32 masters: call "
                               "masters.swap_into(optimizer) once after building the optimizer")
        if not any(id(p) in self._master_ids for p in stepped):
            raise ValueError("optimizer: it steps none of the masters")

    # ------------------------------------------------------------------ the copies of a step
    @torch.no_grad()
    def grads_to_masters(self, inv_scale: float = 1.0) -> Tensor:
        """``m.grad <- p.grad * inv_scale`` in fp32 and the local inf/NaN flag (1.0: found).

        Params without a gradient give their master none. The 16-bit grads are freed.
        """
        inv_scale = check_number("inv_scale", inv_scale, above=0.0)
        grads = []
        for p, m in zip(self.model_params, self.masters):
            g = p.grad
            if g is None:
                if m is not p:
                    m.grad = None
                continue
            if m is not p:
                # one fp32 buffer per master for the whole run: optimizer.zero_grad() sets m.grad to
                # None every step, and a fresh 4 B/param allocation each step costs page faults
                buffer = self._grad_buffers.get(id(m))
                if buffer is None:
                    buffer = self._grad_buffers[id(m)] = torch.empty_like(m)
                g = m.grad = buffer.copy_(g)
                p.grad = None
            grads.append(g)
        return found_non_finite(grads, inv_scale)

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """``p <- round16(m)`` for every param with a separate master."""
        if self._copied:
            torch._foreach_copy_([p for p, _ in self._copied], [m for _, m in self._copied])

    def step(self, optimizer: torch.optim.Optimizer, scaler: DynamicLossScaler | None = None,
             max_grad_norm: float | None = None) -> bool:
        """One whole master-weights step after ``backward`` (on ``scaler.scale(loss)`` when a scaler is given).

        Unscales into the masters; with a scaler, an inf/NaN on any rank skips the step everywhere
        and backs the scale off (without one, NaN/Inf flow into the update as in torch). Clips the
        fp32 master grads to ``max_grad_norm`` (> 0; None or inf: no clipping), steps, and rounds
        the masters into the model. Returns whether the optimizer stepped. The arguments, and that
        ``optimizer`` steps the masters (:meth:`swap_into`), are checked before anything changes;
        the scaler records the step once it went through.
        """
        self.check_steps_masters(optimizer)
        if scaler is not None and not isinstance(scaler, DynamicLossScaler):
            raise TypeError(f"scaler: expected None or a DynamicLossScaler, got {describe(scaler)}")
        max_norm = clip_norm("max_grad_norm", max_grad_norm)
        found = self.grads_to_masters(1.0 if scaler is None else 1.0 / scaler.loss_scale)
        if scaler is not None and scaler.agree(found):
            scaler.update(True)
            self.zero_master_grads()
            return False
        if max_norm is not None:
            nn.utils.clip_grad_norm_([m for m in self.masters if m.grad is not None], max_norm)
        optimizer.step()
        self.after_step(optimizer)
        if scaler is not None:
            scaler.update(False)
        return True

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Round the masters into the model, unless ``optimizer`` already wrote the copies in its step."""
        check_optimizer("optimizer", optimizer)
        if not (getattr(optimizer, "writes_param_copies", False) and getattr(optimizer, "_param_copies", None)):
            self.masters_to_model()

    def zero_master_grads(self) -> None:
        for m in self.masters:
            m.grad = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The masters (the model's own state dict holds only their rounded copies)."""
        return {"masters": [m.detach().clone() for _, m in self._copied]}

    def check_state_dict(self, state: Any, where: str = "state") -> list[Tensor]:
        """``state['masters']`` checked against these masters (count, float32, shapes); changes nothing."""
        check_label("where", where)
        check_keys(where, state, {"masters"})
        saved = state["masters"]
        if not isinstance(saved, (list, tuple)):
            raise TypeError(
                f"{where}['masters']: expected a list of {len(self._copied)} tensors, got {describe(saved)}")
        if len(saved) != len(self._copied):
            raise ValueError(f"{where}['masters']: expected {len(self._copied)} master tensors, got {len(saved)}")
        for i, ((_, m), t, label) in enumerate(zip(self._copied, saved, self._copied_labels)):
            name = f"{where}['masters'][{i}] (the master of {label})"
            if not isinstance(t, Tensor) or t.dtype != m.dtype:
                got = t.dtype if isinstance(t, Tensor) else describe(t)
                raise TypeError(f"{name}: expected a {m.dtype} tensor (masters are kept in fp32), got {got}")
            if t.shape != m.shape:
                raise ValueError(f"{name}: has shape {tuple(t.shape)}, expected {tuple(m.shape)}")
        return list(saved)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Everything is checked (:meth:`check_state_dict`) before any master changes."""
        for (_, m), t in zip(self._copied, self.check_state_dict(state)):
            m.copy_(t)
        self.masters_to_model()
