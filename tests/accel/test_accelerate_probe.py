"""Probe: every argument of the Accelerate adapters (enable_onebit, enable_master_weights,
enable_gradient_release, their handles and helpers) refuses wrong types (TypeError) and ranges or
foreign objects (ValueError) with a message naming it, before anything changes (accelerator methods,
hooks, scaler slot, optimizer and model compared before and after); state loads are all-or-nothing;
on 2 real gloo ranks a refused call leaves nothing behind and the valid call after it trains.
Real ``Accelerator(cpu=True)`` objects, one process except the last test."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402

import accel_plugins  # noqa: E402
import lightning_optim as lo  # noqa: E402
from accel_plugins import accelerate as onebit_module  # noqa: E402
from accel_plugins import master_weights as masters_module  # noqa: E402
from accel_plugins import release as release_module  # noqa: E402
from accel_plugins.accelerate import OnebitHandle, load_rank_state, rank_state_path, save_rank_state  # noqa: E402
from accel_plugins.master_weights import MasterWeightsHandle  # noqa: E402
from accel_plugins.release import GradientReleaseHandle  # noqa: E402
from lightning_optim.precision import DynamicLossScaler, MasterWeights  # noqa: E402
from tests.distributed import run_workers  # noqa: E402
from tests.precision.probe_specs import (  # noqa: E402
    INF,
    KINDS,
    NAN,
    NUMPY_KINDS,
    R,
    T,
    V,
    Lazy,
    Target,
    check_bad_values_refused,
    check_numpy_twin_alike,
    observe,
    public_arguments,
)


# ---------------------------------------------------------------------------------------- fresh objects
def _onebit_of(params, freeze_step: int = 2):
    return accel_plugins.to_onebit_optimizer(torch.optim.AdamW(params, lr=1e-3), "onebit_adam", freeze_step=freeze_step)


def _bench(dtype: torch.dtype = torch.float32, optimizer: str = "lo") -> SimpleNamespace:
    """A prepared model and optimizer, another model, and optimizers that must be refused."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model, other = nn.Linear(4, 2).to(dtype), nn.Linear(4, 2).to(dtype)
    make = _onebit_of if optimizer == "onebit" else (lambda ps: lo.AdamW(ps, lr=1e-3))
    prepared, prepared_optimizer = accelerator.prepare(model, make(model.parameters()))
    return SimpleNamespace(accelerator=accelerator, model=prepared, optimizer=prepared_optimizer, other=other,
                           foreign=make(other.parameters()), torch_adamw=torch.optim.AdamW(model.parameters()))


def _backward(ctx: SimpleNamespace, dtype: torch.dtype) -> None:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)).to(dtype)
    ctx.accelerator.backward(ctx.model(x).float().pow(2).mean() * 1e-2)  # finite at fp16's default scale 2**16


def onebit_enabled() -> SimpleNamespace:
    ctx = _bench(optimizer="onebit")
    ctx.handle = accel_plugins.enable_onebit(ctx.accelerator, ctx.model, ctx.optimizer)
    _backward(ctx, torch.float32)
    return ctx


def rank_files() -> SimpleNamespace:
    ctx = _bench(optimizer="onebit")
    ctx.directory = _TMP.mktemp("rank")
    save_rank_state(ctx.optimizer.optimizer, ctx.model, ctx.directory)
    return ctx


def masters_ready() -> SimpleNamespace:
    """fp16 model, masters swapped into the optimizer, no handle yet."""
    ctx = _bench(torch.float16)
    ctx.masters = MasterWeights(ctx.model.parameters())
    ctx.masters.swap_into(ctx.optimizer.optimizer)
    ctx.unswapped = torch.optim.SGD(ctx.other.parameters(), lr=0.1)
    return ctx


def masters_enabled(dtype: torch.dtype = torch.float16) -> SimpleNamespace:
    ctx = _bench(dtype)
    ctx.handle = accel_plugins.enable_master_weights(ctx.accelerator, ctx.model, ctx.optimizer)
    _backward(ctx, dtype)
    return ctx


