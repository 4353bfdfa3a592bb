"""Lightning precision plugins over :mod:`lightning_optim.precision` (no math here).

* :class:`MasterWeightsPrecision`: fp16/bf16 model, fp32 master weights held by the optimizer,
  dynamic loss scaling for fp16 with the overflow decision shared by every rank. Works with one
  device, ``DDPStrategy`` and the 1-bit strategies (their flat layout is built on the masters).
* :class:`KahanPrecision`: bf16 params (norm layers kept in fp32) stepped with Kahan summation.

Use as ``Trainer(plugins=[MasterWeightsPrecision()])`` (not together with ``precision=``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_optim.optim.base import BaseOptimizer
from lightning_optim.optim.validation import check_int
from lightning_optim.precision import DynamicLossScaler, MasterWeights
from lightning_optim.precision._checks import check_count

__all__ = ["MasterWeightsPrecision", "KahanPrecision"]

_DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16}
NORM_LAYERS: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase,
                                             *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))


def _check_precision(precision: object) -> torch.dtype:
    if precision not in _DTYPES:
        raise ValueError(f"precision: must be one of {sorted(_DTYPES)}, got {precision!r}")
    return _DTYPES[precision]


class _LowPrecisionModule(Precision):
    """What both plugins share: the model and its inputs in ``self.dtype`` (like Lightning's
    ``HalfPrecision``), the module converted in place (Lightning ignores ``convert_module``'s
    return value under DDP)."""

    dtype: torch.dtype

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.dtype)

    def tensor_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self.dtype)

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.dtype)


class MasterWeightsPrecision(_LowPrecisionModule):
    r"""fp16/bf16 training with fp32 master weights and (fp16) dynamic loss scaling.

    The optimizer built in ``configure_optimizers`` over the 16-bit params is made to step fp32
    masters when the plugin connects (before the first step). Each optimizer step: backward on
    :math:`S \cdot loss`; the 16-bit grads go to the masters as :math:`g / S` in fp32; an inf/NaN on
    any rank skips the step on every rank and backs :math:`S` off; otherwise
    ``gradient_clip_val`` clips the fp32 master grads, the optimizer steps and the masters are
    rounded into the model. ``precision/loss_scale`` is logged each step. Scaler and masters are in
    checkpoints (resume is exact).

    Args:
        precision: ``"16-true"`` (fp16, loss scaling) or ``"bf16-true"`` (bf16: same range as fp32,
            no scaling).
        init_scale, growth_factor, backoff_factor, growth_interval, min_scale, max_scale,
            hysteresis: the :class:`~lightning_optim.precision.DynamicLossScaler` (GradScaler's
            names; ``growth_interval`` is its ``scale_window``).
    """

    def __init__(
        self,
        precision: Literal["16-true", "bf16-true"] = "16-true",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1e-4,
        max_scale: float | None = 2.0**24,
        hysteresis: int = 1,
    ) -> None:
        self.dtype = _check_precision(precision)
        check_int("growth_interval", growth_interval, minimum=1)  # named as here, not as the scaler's
        if not isinstance(growth_factor, (int, float)) or isinstance(growth_factor, bool) or not growth_factor > 1:
            raise ValueError(f"growth_factor: must be a number > 1, got {growth_factor!r}")
        self.precision = precision
        self.scaler = None  # Lightning's GradScaler slot stays empty: our scaler is not a GradScaler
        self.loss_scaler = (DynamicLossScaler(init_scale, growth_factor, growth_interval, min_scale, max_scale,
                                              hysteresis, backoff_factor=backoff_factor)
                            if self.dtype == torch.float16 else None)
        self.masters: MasterWeights | None = None
        self._pending_state: dict[str, Any] | None = None
        self.skipped_steps = 0

    def connect(self, model: nn.Module, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple:
        if not optimizers:  # validate/test/predict: nothing to step
            return model, optimizers, lr_schedulers
        if len(optimizers) != 1:
            raise ValueError(f"MasterWeightsPrecision: needs exactly one optimizer, got {len(optimizers)}")
        optimizer = optimizers[0]
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("MasterWeightsPrecision: LBFGS re-evaluates the closure inside step(); not supported")
        self.masters = MasterWeights(model.parameters())
        self.masters.swap_into(optimizer)
        if self._pending_state is not None:
            self._load(self._pending_state)
            self._pending_state = None
        return model, optimizers, lr_schedulers

    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        if self.loss_scaler is not None:
            tensor = self.loss_scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    # lightning.pytorch's Precision.optimizer_step signature, itself an incompatible override of fabric's
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.masters is None:
            raise RuntimeError("MasterWeightsPrecision: optimizer_step before connect (the masters do not exist yet)")
        closure_result = closure()
        skipped_backward = closure_result is None and getattr(model, "automatic_optimization", True)
        if skipped_backward:
            self._after_closure(model, optimizer)
            return closure_result
        scaler = self.loss_scaler
        found = self.masters.grads_to_masters(1.0 if scaler is None else 1.0 / scaler.loss_scale)
        overflow = False
        if scaler is not None:
            overflow = scaler.agree(found)  # one 4-byte all-reduce: every rank skips the same steps
            scaler.update(overflow)
            self._log(model, scaler.loss_scale)
        self._after_closure(model, optimizer)  # on_before_optimizer_step + clipping on the fp32 master grads
        if overflow:
            self.skipped_steps += 1
            self.masters.zero_master_grads()
            return closure_result
        optimizer.step(**kwargs)
        self.masters.after_step(optimizer)
        return closure_result

    def main_params(self, optimizer: Any) -> Any:
        return [m for m in (self.masters.masters if self.masters else []) if m.grad is not None]

    @staticmethod
    def _log(model: Any, scale: float) -> None:
        log = getattr(model, "log", None)
        if callable(log) and getattr(model, "_trainer", None) is not None:
            log("precision/loss_scale", scale, on_step=True, on_epoch=False, prog_bar=False, logger=True)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"skipped_steps": self.skipped_steps}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        if self.masters is not None:
            state["masters"] = self.masters.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.masters is None:  # restored before connect: apply once the masters exist
            self._pending_state = state_dict
            return
        self._load(state_dict)

    def _load(self, state: dict[str, Any]) -> None:
        # every part checked before any is loaded: a bad masters entry must not leave the scale changed
        scaler, masters = self.loss_scaler, self.masters
        if masters is None:  # load_state_dict keeps the state until connect has made the masters
            raise RuntimeError("MasterWeightsPrecision: loading a state before the masters exist")
        scaler_state = state.get("loss_scaler") if scaler is not None else None
        if scaler is not None and scaler_state is not None:
            scaler.check_state_dict(scaler_state, "loss_scaler")
        if "masters" in state:
            masters.check_state_dict(state["masters"], "masters")
        skipped = check_count("skipped_steps", state.get("skipped_steps", 0))
        if scaler is not None and scaler_state is not None:
            scaler.load_state_dict(scaler_state)
        if "masters" in state:
            masters.load_state_dict(state["masters"])
        self.skipped_steps = skipped


class KahanPrecision(_LowPrecisionModule):
    r"""bf16 params with Kahan-compensated updates; norm layers stay fp32.

    Each update :math:`d` of a bf16 param :math:`p` with compensation :math:`c` runs
    :math:`y = d + c;\ t = \mathrm{round}(p + y);\ c = y - (t - p);\ p = t`, so the rounding error
    of every step is carried into the next (optimi's Kahan summation): near fp32 quality at bf16
    memory. Our optimizers compensate every bf16 param (a group that set ``kahan_sum=False`` is
    switched back on, with a warning); a torch optimizer has no Kahan summation: a warning says so once.

    Args:
        keep_fp32: module types kept in fp32 (inputs cast to fp32 and outputs back to bf16);
            default: the norm layers.

    The casts are forward hooks that live only while a Trainer runs: teardown removes them, so after
    ``fit`` the model holds bf16 params (fp32 kept modules) and no hooks; call ``model.float()`` (or
    ``model.to(torch.bfloat16)``) to use it outside a Trainer in one dtype.
    """

    precision = "bf16-true"

    def __init__(self, keep_fp32: tuple[type[nn.Module], ...] | None = None) -> None:
        self.dtype = torch.bfloat16
        keep = NORM_LAYERS if keep_fp32 is None else tuple(keep_fp32)
        if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in keep):
            raise TypeError(f"keep_fp32: expected nn.Module subclasses, got {keep_fp32!r}")
        self.keep_fp32 = keep
        self._cast_hooks: list[RemovableHandle] = []  # registered by convert_module, removed by teardown

    def convert_module(self, module: nn.Module) -> nn.Module:
        kept = [sub for sub in module.modules() if self.keep_fp32 and isinstance(sub, self.keep_fp32)]
        inside_kept = {id(m) for sub in kept for m in sub.modules()}
        for sub in module.modules():  # each module's own tensors: a kept one is never rounded to bf16
            if id(sub) not in inside_kept:
                sub._apply(lambda t: t.to(self.dtype) if t.is_floating_point() else t, recurse=False)
        for sub in kept:
            sub.float()
            if _inputs_to_fp32 not in sub._forward_pre_hooks.values():  # once, however often converted
                self._cast_hooks.append(sub.register_forward_pre_hook(_inputs_to_fp32))
                self._cast_hooks.append(sub.register_forward_hook(_output_to_bf16))
        return module

    def teardown(self) -> None:
        """Remove the casting hooks (the run is over): the user's module is a plain torch module again,
        its params left as the run made them (bf16, kept modules fp32), so ``model.float()`` or
        ``model.to(torch.bfloat16)`` gives a module that runs in one dtype. The next fit, validate,
        test or predict with this plugin converts and hooks it again."""
        for handle in self._cast_hooks:
            handle.remove()
        self._cast_hooks.clear()
        super().teardown()

    def connect(self, model: nn.Module, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple:
        for optimizer in optimizers:
            if isinstance(optimizer, BaseOptimizer):
                for i, group in enumerate(optimizer.param_groups):
                    if group.get("kahan_sum") is False:
                        warnings.warn(f"KahanPrecision: param group {i} set kahan_sum=False; switched on "
                                      "(bf16 params lose small updates to rounding without it)", stacklevel=2)
                        group["kahan_sum"] = None  # None: on for every 16-bit param, off for the fp32 ones
                optimizer._plans.clear()
            else:
                warnings.warn(
                    f"KahanPrecision: {type(optimizer).__name__} has no Kahan summation, so bf16 params lose "
                    "updates smaller than half a bf16 ulp; use a lightning_optim optimizer (e.g. "
                    "lightning_optim.AdamW) to get it", stacklevel=2)
        return model, optimizers, lr_schedulers


def _inputs_to_fp32(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if isinstance(a, Tensor) and a.is_floating_point() else a for a in args)


def _output_to_bf16(module: nn.Module, args: tuple, output: Any) -> Any:
    return apply_to_collection(output, function=lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t,
                               dtype=Tensor)
