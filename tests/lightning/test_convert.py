"""In-process checks of the strategies' adapters: optimizer conversion (hyper-parameters, param
groups, LR schedulers), adopting an already-1-bit optimizer, and argument errors."""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch

import lightning_optim
from lightning_optim.lightning import (
    OnebitAdamStrategy,
    OnebitFSDPStrategy,
    OnebitLambStrategy,
    ZeroOneAdamStrategy,
    to_onebit,
)
from lightning_optim.lightning.convert import retarget_schedulers
from lightning_optim.model import ByteGPT, param_groups
from lightning_optim.onebit import OnebitAdam, OnebitLamb, ZeroOneAdam


def _groups():
    return param_groups(ByteGPT(max_seq_len=8, n_layer=1, n_head=2, d_model=16))


def _same_params(a, b):
    return [[id(p) for p in g["params"]] for g in a.param_groups] == [[id(p) for p in g["params"]] for g in b.param_groups]


@pytest.mark.parametrize("target", [OnebitAdam, ZeroOneAdam])
def test_torch_adamw_keeps_hyper_parameters_and_groups(target):
    groups = _groups()
    groups[0]["lr"] = 2e-3  # a per-group override
    groups[1]["name"] = "no_decay"  # a user tag
    source = torch.optim.AdamW(groups, lr=1e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05)
    knobs = {"freeze_step": 7} if target is OnebitAdam else {"var_freeze_step": 7, "local_step_clipper": 4}
    new = to_onebit(source, target, knobs)
    assert type(new) is target and new.average_grads is False and _same_params(source, new)
    for old_group, group in zip(source.param_groups, new.param_groups):
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert group[key] == pytest.approx(old_group[key]), key
        assert group["bias_correction"] is True and group["eps_inside_sqrt"] is False
    assert new.param_groups[0]["lr"] == 2e-3 and new.param_groups[0]["weight_decay"] == 0.05
    assert new.param_groups[1]["weight_decay"] == 0.0 and new.param_groups[1]["name"] == "no_decay"
    for key, value in knobs.items():
        assert getattr(new, key) == value


def test_lightning_optim_adamw_flags_carry_over():
    source = lightning_optim.AdamW(_groups(), lr=3e-3, weight_decay=0.1, bias_correction=False, kahan_sum=True)
    new = to_onebit(source, OnebitAdam, {"freeze_step": 3})
    assert all(g["bias_correction"] is False and g["kahan_sum"] is True for g in new.param_groups)
    assert [g["weight_decay"] for g in new.param_groups] == [0.1, 0.0]