class _Tmp:
    """pytest's tmp_path_factory for the builders (set by the autouse fixture)."""

    factory: Any = None

    def mktemp(self, name: str) -> str:
        return str(self.factory.mktemp(name))


_TMP = _Tmp()


@pytest.fixture(autouse=True)
def _tmp(tmp_path_factory):
    _TMP.factory = tmp_path_factory


# ---------------------------------------------------------------------------------------- the table
KINDS_HERE = {
    "accelerator": [("not an accelerator", T), (None, T), (Lazy(lambda c: c.model, "a module"), T)],
    "acc_model": [("x", T), (None, T), (Lazy(lambda c: c.other, "another model"), V)],
    "a_module": [("x", T), (None, T), (torch.zeros(2), T)],
    "onebit_optimizer": [("x", T), (None, T), (Lazy(lambda c: c.torch_adamw, "not 1-bit"), T),
                         (Lazy(lambda c: c.foreign, "over another model"), V)],
    "onebit_inner": [("x", T), (None, T), (Lazy(lambda c: c.torch_adamw, "not 1-bit"), T)],
    "acc_optimizer": [("x", T), (None, T), (Lazy(lambda c: c.foreign, "over another model"), V)],
    "release_optimizer": [("x", T), (None, T), (Lazy(lambda c: c.torch_adamw, "a torch optimizer"), T),
                          (Lazy(lambda c: c.foreign, "over another model"), V)],
    "lo_inner": [("x", T), (Lazy(lambda c: c.torch_adamw, "a torch optimizer"), T)],
    "masters_optimizer": [("x", T), (None, T), (Lazy(lambda c: c.unswapped, "masters not swapped in"), V),
                          (Lazy(lambda c: torch.optim.SGD(c.model.parameters(), lr=0.1), "the 16-bit params"), R)],
    "torch_optimizer": [("x", T), (None, T), (Lazy(lambda c: c.model, "a module"), T)],
    "onebit_name": [(5, T), (None, T), ("onebit_sgd", V)],
    "loss_scaler_choice": [("dynamic", T), (5, T), (Lazy(lambda c: DynamicLossScaler, "the class"), T)],
    "masters": [("x", T), (None, T)],
    "optional_scaler": [("x", T), (1.0, T)],
    "switch": [("x", T), (1, T)],
    "optional_accelerator": [("x", T), (Lazy(lambda c: c.model, "a module"), T)],
    "clip_params": [("abc", T), (5, T), ([5], T), (None, T), ([torch.ones(2, dtype=torch.int64)], T)],
    "directory": [(5, T), (None, T)],
    "closure_refused": [("x", V), (Lazy(lambda c: (lambda: None), "a closure"), V)],
}
ALL_KINDS = {**KINDS, **KINDS_HERE}
CLIP_ARGS = {"parameters": "clip_params", "max_norm": "positive_or_inf", "norm_type": "positive_or_inf"}


def _clip_valid(c):
    return {"parameters": list(c.model.parameters()), "max_norm": 0.5, "norm_type": 2.0}


