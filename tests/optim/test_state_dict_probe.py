"""Probe: loads and steps are atomic and dtype-correct for every optimizer; torch.optim checkpoints
load into our drop-in classes and continue exactly like torch; other algorithms' dicts are refused.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import lightning_optim as lo
from tests.optim.specs import SPECS, Spec

SHAPES = [(4, 3), (5,)]


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in SHAPES]


def _groups(spec: Spec, params):
    return [{"params": [params[0]]}, {"params": [params[1]], "lr": spec.kwargs.get("lr", 1e-3) / 2}]


def _make(spec: Spec, params, **extra):
    return spec.cls(_groups(spec, params), **{**spec.kwargs, **extra})


def _steps(opt, params, n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def _trained(spec: Spec, dtype=torch.float32, steps=2):
    """A ``spec`` optimizer over fresh params after ``steps`` steps, its params and its state dict."""
    params = _params(dtype)
    opt = _make(spec, params)
    _steps(opt, params, steps)
    return opt, params, opt.state_dict()


def _snapshot(opt, params):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return buf.getvalue(), [p.detach().clone() for p in params]


def _unchanged(before, opt, params):
    after = _snapshot(opt, params)
    return before[0] == after[0] and all(torch.equal(a, b) for a, b in zip(before[1], after[1]))


# ---------------------------------------------------------------- round trip
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_reloaded_optimizer_saves_the_same_group_keys(spec):
    _, _, saved = _trained(spec)
    fresh = _make(spec, _params(seed=3))
    fresh.load_state_dict(copy.deepcopy(saved))
    again = fresh.state_dict()
    assert [sorted(g) for g in again["param_groups"]] == [sorted(g) for g in saved["param_groups"]]


# ---------------------------------------------------------------- dtype rules
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_fp32_state_into_bf16_params_stays_fp32_and_steps(spec):
    _, src, saved = _trained(spec)
    low = [p.detach().bfloat16().requires_grad_(True) for p in src]
    target = _make(spec, low)
    target.load_state_dict(saved)
    for p in low:
        for key, value in target.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim() and value.is_floating_point():
                assert value.dtype == (torch.bfloat16 if key == "kahan_comp" else torch.float32), (key, value.dtype)
    # the continuation tracks the same continuation in fp32 (bf16 params round each step)
    ref = _make(spec, [p.detach().clone().requires_grad_(True) for p in src])
    ref.load_state_dict(saved)
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    _steps(target, low, 3, seed=5)
    _steps(ref, ref_params, 3, seed=5)
    for a, b in zip(low, ref_params):
        assert torch.isfinite(a.float()).all()
        torch.testing.assert_close(a.float(), b, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_bf16_state_into_fp32_params_is_upcast(spec):
    _, low, saved = _trained(spec, torch.bfloat16)
    high = [p.detach().float().requires_grad_(True) for p in low]
    target = _make(spec, high)
    target.load_state_dict(saved)
    for index, p in enumerate(high):
        assert "kahan_comp" not in target.state[p]
        for key, value in target.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim() and value.is_floating_point():
                assert value.dtype == torch.float32, key
                assert torch.equal(value, saved["state"][index][key].float())  # lossless
    _steps(target, high, 2)
    assert all(torch.isfinite(p).all() for p in high)


# ---------------------------------------------------------------- torch.optim checkpoints
TORCH_PAIRS = [
    (lambda ps: torch.optim.Adam(ps, lr=1e-2), lambda ps: lo.Adam(ps, lr=1e-2)),
    (lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
     lambda ps: lo.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), lambda ps: lo.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
     lambda ps: lo.FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=True)),
    (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
     lambda ps: lo.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1),
     lambda ps: lo.FusedSGD(ps, lr=1e-2, momentum=0.9, dampening=0.1)),
    (lambda ps: torch.optim.SGD(ps, lr=1e-2), lambda ps: lo.SGD(ps, lr=1e-2)),
    (lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=0.1), lambda ps: lo.RAdam(ps, lr=1e-2, weight_decay=0.1)),
]


@pytest.mark.parametrize("pair", range(len(TORCH_PAIRS)))
def test_torch_checkpoints_continue_like_torch(pair):
    make_torch, make_ours = TORCH_PAIRS[pair]
    params = _params()
    theirs = make_torch(params)
    _steps(theirs, params, 7)  # past RAdam's rectification threshold
    theirs.param_groups[0]["lr"] *= 0.5  # a running LR schedule travels in the group
    saved = copy.deepcopy(theirs.state_dict())
    mine_params = [p.detach().clone().requires_grad_(True) for p in params]
    mine = make_ours(mine_params)
    mine.load_state_dict(saved)
    assert mine.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]
    _steps(theirs, params, 4, seed=9)
    _steps(mine, mine_params, 4, seed=9)
    for a, b in zip(mine_params, params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


ADAM_FAMILY = {"Adam", "AdamW", "FusedAdam", "CPUAdam"}


def _state_keys(spec: Spec) -> frozenset:
    params = _params()
    opt = _make(spec, params)
    _steps(opt, params, 1)
    return frozenset(opt.state_dict()["state"][0]) - {"step", "kahan_comp"}


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_another_algorithms_dict_is_refused_and_changes_nothing(spec):
    mine = _state_keys(spec)
    family = ADAM_FAMILY if spec.name in ADAM_FAMILY else {spec.name}  # their dicts carry amsgrad etc.
    sources = [s for s in SPECS if _state_keys(s) != mine and s.name not in family]
    sources += ["torch.SGD"] if mine != frozenset({"momentum_buffer"}) else ["torch.Adam"]
    params = _params()
    target = _make(spec, params)
    _steps(target, params, 1)
    before = _snapshot(target, params)
    for source in sources:
        src_params = _params(seed=3)
        groups = [{"params": [src_params[0]]}, {"params": [src_params[1]]}]
        if source == "torch.SGD":
            other = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
        elif source == "torch.Adam":
            other = torch.optim.Adam(groups, lr=0.1)
        else:
            other = _make(source, src_params)
        _steps(other, src_params, 1)
        # refused at its group (e.g. three betas for a two-beta algorithm) or at its state keys
        with pytest.raises(ValueError, match=r"state_dict: (param group \d: |param 0 .*missing: .*extra: .*another algorithm)"):
            target.load_state_dict(other.state_dict())
        assert _unchanged(before, target, params), source


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_malformed_dict_is_refused_before_anything_changes(spec):
    opt, params, good = _trained(spec)
    before = _snapshot(opt, params)
    first_key = next(k for k, v in good["state"][0].items() if isinstance(v, torch.Tensor) and v.dim())

    def edited(fn):
        sd = copy.deepcopy(good)
        fn(sd)
        return sd

    bad = {
        "one group missing": edited(lambda sd: sd["param_groups"].pop()),
        "a param missing": edited(lambda sd: sd["param_groups"][1]["params"].append(99)),
        "wrong shape": edited(lambda sd: sd["state"][0].__setitem__(first_key, torch.zeros(7))),
        "negative step": edited(lambda sd: sd["state"][1].__setitem__("step", -1)),
        "fractional step": edited(lambda sd: sd["state"][1].__setitem__("step", 1.5)),
        "bad lr": edited(lambda sd: sd["param_groups"][1].__setitem__("lr", -1.0)),
    }
    for what, sd in bad.items():
        with pytest.raises(ValueError, match="state_dict"):
            opt.load_state_dict(sd)
        assert _unchanged(before, opt, params), what


# ---------------------------------------------------------------- atomic steps
@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_refused_step_changes_nothing(spec, foreach):
    params = _params()
    opt = _make(spec, params, foreach=foreach)
    _steps(opt, params, 2)
    before = _snapshot(opt, params)
    # a sparse grad in the second group: refused before the first group is touched
    params[0].grad = torch.randn(SHAPES[0])
    params[1].grad = torch.randn(SHAPES[1]).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    assert _unchanged(before, opt, params)
    # a state replaced by hand with a wrong shape / dtype (in the second group)
    state = opt.state[params[1]]
    key = next(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim())
    for wrong in (torch.zeros(7), state[key].to(torch.float64), *_not_floating(state[key])):
        opt.state[params[1]] = {**state, key: wrong}
        params[1].grad = torch.randn(SHAPES[1])
        with pytest.raises(ValueError, match=rf"state: param 0 of its group has {key}"):
            opt.step()
        opt.state[params[1]] = state
        assert _unchanged(before, opt, params)


def _not_floating(t):
    return t.to(torch.int64), t > 0, t.to(torch.complex64)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_state_tensor_swapped_in_place_is_refused_without_counting_a_step(spec):
    # the same state dict object, one tensor replaced after the step plan was built: the kernel (or the
    # torch fallback) refuses it; neither the step count nor a param moves, and the next step names the key
    params = _params()
    opt = _make(spec, params)
    _steps(opt, params, 2)
    before = _snapshot(opt, params)
    state = opt.state[params[0]]
    for key in [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim()]:
        good = state[key]
        for wrong in _not_floating(good):
            state[key] = wrong
            params[0].grad, params[1].grad = torch.randn(SHAPES[0]), torch.randn(SHAPES[1])
            with pytest.raises((TypeError, ValueError, RuntimeError)):
                opt.step()
            with pytest.raises(ValueError, match=rf"state: param 0 of its group has {key}"):
                opt.step()
            state[key] = good
            assert _unchanged(before, opt, params), (key, wrong.dtype)
