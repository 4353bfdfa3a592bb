"""Probe: what torch's tools do to an optimizer from outside works on ours as on torch.optim's.

* LR schedulers (``StepLR``, ``OneCycleLR``, ``swa_utils.SWALR``) set the same lrs as on ``torch.optim.SGD``,
  for a float lr and for a 0-dim or one-element tensor lr (filled in place, as torch's schedulers do), and
  the step uses what they set (bitwise the step of a run given those values by hand);
* the step, state-dict and load-state-dict hooks (and torch's global step hooks) run in torch's order and
  with torch's arguments: a step pre-hook may replace the arguments, a state-dict post-hook sees the whole
  dict (the 1-bit ``"onebit"`` entry included) and may replace it, a load pre-hook sees the dict as given
  and what it returns is what gets checked and loaded, a load post-hook sees the optimizer fully loaded.

Every class of the catalogue (tests/optim/specs.py) and the 1-bit optimizers (in one process).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR, StepLR
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.optim.swa_utils import SWALR

import lightning_optim as lo
from lightning_optim.distributed import CentralizedAdam, CentralizedSGD, DecentralizedSGD, DiLoCo, PowerSGD
from lightning_optim.onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
from tests.optim.specs import SPECS

SHAPES = [(4, 3), (5,)]
STEPS = 5
CATALOGUE = [pytest.param(spec.cls, spec.kwargs, id=spec.name) for spec in SPECS]
ONEBIT = [pytest.param(OnebitAdam, dict(lr=1e-2, freeze_step=2), id="OnebitAdam"),
          pytest.param(ZeroOneAdam, dict(lr=1e-2, var_freeze_step=2), id="ZeroOneAdam"),
          pytest.param(OnebitLamb, dict(lr=1e-2, freeze_step=2), id="OnebitLamb")]
EVERY = CATALOGUE + ONEBIT


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in SHAPES]


def _grads(params, gen: torch.Generator) -> None:
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _make(cls, kwargs, params, lr=None, second_lr=None):
    kwargs = dict(kwargs) if lr is None else {**kwargs, "lr": lr}
    second = kwargs.get("lr", 1e-3) / 2 if second_lr is None else second_lr
    return cls([{"params": [params[0]]}, {"params": [params[1]], "lr": second}], **kwargs)


# ---------------------------------------------------------------- LR schedulers
def _cycles_momentum(opt) -> bool:
    return any(key in opt.defaults for key in ("momentum", "betas"))  # torch's OneCycleLR needs one of them


SCHEDULERS = {
    "StepLR": lambda opt: StepLR(opt, step_size=2, gamma=0.5),
    "OneCycleLR": lambda opt: OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 1,
                                         cycle_momentum=_cycles_momentum(opt)),
    "SWALR": lambda opt: SWALR(opt, swa_lr=0.005, anneal_epochs=3),
}
LRS = {  # the lr of the first group and of the second, as the user gives them
    "float": lambda: (1e-2, 5e-3),
    "0-dim tensor": lambda: (torch.tensor(1e-2), torch.tensor(5e-3)),
    "one-element tensor": lambda: (torch.tensor([1e-2]), torch.tensor([5e-3])),
}
DRIVEN = ("lr", "momentum", "betas")  # what the schedulers write


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.item()
    return tuple(_plain(v) for v in value) if isinstance(value, tuple) else value


def _scheduled(opt, params, schedule: str) -> list[list[dict]]:
    """Run ``STEPS`` steps under ``schedule``; the driven values of each group before each step."""
    scheduler = SCHEDULERS[schedule](opt)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(STEPS):
        seen.append([{k: _plain(g[k]) for k in DRIVEN if k in g} for g in opt.param_groups])
        _grads(params, gen)
        opt.step()
        scheduler.step()
    return seen


# the 1-bit optimizers take a float lr only (a tensor is refused, see test_tensor_lr.py)
SCHEDULED = [pytest.param(*case.values, kind, id=f"{case.id}-{kind}") for case in CATALOGUE for kind in LRS]
SCHEDULED += [pytest.param(*case.values, "float", id=f"{case.id}-float") for case in ONEBIT]


@pytest.mark.parametrize("schedule", SCHEDULERS)
@pytest.mark.parametrize(("cls", "kwargs", "lr_kind"), SCHEDULED)
def test_a_scheduler_drives_the_lr_as_on_torch_sgd(cls, kwargs, lr_kind, schedule):
    lrs = LRS[lr_kind]()
    params = _params()
    opt = _make(cls, kwargs, params, *lrs)
    seen = _scheduled(opt, params, schedule)
    # torch's own optimizer under the same scheduler: the reference lrs
    reference_params = _params()
    reference = _make(torch.optim.SGD, dict(momentum=0.9), reference_params, *LRS[lr_kind]())
    expected = _scheduled(reference, reference_params, schedule)
    assert [[g["lr"] for g in step] for step in seen] == [[g["lr"] for g in step] for step in expected]
    assert len({step[0]["lr"] for step in seen}) > 1  # the schedule moved it
    for group, given in zip(opt.param_groups, lrs):
        if isinstance(given, torch.Tensor):
            assert group["lr"] is given and group["lr"].shape == given.shape  # filled in place
    # the step used what the scheduler set: a run given the same values by hand moves the params alike
    by_hand_params = _params()
    by_hand = _make(cls, kwargs, by_hand_params, 1e-2, 5e-3)
    gen = torch.Generator().manual_seed(1)
    for values in seen:
        for group, driven in zip(by_hand.param_groups, values):
            group.update(driven)
        _grads(by_hand_params, gen)
        by_hand.step()
    for a, b in zip(params, by_hand_params):
        assert torch.equal(a, b)


@pytest.mark.parametrize("lr_kind", ["0-dim tensor", "one-element tensor"])
def test_torch_takes_the_same_tensor_lrs(lr_kind):
    """The reference above: torch.optim.SGD takes both tensor shapes (it refuses two elements)."""
    for lr in LRS[lr_kind]():
        torch.optim.SGD(_params(), lr=lr)
    with pytest.raises(ValueError, match="1-element"):
        torch.optim.SGD(_params(), lr=torch.tensor([1e-2, 1e-2]))


# ---------------------------------------------------------------- hooks
def _closure():
    return torch.tensor(1.5)


def _hooked_script(opt, params) -> list[str]:
    """Every hook of ``opt`` (and torch's global step hooks) recording its calls, through a step, a
    ``state_dict()``, a ``load_state_dict()`` and a step with a closure."""
    events: list[str] = []

    def note(name):
        return lambda o, *rest: events.append(name) if o is opt else None

    handles = [
        register_optimizer_step_pre_hook(note("global step pre")),
        register_optimizer_step_post_hook(note("global step post")),
        opt.register_step_pre_hook(note("step pre")),
        opt.register_step_post_hook(note("step post")),
        opt.register_state_dict_pre_hook(note("state_dict pre")),
        opt.register_state_dict_post_hook(note("state_dict post")),
        opt.register_load_state_dict_pre_hook(note("load pre")),
        opt.register_load_state_dict_post_hook(note("load post")),
    ]
    try:
        gen = torch.Generator().manual_seed(1)
        _grads(params, gen)
        events.append("step")
        opt.step()
        events.append("state_dict")
        saved = opt.state_dict()
        events.append("load_state_dict")
        opt.load_state_dict(copy.deepcopy(saved))
        _grads(params, gen)
        events.append("step(closure)")
        assert opt.step(_closure) == _closure()
    finally:
        for handle in handles:
            handle.remove()
    return events


@pytest.mark.parametrize(("cls", "kwargs"), EVERY)
def test_hooks_run_in_torchs_order(cls, kwargs):
    params = _params()
    events = _hooked_script(_make(cls, kwargs, params), params)
    reference_params = _params()
    expected = _hooked_script(_make(torch.optim.SGD, dict(lr=1e-2, momentum=0.9), reference_params),
                              reference_params)
    assert events == expected


@pytest.mark.parametrize(("cls", "kwargs"), EVERY)
def test_a_step_pre_hook_may_replace_the_arguments(cls, kwargs):
    params = _params()
    opt = _make(cls, kwargs, params)
    called = []

    def with_closure():
        called.append(True)
        return torch.tensor(2.5)

    handle = opt.register_step_pre_hook(lambda o, args, kw: (args, {**kw, "closure": with_closure}))
    _grads(params, torch.Generator().manual_seed(1))
    assert opt.step() == 2.5 and called == [True]
    handle.remove()


@pytest.mark.parametrize(("cls", "kwargs"), EVERY)
def test_a_state_dict_post_hook_sees_the_whole_dict_and_may_replace_it(cls, kwargs):
    params = _params()
    opt = _make(cls, kwargs, params)
    _grads(params, torch.Generator().manual_seed(1))
    opt.step()
    keys = sorted(opt.state_dict())  # the 1-bit "onebit" entry, SparsifiedSGD's generator state ...
    seen = []

    def replace(o, state_dict):
        seen.append(sorted(state_dict))
        return {**state_dict, "by_the_hook": True}

    handle = opt.register_state_dict_post_hook(replace)
    returned = opt.state_dict()
    handle.remove()
    assert seen == [keys] and sorted(returned) == sorted([*keys, "by_the_hook"])


@pytest.mark.parametrize(("cls", "kwargs"), EVERY)
def test_a_load_pre_hook_sees_the_given_dict_and_what_it_returns_is_loaded(cls, kwargs):
    """The hook runs before our checks: it may repair a dict they would refuse (an lr of -1 here)."""
    params = _params()
    opt = _make(cls, kwargs, params)
    _grads(params, torch.Generator().manual_seed(1))
    opt.step()
    given = copy.deepcopy(opt.state_dict())
    given["param_groups"][1]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        opt.load_state_dict(copy.deepcopy(given))
    seen = []

    def repair(o, state_dict):
        seen.append(state_dict)
        fixed = copy.deepcopy(state_dict)
        fixed["param_groups"][1]["lr"] = 0.25
        return fixed

    handle = opt.register_load_state_dict_pre_hook(repair)
    opt.load_state_dict(given)
    handle.remove()
    assert seen[0] is not given and seen[0]["state"] is given["state"]  # torch's shallow copy
    assert seen[0]["param_groups"][1]["lr"] == -1.0 and opt.param_groups[1]["lr"] == 0.25


def _state_bytes(opt) -> bytes:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return buf.getvalue()


@pytest.mark.parametrize(("cls", "kwargs"), EVERY)
def test_a_load_post_hook_sees_the_optimizer_fully_loaded(cls, kwargs):
    """A dict of an fp32 run loaded into bf16 params (the fp32 moments stay fp32, the 1-bit schedule moves
    on): the post-hook sees the optimizer as the load leaves it, not a half-way state."""
    source_params = _params()
    source = _make(cls, kwargs, source_params)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        _grads(source_params, gen)
        source.step()
    params = _params(seed=2, dtype=torch.bfloat16)
    opt = _make(cls, kwargs, params)
    seen = []
    handle = opt.register_load_state_dict_post_hook(lambda o: seen.append(_state_bytes(o)))
    opt.load_state_dict(copy.deepcopy(source.state_dict()))
    handle.remove()
    assert seen == [_state_bytes(opt)]


# built over a model, one process (the aggregation is the identity): the mlbench wrappers and DiLoCo hand their
# state dicts to the local optimizer (DiLoCo adds its own part), PowerSGD (a torch.optim.SGD) adds its
# compressor's; PowerSGD and DecentralizedSGD step through their parent's step, and the hooks must still run
# once (torch wraps the parent's step too, once any instance of it was built, as the test makes sure)
MODEL_BUILT = {"CentralizedSGD": lambda model: CentralizedSGD(None, model, lr=1e-2, momentum=0.9),
               "CentralizedAdam": lambda model: CentralizedAdam(None, model, lr=1e-2),
               "PowerSGD": lambda model: PowerSGD(model, lr=1e-2, momentum=0.9, reuse_query=True),
               "DecentralizedSGD": lambda model: DecentralizedSGD(model=model, lr=1e-2, momentum=0.9),
               "DiLoCo": lambda model: DiLoCo(lo.AdamW(model.parameters(), lr=1e-2), sync_every=2)}


@pytest.mark.parametrize("name", MODEL_BUILT)
def test_hooks_of_the_optimizers_built_over_a_model_run_as_torchs(name):
    for parent in (torch.optim.SGD, lo.SGD):  # built once: torch has wrapped the parents' steps
        parent(_params(), lr=1e-2)
    model = nn.Linear(4, 3)
    opt = MODEL_BUILT[name](model)
    params = list(model.parameters())
    events = _hooked_script(opt, params)
    reference_params = _params()
    expected = _hooked_script(_make(torch.optim.SGD, dict(lr=1e-2, momentum=0.9), reference_params),
                              reference_params)
    assert events == expected
    # the state-dict post-hook sees the whole dict, the load post-hook the optimizer fully loaded
    keys, seen = sorted(opt.state_dict()), []
    handles = [opt.register_state_dict_post_hook(lambda o, sd: seen.append(sorted(sd))),
               opt.register_load_state_dict_post_hook(lambda o: seen.append(_state_bytes(o)))]
    saved = copy.deepcopy(opt.state_dict())
    other_model = nn.Linear(4, 3)
    other = MODEL_BUILT[name](other_model)
    _grads(list(other_model.parameters()), torch.Generator().manual_seed(2))
    other.step()
    handles += [other.register_load_state_dict_post_hook(lambda o: seen.append(_state_bytes(o)))]
    other.load_state_dict(saved)
    for handle in handles:
        handle.remove()
    assert seen[0] == keys and seen[1] == _state_bytes(other)
