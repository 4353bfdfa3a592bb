"""Probe: every optimizer keeps its state as torch.optim keeps it, so that code written against torch.optim
and torch's own tools work on it: the step count is the 0-dim CPU tensor torch makes (``.item()``,
``.detach()``), nothing is lost on a reload (momentum-free optimizers keep their count too), an older
checkpoint with int steps still loads, a saved step that is not a whole number is refused naming its key,
torch's twin of a class continues from our dict (and torch's own ``Optimizer.load_state_dict`` takes it),
``torch.distributed.checkpoint``'s get/set round trip continues bitwise, and ``torch.compile`` of
``opt.step`` equals the eager step. Every class of the catalogue (tests/optim/specs.py), plus a
momentum-free variant of each class that takes ``momentum``.
"""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch
from torch import nn

import lightning_optim as lo
from lightning_optim.onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
from tests.optim.specs import SPECS, Spec

SHAPES = [(4, 3), (5,)]


def _variants() -> list:
    """Every spec, and where the class takes ``momentum``, the same without momentum (a state of only a step)."""
    out = []
    for spec in SPECS:
        out.append(pytest.param(spec.cls, spec.kwargs, id=spec.name))
        if spec.kwargs.get("momentum") and "momentum" in inspect.signature(spec.cls).parameters:
            kwargs = {k: v for k, v in spec.kwargs.items() if k != "nesterov"}
            out.append(pytest.param(spec.cls, {**kwargs, "momentum": 0.0}, id=f"{spec.name}-momentum0"))
    return out


VARIANTS = _variants()


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in SHAPES]


def _make(cls, kwargs, params):
    # two groups, the second with its own lr: ids 0 and 1 in the state dict
    return cls([{"params": [params[0]]}, {"params": [params[1]], "lr": kwargs.get("lr", 1e-3) / 2}], **kwargs)


