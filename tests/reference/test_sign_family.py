"""Sanity tests of the sign-step references (Lion, SignSGD) against closed forms and torch SGD's
momentum direction."""

from __future__ import annotations

import pytest
import torch

from . import RefLion, RefSignSGD
from ._harness import DT, SHAPES, clone_all, make_grads, make_params, run_ref


# ----------------------------------------------------------------------------------------- Lion
def test_lion_moves_exactly_lr_per_coordinate():
    # quadratic f = 0.5 ||p||^2, g = p; p far from 0 so the sign never flips
    ps = [torch.full(s, 5.0, dtype=DT) for s in SHAPES]
    ref = RefLion(ps, lr=0.01)
    for t in range(1, 11):
        ref.step([p.clone() for p in ps])
        for p in ps:
            torch.testing.assert_close(p, torch.full_like(p, 5.0 - 0.01 * t), rtol=0, atol=1e-12)


def test_lion_first_steps_closed_form_with_decay():
    p0, gs = make_params(), make_grads(2)
    lr, b1, b2, wd = 0.01, 0.9, 0.99, 0.1
    got = run_ref(RefLion, p0, gs, lr=lr, betas=(b1, b2), weight_decay=wd)
    for p, g0, g1, q in zip(p0, gs[0], gs[1], got):
        p1 = p * (1 - lr * wd) - lr * torch.sign(g0)  # m0 = 0 -> c = (1 - b1) g0
        m1 = (1 - b2) * g0
        p2 = p1 * (1 - lr * wd) - lr * torch.sign(b1 * m1 + (1 - b1) * g1)
        torch.testing.assert_close(q, p2, rtol=1e-12, atol=1e-13)


# ------------------------------------------------------------------------------------- SignSGD
def test_signsgd_without_momentum_moves_lr_times_sign():
    p0, gs = make_params(), make_grads(1)
    got = run_ref(RefSignSGD, p0, gs, lr=0.01, weight_decay=0.1)
    for p, g, q in zip(p0, gs[0], got):
        torch.testing.assert_close(q, p - 0.01 * torch.sign(g + 0.1 * p), rtol=0, atol=1e-15)


@pytest.mark.parametrize("dampening,nesterov", [(0.0, False), (0.3, False), (0.0, True)])
def test_signsgd_momentum_is_sign_of_torch_sgd_direction(dampening, nesterov):
    # with wd = 0 torch SGD's direction does not depend on the params: read it off a dummy run
    p0, gs = make_params(), make_grads()
    ps = clone_all(p0)
    ref = RefSignSGD(ps, lr=0.01, momentum=0.9, dampening=dampening, nesterov=nesterov)
    dummy = [torch.zeros(s, dtype=DT, requires_grad=True) for s in SHAPES]
    sgd = torch.optim.SGD(dummy, lr=1.0, momentum=0.9, dampening=dampening, nesterov=nesterov)
    for grads in gs:
        before_ref = clone_all(ps)
        before_dummy = [d.detach().clone() for d in dummy]
        ref.step(grads)
        for d, g in zip(dummy, grads):
            d.grad = g.clone()
        sgd.step()
        for b, q, bd, d in zip(before_ref, ps, before_dummy, dummy):
            direction = bd - d.detach()
            torch.testing.assert_close(q, b - 0.01 * torch.sign(direction), rtol=0, atol=1e-15)
