"""Lion, Adan and StableAdamW against the independent references in tests/reference, plus
behaviour checks that need no reference (Lion's uniform step, Adan's first step, StableAdamW ==
AdamW when nothing is clipped)."""

from __future__ import annotations

import inspect
import io

import pytest
import torch

from lightning_optim.optim.adam import AdamW
from lightning_optim.optim.adan import Adan
from lightning_optim.optim.lion import Lion
from lightning_optim.optim.release import prepare_for_gradient_release, remove_gradient_release
from lightning_optim.optim.stableadamw import StableAdamW
from tests.optim.helpers import clone_params, grad_stream, make_params, max_abs_diff, run_steps, two_groups
from tests.reference.adan import RefAdan
from tests.reference.lion import RefLion
from tests.reference.stableadamw import RefStableAdamW

STEPS = 12
LR_CHANGE_AT = 6  # the lr is halved here (like a scheduler) on both sides
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
NOT_FOR_REF = ("foreach", "kahan_sum", "fp32_state", "maximize")

# name -> (class, reference, base kwargs, second-group overrides, flag variants)
CASES = {
    "Lion": (
        Lion, RefLion, dict(lr=1e-2),
        dict(lr=3e-3, betas=(0.8, 0.95), weight_decay=0.3),
        [
            dict(),
            dict(weight_decay=0.1),
            dict(weight_decay=0.1, decouple_lr=True),
            dict(weight_decay=1e-3, decouple_lr=True, max_lr=4e-2),
            dict(betas=(0.5, 0.9)),
            dict(weight_decay=0.1, maximize=True),
        ],
    ),
    "Adan": (
        Adan, RefAdan, dict(lr=1e-2),
        dict(lr=5e-3, betas=(0.95, 0.9, 0.999), weight_decay=0.05, eps=1e-4),
        [
            dict(weight_decay=0.0),
            dict(),  # the default weight_decay=0.02, proximal decay
            dict(weight_decay=0.1, adam_wd=True),
            dict(weight_decay=0.1, decouple_lr=True),
            dict(weight_decay=1e-3, decouple_lr=True, max_lr=4e-2, adam_wd=True),
            dict(betas=(0.9, 0.8, 0.95), eps=1e-3),
            dict(maximize=True),
        ],
    ),
    "StableAdamW": (
        StableAdamW, RefStableAdamW, dict(lr=1e-2),
        # a large eps: eps^2 floors v_hat for many elements inside the RMS
        dict(lr=5e-3, betas=(0.8, 0.9), weight_decay=0.05, eps=0.3),
        [
            dict(weight_decay=0.0),
            dict(),  # the default weight_decay=1e-2
            dict(weight_decay=0.1, decouple_lr=True),
            dict(weight_decay=1e-3, decouple_lr=True, max_lr=4e-2),
            dict(betas=(0.5, 0.999), eps=1e-8),
            dict(weight_decay=0.1, maximize=True),
        ],
    ),
}
REF_CASES = [(name, v) for name, case in CASES.items() for v in case[4]]


def _spiky_grads(steps: int = STEPS) -> list[list[torch.Tensor]]:
    """grad_stream with a 20x spike on two tensors at step 4 (so StableAdamW clips)."""
    grads = grad_stream(steps=steps)
    grads[4] = [g * 20 if i in (0, 2) else g for i, g in enumerate(grads[4])]
    return grads


def _ref_kwargs(cls: type, ref_cls: type, kwargs: dict) -> dict:
    """Our defaults (weight_decay differs for StableAdamW) overridden by ``kwargs``, minus our-only flags."""
    ref_args = inspect.signature(ref_cls).parameters
    ours = {k: p.default for k, p in inspect.signature(cls).parameters.items()
            if k in ref_args and p.default is not inspect.Parameter.empty}
    return {k: v for k, v in {**ours, **kwargs}.items() if k not in NOT_FOR_REF}


