"""The argument table of the precision probes: every public callable of ``lightning_optim.precision``,
how to build fresh objects to call it on, and the kind of each argument. A kind decides the bad
values swept over the argument (each with the exception it must raise) and the numpy scalars that
must work like the Python numbers they hold. tests/accel/test_accelerate_probe.py adds the adapters'.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import lightning_optim as lo
from lightning_optim.precision import DynamicLossScaler, FP16Optimizer, MasterWeights, found_non_finite

V, T, R, K = ValueError, TypeError, RuntimeError, KeyError
NAN, INF = math.nan, math.inf


@dataclass(frozen=True)
class Lazy:
    """A bad value built from the fresh objects (``Lazy(lambda ctx: ctx.model.weight * 2)``)."""

    make: Callable[[SimpleNamespace], Any]
    label: str

    def __repr__(self) -> str:
        return self.label


# kind -> [(bad value, exception)]; numbers also get numpy twins that must be accepted (NUMPY_KINDS)
KINDS: dict[str, list[tuple[Any, type]]] = {
    "positive": [(NAN, V), (INF, V), (-INF, V), (0.0, V), (-1.0, V), (True, T), ("1.0", T), (None, T), ([1.0], T),
                 (torch.tensor(1.0), T)],
    "positive_or_inf": [(NAN, V), (-INF, V), (0.0, V), (-1.0, V), (True, T), ("1.0", T), (None, T), ([1.0], T)],
    "optional_positive_or_inf": [(NAN, V), (-INF, V), (0.0, V), (-1.0, V), (True, T), ("1.0", T), ([1.0], T)],
    "optional_positive": [(NAN, V), (INF, V), (0.0, V), (-1.0, V), (True, T), ("1.0", T)],
    "above_one": [(1.0, V), (0.5, V), (INF, V), (NAN, V), (True, T), ("2", T), (None, T)],
    "optional_unit_open": [(0.0, V), (1.0, V), (-0.5, V), (1.5, V), (NAN, V), (INF, V), (True, T), ("0.5", T)],
    "count1": [(0, V), (-1, V), (2.5, T), (2.0, T), ("3", T), (True, T), (None, T), (NAN, T)],
    "flag": [("False", T), (1, T), (0.0, T), (None, T)],
    "label": [(5, T), (None, T)],
    "process_group": [("x", T), (0, T)],
    "module": [("x", T), (None, T), (torch.zeros(2), T)],
    "optimizer": [("x", T), (None, T), (Lazy(lambda c: c.model, "a module"), T)],
    "scaler": [("x", T), (1.0, T)],
    "loss": [("x", T), (2.0, T), (torch.tensor(2), T), (None, T)],
    "tensor_list": [(torch.ones(3, 2), T), ("abc", T), (5, T), ([5], T), ([torch.ones(2, dtype=torch.int64)], T),
                    (None, T)],
    "found": [("x", T), (None, T), (1.0, T), (torch.zeros(2), V)],
    "callable": [("x", T), (5, T)],
    "tracker": [(object(), T), ("x", T)],
    "denom": [("x", T), (True, T), (NAN, V), (-1.0, V), (INF, V), (torch.ones(2), T), (None, V)],
    "param": [("x", T), (None, T), (torch.zeros(3), K)],
    "flat": [("x", T), (torch.zeros(21, dtype=torch.int64), T), (torch.zeros(7), V), (torch.zeros(21, 1), V),
             (torch.zeros(22), V)],
}
NUMPY_KINDS = {"positive", "positive_or_inf", "optional_positive_or_inf", "optional_positive", "above_one",
               "optional_unit_open", "count1", "flag", "denom"}


def numpy_twin(value: Any) -> Any:
    """The numpy scalar that must act like ``value``."""
    if isinstance(value, bool):
        return np.bool_(value)
    return np.int64(value) if isinstance(value, int) else np.float32(value)


@dataclass(frozen=True)
class Target:
    """One public callable: ``call(ctx, **kwargs)`` on fresh objects ``make()``; ``args``: name -> kind;
    ``valid(ctx)``: a valid value for every argument."""

    name: str
    make: Callable[[], SimpleNamespace]
    call: Callable[..., Any]
    args: dict[str, str]
    valid: Callable[[SimpleNamespace], dict[str, Any]] = field(default=lambda ctx: {})

    def __str__(self) -> str:
        return self.name


# ---------------------------------------------------------------------------------------- fresh objects
def fp16_model(seed: int = 0) -> nn.Module:
    """A half model with an fp32 norm (its own master) and gradients from one backward."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)).half()
    model[1].float()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    model[1](model[0](x.half()).float()).pow(2).mean().mul(64.0).backward()
    return model


def bare() -> SimpleNamespace:
    return SimpleNamespace(model=fp16_model())