TARGETS = [
    Target("enable_onebit", lambda: _bench(optimizer="onebit"), lambda c, **kw: accel_plugins.enable_onebit(**kw),
           {"accelerator": "accelerator", "model": "acc_model", "optimizer": "onebit_optimizer"},
           lambda c: {"accelerator": c.accelerator, "model": c.model, "optimizer": c.optimizer}),
    Target("to_onebit_optimizer", _bench, lambda c, **kw: accel_plugins.to_onebit_optimizer(**kw),
           {"optimizer": "torch_optimizer", "name": "onebit_name"},
           lambda c: {"optimizer": torch.optim.AdamW(c.other.parameters()), "name": "zero_one_adam"}),
    Target("OnebitHandle", lambda: _bench(optimizer="onebit"), lambda c, **kw: OnebitHandle(**kw),
           {"optimizer": "onebit_inner", "model": "a_module", "switch": "switch", "accelerator": "optional_accelerator"},
           lambda c: {"optimizer": c.optimizer.optimizer, "model": c.model, "switch": None,
                      "accelerator": c.accelerator}),
    Target("OnebitHandle.clip_grad_norm_", onebit_enabled, lambda c, **kw: c.handle.clip_grad_norm_(**kw),
           CLIP_ARGS, _clip_valid),
    Target("save_rank_state", lambda: _bench(optimizer="onebit"), lambda c, **kw: save_rank_state(**kw),
           {"optimizer": "onebit_inner", "model": "a_module", "directory": "directory"},
           lambda c: {"optimizer": c.optimizer.optimizer, "model": c.model, "directory": _TMP.mktemp("save")}),
    Target("load_rank_state", rank_files, lambda c, **kw: load_rank_state(**kw),
           {"optimizer": "onebit_inner", "model": "a_module", "directory": "directory"},
           lambda c: {"optimizer": c.optimizer.optimizer, "model": c.model, "directory": c.directory}),
    Target("enable_master_weights", lambda: _bench(torch.float16), lambda c, **kw: accel_plugins.enable_master_weights(**kw),
           {"accelerator": "accelerator", "model": "acc_model", "optimizer": "acc_optimizer",
            "loss_scaler": "loss_scaler_choice"},
           lambda c: {"accelerator": c.accelerator, "model": c.model, "optimizer": c.optimizer, "loss_scaler": "auto"}),
    Target("MasterWeightsHandle", masters_ready, lambda c, **kw: MasterWeightsHandle(**kw),
           {"accelerator": "accelerator", "optimizer": "masters_optimizer", "masters": "masters",
            "loss_scaler": "optional_scaler"},
           lambda c: {"accelerator": c.accelerator, "optimizer": c.optimizer, "masters": c.masters,
                      "loss_scaler": DynamicLossScaler()}),
    Target("MasterWeightsHandle.scale", masters_enabled, lambda c, **kw: c.handle.scale(**kw), {"loss": "loss"},
           lambda c: {"loss": torch.tensor(3.0)}),
    Target("MasterWeightsHandle.optimizer_step", masters_enabled, lambda c, **kw: c.handle.optimizer_step(**kw),
           {"closure": "closure_refused"}, lambda c: {"closure": None}),
    Target("MasterWeightsHandle.clip_grad_norm_", masters_enabled, lambda c, **kw: c.handle.clip_grad_norm_(**kw),
           CLIP_ARGS, _clip_valid),
    Target("MasterWeightsHandle.clip_grad_value_", masters_enabled, lambda c, **kw: c.handle.clip_grad_value_(**kw),
           {"parameters": "clip_params", "clip_value": "positive"},
           lambda c: {"parameters": list(c.model.parameters()), "clip_value": 0.5}),
    Target("enable_gradient_release", _bench, lambda c, **kw: accel_plugins.enable_gradient_release(**kw),
           {"accelerator": "accelerator", "model": "acc_model", "optimizer": "release_optimizer"},
           lambda c: {"accelerator": c.accelerator, "model": c.model, "optimizer": c.optimizer}),
    Target("GradientReleaseHandle", _bench, lambda c, **kw: GradientReleaseHandle(**kw),
           {"accelerator": "accelerator", "model": "a_module", "optimizer": "lo_inner"},
           lambda c: {"accelerator": c.accelerator, "model": c.model, "optimizer": c.optimizer.optimizer}),
]
ARGS = [(t, name) for t in TARGETS for name in t.args]
STATE_PROBED = {("OnebitHandle.load_state_dict", "state"), ("MasterWeightsHandle.load_state_dict", "state")}


