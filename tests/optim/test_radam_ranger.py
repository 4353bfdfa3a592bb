"""RAdam against torch.optim.RAdam and RefRAdam; Ranger against RefRanger; their own features."""

from __future__ import annotations

import io

import pytest
import torch

from lightning_optim.optim.radam import RAdam, rectification
from lightning_optim.optim.ranger import Ranger
from tests.optim.helpers import clone_params, grad_stream, make_params, max_abs_diff, run_steps, two_groups
from tests.reference.radam_lookahead import RefRAdam, RefRanger

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
STEPS = 25


def test_the_runs_reach_the_rectified_regime():
    # the comparisons below would not test the rectified step otherwise
    for beta2 in (0.999, 0.99, 0.95):
        assert rectification(beta2, 1) is None
        assert rectification(beta2, 20) is not None
    assert rectification(0.0, 100) is None  # rho_inf = 1: never rectified


# ---------------------------------------------------------------- RAdam vs torch
TORCH_CASES = [
    dict(),
    dict(weight_decay=0.1),
    dict(weight_decay=0.1, decoupled_weight_decay=True),
    dict(weight_decay=0.05, maximize=True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("kwargs", TORCH_CASES, ids=str)
def test_radam_matches_torch(kwargs, foreach, dtype):
    base = make_params(dtype)
    p_ours, p_torch = clone_params(base), clone_params(base)
    kwargs = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, foreach=foreach, **kwargs)
    second = dict(lr=3e-3, betas=(0.9, 0.999), weight_decay=0.02)
    ours = RAdam(two_groups(p_ours, **second), **kwargs)
    ref = torch.optim.RAdam(two_groups(p_torch, **second), **kwargs)
    grads = grad_stream(steps=STEPS)
    run_steps(ours, p_ours, grads)
    run_steps(ref, p_torch, grads)
    assert max_abs_diff(p_ours, p_torch) < (1e-12 if dtype == torch.float64 else 1e-6)
    assert max_abs_diff(p_ours, base) > 1e-2


# ---------------------------------------------------------------- against the references
def _groups_and_refs(params, ref_cls, first: dict, second: dict):
    """Our two-group optimizer input and one reference per group (the references take flat lists)."""
    groups = [{"params": params[:2], **first}, {"params": params[2:], **second}]
    ref_params = [p.detach().clone() for p in params]
    refs = [ref_cls(ref_params[:2], **first), ref_cls(ref_params[2:], **second)]
    return groups, refs, ref_params


def _run_against_refs(opt, params, refs, ref_params, steps, negate=False, lr_at=None):
    for i, step_grads in enumerate(grad_stream(steps=steps)):
        if lr_at is not None and i == lr_at:  # a scheduler-like lr change mid-run
            for group, ref in zip(opt.param_groups, refs):
                group["lr"] *= 0.5
                ref.lr *= 0.5
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        opt.step()
        grads = [(-g if negate else g).to(p.dtype) for p, g in zip(ref_params, step_grads)]
        refs[0].step(grads[:2])
        refs[1].step(grads[2:])


RADAM_REF_CASES = [
    dict(),
    dict(weight_decay=0.1),
    dict(weight_decay=0.1, decoupled_weight_decay=True),
    dict(weight_decay=0.1, decouple_lr=True, max_lr=2e-2),
    dict(weight_decay=0.1, decouple_lr=True),  # max_lr defaults to the initial lr
    dict(maximize=True),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("kwargs", RADAM_REF_CASES, ids=str)
def test_radam_matches_reference(kwargs, foreach, dtype):
    kwargs = dict(kwargs)
    maximize = kwargs.pop("maximize", False)
    params = make_params(dtype)
    first = dict(lr=1e-2, betas=(0.85, 0.99), eps=1e-7, **kwargs)
    second = dict(first, lr=4e-3, betas=(0.9, 0.995), eps=1e-6)
    groups, refs, ref_params = _groups_and_refs(params, RefRAdam, first, second)
    opt = RAdam(groups, foreach=foreach, maximize=maximize)
    _run_against_refs(opt, params, refs, ref_params, STEPS, negate=maximize, lr_at=12)
    assert max_abs_diff(params, ref_params) < TOL[dtype]
    assert max_abs_diff(params, make_params(dtype)) > 1e-2


RANGER_REF_CASES = [
    dict(),
    dict(weight_decay=0.1),  # decouple_wd=True is the default
    dict(weight_decay=0.1, decouple_wd=False),  # L2
    dict(weight_decay=0.1, decouple_lr=True, max_lr=2e-2),
    dict(k=4, alpha=0.8),
    dict(k=1, alpha=1.0),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("kwargs", RANGER_REF_CASES, ids=str)
def test_ranger_matches_reference(kwargs, foreach, dtype):
    params = make_params(dtype)
    first = dict(lr=1e-2, **kwargs)
    second = dict(first, lr=5e-3, betas=(0.8, 0.999), eps=1e-5, alpha=0.3)
    groups, refs, ref_params = _groups_and_refs(params, RefRanger, first, second)
    opt = Ranger(groups, lr=1.0, foreach=foreach)
    _run_against_refs(opt, params, refs, ref_params, 20, lr_at=9)  # 20 > 3 k: several syncs
    assert max_abs_diff(params, ref_params) < TOL[dtype]
    assert max_abs_diff(params, make_params(dtype)) > 1e-2


def test_ranger_really_syncs_to_the_slow_weights():
    params = make_params(torch.float64)
    opt = Ranger(params, lr=1e-2, k=3, alpha=0.5)
    grads = grad_stream(steps=6)
    run_steps(opt, params, grads[:2])
    start = [opt.state[p]["la_param"].clone() for p in params]
    assert all(not torch.equal(p, s) for p, s in zip(params, start))
    run_steps(opt, params, grads[2:3])  # third step: sync
    for p in params:
        assert torch.equal(p, opt.state[p]["la_param"])
    # the slow weights moved halfway from their start to the fast weights
    assert all(not torch.equal(opt.state[p]["la_param"], s) for p, s in zip(params, start))


# ---------------------------------------------------------------- foreach == for-loop
FLAG_CASES = [
    (RAdam, dict(lr=1e-2, weight_decay=0.1)),
    (RAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, maximize=True)),
    (Ranger, dict(lr=1e-2, weight_decay=0.1, k=4)),
    (Ranger, dict(lr=1e-2, weight_decay=0.1, decouple_lr=True, k=4)),
]


@pytest.mark.parametrize("dtype,extra", [
    (torch.float32, {}),
    (torch.bfloat16, {}),  # Kahan on by default
    (torch.bfloat16, dict(fp32_state=True)),
    (torch.bfloat16, dict(kahan_sum=False)),
], ids=["fp32", "bf16-kahan", "bf16-fp32state", "bf16-plain"])
@pytest.mark.parametrize("cls,kwargs", FLAG_CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_foreach_equals_for_loop(cls, kwargs, dtype, extra):
    base = make_params(dtype)
    runs = []
    for foreach in (False, True):
        params = clone_params(base)
        run_steps(cls(two_groups(params, lr=3e-3), foreach=foreach, **kwargs, **extra), params, grad_stream(steps=10))
        runs.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert max_abs_diff(runs[0], base) > 1e-3


def test_fp32_state_keeps_slow_weights_fp32_through_a_reload():
    params = make_params(torch.bfloat16)
    opt = Ranger(params, lr=1e-2, fp32_state=True)
    run_steps(opt, params, grad_stream(steps=3))
    resumed_params = clone_params(params)
    resumed = Ranger(resumed_params, lr=1e-2, fp32_state=True)
    resumed.load_state_dict(opt.state_dict())
    for p, q in zip(params, resumed_params):
        for key in ("exp_avg", "exp_avg_sq", "la_param"):
            assert resumed.state[q][key].dtype == torch.float32
            assert torch.equal(resumed.state[q][key], opt.state[p][key])


def test_kahan_sync_leaves_fast_plus_compensation_at_the_fp32_slow_weights():
    params = make_params(torch.bfloat16)
    opt = Ranger(params, lr=1e-3, k=2, fp32_state=True, kahan_sum=True)
    run_steps(opt, params, grad_stream(steps=2))
    for p in params:
        s = opt.state[p]
        comp = s["kahan_comp"].float()
        # exact up to the bf16 rounding of the compensation itself
        assert ((p.float() + comp - s["la_param"]).abs() <= comp.abs() * 2**-8).all()
        # the compensation is really needed: without it the error is far larger
        assert (p.float() - s["la_param"]).abs().max() > 30 * (p.float() + comp - s["la_param"]).abs().max()


# ---------------------------------------------------------------- state dicts
@pytest.mark.parametrize("cls,kwargs", [
    (RAdam, dict(lr=1e-2, weight_decay=0.1)),
    (Ranger, dict(lr=1e-2, weight_decay=0.1, k=4)),  # syncs at 4 (before the save) and 8 (after)
], ids=["RAdam", "Ranger"])
@pytest.mark.parametrize("foreach", [False, True])
def test_state_dict_round_trip_continues_bit_identically(cls, kwargs, foreach):
    base = make_params()
    grads = grad_stream(steps=10)
    p_full = clone_params(base)
    run_steps(cls(two_groups(p_full, lr=3e-3), foreach=foreach, **kwargs), p_full, grads)
    p_first = clone_params(base)
    first = cls(two_groups(p_first, lr=3e-3), foreach=foreach, **kwargs)
    run_steps(first, p_first, grads[:5])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    p_resumed = clone_params(p_first)
    resumed = cls(two_groups(p_resumed, lr=3e-3), foreach=foreach, **kwargs)
    resumed.load_state_dict(torch.load(buf))
    run_steps(resumed, p_resumed, grads[5:])
    assert all(torch.equal(a, b) for a, b in zip(p_full, p_resumed))


# ---------------------------------------------------------------- accumulation
def test_ranger_lookahead_counts_applied_steps_only():
    params = make_params(torch.float64)
    opt = Ranger(params, lr=1e-2, k=2)
    grads = grad_stream(steps=6)
    start = [p.detach().clone() for p in params]

    def accumulate(i: int) -> None:  # steps 0, 2, 4 accumulate; 1, 3, 5 apply
        opt.optimizer_accumulation = i % 2 == 0

    run_steps(opt, params, grads[:3], before_step=accumulate)
    # three moment updates, one applied step: no sync yet, the slow weights are the start
    for p, s in zip(params, start):
        assert opt.state[p]["step"] == 3 and opt.state[p]["la_step"] == 1
        assert torch.equal(opt.state[p]["la_param"], s)
    run_steps(opt, params, grads[3:4], before_step=lambda i: accumulate(1))
    for p, s in zip(params, start):  # second applied step: sync
        assert opt.state[p]["la_step"] == 2
        assert torch.equal(p, opt.state[p]["la_param"]) and not torch.equal(p, s)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,arg", [
    (dict(betas=(1.0, 0.9)), "betas"), (dict(betas=(0.9, -0.1)), "betas"), (dict(betas=0.9), "betas"),
    (dict(eps=0.0), "eps"), (dict(eps=-1.0), "eps"), (dict(lr=-1.0), "lr"),
    (dict(weight_decay=-0.1), "weight_decay"), (dict(decoupled_weight_decay="yes"), "decoupled_weight_decay"),
    (dict(decouple_lr=True, max_lr=0.0), "max_lr"), (dict(fp32_state=1), "fp32_state"),
    (dict(capturable=True), "capturable"),
])
def test_bad_radam_arguments(kwargs, arg):
    with pytest.raises((ValueError, TypeError), match=arg):
        RAdam(make_params(), **kwargs)


@pytest.mark.parametrize("kwargs,arg", [
    (dict(k=0), "k"), (dict(k=2.5), "k"), (dict(k=True), "k"), (dict(alpha=0.0), "alpha"),
    (dict(alpha=1.5), "alpha"), (dict(alpha=float("nan")), "alpha"),
    (dict(decoupled_weight_decay="no"), "decoupled_weight_decay"), (dict(decouple_wd="no"), "decoupled_weight_decay"),
    (dict(betas=(0.9, 1.0)), "betas"), (dict(eps=0.0), "eps"), (dict(weight_decay=-1.0), "weight_decay"),
    (dict(maximize=None), "maximize"),
])
def test_bad_ranger_arguments(kwargs, arg):
    with pytest.raises((ValueError, TypeError), match=arg):
        Ranger(make_params(), **{"lr": 1e-2, **kwargs})


def test_bad_per_group_override_is_caught_before_anything_is_built():
    params = make_params()
    with pytest.raises(ValueError, match="alpha"):
        Ranger(two_groups(params, alpha=2.0), lr=1e-2)
