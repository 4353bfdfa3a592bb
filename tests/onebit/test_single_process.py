"""The 1-bit optimizers in one process (no process group): stage math against the plain
optimizers, schedules, checkpoints, bf16, bad input and the Hydra configs."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import lightning_optim.optim as lo
from lightning_optim.onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
from tests.onebit.workers import SHAPES, init_params, rank_grads
from tests.reference.zero_one_adam import RefZeroOneAdam

ALL = [
    (OnebitAdam, dict(freeze_step=3)),
    (ZeroOneAdam, dict(var_freeze_step=4, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)),
    (OnebitLamb, dict(freeze_step=3)),
]
IDS = ["OnebitAdam", "ZeroOneAdam", "OnebitLamb"]


def _feed(opt, params, steps, first=1, grads=None):
    for step in range(first, first + steps):
        for p, g in zip(params, grads(step) if grads else rank_grads(step, 0)):
            p.grad = None if g is None else g.to(p.dtype)
        opt.step()


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _close(a, b, tol=1e-6):
    """Same math on another code path (the plain optimizers may run compiled kernels)."""
    return max((x - y).abs().max().item() for x, y in zip(a, b)) < tol


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# ---------------------------------------------------------------- stage math
@pytest.mark.parametrize("bias_correction", [True, False])
def test_onebit_adam_warmup_is_adamw(bias_correction):
    p1, p2 = init_params(), init_params()
    onebit = OnebitAdam(p1, lr=0.01, freeze_step=10, weight_decay=0.1, bias_correction=bias_correction)
    adamw = lo.AdamW(p2, lr=0.01, weight_decay=0.1, bias_correction=bias_correction)
    _feed(onebit, p1, 10)
    _feed(adamw, p2, 10)
    assert _close(p1, p2)
    assert onebit.needs_averaged_grads is False and onebit.in_compression_stage


def test_onebit_lamb_warmup_is_lamb_and_records_the_coefficient_ema():
    p1, p2 = init_params(), init_params()
    kw = dict(lr=0.01, weight_decay=0.1, eps=1e-6, eps_inside_sqrt=True, max_coeff=2.0, min_coeff=0.5)
    onebit = OnebitLamb(p1, freeze_step=10, coeff_beta=0.8, **kw)
    lamb = lo.Lamb(p2, use_nvlamb=True, **kw)
    ema = [0.0] * len(p1)
    for step in range(1, 6):
        _feed(onebit, p1, 1, first=step)
        _feed(lamb, p2, 1, first=step)
        ema = [0.8 * e + 0.2 * c for e, c in zip(ema, lamb.get_lamb_coeffs())]
    assert _close(p1, p2)
    assert onebit.get_lamb_coeffs() == pytest.approx(lamb.get_lamb_coeffs(), rel=1e-6)
    frozen = [onebit.state[p]["lamb_coeff_freeze"].item() for p in p1]
    assert frozen == pytest.approx(ema, rel=1e-6)


@pytest.mark.parametrize("cls,kw", ALL, ids=IDS)
def test_first_step_updates_params_and_missing_grads_count_as_zero(cls, kw):
    params = init_params()
    before = [p.detach().clone() for p in params]
    opt = cls(params, lr=0.01, **kw)
    _feed(opt, params, 1)
    assert all(not torch.equal(p, b) for p, b in zip(params, before))  # DeepSpeed skips this step
    # a param without a gradient takes part with a zero gradient (every rank runs the same collectives)
    a, b = init_params(), init_params()
    opt_a, opt_b = cls(a, lr=0.01, **kw), cls(b, lr=0.01, **kw)

    def with_none(step):
        g = rank_grads(step, 0)
        return [None if (step % 2 and j == 1) else x for j, x in enumerate(g)]

    def with_zero(step):
        g = rank_grads(step, 0)
        return [torch.zeros_like(x) if (step % 2 and j == 1) else x for j, x in enumerate(g)]

    _feed(opt_a, a, 8, grads=with_none)
    _feed(opt_b, b, 8, grads=with_zero)
    assert _equal(a, b)


def test_zero_one_adam_schedule_follows_deepspeed_rules_on_the_real_step_count():
    params = init_params()
    kw = dict(var_freeze_step=40, var_update_scaler=3, local_step_scaler=5, local_step_clipper=8)
    opt = ZeroOneAdam(params, lr=1e-3, **kw)
    ref = RefZeroOneAdam(init_params(), 1, lr=1e-3, **kw)
    needs = []
    for step in range(1, 101):
        needs.append(opt.needs_averaged_grads)
        _feed(opt, params, 1, first=step)
        ref.step([rank_grads(step, 0)])
        assert opt.params_synchronized == ref.synced[-1]
    # variance steps: 1,2,3 (interval 1), 4,6,8 (2), 12,16,20 (4), 24,32,40 (8)
    assert [s + 1 for s, n in enumerate(needs) if n] == [1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 40]
    assert [s for s in range(41, 101) if ref.synced[s - 1]][:9] == [41, 42, 43, 44, 45, 46, 48, 50, 52]
    assert opt._sched["local_step_interval"] == 8 and ref.local_interval == 8  # clipped
    assert max((p - q).abs().max().item() for p, q in zip(params, ref.params[0])) < 1e-5


# ---------------------------------------------------------------- precision
@pytest.mark.parametrize("cls,kw", ALL, ids=IDS)
def test_bf16_params_track_fp32_with_kahan(cls, kw):
    p16 = init_params(torch.bfloat16)
    p32 = [p.detach().float().requires_grad_() for p in p16]  # same (bf16-representable) start
    o16, o32 = cls(p16, lr=1e-3, **kw), cls(p32, lr=1e-3, **kw)

    def grads(step):
        return [g.bfloat16().float() for g in rank_grads(step, 0)]

    _feed(o16, p16, 12, grads=grads)
    _feed(o32, p32, 12, grads=grads)
    for p, q in zip(p16, p32):
        true = p.float() + o16.state[p]["kahan_comp"].float()
        assert (true - q).abs().max().item() < 1e-3
        assert (p.float() - q).abs().max().item() <= 2 ** -7 * q.abs().max().item()
    state = o16.state_dict()
    o16.load_state_dict(_roundtrip(state))
    assert all(v.dtype == torch.float32 for k, v in o16.state[p16[0]].items() if k != "kahan_comp")


# ---------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("cls,kw", ALL, ids=IDS)
def test_state_dict_round_trip_continues_bitwise_and_carries_the_schedule(cls, kw):
    a = init_params()
    opt_a = cls(a, lr=0.01, **kw)
    _feed(opt_a, a, 5)
    saved = _roundtrip({"opt": opt_a.state_dict(), "params": [p.detach().clone() for p in a]})
    assert saved["opt"]["onebit"]["optimizer"] == cls.__name__
    assert saved["opt"]["onebit"]["schedule"]["step"] == 5
    b = [p.clone().requires_grad_() for p in saved["params"]]
    opt_b = cls(b, lr=0.01, **kw)
    opt_b.load_state_dict(saved["opt"])
    assert opt_b.needs_averaged_grads == opt_a.needs_averaged_grads
    _feed(opt_a, a, 6, first=6)
    _feed(opt_b, b, 6, first=6)
    assert _equal(a, b)


@pytest.mark.parametrize("cls,kw", ALL, ids=IDS)
def test_state_tensors_replaced_from_outside_stay_the_truth(cls, kw):
    """Lightning's _optimizer_to_device swaps state tensors for copies; the flat buffers follow."""
    a, b = init_params(), init_params()
    opt_a, opt_b = cls(a, lr=0.01, **kw), cls(b, lr=0.01, **kw)
    _feed(opt_a, a, 5)
    _feed(opt_b, b, 5)
    for p in b:
        opt_b.state[p] = {k: v.clone() for k, v in opt_b.state[p].items()}
    _feed(opt_a, a, 6, first=6)
    _feed(opt_b, b, 6, first=6)
    assert _equal(a, b)