def _against_reference(name: str, variant: dict, dtype: torch.dtype, foreach: bool):
    cls, ref_cls, base_kwargs, second, _ = CASES[name]
    kwargs = {**base_kwargs, **variant}
    base = make_params(dtype)
    ours_p = clone_params(base)
    ref_p = [p.detach().clone() for p in base]
    ours = cls(two_groups(ours_p, **second), foreach=foreach, **kwargs)
    refs = [ref_cls(ref_p[:2], **_ref_kwargs(cls, ref_cls, kwargs)),
            ref_cls(ref_p[2:], **_ref_kwargs(cls, ref_cls, {**kwargs, **second}))]
    sign = -1.0 if kwargs.get("maximize") else 1.0

    def before_step(i: int) -> None:
        if i == LR_CHANGE_AT:
            for group in ours.param_groups:
                group["lr"] /= 2

    grads = _spiky_grads()
    run_steps(ours, ours_p, grads, before_step)
    largest_rms = 0.0  # StableAdamW's reference records each tensor's last RMS
    for i, step_grads in enumerate(grads):
        if i == LR_CHANGE_AT:
            for ref in refs:
                ref.lr /= 2
        g = [sign * x.to(dtype) for x in step_grads]
        refs[0].step(g[:2])
        refs[1].step(g[2:])
        if ref_cls is RefStableAdamW:
            largest_rms = max([largest_rms, *refs[0].last_rms, *refs[1].last_rms])
    return ours_p, ref_p, base, largest_rms


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name,variant", REF_CASES, ids=[f"{n}-{v}" for n, v in REF_CASES])
def test_matches_reference(name, variant, dtype, foreach):
    ours_p, ref_p, base, largest_rms = _against_reference(name, variant, dtype, foreach)
    diff = max_abs_diff(ours_p, ref_p)
    print(f"{name} {variant} {dtype} foreach={foreach}: max |ours - ref| = {diff:.3e}")
    assert diff < TOL[dtype]
    assert max_abs_diff(ours_p, base) > 1e-2  # the params really moved
    if name == "StableAdamW":
        assert largest_rms > 1.5  # the spike really was clipped (RMS <= sqrt((1-b2^t)/(1-b2)))