# ---------------------------------------------------------------------------------------- what must not change
def observe_here(obj: Any) -> Any:
    if isinstance(obj, Accelerator):
        return (sorted(k for k in ("clip_grad_norm_", "clip_grad_value_") if k in vars(obj)),
                type(obj.scaler).__name__, len(obj._save_model_state_pre_hook), len(obj._load_model_state_pre_hook),
                len(obj._custom_objects))
    if isinstance(obj, nn.Module):
        hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in obj.parameters())
        return observe(obj), hooks, hasattr(obj, "_lightning_optim_release")
    if isinstance(obj, MasterWeightsHandle):
        return observe(obj.state_dict()), observe(obj.masters), obj.accelerator.scaler is obj
    if isinstance(obj, OnebitHandle):
        return len(obj._handles), observe(obj.optimizer)
    return observe(obj)


def snapshot_here(ctx: SimpleNamespace) -> Any:
    return [(k, observe_here(v)) for k, v in sorted(vars(ctx).items())]


def test_the_table_covers_every_public_argument():
    public = set()
    for module in (onebit_module, masters_module, release_module):
        public |= public_arguments(module)
    swept = {(t.name, name) for t, name in ARGS}
    assert public - swept - STATE_PROBED == set()
    assert swept - public == set()


@pytest.mark.parametrize("target,name", ARGS, ids=[f"{t}:{n}" for t, n in ARGS])
def test_a_bad_value_is_refused_by_name_and_changes_nothing(target: Target, name: str):
    check_bad_values_refused(target, name, ALL_KINDS, snapshot_here)


NUMERIC = [(t, n) for t, n in ARGS if t.args[n] in NUMPY_KINDS]


@pytest.mark.parametrize("target,name", NUMERIC, ids=[f"{t}:{n}" for t, n in NUMERIC])
def test_numpy_scalars_work_like_python_numbers(target: Target, name: str):
    check_numpy_twin_alike(target, name, snapshot_here)


def test_an_optimizer_over_another_model_used_to_be_accepted_and_is_now_refused():
    """The model never moved: the optimizer stepped the other model's params."""
    ctx = _bench(torch.float16)
    with pytest.raises(ValueError, match="optimizer: 2 of its params are not params of model"):
        accel_plugins.enable_master_weights(ctx.accelerator, ctx.model, ctx.foreign)
    handle = accel_plugins.enable_master_weights(ctx.accelerator, ctx.model, ctx.optimizer)  # the valid call
    before = [p.detach().clone() for p in ctx.model.parameters()]
    _backward(ctx, torch.float16)
    ctx.optimizer.step()
    assert handle.skipped_steps == 0
    assert all(not torch.equal(a, b) for a, b in zip(before, ctx.model.parameters()))


# ---------------------------------------------------------------------------------------- state loads
def _refused(obj, state, error, names: str, watched: SimpleNamespace) -> None:
    before = snapshot_here(watched)
    with pytest.raises(error) as info:
        obj.load_state_dict(state)
    assert names in str(info.value), str(info.value)
    assert snapshot_here(watched) == before