def test_load_keeps_the_current_exp_avg_mask_and_refuses_foreign_dicts():
    params = init_params()
    old_mask, new_mask = torch.ones(SHAPES[1]), torch.tensor([1.0, 0.0, 1.0, 1.0])
    opt = OnebitAdam([{"params": params[:1]}, {"params": params[1:2], "exp_avg_mask": old_mask}], freeze_step=1)
    _feed(opt, params[:2], 2)
    saved = opt.state_dict()
    fresh = OnebitAdam([{"params": params[:1]}, {"params": params[1:2], "exp_avg_mask": new_mask}], freeze_step=1)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[1]["exp_avg_mask"] is new_mask
    with pytest.raises(ValueError, match="saved by OnebitAdam"):
        ZeroOneAdam(params[:2]).load_state_dict(saved)
    sgd = lo.SGD(params[:2], lr=0.1, momentum=0.9)
    for p in params[:2]:
        p.grad = torch.ones_like(p)
    sgd.step()
    with pytest.raises(ValueError, match=r"holds state \['momentum_buffer', 'step'\].*missing: \['exp_avg', 'exp_avg_sq'\]"):
        OnebitAdam(params[:2]).load_state_dict(sgd.state_dict())


def test_a_param_group_added_in_warmup_joins_the_flat_layout():
    params = init_params()
    opt = OnebitAdam(params[:2], lr=0.01, freeze_step=2)
    _feed(opt, params[:2], 1)
    opt.add_param_group({"params": params[2:]})
    _feed(opt, params, 3, first=2)
    assert opt._flat("exp_avg").numel() == sum(p.numel() for p in params)
    assert all(torch.isfinite(p).all() for p in params)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "cls,kwargs,error,match",
    [
        (OnebitAdam, dict(freeze_step=-1), ValueError, "freeze_step"),
        (OnebitAdam, dict(freeze_step=2.5), TypeError, "freeze_step"),
        (OnebitAdam, dict(amsgrad=True), ValueError, "amsgrad"),
        (OnebitAdam, dict(lr=-1.0), ValueError, "lr"),
        (OnebitAdam, dict(betas=(1.0, 0.999)), ValueError, r"betas\[0\]"),
        (OnebitAdam, dict(eps=0.0), ValueError, "eps"),
        (OnebitAdam, dict(weight_decay=-0.1), ValueError, "weight_decay"),
        (OnebitAdam, dict(average_grads="yes"), TypeError, "average_grads"),
        (OnebitAdam, dict(comm_backend_name="smoke"), ValueError, "comm_backend_name"),
        (ZeroOneAdam, dict(amsgrad=True), ValueError, "amsgrad"),
        (ZeroOneAdam, dict(var_freeze_step=-5), ValueError, "var_freeze_step"),
        (ZeroOneAdam, dict(var_update_scaler=0), ValueError, "var_update_scaler"),
        (ZeroOneAdam, dict(local_step_scaler=0), ValueError, "local_step_scaler"),
        (ZeroOneAdam, dict(local_step_clipper=0), ValueError, "local_step_clipper"),
        (ZeroOneAdam, dict(betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
        (OnebitLamb, dict(freeze_step=-1), ValueError, "freeze_step"),
        (OnebitLamb, dict(amsgrad=True), ValueError, "amsgrad"),
        (OnebitLamb, dict(coeff_beta=1.0), ValueError, "coeff_beta"),
        (OnebitLamb, dict(factor_min=2.0, factor_max=1.0), ValueError, "factor_max"),
        (OnebitLamb, dict(factor_threshold=-0.1), ValueError, "factor_threshold"),
        (OnebitLamb, dict(min_coeff=5.0, max_coeff=1.0), ValueError, "min_coeff"),
        (OnebitLamb, dict(lr=-0.1), ValueError, "lr"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(init_params(), **kwargs)


def test_bad_params_and_masks_raise():
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        OnebitAdam([torch.zeros(3, dtype=torch.float64, requires_grad=True)])
    with pytest.raises(ValueError, match="exp_avg_mask"):
        OnebitAdam([{"params": [torch.zeros(3, requires_grad=True)], "exp_avg_mask": torch.ones(4)}])


@pytest.mark.parametrize("cls,kw", ALL, ids=IDS)
def test_sparse_grads_raise_before_anything_changes(cls, kw):
    params = init_params()
    opt = cls(params, **kw)
    _feed(opt, params, 2)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    params[1].grad = torch.zeros_like(params[1]).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    assert _equal(params, before) and opt.global_step == 2


def test_accumulation_and_gradient_release_are_refused():
    params = init_params()
    opt = OnebitAdam(params)
    with pytest.raises(ValueError, match="optimizer_accumulation"):
        opt.optimizer_accumulation = True
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="gradient release"):
        lo.prepare_for_gradient_release(model, OnebitAdam(model.parameters()))


def test_deepspeed_only_options_warn_once_and_defaults_are_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OnebitAdam(init_params())
        ZeroOneAdam(init_params(), comm_backend_name="gloo")
    for kwargs in (dict(comm_backend_name="mpi"), dict(cuda_aware=True), dict(max_grad_norm=1.0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            OnebitLamb(init_params(), **kwargs)
        assert len(caught) == 1, kwargs


# ---------------------------------------------------------------- Hydra configs
@pytest.mark.parametrize(
    "name,cls", [("onebit_adam", OnebitAdam), ("zero_one_adam", ZeroOneAdam), ("onebit_lamb", OnebitLamb)]
)
def test_hydra_configs_instantiate(name, cls):
    hydra_utils = pytest.importorskip("hydra.utils")
    omegaconf = pytest.importorskip("omegaconf")
    from lightning_optim.conf_dir import conf_dir

    path = conf_dir() / "optimizer" / f"{name}.yaml"
    factory = hydra_utils.instantiate(omegaconf.OmegaConf.load(path))
    opt = factory(init_params())
    assert type(opt) is cls and opt.average_grads is True
    assert opt.param_groups[0]["betas"] == (0.9, 0.99) or list(opt.param_groups[0]["betas"]) == [0.9, 0.99]