def test_decoupled_decay_matches_adamw_in_warmup():
    """One rank, warmup: OnebitAdam from AdamW steps exactly like torch AdamW (decoupled decay)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    reference = torch.optim.AdamW([{"params": twins[:1]}, {"params": twins[1:], "weight_decay": 0.0}],
                                  lr=1e-2, weight_decay=0.3)
    source = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}],
                               lr=1e-2, weight_decay=0.3)
    onebit = to_onebit(source, OnebitAdam, {"freeze_step": 100})
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, t, g in zip(params, twins, grads):
            p.grad, t.grad = g.clone(), g.clone()
        reference.step()
        onebit.step()
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)


def test_lamb_family_to_onebit_lamb():
    groups = _groups()
    new = to_onebit(lightning_optim.FusedLamb(groups, lr=1e-2, weight_decay=0.1, max_coeff=5.0, min_coeff=0.1),
                    OnebitLamb, {"freeze_step": 4, "coeff_beta": 0.5})
    assert type(new) is OnebitLamb and new.freeze_step == 4 and new.coeff_beta == 0.5
    assert all(g["max_coeff"] == 5.0 and g["min_coeff"] == 0.1 for g in new.param_groups)
    decayed = lightning_optim.Lamb([_groups()[0]], lr=1e-2, weight_decay=0.1)  # every group decays
    assert type(to_onebit(decayed, OnebitLamb)) is OnebitLamb


@pytest.mark.parametrize(
    "make,target,match",
    [
        (lambda g: torch.optim.SGD(g, lr=0.1), OnebitAdam, "torch.optim.sgd.SGD"),
        (lambda g: lightning_optim.Lion(g, lr=1e-4), ZeroOneAdam, "Lion"),
        (lambda g: torch.optim.AdamW(g), OnebitLamb, "AdamW"),
        (lambda g: lightning_optim.Lamb(g), OnebitAdam, "Lamb"),
    ],
)
def test_unsupported_optimizer_class_is_named(make, target, match):
    with pytest.raises(TypeError, match=match):
        to_onebit(make(_groups()), target)


@pytest.mark.parametrize(
    "make,target,match",
    [
        (lambda g: torch.optim.Adam(g, weight_decay=0.1), OnebitAdam, "coupled L2"),
        (lambda g: torch.optim.AdamW(g, amsgrad=True), OnebitAdam, "amsgrad"),
        (lambda g: torch.optim.AdamW(g, maximize=True), ZeroOneAdam, "maximize"),
        (lambda g: lightning_optim.AdamW(g, decouple_lr=True, max_lr=1e-3), OnebitAdam, "decouple_lr"),
        (lambda g: lightning_optim.Lamb(g, weight_decay=0.1), OnebitLamb, "use_nvlamb"),
        (lambda g: lightning_optim.Lamb(g, weight_decay=0.1, use_nvlamb=True, decoupled_weight_decay=False),
         OnebitLamb, "decoupled_weight_decay"),
        (lambda g: lightning_optim.FusedLamb(g, max_grad_norm=1.0), OnebitLamb, "gradient_clip_val"),
    ],
)
def test_inexpressible_settings_are_refused(make, target, match):
    with pytest.raises(ValueError, match=match):
        to_onebit(make(_groups()), target)


def test_adam_without_decay_converts():
    new = to_onebit(torch.optim.Adam(_groups(), lr=1e-3), OnebitAdam)  # coupled decay of 0 is no decay
    assert [g["weight_decay"] for g in new.param_groups] == [0.0, 0.0]


def test_stepped_source_is_refused():
    groups = _groups()
    source = torch.optim.AdamW(groups)
    for g in groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    source.step()
    with pytest.raises(ValueError, match="already stepped"):
        to_onebit(source, OnebitAdam)


def test_lr_scheduler_follows_the_new_optimizer():
    source = torch.optim.AdamW(_groups(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(source, lambda step: 0.5 ** step)
    chained = torch.optim.lr_scheduler.SequentialLR(
        source, [torch.optim.lr_scheduler.ConstantLR(source, factor=1.0, total_iters=1),
                 torch.optim.lr_scheduler.ConstantLR(source, factor=1.0, total_iters=1)], milestones=[1])
    new = to_onebit(source, OnebitAdam, {"freeze_step": 10})
    assert retarget_schedulers([scheduler, chained], source, new) == 4
    assert all(g["initial_lr"] == 1e-2 for g in new.param_groups)
    for group in new.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        new.step()
        scheduler.step()
    assert [g["lr"] for g in new.param_groups] == [pytest.approx(5e-3)] * 2
    assert all(g["lr"] == 1e-2 for g in source.param_groups)  # the old optimizer is out of the loop


def test_strategy_adopts_a_onebit_optimizer_as_is():
    strategy = OnebitAdamStrategy(freeze_step=5)
    given = OnebitAdam(_groups(), freeze_step=3)  # average_grads=True by default
    with pytest.warns(UserWarning, match="used as is.*freeze_step=3"):
        adopted = strategy._adopt(given)
    assert adopted is given and adopted.freeze_step == 3 and adopted.average_grads is False
    converted = OnebitAdamStrategy(freeze_step=5)._adopt(torch.optim.AdamW(_groups()))
    assert type(converted) is OnebitAdam and converted.freeze_step == 5


AUTO_FREEZE = ("auto_freeze_window", "auto_freeze_tolerance", "auto_freeze_max")


@pytest.mark.parametrize("strategy_cls", [OnebitAdamStrategy, ZeroOneAdamStrategy, OnebitLambStrategy, OnebitFSDPStrategy])
def test_a_strategy_takes_the_auto_freeze_arguments_its_optimizer_takes(strategy_cls):
    optimizer_cls = strategy_cls.optimizer_class  # OnebitFSDPStrategy: its default, OnebitAdam
    takes = {name for name in inspect.signature(optimizer_cls).parameters if name.startswith("auto_freeze_")}
    assert {n for n in inspect.signature(strategy_cls).parameters if n.startswith("auto_freeze_")} == takes
    if not takes:
        return
    assert takes == set(AUTO_FREEZE)
    strategy = strategy_cls(freeze_step="auto", auto_freeze_window=3, auto_freeze_tolerance=0.25, auto_freeze_max=7)
    source = (lightning_optim.FusedLamb(_groups(), lr=1e-2) if optimizer_cls is OnebitLamb
              else torch.optim.AdamW(_groups(), lr=1e-2))
    converted = to_onebit(source, strategy.optimizer_class, strategy._knobs)
    assert type(converted) is optimizer_cls and converted.auto_freeze
    assert (converted.auto_freeze_window, converted.auto_freeze_tolerance, converted.auto_freeze_max) == (3, 0.25, 7)
    name = strategy_cls.__name__
    for key, bad, error in (("auto_freeze_window", 0, ValueError), ("auto_freeze_tolerance", 1.5, ValueError),
                            ("auto_freeze_max", "x", TypeError), ("auto_freeze_max", float("nan"), TypeError)):
        with pytest.raises(error, match=rf"^{name}: {key} must be"):
            strategy_cls(freeze_step="auto", **{key: bad})
    with pytest.raises(ValueError, match=rf"^{name}: auto_freeze_window: only with freeze_step='auto'"):
        strategy_cls(freeze_step=10, auto_freeze_window=3)


def test_strategy_errors_name_the_strategy_and_the_optimizer():
    with pytest.raises(TypeError, match="OnebitLambStrategy.*AdamW"):
        OnebitLambStrategy()._adopt(torch.optim.AdamW(_groups()))


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: OnebitAdamStrategy(freeze_step=-1), ValueError, "OnebitAdamStrategy: freeze_step must be an integer >= 1"),
        (lambda: OnebitAdamStrategy(freeze_step=2.5), TypeError, "freeze_step must be an integer"),
        (lambda: ZeroOneAdamStrategy(local_step_clipper=0), ValueError, "local_step_clipper must be an integer >= 1"),
        (lambda: OnebitLambStrategy(coeff_beta=1.0), ValueError, "coeff_beta"),
        (lambda: OnebitLambStrategy(factor_min=2.0, factor_max=1.0), ValueError, "factor_max"),
        (lambda: OnebitAdamStrategy(timeout=0), ValueError, "timeout"),
        (lambda: OnebitAdamStrategy(timeout="5"), TypeError, "timeout"),
        (lambda: OnebitAdamStrategy(telemetry="yes"), TypeError, "telemetry"),
        (lambda: OnebitAdamStrategy(ddp_comm_hook=lambda s, b: None), TypeError, "ddp_comm_hook"),
    ],
)
def test_bad_strategy_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_strategy_timeout_and_ddp_arguments_reach_ddp():
    strategy = ZeroOneAdamStrategy(var_freeze_step=10, timeout=12.5, find_unused_parameters=True)
    assert strategy._timeout.total_seconds() == 12.5 and strategy.timeout_s == 12.5
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert OnebitAdamStrategy()._knobs == {}  # None: the optimizer's own defaults
    assert math.isclose(OnebitAdamStrategy().timeout_s, 300.0)


def test_fp16_loss_scaling_is_refused():
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = OnebitAdamStrategy(freeze_step=5)
    strategy.precision_plugin = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), callbacks=[])
    with pytest.raises(ValueError, match="16-mixed.*MasterWeightsPrecision.*bf16-mixed"):
        strategy.setup(trainer)