def scaler_bench() -> SimpleNamespace:
    scaler = DynamicLossScaler(init_scale=64.0, scale_window=3, hysteresis=2)
    scaler.update(False)
    scaler.update(True)  # a state with a counter in every field
    return SimpleNamespace(scaler=scaler, grads=[torch.ones(3) * 64.0], model=fp16_model())


def masters_bench(swapped: bool = True) -> SimpleNamespace:
    model = fp16_model()
    masters = MasterWeights(model.parameters())
    optimizer = lo.AdamW(model.parameters(), lr=1e-2)
    if swapped:
        masters.swap_into(optimizer)
    other = nn.Linear(2, 2)
    return SimpleNamespace(model=model, masters=masters, optimizer=optimizer, scaler=DynamicLossScaler(init_scale=8.0),
                           foreign=torch.optim.SGD(other.parameters(), lr=0.1), other=other)


def fp16_bench(average_custom: bool = False) -> SimpleNamespace:
    model = fp16_model()
    fp = FP16Optimizer(model, 1, average_world=not average_custom, average_custom=average_custom, init_scale=8.0)
    fp.set_optimizer(torch.optim.AdamW([fp.fp32_params], lr=1e-2))
    fp.fp16_model.zero_grad()
    fp.backward_loss(fp.fp16_model[0](torch.ones(2, 4).half()).float().sum())
    stray = nn.Parameter(torch.zeros(3))
    return SimpleNamespace(model=model, fp=fp, other=torch.optim.SGD([stray], lr=0.1),
                           mixed=torch.optim.SGD([fp.fp32_params, stray], lr=0.1))


SCALER_ARGS = {"init_scale": "positive", "scale_factor": "above_one", "scale_window": "count1",
               "min_scale": "positive", "max_scale": "optional_positive_or_inf", "hysteresis": "count1",
               "backoff_factor": "optional_unit_open", "process_group": "process_group"}
SCALER_VALID = dict(init_scale=1024.0, scale_factor=2.0, scale_window=3, min_scale=0.25, max_scale=4096.0,
                    hysteresis=2, backoff_factor=0.5, process_group=None)
FP16_FLAGS = ("use_cuda", "use_horovod", "by_layer", "average_world", "average_custom", "divide_before")
FP16_VALID = dict(world_size=1, use_cuda=False, use_horovod=False, by_layer=False, grad_clip=1.0, init_scale=8.0,
                  scale_factor=2.0, scale_window=3, max_scale=64.0, min_scale=0.25, average_world=True,
                  average_custom=False, divide_before=False)

