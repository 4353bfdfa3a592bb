"""Shared features on every optimizer: foreach, gradient release, reloads, Kahan, accumulation, bad input."""

from __future__ import annotations

import io

import pytest
import torch

import lightning_optim.optim as lo
from tests.optim.helpers import clone_params, grad_stream, make_params, max_abs_diff, run_steps, two_groups
from tests.optim.specs import SPECS


def _build(spec, params, **extra):
    return spec.cls(two_groups(params, lr=spec.kwargs["lr"] / 2), **{**spec.kwargs, **extra})


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_foreach_matches_for_loop(spec):
    base = make_params()
    p_loop, p_multi = clone_params(base), clone_params(base)
    grads = grad_stream(steps=8)
    run_steps(_build(spec, p_loop, foreach=False), p_loop, grads)
    run_steps(_build(spec, p_multi, foreach=True), p_multi, grads)
    assert max_abs_diff(p_loop, p_multi) < 1e-6
    assert max_abs_diff(p_loop, base) > 1e-4  # the optimizer really moved the params


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches(n: int):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(12, 8, generator=gen), torch.randn(12, 4, generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("spec", [s for s in SPECS if s.releases], ids=str)
def test_gradient_release_equals_normal_step_and_follows_scheduler_after_reload(spec):
    normal_model, release_model = _mlp(), _mlp()
    normal = spec.cls(normal_model.parameters(), **{**spec.kwargs, "foreach": False})
    release = spec.cls(release_model.parameters(), **spec.kwargs)
    lo.prepare_for_gradient_release(release_model, release)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.3) for o in (normal, release)]
    lrs = []
    for i, (x, y) in enumerate(_batches(8)):
        if i == 4:  # mid-training reload replaces the param-group dicts
            for opt in (normal, release):
                buf = io.BytesIO()
                torch.save(opt.state_dict(), buf)
                buf.seek(0)
                opt.load_state_dict(torch.load(buf))
        for model, opt in ((normal_model, normal), (release_model, release)):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()  # a no-op for the released optimizer
            opt.zero_grad()
        for s in scheds:
            s.step()
        lrs.append(release.param_groups[0]["lr"])
        assert all(p.grad is None for p in release_model.parameters())
    assert len(set(lrs)) > 2  # the scheduler really changed the lr, also after the reload
    for a, b in zip(normal_model.parameters(), release_model.parameters()):
        assert torch.equal(a, b)
    lo.remove_gradient_release(release_model)
    assert not release.gradient_release


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_gradient_release_flag_works_as_in_optimi(spec):
    """optimi's ``gradient_release=True`` constructor flag and its hook body ``step(param=p)`` +
    ``zero_grad(param=p)``: equal to a normal step; refused at construction where release is impossible."""
    if not spec.releases:
        with pytest.raises(ValueError, match="gradient_release: not possible"):
            spec.cls(_mlp().parameters(), **spec.kwargs, gradient_release=True)
        return
    normal_model, manual_model = _mlp(), _mlp()
    normal = spec.cls(normal_model.parameters(), **{**spec.kwargs, "foreach": False})
    manual = spec.cls(manual_model.parameters(), **spec.kwargs, gradient_release=True)
    assert manual.defaults["gradient_release"] is True
    assert "gradient_release" not in manual.state_dict()["param_groups"][0]
    for x, y in _batches(3):
        torch.nn.functional.mse_loss(normal_model(x), y).backward()
        normal.step()
        normal.zero_grad()
        torch.nn.functional.mse_loss(manual_model(x), y).backward()
        with pytest.raises(ValueError, match="closure"):
            manual.step(closure=lambda: 0.0, param=next(manual_model.parameters()))
        for p in manual_model.parameters():
            manual.step(param=p)
            manual.zero_grad(param=p)
        assert all(p.grad is None for p in manual_model.parameters())
    for a, b in zip(normal_model.parameters(), manual_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_state_dict_round_trip_continues_bit_identically(spec):
    base = make_params()
    grads = grad_stream(steps=10)
    p_full = clone_params(base)
    run_steps(_build(spec, p_full), p_full, grads)

    p_first = clone_params(base)
    first = _build(spec, p_first)
    run_steps(first, p_first, grads[:5])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    p_resumed = clone_params(p_first)
    resumed = _build(spec, p_resumed)
    resumed.load_state_dict(torch.load(buf))
    run_steps(resumed, p_resumed, grads[5:])
    for a, b in zip(p_full, p_resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_kahan_summation_tracks_fp32_better_in_bf16(spec):
    base = make_params(torch.bfloat16, shapes=[(64, 32), (256,)])  # all runs start from the same values
    # a drift (+0.5) so the fp32 run travels many bf16 ulps; plain bf16 rounds small steps away
    grads = [[g + 0.5 for g in step] for step in grad_stream(shapes=[(64, 32), (256,)], steps=100)]
    kwargs = {**spec.kwargs, "lr": spec.kahan_lr}
    runs = {}
    for label, dtype, kahan in (("fp32", torch.float32, None), ("kahan", torch.bfloat16, True), ("plain", torch.bfloat16, False)):
        params = clone_params(base, dtype)
        run_steps(spec.cls(params, kahan_sum=kahan, **kwargs), params, grads)
        runs[label] = params

    def err(label: str) -> float:
        return max(((p.double() - q.double()).abs().mean().item()) for p, q in zip(runs[label], runs["fp32"]))

    kahan_err, plain_err = err("kahan"), err("plain")
    print(f"{spec}: mean |bf16 - fp32| with Kahan {kahan_err:.2e}, without {plain_err:.2e}")
    assert kahan_err < 0.5 * plain_err


@pytest.mark.parametrize("spec", [s for s in SPECS if s.accumulates], ids=str)
def test_optimizer_accumulation_defers_parameter_updates(spec):
    params = make_params()
    opt = _build(spec, params)
    before = [p.detach().clone() for p in params]
    opt.optimizer_accumulation = True
    run_steps(opt, params, grad_stream(steps=3))
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(opt.state[p] for p in params)  # the gradients went into the states
    opt.optimizer_accumulation = False
    run_steps(opt, params, grad_stream(steps=1, seed=9))
    assert max_abs_diff(params, before) > 0


def _regression(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(10, 1, generator=gen)
    x = torch.randn(256, 10, generator=gen)
    return x, x @ w_true + 0.1 * torch.randn(256, 1, generator=gen)


@pytest.mark.parametrize("name,kwargs", [("AdamW", dict(lr=0.05)), ("SGD", dict(lr=0.05, momentum=0.9))])
def test_optimizer_accumulation_approximates_gradient_accumulation(name, kwargs):
    x, y = _regression()
    micro = 4
    init = torch.zeros(10, 1)
    w_grad, w_opt = init.clone().requires_grad_(), init.clone().requires_grad_()
    grad_acc = getattr(lo, name)([w_grad], **kwargs)
    opt_acc = getattr(lo, name)([w_opt], **kwargs)
    for step in range(30):
        chunks = list(zip(x[step % 4 * 64:(step % 4 + 1) * 64].chunk(micro), y[step % 4 * 64:(step % 4 + 1) * 64].chunk(micro)))
        for xb, yb in chunks:  # classic gradient accumulation: mean gradient, one step
            (torch.nn.functional.mse_loss(xb @ w_grad, yb) / micro).backward()
        grad_acc.step()
        grad_acc.zero_grad()
        for i, (xb, yb) in enumerate(chunks):  # optimizer accumulation: into the states
            opt_acc.optimizer_accumulation = i < micro - 1
            torch.nn.functional.mse_loss(xb @ w_opt, yb).backward()
            opt_acc.step()
            opt_acc.zero_grad()
    travelled = (w_grad - init).norm().item()
    gap = (w_opt - w_grad).norm().item()
    print(f"{name}: gradient accumulation moved {travelled:.3f}, optimizer accumulation differs by {gap:.3f}")
    assert gap < 0.25 * travelled
    assert torch.nn.functional.mse_loss(x @ w_opt, y) < 0.5 * torch.nn.functional.mse_loss(x @ init, y)


def test_fp32_state_of_bf16_params_stays_fp32_after_reload():
    params = make_params(torch.bfloat16)
    opt = lo.CPUAdam(params, lr=1e-2)
    grads = grad_stream(steps=6)
    run_steps(opt, params, grads[:3])
    saved = opt.state_dict()
    resumed_params = clone_params(params)
    resumed = lo.CPUAdam(resumed_params, lr=1e-2)
    resumed.load_state_dict(saved)
    for p, q in zip(params, resumed_params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert resumed.state[q][key].dtype == torch.float32
            assert torch.equal(resumed.state[q][key], opt.state[p][key])
    run_steps(opt, params, grads[3:])
    run_steps(resumed, resumed_params, grads[3:])
    assert all(torch.equal(p, q) for p, q in zip(params, resumed_params))


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("arg,value", [("lr", -1.0), ("weight_decay", -0.1), ("lr", float("nan"))])
def test_bad_common_hyperparameters_name_the_argument(spec, arg, value):
    with pytest.raises(ValueError, match=arg):
        spec.cls(make_params(), **{**spec.kwargs, arg: value})


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_unknown_flag_raises_type_error(spec):
    with pytest.raises(TypeError, match="no_such_flag"):
        spec.cls(make_params(), **spec.kwargs, no_such_flag=True)


@pytest.mark.parametrize("kwargs,arg", [
    (dict(betas=(1.0, 0.9)), "betas"), (dict(betas=(0.9, -0.1)), "betas"), (dict(betas=(0.9,)), "betas"),
    (dict(eps=0.0), "eps"), (dict(eps=-1e-8), "eps"), (dict(amsgrad="yes"), "amsgrad"),
    (dict(decouple_lr=True, max_lr=-1.0), "max_lr"), (dict(kahan_sum=1), "kahan_sum"),
])
def test_bad_adam_arguments(kwargs, arg):
    with pytest.raises((ValueError, TypeError), match=arg):
        lo.Adam(make_params(), **kwargs)


def test_bad_per_group_override_is_caught():
    params = make_params()
    with pytest.raises(ValueError, match="lr"):
        lo.Adam(two_groups(params, lr=-0.1))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_sparse_grad_raises_before_anything_changes(spec):
    params = make_params()
    opt = _build(spec, params)
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grad_stream(steps=1)[0]):
        p.grad = g.float()
    params[-1].grad = params[-1].grad.to_sparse()  # the last param of the last group
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert not any(opt.state[p] for p in params)


def test_complex_params_are_refused():
    with pytest.raises(TypeError, match="complex"):
        lo.Adam([torch.zeros(3, dtype=torch.complex64, requires_grad=True)])


def test_accumulation_without_state_is_refused():
    opt = lo.SGD(make_params(), lr=0.1)
    with pytest.raises(ValueError, match="momentum"):
        opt.optimizer_accumulation = True


def test_gradient_release_refuses_foreign_optimizers_and_params():
    model = _mlp()
    with pytest.raises(TypeError, match="optimizer"):
        lo.prepare_for_gradient_release(model, torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match="model"):
        lo.prepare_for_gradient_release(model, lo.Adam(make_params()))


def test_kahan_on_fp32_params_warns_once():
    params = make_params()
    opt = lo.AdamW(params, kahan_sum=True)
    with pytest.warns(UserWarning, match="kahan_sum=True has no effect"):
        run_steps(opt, params, grad_stream(steps=2))
    assert not any("kahan_comp" in opt.state[p] for p in params)


def test_bucket_states_share_one_buffer_saved_once_and_repacked_after_reload():
    params = [torch.nn.Parameter(torch.randn(1000, generator=torch.Generator().manual_seed(i))) for i in range(20)]
    opt = lo.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()

    def buffers(key):
        return {opt.state[p][key].untyped_storage().data_ptr() for p in params}

    assert len(buffers("exp_avg")) == 1 and len(buffers("exp_avg_sq")) == 1
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    state_bytes = 2 * 20 * 1000 * 4  # exp_avg + exp_avg_sq, fp32
    assert state_bytes < saved.tell() < 1.2 * state_bytes  # the shared buffers once, not once per view
    saved.seek(0)
    opt.load_state_dict(torch.load(saved))
    assert len(buffers("exp_avg")) == 20  # load_state_dict makes owning copies...
    opt.step()
    assert len(buffers("exp_avg")) == 1  # ...which the next step packs again


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_slicing_16_bit_buckets_changes_no_result(spec, monkeypatch):
    """Buckets on 16-bit states are stepped in slices (bounded fp32 temporaries): bitwise the same."""
    import lightning_optim.optim.batch as batch

    def run(slice_numel):
        monkeypatch.setattr(batch, "TORCH_PATH_SLICE", slice_numel)
        params = [p.detach().to(torch.bfloat16).requires_grad_() for p in make_params()]
        opt = spec.cls(params, **spec.kwargs)
        run_steps(opt, params, grad_stream(steps=3))
        return params

    whole, sliced = run(1 << 30), run(7)
    assert sum(p.numel() for p in whole) > 7 * 3  # several slices
    for a, b in zip(whole, sliced):
        assert torch.equal(a, b)