def _steps(opt, params, n: int, seed: int = 1, step=None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        (step or opt.step)()


def _snapshot(opt, params):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return buf.getvalue(), [p.detach().clone() for p in params]


def _unchanged(before, opt, params) -> bool:
    after = _snapshot(opt, params)
    return before[0] == after[0] and all(torch.equal(a, b) for a, b in zip(before[1], after[1]))


def _same_state(a: dict, b: dict) -> None:
    """Two state dicts hold the same per-param state: the same keys, equal values (steps as numbers)."""
    assert sorted(a["state"]) == sorted(b["state"])
    for pid in a["state"]:
        assert sorted(a["state"][pid]) == sorted(b["state"][pid]), pid
        for key, value in a["state"][pid].items():
            other = b["state"][pid][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), (pid, key)
            else:
                assert value == other, (pid, key)


def _torch_step_tensor(steps: int) -> torch.Tensor:
    """What torch.optim keeps as the step after ``steps`` steps (the independent reference)."""
    p = torch.zeros(3, requires_grad=True)
    ref = torch.optim.Adam([p], lr=1e-3)
    for _ in range(steps):
        p.grad = torch.ones(3)
        ref.step()
    return ref.state[p]["step"]


# ---------------------------------------------------------------- the step count
@pytest.mark.filterwarnings("ignore:SparsifiedSGD. foreach=True has no effect")
@pytest.mark.parametrize("default_dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
@pytest.mark.parametrize(("cls", "kwargs"), VARIANTS)
def test_the_step_is_the_tensor_torch_keeps(cls, kwargs, foreach, default_dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        reference = _torch_step_tensor(3)
        params = _params()
        opt = _make(cls, {**kwargs, "foreach": foreach}, params)
        _steps(opt, params, 3)
    finally:
        torch.set_default_dtype(previous)
    for p in params:
        step = opt.state[p]["step"]
        assert isinstance(step, torch.Tensor) and not step.requires_grad
        assert (step.shape, step.dtype, step.device) == (reference.shape, reference.dtype, reference.device)
        assert step.item() == reference.item() == 3.0
        assert torch.equal(step.detach(), reference)
    saved = opt.state_dict()["state"]
    assert all(torch.equal(entry["step"], reference) for entry in saved.values())


@pytest.mark.parametrize(("cls", "kwargs"), VARIANTS)
def test_a_step_tensor_replaced_by_hand_is_counted_on(cls, kwargs):
    """The bucket moves its step tensors with one op; one set by hand since then still moves."""
    params = _params()
    opt = cls(params, **kwargs)
    _steps(opt, params, 2)
    opt.state[params[1]]["step"] = torch.tensor(7.0)
    _steps(opt, params, 1)
    assert [opt.state[p]["step"].item() for p in params] == [3.0, 8.0]


# ---------------------------------------------------------------- reloads
def _trained(cls, kwargs, steps: int = 3):
    params = _params()
    opt = _make(cls, kwargs, params)
    _steps(opt, params, steps)
    return opt, params


def _continue_alike(cls, kwargs, opt, params, saved) -> None:
    """A fresh optimizer loaded with ``saved`` holds the same state as ``opt`` and continues bitwise alike."""
    fresh_params = [p.detach().clone().requires_grad_(True) for p in params]
    fresh = _make(cls, kwargs, fresh_params)
    fresh.load_state_dict(saved)
    _same_state(fresh.state_dict(), opt.state_dict())
    _steps(opt, params, 2, seed=5)
    _steps(fresh, fresh_params, 2, seed=5)
    for a, b in zip(params, fresh_params):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("cls", "kwargs"), VARIANTS)
def test_no_state_is_lost_on_a_reload(cls, kwargs):
    opt, params = _trained(cls, kwargs)
    saved = copy.deepcopy(opt.state_dict())
    assert all("step" in entry for entry in saved["state"].values())
    _continue_alike(cls, kwargs, opt, params, saved)


@pytest.mark.parametrize(("cls", "kwargs"), VARIANTS)
def test_an_older_checkpoint_with_int_steps_loads(cls, kwargs):
    opt, params = _trained(cls, kwargs)
    saved = copy.deepcopy(opt.state_dict())
    for entry in saved["state"].values():
        entry["step"] = int(entry["step"].item())
    _continue_alike(cls, kwargs, opt, params, saved)
    assert all(isinstance(s["step"], torch.Tensor) for s in opt.state.values())


BAD_STEPS = {
    "nan": float("nan"),
    "nan tensor": torch.tensor(float("nan")),
    "inf": float("inf"),
    "-inf tensor": torch.tensor(float("-inf")),
    "negative": -1,
    "negative tensor": torch.tensor(-2.0),
    "fractional": 1.5,
    "fractional tensor": torch.tensor(2.5),
    "string": "3",
    "bool": True,
    "None": None,
    "two elements": torch.tensor([1.0, 2.0]),
    "complex": torch.tensor(1 + 0j),
}
REFUSED = r"state_dict: param 1 \(group 1\) step must be a whole number in \[0, \d+\]"


@pytest.mark.parametrize("bad", BAD_STEPS)
@pytest.mark.parametrize(("cls", "kwargs"), VARIANTS)
def test_a_saved_step_out_of_range_is_refused_naming_it(cls, kwargs, bad):
    opt, params = _trained(cls, kwargs, steps=2)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][1]["step"] = BAD_STEPS[bad]
    before = _snapshot(opt, params)
    with pytest.raises(ValueError, match=REFUSED):
        opt.load_state_dict(saved)
    assert _unchanged(before, opt, params)


ONEBIT = [pytest.param(OnebitAdam, dict(freeze_step=2), id="OnebitAdam"),
          pytest.param(ZeroOneAdam, dict(var_freeze_step=2), id="ZeroOneAdam"),
          pytest.param(OnebitLamb, dict(freeze_step=2), id="OnebitLamb")]


@pytest.mark.parametrize("bad", BAD_STEPS)
@pytest.mark.parametrize(("cls", "kwargs"), ONEBIT)
def test_a_one_bit_optimizer_refuses_a_plain_dicts_bad_step(cls, kwargs, bad):
    """The 1-bit optimizers keep one step count in their schedule (every rank agrees on it, it picks the
    stage): a torch Adam dict they start from is refused for a bad per-param step, before anything moves."""
    source_params = _params(seed=3)
    source = _make(torch.optim.Adam, dict(lr=1e-2), source_params)
    _steps(source, source_params, 2)
    saved = copy.deepcopy(source.state_dict())
    saved["state"][1]["step"] = BAD_STEPS[bad]
    params = _params()
    opt = _make(cls, dict(lr=1e-2, **kwargs), params)
    _steps(opt, params, 1)
    before = _snapshot(opt, params)
    with pytest.raises(ValueError, match=REFUSED):
        opt.load_state_dict(saved)
    assert _unchanged(before, opt, params)


@pytest.mark.parametrize("bad", ["nan", "nan tensor", "inf", "negative tensor", "string", "two elements"])
def test_fp16_optimizer_refuses_its_optimizers_bad_step(bad):
    from lightning_optim.precision import FP16Optimizer

    def trained(seed: int) -> FP16Optimizer:
        torch.manual_seed(seed)
        fp = FP16Optimizer(nn.Sequential(nn.Linear(4, 3)).half(), 1, average_world=True)
        fp.set_optimizer(lo.AdamW([fp.fp32_params], lr=1e-2))
        fp.backward_loss(fp.fp16_model(torch.randn(5, 4).half()).float().pow(2).mean())
        fp.step()
        return fp

    target, good = trained(0), trained(1).state_dict()
    saved = copy.deepcopy(good)
    saved["optimizer"]["state"][0]["step"] = BAD_STEPS[bad]
    before = io.BytesIO()
    torch.save(target.state_dict(), before)
    with pytest.raises(ValueError, match=r"state\['optimizer'\]\['state'\]\[0\]\['step'\] must be a whole number"):
        target.load_state_dict(saved)
    after = io.BytesIO()
    torch.save(target.state_dict(), after)
    assert before.getvalue() == after.getvalue()


# ---------------------------------------------------------------- torch's own loading
# the classes with a torch.optim twin: (ours, our arguments, torch's class, its arguments)
TWINS = {
    "Adam": (lo.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True), torch.optim.Adam, None),
    "AdamW": (lo.AdamW, dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW, None),
    "FusedAdam": (lo.FusedAdam, dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW, None),
    "CPUAdam": (lo.CPUAdam, dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW, None),
    "SGD": (lo.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1), torch.optim.SGD, None),
    "SGD-momentum0": (lo.SGD, dict(lr=1e-2, weight_decay=0.1), torch.optim.SGD, None),
    "FusedSGD": (lo.FusedSGD, dict(lr=1e-2, momentum=0.9, dampening=0.1), torch.optim.SGD, None),
    "RAdam": (lo.RAdam, dict(lr=1e-2, weight_decay=0.1), torch.optim.RAdam, None),
}