TARGETS: list[Target] = [
    Target("DynamicLossScaler", SimpleNamespace, lambda c, **kw: DynamicLossScaler(**kw), SCALER_ARGS, lambda c: SCALER_VALID),
    Target("DynamicLossScaler.scale", scaler_bench, lambda c, **kw: c.scaler.scale(**kw), {"loss": "loss"},
           lambda c: {"loss": torch.tensor(2.0)}),
    Target("DynamicLossScaler.unscale_and_check", scaler_bench, lambda c, **kw: c.scaler.unscale_and_check(**kw),
           {"grads": "tensor_list"}, lambda c: {"grads": c.grads}),
    Target("DynamicLossScaler.agree", scaler_bench, lambda c, **kw: c.scaler.agree(**kw), {"found": "found"},
           lambda c: {"found": True}),
    Target("DynamicLossScaler.update", scaler_bench, lambda c, **kw: c.scaler.update(**kw), {"overflow": "flag"},
           lambda c: {"overflow": True}),
    Target("DynamicLossScaler.check_state_dict", scaler_bench, lambda c, **kw: c.scaler.check_state_dict(**kw),
           {"where": "label"}, lambda c: {"state": c.scaler.state_dict(), "where": "saved"}),
    Target("found_non_finite", scaler_bench, lambda c, **kw: found_non_finite(**kw),
           {"grads": "tensor_list", "inv_scale": "optional_positive"}, lambda c: {"grads": c.grads, "inv_scale": 0.5}),
    Target("MasterWeights", bare, lambda c, **kw: MasterWeights(**kw), {"params": "params"},
           lambda c: {"params": list(c.model.parameters())}),
    Target("MasterWeights.master_of", masters_bench, lambda c, **kw: c.masters.master_of(**kw), {"p": "param"},
           lambda c: {"p": c.model[0].weight}),
    Target("MasterWeights.swap_into", lambda: masters_bench(False), lambda c, **kw: c.masters.swap_into(**kw),
           {"optimizer": "optimizer_to_swap"}, lambda c: {"optimizer": c.optimizer}),
    Target("MasterWeights.check_steps_masters", masters_bench, lambda c, **kw: c.masters.check_steps_masters(**kw),
           {"optimizer": "optimizer_swapped"}, lambda c: {"optimizer": c.optimizer}),
    Target("MasterWeights.grads_to_masters", masters_bench, lambda c, **kw: c.masters.grads_to_masters(**kw),
           {"inv_scale": "positive"}, lambda c: {"inv_scale": 0.5}),
    Target("MasterWeights.step", masters_bench, lambda c, **kw: c.masters.step(**kw),
           {"optimizer": "optimizer_swapped", "scaler": "scaler", "max_grad_norm": "optional_positive_or_inf"},
           lambda c: {"optimizer": c.optimizer, "scaler": c.scaler, "max_grad_norm": 0.5}),
    Target("MasterWeights.after_step", masters_bench, lambda c, **kw: c.masters.after_step(**kw),
           {"optimizer": "optimizer"}, lambda c: {"optimizer": c.optimizer}),
    Target("MasterWeights.check_state_dict", masters_bench, lambda c, **kw: c.masters.check_state_dict(**kw),
           {"where": "label"}, lambda c: {"state": c.masters.state_dict(), "where": "saved"}),
    Target("FP16Optimizer", bare, lambda c, **kw: FP16Optimizer(**kw),
           {"fp16_model": "module", "world_size": "world_size", "grad_clip": "positive_or_inf",
            **{k: v for k, v in SCALER_ARGS.items() if k in ("init_scale", "scale_factor", "scale_window", "max_scale",
                                                            "min_scale")},
            **{flag: "flag" for flag in FP16_FLAGS}},
           lambda c: {"fp16_model": c.model, **FP16_VALID}),
    Target("FP16Optimizer.fp16_to_fp32_flat_grad", fp16_bench, lambda c, **kw: FP16Optimizer.fp16_to_fp32_flat_grad(**kw),
           {"fp32_params": "flat", "fp16_model": "module"},
           lambda c: {"fp32_params": c.fp.fp32_params, "fp16_model": c.model}),
    Target("FP16Optimizer.fp32_to_fp16_weights", fp16_bench, lambda c, **kw: FP16Optimizer.fp32_to_fp16_weights(**kw),
           {"fp16_model": "module", "fp32_params": "flat"},
           lambda c: {"fp32_params": c.fp.fp32_params.detach() + 1, "fp16_model": c.model}),
    Target("FP16Optimizer.set_optimizer", fp16_bench, lambda c, **kw: c.fp.set_optimizer(**kw),
           {"optimizer": "optimizer_of_flat"}, lambda c: {"optimizer": torch.optim.SGD([c.fp.fp32_params], lr=0.1)}),
    Target("FP16Optimizer.backward_loss", fp16_bench, lambda c, **kw: c.fp.backward_loss(**kw), {"loss": "loss"},
           lambda c: {"loss": c.model[0](torch.ones(1, 4).half()).float().sum()}),
    Target("FP16Optimizer.step", fp16_bench, lambda c, **kw: c.fp.step(**kw),
           {"closure": "callable", "tracker": "tracker", "multiplier": "positive"},
           lambda c: {"closure": None, "tracker": None, "multiplier": 2.0}),
    Target("FP16Optimizer.step[average_custom]", lambda: fp16_bench(True), lambda c, **kw: c.fp.step(**kw),
           {"denom": "denom"}, lambda c: {"denom": 3.0}),
]

# kinds whose bad values need the fresh objects
KINDS.update({
    "params": [(Lazy(lambda c: c.model[0].weight, "one Parameter"), T), ("abc", T), (5, T), ([5], T), ([], V),
               (Lazy(lambda c: [c.model[0].weight, c.model[0].bias, c.model[0].weight], "a duplicate"), V),
               (Lazy(lambda c: [{"params": [c.model[0].weight]}, {"params": [c.model[0].weight]}],
                     "a duplicate across groups"), V),
               (Lazy(lambda c: [c.model[0].weight * 2], "a non-leaf"), V),
               (Lazy(lambda c: [torch.zeros(2, dtype=torch.complex64, requires_grad=True)], "complex"), T),
               ([{"lr": 1.0}], T)],
    "optimizer_to_swap": [*KINDS["optimizer"], (Lazy(lambda c: c.foreign, "another model's optimizer"), V)],
    "optimizer_swapped": [*KINDS["optimizer"], (Lazy(lambda c: c.foreign, "another model's optimizer"), V),
                          (Lazy(lambda c: torch.optim.SGD(c.model.parameters(), lr=0.1), "swap_into forgotten"), R)],
    "optimizer_of_flat": [*KINDS["optimizer"], (Lazy(lambda c: c.other, "another param's optimizer"), V),
                          (Lazy(lambda c: c.mixed, "fp32_params and another param"), V)],
    "world_size": [(0, V), (-1, V), (2, V), (1.0, T), ("1", T), (True, T), (None, T)],
})
NUMPY_KINDS.add("world_size")


