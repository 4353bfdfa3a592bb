"""Probe: loads and steps of the precision tools are all-or-nothing. Every key of a DynamicLossScaler,
MasterWeights and FP16Optimizer state dict (inner optimizer state included, for a torch and our
optimizer) is refused by name when its type, range, dtype or shape is wrong, or when keys are
missing or extra, and the objects are then bitwise as before; a refused step leaves the scaler as
it was. Also: the misuses that used to train wrongly without an error now raise, and the valid use
still equals a reference written by hand (tests/reference/fp16_reference.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import lightning_optim as lo
from lightning_optim.precision import DynamicLossScaler, FP16Optimizer, MasterWeights
from tests.precision.probe_specs import INF, NAN, T, V, fp16_model, observe
from tests.reference.fp16_reference import expected_gradient

EITHER = (TypeError, ValueError)


def _edited(state: dict, path: tuple, value) -> dict:
    """A deep copy of ``state`` with ``state[path[0]][path[1]]... = value`` (``DELETE``: the key removed)."""
    out = copy.deepcopy(state)
    holder = out
    for key in path[:-1]:
        holder = holder[key]
    if value is DELETE:
        del holder[path[-1]]
    else:
        holder[path[-1]] = value
    return out


DELETE = object()


def _refused(obj, state: dict, error, names: str) -> None:
    """``obj.load_state_dict(state)`` raises ``error`` naming ``names`` and leaves ``obj`` bitwise as it was."""
    before = observe(obj)
    with pytest.raises(error) as info:
        obj.load_state_dict(state)
    assert names in str(info.value), str(info.value)
    assert observe(obj) == before


# ---------------------------------------------------------------------------------------- the loss scaler
def _scaler(steps: list[bool]) -> DynamicLossScaler:
    scaler = DynamicLossScaler(init_scale=64.0, scale_window=3, min_scale=1.0, max_scale=1024.0, hysteresis=2)
    for overflow in steps:
        scaler.update(overflow)
    return scaler


SCALER_BAD = {
    "loss_scale": [("x", T), (NAN, V), (INF, V), (0.0, V), (-1.0, V), (True, T), (0.5, V), (2048.0, V), (None, T)],
    "clean_steps": [(-1, V), (1.5, T), ("3", T), (True, T), (None, T), (torch.tensor(1), T)],
    "overflows_left": [(0, V), (3, V), (1.5, T), (None, T)],
    "skipped_steps": [(-1, V), (2.5, T), ("1", T)],
}


@pytest.mark.parametrize("key", list(SCALER_BAD))
def test_scaler_load_refuses_a_bad_key_before_assigning_any(key):
    target, good = _scaler([False, True]), _scaler([True, True, False, False]).state_dict()
    assert good["loss_scale"] != target.loss_scale  # a load would change the scale first
    for bad, error in SCALER_BAD[key]:
        _refused(target, _edited(good, (key,), bad), error, f"state['{key}']")


def test_scaler_load_refuses_missing_extra_and_non_dict_states():
    target, good = _scaler([False, True]), _scaler([True, True, False]).state_dict()
    for key in ("loss_scale", "clean_steps", "overflows_left"):
        _refused(target, _edited(good, (key,), DELETE), V, key)
    _refused(target, {**good, "growth_tracker": 3}, V, "growth_tracker")
    _refused(target, [good["loss_scale"]], T, "state")
    legacy = _edited(good, ("skipped_steps",), DELETE)  # written before the counter existed: still loads
    target.load_state_dict(legacy)
    assert target.skipped_steps == 0 and target.loss_scale == good["loss_scale"]


def test_scaler_load_takes_numpy_scalars_like_python_numbers():
    good = _scaler([True, True, False]).state_dict()
    as_numpy = {k: (np.float32(v) if isinstance(v, float) else np.int64(v)) for k, v in good.items()}
    python, numpy = _scaler([]), _scaler([])
    python.load_state_dict(good)
    numpy.load_state_dict(as_numpy)
    assert python.state_dict() == numpy.state_dict() == good
    assert all(type(v) in (int, float) for v in numpy.state_dict().values())


# ---------------------------------------------------------------------------------------- master weights
def _masters(seed: int) -> MasterWeights:
    model = fp16_model(seed)
    masters = MasterWeights(model.parameters())
    optimizer = lo.AdamW(model.parameters(), lr=1e-2)
    masters.swap_into(optimizer)
    masters.step(optimizer)
    return masters


def test_master_weights_load_refuses_wrong_dtypes_shapes_and_keys():
    target, good = _masters(0), _masters(1).state_dict()
    assert len(good["masters"]) == 2  # the two fp16 params; the fp32 norm is its own master
    first = good["masters"][0]
    bad = [((0,), first.to(torch.int64), T), ((0,), first.double(), T), ((0,), first.bfloat16(), T),
           ((1,), torch.zeros(7), V), ((0,), "x", T), ((0,), first.t(), V)]
    for (index,), value, error in bad:
        _refused(target, _edited(good, ("masters", index), value), error, f"state['masters'][{index}]")
    _refused(target, {"masters": good["masters"][:1]}, V, "expected 2 master tensors, got 1")
    _refused(target, {"masters": torch.stack([first, first])}, T, "state['masters']")
    _refused(target, {}, V, "masters")
    _refused(target, {**good, "scale": 1.0}, V, "scale")
    _refused(target, "masters", T, "state")
    target.load_state_dict(good)  # and the good one loads
    assert observe(target.state_dict()) == observe(good)


# ---------------------------------------------------------------------------------------- FP16Optimizer
def _fp16(optimizer_cls, seed: int, steps: int, with_optimizer: bool = True) -> FP16Optimizer:
    fp = FP16Optimizer(fp16_model(seed), 1, average_world=True, init_scale=8.0, scale_window=2)
    if with_optimizer:
        fp.set_optimizer(optimizer_cls([fp.fp32_params], lr=1e-2))
    for step in range(steps):
        fp.zero_grad()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed * 100 + step)).half()
        fp.backward_loss(fp.fp16_model(x).float().pow(2).mean())
        fp.step()
    return fp


OPTIMIZERS = {"torch.AdamW": torch.optim.AdamW, "lo.AdamW": lo.AdamW}


def _fp16_bad(good: dict) -> list[tuple[tuple, object, type, str]]:
    flat, moment = good["fp32_params"], good["optimizer"]["state"][0]["exp_avg"]
    return [
        (("fp32_params",), flat.to(torch.int64), T, "state['fp32_params']"),
        (("fp32_params",), flat.double(), T, "state['fp32_params']"),
        (("fp32_params",), flat[:-1], V, "state['fp32_params']"),
        (("fp32_params",), "x", T, "state['fp32_params']"),
        (("loss_scaler", "clean_steps"), -1, V, "state['loss_scaler']['clean_steps']"),
        (("loss_scaler", "overflows_left"), 0.5, T, "state['loss_scaler']['overflows_left']"),
        (("loss_scaler", "loss_scale"), DELETE, V, "state['loss_scaler']"),
        (("optimizer", "state", 0, "exp_avg"), moment.to(torch.int64), T, "state['optimizer']['state'][0]['exp_avg']"),
        (("optimizer", "state", 0, "exp_avg_sq"), moment[:3], V, "state['optimizer']['state'][0]['exp_avg_sq']"),
        (("optimizer", "state", 0, "step"), -1, EITHER, "state['optimizer']['state'][0]['step']"),
        (("optimizer", "state", 0, "step"), 1.5, EITHER, "state['optimizer']['state'][0]['step']"),
        (("optimizer", "state", 7), {"exp_avg": moment}, V, "state['optimizer']['state']"),
        (("optimizer", "param_groups"), [], V, "state['optimizer']['param_groups']"),
        (("optimizer", "state"), DELETE, V, "state['optimizer']"),
        (("optimizer",), "x", T, "state['optimizer']"),
        (("optimizer",), DELETE, V, "optimizer"),
        (("extra",), 1, V, "extra"),
    ]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fp16_optimizer_load_checks_the_whole_dict_before_touching_anything(name):
    target = _fp16(OPTIMIZERS[name], seed=0, steps=2)
    good = _fp16(OPTIMIZERS[name], seed=1, steps=5).state_dict()
    assert good["loss_scaler"] != target.loss_scaler.state_dict()  # the scaler would change first
    for path, value, error, names in _fp16_bad(good):
        _refused(target, _edited(good, path, value), error, names)
    _refused(target, "x", T, "state")
    target.load_state_dict(good)
    assert observe(target.state_dict()) == observe(good)


def test_fp16_optimizer_load_with_optimizer_state_before_set_optimizer_changes_nothing():
    target = _fp16(torch.optim.AdamW, seed=0, steps=0, with_optimizer=False)
    good = _fp16(torch.optim.AdamW, seed=1, steps=3).state_dict()
    _refused(target, good, RuntimeError, "set_optimizer")


# ---------------------------------------------------------------------------------------- steps
def test_fp16_optimizer_refused_step_arguments_leave_the_scaler_as_it_was():
    fp = _fp16(torch.optim.AdamW, seed=0, steps=2)
    fp.backward_loss(fp.fp16_model(torch.ones(2, 4).half()).float().sum())
    before = observe(fp)
    for kwargs, error in (({"closure": "x"}, T), ({"tracker": object()}, T), ({"multiplier": -1.0}, V),
                          ({"denom": 2.0}, V)):
        with pytest.raises(error, match=next(iter(kwargs))):
            fp.step(**kwargs)
        assert observe(fp) == before


class _Refusing(torch.optim.SGD):
    """An optimizer that refuses its step (as ours do for a sparse gradient or a broken state)."""

    def step(self, closure=None):
        raise ValueError("refused by the optimizer")


def test_a_step_the_optimizer_refuses_does_not_advance_the_scaler():
    fp = _fp16(torch.optim.SGD, seed=0, steps=2)
    fp.set_optimizer(_Refusing([fp.fp32_params], lr=0.1))
    fp.backward_loss(fp.fp16_model(torch.ones(2, 4).half()).float().sum())
    scaler_before = fp.loss_scaler.state_dict()
    with pytest.raises(ValueError, match="refused by the optimizer"):
        fp.step()
    assert fp.loss_scaler.state_dict() == scaler_before
    model = fp16_model()
    masters = MasterWeights(model.parameters())
    optimizer = _Refusing(model.parameters(), lr=0.1)
    masters.swap_into(optimizer)
    scaler = DynamicLossScaler(init_scale=4.0, scale_window=1)
    with pytest.raises(ValueError, match="refused by the optimizer"):
        masters.step(optimizer, scaler)  # scale_window=1: recording the clean step would have grown the scale
    assert scaler.state_dict() == DynamicLossScaler(init_scale=4.0, scale_window=1).state_dict()


# ---------------------------------------------------------------------------------------- misuse vs valid use
def test_one_parameter_used_to_step_with_scaled_gradients_and_is_now_refused():
    """``MasterWeights(m.weight)`` iterated the weight's rows: per-row masters that the optimizer never
    stepped, and the fp16 weight itself stepped with gradients still scaled by S (65536x too large)."""
    model = fp16_model()
    with pytest.raises(TypeError, match="params: expected an iterable of Tensors .* single Tensor of shape \\(3, 4\\)"):
        MasterWeights(model[0].weight)
    with pytest.raises(RuntimeError, match="swap_into"):  # and the forgotten swap that moved nothing
        MasterWeights(model.parameters()).step(torch.optim.SGD(model.parameters(), lr=0.1), DynamicLossScaler())


def _flat_grad32(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).float() for p in params])


def test_the_valid_use_still_equals_the_reference_bitwise():
    """fp16 model + masters + torch SGD (momentum) under a loss scale with an overflow on the way: the
    masters equal torch's SGD on an fp32 flat copy fed fp16_reference's unscaled gradient, the model
    holds round16(master); a one-param list (the fixed form of the misuse) trains the same way."""
    model = nn.Linear(6, 4).half()
    params = [model.weight, model.bias]
    masters = MasterWeights([model.weight, model.bias])
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    masters.swap_into(optimizer)
    scaler = DynamicLossScaler(init_scale=2.0**10, scale_window=2)
    reference = torch.cat([p.detach().reshape(-1).float() for p in params]).requires_grad_(True)
    ref_optimizer = torch.optim.SGD([reference], lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        x = torch.randn(5, 6, generator=gen).half()
        scaled = scaler.scale(model(x).float().pow(2).mean())
        scaled.backward()
        if step == 3:
            model.bias.grad[0] = float("inf")
        expected = expected_gradient([_flat_grad32(params)], scale=scaler.loss_scale)
        stepped = masters.step(optimizer, scaler)
        assert stepped is (expected is not None)
        if stepped:
            reference.grad = expected
            ref_optimizer.step()
        optimizer.zero_grad()
        flat_masters = torch.cat([m.detach().reshape(-1) for m in masters.masters])
        assert torch.equal(flat_masters, reference.detach())
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params]), reference.detach().half())
    assert scaler.skipped_steps == 1