@pytest.mark.parametrize("name", TWINS)
def test_torchs_twin_continues_from_our_dict(name):
    ours_cls, kwargs, torch_cls, torch_kwargs = TWINS[name]
    opt, params = _trained(ours_cls, kwargs, steps=7)  # past RAdam's rectification threshold
    twin_params = [p.detach().clone().requires_grad_(True) for p in params]
    twin = _make(torch_cls, torch_kwargs or kwargs, twin_params)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    _steps(opt, params, 4, seed=9)
    _steps(twin, twin_params, 4, seed=9)
    for a, b in zip(params, twin_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if torch_cls is not torch.optim.SGD:  # torch's SGD counts no steps (it keeps ours as it got it)
        for p, q in zip(params, twin_params):
            assert torch.equal(opt.state[p]["step"], twin.state[q]["step"])


@pytest.mark.parametrize(("cls", "kwargs"), VARIANTS)
def test_torchs_own_load_state_dict_takes_our_dict(cls, kwargs):
    """``torch.optim.Optimizer.load_state_dict`` (no checks of ours) gives an optimizer that continues as
    our own load does: our dicts hold nothing torch's generic path does not take."""
    opt, params = _trained(cls, kwargs)
    saved = copy.deepcopy(opt.state_dict())
    ours_params = [p.detach().clone().requires_grad_(True) for p in params]
    theirs_params = [p.detach().clone().requires_grad_(True) for p in params]
    ours, theirs = _make(cls, kwargs, ours_params), _make(cls, kwargs, theirs_params)
    ours.load_state_dict(copy.deepcopy(saved))
    torch.optim.Optimizer.load_state_dict(theirs, copy.deepcopy(saved))
    _steps(ours, ours_params, 2, seed=5)
    _steps(theirs, theirs_params, 2, seed=5)
    for a, b in zip(ours_params, theirs_params):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- torch.distributed.checkpoint
def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _train(model: nn.Module, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(5, 4, generator=gen)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _lr0_step_moves_params(cls, kwargs) -> bool:
    p = nn.Parameter(torch.randn(6))
    before = p.detach().clone()
    opt = cls([p], **{**kwargs, "lr": 0.0})
    p.grad = torch.zeros(6)
    opt.step()
    return not torch.equal(before, p.detach())


@pytest.mark.parametrize(("cls", "kwargs"), VARIANTS)
def test_dcp_round_trip_on_a_plain_model_continues_bitwise(cls, kwargs):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    if _lr0_step_moves_params(cls, kwargs):
        # torch's set_optimizer_state_dict first steps a fresh optimizer at lr 0 with zero grads, taking that
        # for a no-op; SparsifiedSGD decays the params by weight_decay whatever the lr (mlbench's rule)
        pytest.skip(f"{cls.__name__} moves the params in a zero-lr step: DCP's state initialisation would too")
    model = _model()
    opt = cls(model.parameters(), **kwargs)
    _train(model, opt, 3, seed=1)
    saved = get_optimizer_state_dict(model, opt)
    assert all(isinstance(entry["step"], torch.Tensor) for entry in saved["state"].values())
    other = _model(seed=5)
    other.load_state_dict(model.state_dict())
    fresh = cls(other.parameters(), **kwargs)
    set_optimizer_state_dict(other, fresh, copy.deepcopy(saved))
    _same_state(fresh.state_dict(), opt.state_dict())
    _train(model, opt, 3, seed=2)
    _train(other, fresh, 3, seed=2)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("cls", "kwargs"), ONEBIT)
def test_dcp_loses_the_one_bit_entry_and_the_load_says_so(cls, kwargs):
    """DCP's optimizer dict keeps only 'state' and 'param_groups': the stage counters and error buffers of a
    1-bit optimizer do not fit it (they have fsdp_checkpoint.rank_state), and a load of what is left is
    refused naming that, instead of restarting the schedule at step 0."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = _model()
    opt = cls(model.parameters(), lr=1e-2, **kwargs)
    _train(model, opt, 3, seed=1)
    saved = get_optimizer_state_dict(model, opt)
    assert "onebit" not in saved
    other = _model(seed=5)
    fresh = cls(other.parameters(), lr=1e-2, **kwargs)
    with pytest.raises(ValueError, match=r"no step count.*'onebit' entry.*rank_state"):
        set_optimizer_state_dict(other, fresh, saved)


# ---------------------------------------------------------------- torch.compile
needs_dynamo = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported here")


@needs_dynamo
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_compiled_step_equals_the_eager_step(spec: Spec):
    """``torch.compile(opt.step)`` (dynamo's tracing, run as traced) moves the params bitwise as the eager
    step does and counts its steps in the same tensors."""
    eager_params, compiled_params = _params(), _params()
    eager, compiled = _make(spec.cls, spec.kwargs, eager_params), _make(spec.cls, spec.kwargs, compiled_params)
    torch._dynamo.reset()
    step = torch.compile(compiled.step, backend="eager")
    _steps(eager, eager_params, 3)
    _steps(compiled, compiled_params, 3, step=step)
    for a, b in zip(eager_params, compiled_params):
        assert torch.equal(a, b)
    assert [compiled.state[p]["step"].item() for p in compiled_params] == [3.0, 3.0]
    assert not torch.equal(eager_params[0], _params()[0])  # it did train
