"""fp32 master weights for Hugging Face Accelerate: one call after ``accelerator.prepare``.

    model = build_model().half()                     # or .to(torch.bfloat16): the model lives in 16 bits
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)   # mixed_precision="no"
    masters = accel_plugins.enable_master_weights(accelerator, model, optimizer)
    # the loop stays as it is: accelerator.backward, accelerator.accumulate, clip_grad_norm_, optimizer.step()

The math is :class:`lightning_optim.precision.MasterWeights` and
:class:`~lightning_optim.precision.DynamicLossScaler`; this module only wires them into Accelerate:

* the optimizer is made to step fp32 copies of the 16-bit params (the masters); our optimizers write
  the rounded 16-bit params in the same pass as their update;
* the returned handle takes Accelerate's scaler slot (``accelerator.scaler``), so
  ``accelerator.backward`` computes :math:`\\nabla (S \\cdot loss)` (fp16; bf16: :math:`S = 1`) and
  ``accelerator.save_state``/``load_state`` keep the scale and the masters (``scaler.pt``);
* ``optimizer.step()`` (on the prepared optimizer) runs one master step when Accelerate syncs
  gradients: :math:`m.grad = g / S` in fp32, an inf/NaN on any rank skips the step on every rank
  (``optimizer.step_was_skipped``; Accelerate's LR scheduler skips with it) and backs :math:`S` off;
  otherwise the optimizer steps the masters and the model gets :math:`round_{16}(m)`;
* ``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` clip the unscaled fp32 master grads of the
  params you pass (Accelerate's own would clip the scaled 16-bit grads).

Refused: ``mixed_precision="fp16"`` (torch's GradScaler decides per rank and would scale twice),
DeepSpeed/FSDP (their own mixed precision), a model without fp16/bf16 params, LBFGS, gradient
release (it steps during backward, before the overflow check). Works with one process, DDP and the
1-bit optimizers (``enable_onebit`` after this call; the overflow decision is shared by all ranks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from accel_plugins._accelerator import (
    AcceleratorMethods,
    check_accelerator,
    check_ddp_ground,
    check_model,
    check_owned_params,
    unwrap_model,
    unwrap_optimizer,
)
from lightning_optim.precision import DynamicLossScaler, MasterWeights
from lightning_optim.precision._checks import check_count, check_keys, check_number, check_tensor_list, describe
from lightning_optim.precision.master_weights import LOW_PRECISION

__all__ = ["MasterWeightsHandle", "enable_master_weights"]


class MasterWeightsHandle:
    """The masters, the loss scaler and the hooks :func:`enable_master_weights` installed.

    It sits in ``accelerator.scaler``: ``scale``, ``get_scale``, ``state_dict`` and
    ``load_state_dict`` are what Accelerate calls there.
    """

    def __init__(self, accelerator: Any, optimizer: Any, masters: MasterWeights,
                 loss_scaler: DynamicLossScaler | None) -> None:
        check_accelerator(accelerator)
        if not isinstance(unwrap_optimizer(optimizer), torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch optimizer (as accelerator.prepare returns it), got "
                            f"{describe(optimizer)}")
        if not isinstance(masters, MasterWeights):
            raise TypeError(f"masters: expected a MasterWeights, got {describe(masters)}")
        if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
            raise TypeError(f"loss_scaler: expected None or a DynamicLossScaler, got {describe(loss_scaler)}")
        masters.check_steps_masters(unwrap_optimizer(optimizer))  # swapped in: the model moves
        self.accelerator = accelerator
        self.optimizer = optimizer  # as prepared (AcceleratedOptimizer) or plain
        self.masters = masters
        self.loss_scaler = loss_scaler
        self.skipped_steps = 0
        self._found: Tensor | None = None  # the local inf/NaN flag once this step's grads are unscaled
        self._inner_step = unwrap_optimizer(optimizer).step  # taken before optimizer.step is replaced
        self._methods = AcceleratorMethods(accelerator)

    # ------------------------------------------------------------------ Accelerate's scaler slot
    def scale(self, loss: Tensor) -> Tensor:
        if not isinstance(loss, Tensor) or not loss.is_floating_point():
            raise TypeError(f"loss: expected a floating-point Tensor, got "
                            f"{loss.dtype if isinstance(loss, Tensor) else describe(loss)}")
        return loss if self.loss_scaler is None else self.loss_scaler.scale(loss)

    def get_scale(self) -> float:
        return 1.0 if self.loss_scaler is None else self.loss_scaler.loss_scale

    def is_enabled(self) -> bool:
        return self.loss_scaler is not None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"masters": self.masters.state_dict(), "skipped_steps": self.skipped_steps}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Masters, scale and counter, all checked before any of them changes."""
        check_keys("state", state, {"masters"}, {"skipped_steps", "loss_scaler"})
        saved_scaling, scaling = "loss_scaler" in state, self.loss_scaler is not None
        if saved_scaling != scaling:
            raise ValueError(f"state: loss scaling is {'on' if saved_scaling else 'off'} in the checkpoint and "
                             f"{'on' if scaling else 'off'} in this run (fp16 vs bf16 params?)")
        self.masters.check_state_dict(state["masters"], where="state['masters']")
        if self.loss_scaler is not None:
            self.loss_scaler.check_state_dict(state["loss_scaler"], where="state['loss_scaler']")
        skipped = check_count("state['skipped_steps']", state.get("skipped_steps", 0))
        self.masters.load_state_dict(state["masters"])  # checked above: these cannot fail half-way
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.skipped_steps = skipped

    # ------------------------------------------------------------------ the step
    def _unscale(self) -> Tensor:
        """Move this step's grads to the masters once (unscaled); the local inf/NaN flag."""
        if self._found is None:
            self._found = self.masters.grads_to_masters(self.get_scale() ** -1)
        return self._found

    def optimizer_step(self, closure: Any = None) -> None:
        """``optimizer.step()`` of the prepared optimizer: one master step when gradients are synced."""
        if closure is not None:
            raise ValueError("closure: not supported with master weights (the grads are unscaled before the step)")
        if not self.accelerator.sync_gradients:
            return  # accumulating: the 16-bit grads keep summing
        inner = unwrap_optimizer(self.optimizer)
        self.masters.check_steps_masters(inner)  # before the grads move: still the masters after a reload?
        found, self._found = self._unscale(), None
        # one 4-byte all-reduce: every rank skips the same steps
        scaler = self.loss_scaler
        overflow = scaler is not None and scaler.agree(found)
        if scaler is not None and overflow:
            scaler.update(True)
            self.skipped_steps += 1
            self.masters.zero_master_grads()
        else:
            self._inner_step()
            self.masters.after_step(inner)
            if self.loss_scaler is not None:
                self.loss_scaler.update(False)  # once the step went through
        if hasattr(self.optimizer, "_is_overflow"):
            self.optimizer._is_overflow = overflow  # AcceleratedOptimizer.step_was_skipped; the scheduler reads it

    def _masters_of(self, parameters: Any) -> list[Tensor]:
        params = check_tensor_list("parameters", [parameters] if isinstance(parameters, Tensor) else parameters)
        self._unscale()
        masters = []
        for p in params:
            try:
                masters.append(self.masters.master_of(p))
            except KeyError:
                masters.append(p)  # a master already, or a param outside the model (frozen): as it is
        return [m for m in masters if m.grad is not None]

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Tensor:
        """Clip the fp32 master grads of ``parameters`` (unscaled first); the total norm, as torch returns it.
        ``max_norm`` in (0, inf] (inf: only measure), ``norm_type`` in (0, inf]: torch checks neither."""
        check_number("max_norm", max_norm, above=0.0, allow_inf=True)
        check_number("norm_type", norm_type, above=0.0, allow_inf=True)
        return nn.utils.clip_grad_norm_(self._masters_of(parameters), max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clip the fp32 master grads of ``parameters`` to [-clip_value, clip_value], clip_value > 0."""
        check_number("clip_value", clip_value, above=0.0)
        nn.utils.clip_grad_value_(self._masters_of(parameters), clip_value)

    # ------------------------------------------------------------------ undo
    def close(self) -> None:
        """Give Accelerate its scaler slot and methods back (the optimizer keeps stepping the masters)."""
        self._methods.restore()
        vars(self.optimizer).pop("step", None)
        if self.accelerator.scaler is self:
            self.accelerator.scaler = None


def refuse_grad_scaler(caller: str, accelerator: Any, why: str) -> None:
    """``mixed_precision="fp16"`` puts torch's GradScaler in ``accelerator.scaler``; a
    :class:`MasterWeightsHandle` there is ours (here, beside the class: the adapters import both from
    this module, and ``_accelerator`` stays free of the adapters)."""
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and not isinstance(scaler, MasterWeightsHandle):
        raise ValueError(f"{caller}: Accelerator(mixed_precision='fp16') uses torch's GradScaler, which {why}. "
                         "Use mixed_precision='bf16' or 'no', or fp16 params with accel_plugins.enable_master_weights "
                         "(its overflow decision is shared by every rank)")


def enable_master_weights(accelerator: Any, model: nn.Module, optimizer: Any,
                          loss_scaler: DynamicLossScaler | str | None = "auto") -> MasterWeightsHandle:
    """Train the 16-bit ``model`` with fp32 master weights in ``optimizer`` (see the module doc).

    Args:
        accelerator: the ``Accelerator`` that prepared ``model`` and ``optimizer``.
        model: the prepared model (a DDP model on several ranks), with fp16 or bf16 params.
        optimizer: the prepared optimizer, built over the model's 16-bit params.
        loss_scaler: ``"auto"``: dynamic loss scaling when any param is fp16, none for bf16;
            a :class:`~lightning_optim.precision.DynamicLossScaler` to choose its settings; ``None``: no scaling.
    """
    caller = "enable_master_weights"
    check_accelerator(accelerator)
    check_model(model)
    auto = isinstance(loss_scaler, str) and loss_scaler == "auto"
    if not (auto or loss_scaler is None or isinstance(loss_scaler, DynamicLossScaler)):
        raise TypeError(f"loss_scaler: must be 'auto', None or a DynamicLossScaler, got {describe(loss_scaler)}")
    inner = unwrap_optimizer(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch optimizer (as accelerator.prepare returns it), got "
                        f"{type(inner).__name__}")
    if isinstance(inner, torch.optim.LBFGS):
        raise ValueError("optimizer: LBFGS re-evaluates the closure inside step(); not supported with master weights")
    if getattr(inner, "_released", False):
        raise ValueError("optimizer: gradient release steps each param during backward, before the overflow check "
                         "of master weights; use one of them (bf16 params + Kahan summation go with release)")
    if isinstance(getattr(accelerator, "scaler", None), MasterWeightsHandle):
        raise RuntimeError("accelerator: master weights are already enabled on it")
    if "clip_grad_norm_" in vars(accelerator):
        raise RuntimeError("accelerator: enable_onebit / enable_gradient_release ran first; call "
                           "enable_master_weights right after accelerator.prepare, before them")
    refuse_grad_scaler(caller, accelerator, "would scale the loss a second time and skip steps per rank")
    check_ddp_ground(caller, accelerator, model)
    check_owned_params(inner, model)
    params = [p for p in unwrap_model(model).parameters() if p.requires_grad]
    dtypes = {p.dtype for p in params}
    if not dtypes & set(LOW_PRECISION):
        raise ValueError(f"model: no fp16/bf16 parameters (dtypes {sorted(map(str, dtypes))}); convert it with "
                         "model.half() or model.to(torch.bfloat16) before accelerator.prepare")
    scaler = loss_scaler if isinstance(loss_scaler, DynamicLossScaler) else None  # checked above: or None
    if auto:
        scaler = DynamicLossScaler() if torch.float16 in dtypes else None
    masters = MasterWeights(params)
    masters.swap_into(inner)  # the first change: everything above only checked
    handle = MasterWeightsHandle(accelerator, optimizer, masters, scaler)
    accelerator.scaler = handle
    optimizer.step = handle.optimizer_step  # on this instance only; close() removes it
    handle._methods.replace("clip_grad_norm_", handle.clip_grad_norm_)
    handle._methods.replace("clip_grad_value_", handle.clip_grad_value_)
    return handle