@pytest.mark.parametrize("name,variant", REF_CASES, ids=[f"{n}-{v}" for n, v in REF_CASES])
def test_foreach_equals_for_loop_bitwise(name, variant):
    cls, _, base_kwargs, second, _ = CASES[name]
    base = make_params()
    runs = []
    for foreach in (False, True):
        params = clone_params(base)
        run_steps(cls(two_groups(params, **second), foreach=foreach, **base_kwargs, **variant), params, _spiky_grads())
        runs.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("dtype,fp32_state", [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_round_trip_continues_bit_identically(name, dtype, fp32_state):
    cls, _, base_kwargs, second, variants = CASES[name]
    kwargs = {**base_kwargs, **variants[2], "fp32_state": fp32_state}
    base = make_params(dtype)
    grads = _spiky_grads(10)
    full_p = clone_params(base)
    run_steps(cls(two_groups(full_p, **second), **kwargs), full_p, grads)

    first_p = clone_params(base)
    first = cls(two_groups(first_p, **second), **kwargs)
    run_steps(first, first_p, grads[:5])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed_p = clone_params(first_p)
    resumed = cls(two_groups(resumed_p, **second), **kwargs)
    resumed.load_state_dict(torch.load(buf))
    state_dtype = torch.float32 if fp32_state else dtype
    for p in resumed_p:
        assert resumed.state[p]["exp_avg"].dtype == state_dtype
    run_steps(resumed, resumed_p, grads[5:])
    assert all(torch.equal(a, b) for a, b in zip(full_p, resumed_p))


@pytest.mark.parametrize("name", list(CASES))
def test_optimizer_accumulation_equals_reference_with_zero_lr(name):
    # An accumulating step updates the states and leaves the params alone; the reference does
    # exactly that when its lr is 0 (every decay here scales with lr).
    cls, ref_cls, base_kwargs, _, _ = CASES[name]
    kwargs = {**base_kwargs, "weight_decay": 0.1}
    base = make_params(torch.float64)
    ours_p, ref_p = clone_params(base), [p.detach().clone() for p in base]
    ours, ref = cls(ours_p, **kwargs), ref_cls(ref_p, **kwargs)
    accumulate = [True, True, False, True, False, False, True, True, True, False]
    grads = _spiky_grads(len(accumulate))

    def before_step(i: int) -> None:
        ours.optimizer_accumulation = accumulate[i]

    run_steps(ours, ours_p, grads, before_step)
    for acc, g in zip(accumulate, grads):
        ref.lr = 0.0 if acc else kwargs["lr"]
        ref.step(g)
    assert max_abs_diff(ours_p, ref_p) < 1e-10
    assert max_abs_diff(ours_p, base) > 1e-2


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_release_equals_normal_step(name):
    cls, _, base_kwargs, _, _ = CASES[name]
    kwargs = {**base_kwargs, "weight_decay": 0.1}
    normal_model, release_model = _mlp(), _mlp()
    normal = cls(normal_model.parameters(), foreach=True, **kwargs)
    release = cls(release_model.parameters(), **kwargs)
    prepare_for_gradient_release(release_model, release)
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        x, y = torch.randn(10, 6, generator=gen), torch.randn(10, 3, generator=gen)
        for model, opt in ((normal_model, normal), (release_model, release)):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    remove_gradient_release(release_model)
    assert all(torch.equal(a, b) for a, b in zip(normal_model.parameters(), release_model.parameters()))


@pytest.mark.parametrize("foreach", [False, True])
def test_grads_are_left_untouched(foreach):
    for name, (cls, _, base_kwargs, second, variants) in CASES.items():
        params = make_params()
        opt = cls(two_groups(params, **second), foreach=foreach, **base_kwargs, **variants[-1])
        grads = grad_stream(steps=3)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.float().clone()
            opt.step()
            assert all(torch.equal(p.grad, g.float()) for p, g in zip(params, step_grads)), name


# ---------------------------------------------------------------- behaviour without a reference
def test_lion_moves_every_coordinate_by_exactly_lr():
    lr = 2.0**-6
    params = make_params(torch.float64)
    opt = Lion(params, lr=lr, betas=(0.7, 0.9))
    for step_grads in grad_stream(steps=5):
        before = [p.detach().clone() for p in params]
        run_steps(opt, params, [step_grads])
        for p, b in zip(params, before):
            assert torch.allclose((p - b).abs(), torch.full_like(p, lr), rtol=0, atol=1e-15)


def test_lion_step_sign_follows_interpolation_not_gradient():
    # m = 0.1 after one step of g = 1 with beta2 = 0.9; then g = -0.05: c = 0.5*0.1 + 0.5*(-0.05) > 0
    p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = Lion([p], lr=1.0, betas=(0.5, 0.9))
    run_steps(opt, [p], [[torch.ones(1, dtype=torch.float64)], [torch.full((1,), -0.05, dtype=torch.float64)]])
    assert p.item() == -2.0  # both steps went down although the second gradient is negative


def test_adan_first_step_is_normalised_gradient():
    # at t = 1: d = 0, m_hat = g, v_hat = g^2  ->  p <- (p - lr g / (|g| + eps)) / (1 + lr wd)
    lr, eps, wd = 0.1, 1e-3, 0.5
    params = make_params(torch.float64)
    expected = [p.detach().clone() for p in params]
    grads = grad_stream(steps=1)
    run_steps(Adan(params, lr=lr, eps=eps, weight_decay=wd), params, grads)
    for e, g in zip(expected, grads[0]):
        e.copy_((e - lr * g / (g.abs() + eps)) / (1 + lr * wd))
    assert max_abs_diff(params, expected) < 1e-14


def test_stableadamw_equals_adamw_when_nothing_is_clipped():
    # a constant gradient gives g^2 / v_hat = 1, so RMS = 1 and lr_t = lr
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
    base = make_params(torch.float64)
    stable_p, adamw_p = clone_params(base), clone_params(base)
    grads = grad_stream(steps=1)[0]
    stable, adamw = StableAdamW(stable_p, **kwargs), torch.optim.AdamW(adamw_p, **kwargs)
    run_steps(stable, stable_p, [grads] * 8)
    run_steps(adamw, adamw_p, [grads] * 8)
    assert max_abs_diff(stable_p, adamw_p) < 1e-12


def test_stableadamw_clips_a_gradient_spike_per_tensor():
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0)
    base = make_params(torch.float64)
    stable_p, adamw_p = clone_params(base), clone_params(base)
    stable, adamw = StableAdamW(stable_p, **kwargs), AdamW(adamw_p, **kwargs)
    grads = _spiky_grads(5)
    run_steps(stable, stable_p, grads[:4])
    run_steps(adamw, adamw_p, grads[:4])
    stable_before = [p.detach().clone() for p in stable_p]
    adamw_before = [p.detach().clone() for p in adamw_p]
    run_steps(stable, stable_p, grads[4:5])  # the spike on tensors 0 and 2
    run_steps(adamw, adamw_p, grads[4:5])
    for i, (s, a, sb, ab) in enumerate(zip(stable_p, adamw_p, stable_before, adamw_before)):
        # the moments depend on the gradients only, so the moves differ by lr_t / lr = 1 / max(1, RMS)
        ratio = ((s - sb).abs().max() / (a - ab).abs().max()).item()
        assert ratio < 1 / 1.5 if i in (0, 2) else ratio <= 1 + 1e-9


def test_defaults_follow_optimi():
    p = make_params()
    lion = Lion(p, lr=1e-4).defaults
    assert (lion["betas"], lion["weight_decay"]) == ((0.9, 0.99), 0.0)
    adan = Adan(p, lr=1e-3).defaults
    assert (adan["betas"], adan["eps"], adan["weight_decay"]) == ((0.98, 0.92, 0.99), 1e-6, 0.02)
    assert adan["adam_wd"] is False
    stable = StableAdamW(p, lr=1e-3).defaults
    assert (stable["betas"], stable["eps"], stable["weight_decay"]) == ((0.9, 0.99), 1e-6, 1e-2)
    # optimi's positional order: (params, lr, betas, weight_decay, eps)
    assert StableAdamW(p, 1e-3, (0.9, 0.99), 0.05, 1e-4).defaults["eps"] == 1e-4
    assert Adan(p, 1e-3, (0.9, 0.9, 0.9), 0.05, 1e-4).defaults["weight_decay"] == 0.05


# ---------------------------------------------------------------- bad input
BAD = [
    (Lion, dict(betas=(1.0, 0.9)), ValueError, r"betas\[0\]"),
    (Lion, dict(betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
    (Lion, dict(betas=(0.9, 0.99, 0.9)), TypeError, "betas"),
    (Lion, dict(lr=-1.0), ValueError, "lr"),
    (Lion, dict(lr=None), TypeError, "lr"),
    (Lion, dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (Lion, dict(decouple_lr=True, max_lr=0.0), ValueError, "max_lr"),
    (Lion, dict(decouple_lr="yes"), TypeError, "decouple_lr"),
    (Lion, dict(kahan_sum=1), TypeError, "kahan_sum"),
    (Lion, dict(maximize=None), TypeError, "maximize"),
    (Adan, dict(betas=(0.9, 0.9)), TypeError, "betas"),
    (Adan, dict(betas=(0.98, 0.92, 1.0)), ValueError, r"betas\[2\]"),
    (Adan, dict(eps=0.0), ValueError, "eps"),
    (Adan, dict(eps=float("inf")), ValueError, "eps"),
    (Adan, dict(weight_decay=-1.0), ValueError, "weight_decay"),
    (Adan, dict(adam_wd="false"), TypeError, "adam_wd"),
    (Adan, dict(fp32_state=2), TypeError, "fp32_state"),
    (Adan, dict(lr=float("nan")), ValueError, "lr"),
    (StableAdamW, dict(betas=(0.9, 1.5)), ValueError, r"betas\[1\]"),
    (StableAdamW, dict(eps=-1e-6), ValueError, "eps"),
    (StableAdamW, dict(eps="1e-6"), TypeError, "eps"),
    (StableAdamW, dict(weight_decay=-0.01), ValueError, "weight_decay"),
    (StableAdamW, dict(decouple_lr=True, max_lr=-1.0), ValueError, "max_lr"),
    (StableAdamW, dict(foreach="yes"), TypeError, "foreach"),
]


@pytest.mark.parametrize("cls,kwargs,exc,arg", BAD, ids=[f"{c.__name__}-{k}" for c, k, _, _ in BAD])
def test_bad_hyperparameter_names_the_argument(cls, kwargs, exc, arg):
    with pytest.raises(exc, match=arg):
        cls(make_params(), **{"lr": 1e-3, **kwargs})


@pytest.mark.parametrize("cls", [Lion, Adan, StableAdamW])
def test_lr_is_required_and_bad_group_override_is_caught(cls):
    with pytest.raises(TypeError, match="lr"):
        cls(make_params())
    with pytest.raises(ValueError, match="betas"):
        cls(two_groups(make_params(), betas=(0.9, 1.0, 0.9)[: 3 if cls is Adan else 2]), lr=1e-3)