def _with(state: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(state)
    holder = out
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    return out


def test_master_weights_handle_load_checks_every_key_before_any_changes():
    target, source = masters_enabled(), masters_enabled()
    source.optimizer.step()
    source.handle.loss_scaler.update(True)  # the source's scale differs: a half-applied load would show
    good = source.handle.state_dict()
    master = good["masters"]["masters"][0]
    bad = [(("masters", "masters", 0), master.to(torch.int64), T, "state['masters']['masters'][0]"),
           (("masters", "masters", 0), master[:1], V, "state['masters']['masters'][0]"),
           (("masters", "masters"), [master], V, "state['masters']['masters']"),
           (("loss_scaler", "clean_steps"), -1, V, "state['loss_scaler']['clean_steps']"),
           (("loss_scaler", "overflows_left"), 1.5, T, "state['loss_scaler']['overflows_left']"),
           (("loss_scaler", "loss_scale"), NAN, V, "state['loss_scaler']['loss_scale']"),
           (("skipped_steps",), -1, V, "state['skipped_steps']"),
           (("skipped_steps",), 0.5, T, "state['skipped_steps']"),
           (("extra",), 1, V, "extra")]
    for path, value, error, names in bad:
        _refused(target.handle, _with(good, path, value), error, names, target)
    _refused(target.handle, {k: v for k, v in good.items() if k != "masters"}, V, "masters", target)
    _refused(target.handle, "x", T, "state", target)
    target.handle.load_state_dict(good)
    assert observe(target.handle.state_dict()) == observe(good)


def test_bf16_handle_refuses_a_scaled_state():
    target, source = masters_enabled(torch.bfloat16), masters_enabled()
    _refused(target.handle, source.handle.state_dict(), V, "loss scaling is on in the checkpoint", target)


def test_onebit_handle_and_rank_files_are_checked_before_loading():
    ctx = onebit_enabled()
    for state, error, names in (({"format": 2, "world_size": 1}, V, "state['format']"),
                                ({"format": 1, "world_size": 0}, V, "state['world_size']"),
                                ({"format": 1, "world_size": "1"}, T, "state['world_size']"),
                                ({"format": 1}, V, "world_size"), ([1], T, "state")):
        _refused(ctx.handle, state, error, names, ctx)
    ctx.handle.load_state_dict({"format": 1, "world_size": 1})
    # a rank file whose pieces are wrong: refused whole (torch's module load would apply what matches first)
    ctx = rank_files()
    inner = ctx.optimizer.optimizer
    path = rank_state_path(ctx.directory, 0)
    good = torch.load(path, weights_only=False)
    live = {k: v.detach().clone() for k, v in ctx.model.state_dict().items()}
    stepped = [p.detach().clone() for g in inner.param_groups for p in g["params"]]
    weight = live["weight"]
    files = [({**good, "model": {**live, "weight": weight.to(torch.int64)}}, V, "['model']['weight']"),
             ({**good, "model": {"weight": weight}}, V, "['model']"),
             ({**good, "stepped": stepped[:1]}, V, "['stepped']"),
             ({**good, "stepped": [stepped[0].double(), stepped[1]]}, V, "['stepped'][0]"),
             ({**good, "optimizer": {"state": {0: {"exp_avg": weight.to(torch.int64)}},
                                     "param_groups": good["optimizer"]["param_groups"]}}, T,
              "['optimizer']['state'][0]['exp_avg']"),
             ({k: v for k, v in good.items() if k != "stepped"}, V, "stepped")]
    for payload, error, names in files:
        torch.save(payload, path)
        before = snapshot_here(ctx)
        with pytest.raises(error) as info:
            load_rank_state(inner, ctx.model, ctx.directory)
        assert names in str(info.value), str(info.value)
        assert snapshot_here(ctx) == before
    torch.save(good, path)
    assert load_rank_state(inner, ctx.model, ctx.directory) is True


# ---------------------------------------------------------------------------------------- 2 gloo ranks
def test_on_two_ranks_a_refused_call_leaves_nothing_and_the_valid_one_trains():
    from tests.accel.probe_workers import refused_then_valid

    results = run_workers(2, refused_then_valid, timeout=180)
    for out in results:
        assert "MULTI_CPU" in out["kind"]
        assert out["masters_refused"].startswith("ValueError: optimizer: 2 of its params are not params of model")
        assert out["onebit_refused"].startswith("ValueError: optimizer: 2 of its params are not params of model")
        assert out["masters_untouched"] and out["onebit_untouched"] and out["masters_moved"]
    for key in ("masters_params", "onebit_params"):
        for a, b in zip(results[0][key], results[1][key]):
            assert torch.equal(a, b), key


def test_special_values_are_accepted():
    ctx = onebit_enabled()
    assert torch.isfinite(ctx.handle.clip_grad_norm_(list(ctx.model.parameters()), INF))  # measure only
    ctx = masters_enabled()
    accel_plugins.enable_onebit  # noqa: B018 - (import check: the lazy attribute resolves)
    assert torch.isfinite(ctx.handle.clip_grad_norm_(ctx.model.parameters(), INF, norm_type=INF))
