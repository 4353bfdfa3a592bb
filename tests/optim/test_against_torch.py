"""Adam, AdamW and SGD against torch.optim: for-loop and foreach, several groups, closures."""

from __future__ import annotations

import itertools

import pytest
import torch

import lightning_optim.optim as lo
from tests.optim.helpers import SHAPES, clone_params, grad_stream, make_params, max_abs_diff, run_steps, two_groups

ATOL = 1e-6  # fp32 over ten steps; observed differences are at the ulp level


def _compare(ours_cls, torch_cls, kwargs: dict, foreach: bool, second_group: dict, steps: int = 10) -> float:
    base = make_params()
    p_ours, p_ref = clone_params(base), clone_params(base)
    ours = ours_cls(two_groups(p_ours, **second_group), foreach=foreach, **kwargs)
    ref = torch_cls(two_groups(p_ref, **second_group), foreach=foreach, **kwargs)
    grads = grad_stream(steps=steps)
    run_steps(ours, p_ours, grads)
    run_steps(ref, p_ref, grads)
    return max_abs_diff(p_ours, p_ref)


ADAM_CASES = [
    dict(amsgrad=a, weight_decay=wd, maximize=m)
    for a, wd, m in itertools.product([False, True], [0.0, 0.1], [False, True])
]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("kwargs", ADAM_CASES, ids=str)
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_family_matches_torch(name, kwargs, foreach):
    kwargs = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-7, **kwargs)
    diff = _compare(getattr(lo, name), getattr(torch.optim, name), kwargs, foreach, {"lr": 3e-3, "weight_decay": 0.05})
    assert diff < ATOL


SGD_CASES = [
    dict(momentum=0.0, weight_decay=0.0),
    dict(momentum=0.0, weight_decay=0.1),
    dict(momentum=0.9, dampening=0.0),
    dict(momentum=0.9, dampening=0.3, weight_decay=0.1),
    dict(momentum=0.9, nesterov=True, weight_decay=0.1),
    dict(momentum=0.5, nesterov=True, maximize=True),
]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("kwargs", SGD_CASES, ids=str)
def test_sgd_matches_torch(kwargs, foreach):
    diff = _compare(lo.SGD, torch.optim.SGD, dict(lr=0.05, **kwargs), foreach, {"lr": 0.01, "momentum": 0.7})
    assert diff < ATOL


def test_sgd_wd_after_momentum_matches_manual_equations():
    # apex/ColossalAI FusedSGD: momentum on the raw grad, decay added afterwards.
    lr, mu, wd = 0.1, 0.9, 0.05
    p = make_params(torch.float64)
    opt = lo.SGD(p, lr=lr, momentum=mu, weight_decay=wd, wd_after_momentum=True)
    expected = [x.detach().clone() for x in p]
    bufs = [None] * len(p)
    for step_grads in grad_stream():
        for i, g in enumerate(step_grads):
            bufs[i] = g.clone() if bufs[i] is None else mu * bufs[i] + g
            expected[i] = expected[i] - lr * (bufs[i] + wd * expected[i])
        run_steps(opt, p, [step_grads])
    assert max_abs_diff(p, expected) < 1e-12


@pytest.mark.parametrize("name", ["Adam", "SGD"])
def test_closure_returns_loss_and_matches_torch(name):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    ref_model = torch.nn.Linear(6, 3)
    ref_model.load_state_dict(model.state_dict())
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    kwargs = dict(lr=0.05, momentum=0.9) if name == "SGD" else dict(lr=0.05)
    ours = getattr(lo, name)(model.parameters(), **kwargs)
    ref = getattr(torch.optim, name)(ref_model.parameters(), **kwargs)
    for _ in range(5):
        def closure(m=model, o=ours):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss

        def ref_closure(m=ref_model, o=ref):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss

        loss, ref_loss = ours.step(closure), ref.step(ref_closure)
        assert torch.equal(loss, ref_loss) or abs(loss.item() - ref_loss.item()) < 1e-6
    assert max_abs_diff(list(model.parameters()), list(ref_model.parameters())) < ATOL


@pytest.mark.parametrize("foreach", [False, True])
def test_grads_are_not_overwritten(foreach):
    p = make_params()
    grads = grad_stream(steps=1)[0]
    opt = lo.Adam(p, lr=0.1, weight_decay=0.3, foreach=foreach)  # L2: g + wd p must not land in p.grad
    for x, g in zip(p, grads):
        x.grad = g.float().clone()
    opt.step()
    for x, g in zip(p, grads):
        assert torch.equal(x.grad, g.float())


def test_params_without_grad_are_skipped_like_torch():
    base = make_params()
    p_ours, p_ref = clone_params(base), clone_params(base)
    ours, ref = lo.AdamW(p_ours, lr=0.01), torch.optim.AdamW(p_ref, lr=0.01)
    for step, grads in enumerate(grad_stream(steps=6)):
        for i, (a, b, g) in enumerate(zip(p_ours, p_ref, grads)):
            keep = not (i == 1 and step % 2 == 0)  # param 1 gets a grad every other step
            a.grad = g.float() if keep else None
            b.grad = g.float() if keep else None
        ours.step()
        ref.step()
    assert max_abs_diff(p_ours, p_ref) < ATOL
    assert SHAPES  # the shared shapes are non-empty