# ---------------------------------------------------------------------------------------- what must not change
def observe(obj: Any) -> Any:
    """What a refused call must leave exactly as it was, as plain values (tensors as their bytes, so the
    comparison is bitwise and NaN equals NaN)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        grad = obj.grad if obj.is_leaf else None
        return ("tensor", str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes(),
                None if grad is None else observe(grad))
    if isinstance(obj, nn.Module):
        return ([(n, observe(p)) for n, p in obj.named_parameters()] + [(n, observe(b)) for n, b in obj.named_buffers()]
                + [("hooks", len(obj._forward_pre_hooks), len(obj._forward_hooks))])
    if isinstance(obj, torch.optim.Optimizer):
        # the params by content and dtype (a swap shows as fp32 masters in place of fp16 params)
        return (observe(obj.state_dict()), [observe(p) for g in obj.param_groups for p in g["params"]],
                "step" in vars(obj), getattr(obj, "_released", None), getattr(obj, "ddp_allreduce_managed", None),
                len(getattr(obj, "_param_copies", None) or {}))
    if isinstance(obj, DynamicLossScaler):
        return observe({k: v for k, v in vars(obj).items() if k != "process_group"})
    if isinstance(obj, MasterWeights):
        return (observe(obj.state_dict()), observe(obj.masters), observe(obj.model_params))
    if isinstance(obj, FP16Optimizer):
        return observe(obj.state_dict()), observe(obj.fp16_model), obj.optimizer is None
    if isinstance(obj, dict):
        return sorted(((str(k), observe(v)) for k, v in obj.items()), key=lambda kv: kv[0])  # order is no state
    if isinstance(obj, (list, tuple)):
        return [observe(v) for v in obj]
    if isinstance(obj, float) and math.isnan(obj):
        return "nan"
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return type(obj).__name__  # anything else: its kind only (extended by the adapters' probe)


def snapshot(ctx: SimpleNamespace) -> Any:
    return observe(vars(ctx))


def with_value(target: Target, ctx: SimpleNamespace, name: str, value: Any) -> dict[str, Any]:
    """The valid arguments of ``target`` with ``name`` set to ``value`` (a :class:`Lazy` one built on ``ctx``)."""
    kwargs = dict(target.valid(ctx))
    kwargs[name] = value.make(ctx) if isinstance(value, Lazy) else value
    return kwargs


def public_arguments(module, owner: str = "") -> set[tuple[str, str]]:
    """``(callable, argument)`` for every public function, class constructor and public method in ``__all__``
    (private dataclass fields and ``**kwargs`` left out)."""
    out = set()
    for name in module.__all__:
        obj = getattr(module, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            continue  # an exception class takes a message
        if isinstance(obj, type):
            callables = [(name, obj)] + [(f"{name}.{m}", getattr(obj, m)) for m in vars(obj)
                                         if not m.startswith("_") and callable(getattr(obj, m))]
        elif callable(obj):
            callables = [(name, obj)]
        else:
            continue  # a constant (a table of names)
        for label, fn in callables:
            for arg, param in inspect.signature(fn).parameters.items():
                if arg != "self" and not arg.startswith("_") and param.kind not in (param.VAR_KEYWORD,
                                                                                    param.VAR_POSITIONAL):
                    out.add((owner + label, arg))
    return out


def check_bad_values_refused(target: Target, name: str, kinds: dict[str, list], snap: Callable[[SimpleNamespace], Any]
                             ) -> None:
    """Each bad value of ``name``'s kind: the error type expected, a message naming ``name``, and ``snap`` of the
    objects the same before and after (nothing changed before the refusal)."""
    for bad, error in kinds[target.args[name]]:
        ctx = target.make()
        kwargs = with_value(target, ctx, name, bad)
        before = snap(ctx)
        with pytest.raises(error) as info:
            target.call(ctx, **kwargs)
        assert name in str(info.value), (bad, str(info.value))
        assert snap(ctx) == before, f"{target}({name}={bad!r}) changed its objects before refusing"


def check_numpy_twin_alike(target: Target, name: str, snap: Callable[[SimpleNamespace], Any]) -> None:
    """The valid value of ``name`` as a numpy scalar: the same result and the same objects afterwards."""
    seen = []
    for convert in (lambda v: v, numpy_twin):
        ctx = target.make()
        kwargs = dict(target.valid(ctx))
        kwargs[name] = convert(kwargs[name])
        seen.append((observe(target.call(ctx, **kwargs)), snap(ctx)))
    assert seen[0] == seen[1]
