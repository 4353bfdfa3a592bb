"""Sanity tests of the trust-ratio references (LAMB, LARS) against torch.optim and closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from . import RefLAMB, RefLARS
from ._harness import (
    DT,
    LRS,
    SHAPES,
    assert_all_close,
    clone_all,
    make_grads,
    make_params,
    run_ref,
    run_torch,
)


# ----------------------------------------------------------------------------------------- LAMB
def test_lamb_adam_flag_equals_torch_adam():
    p0, gs = make_params(), make_grads()
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
    want = run_torch(torch.optim.Adam, p0, gs, lrs=LRS, **kw)
    assert_all_close(run_ref(RefLAMB, p0, gs, lrs=LRS, adam=True, **kw), want)
    # apex semantics: no trust ratio for wd == 0 tensors unless use_nvlamb
    assert_all_close(run_ref(RefLAMB, p0, gs, lrs=LRS, **kw), want)


def test_lamb_adam_flag_with_decay_equals_torch_adamw_and_adam_l2():
    p0, gs = make_params(), make_grads()
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
    want_w = run_torch(torch.optim.AdamW, p0, gs, **kw)
    assert_all_close(run_ref(RefLAMB, p0, gs, adam=True, adam_w_mode=True, **kw), want_w)
    want_l2 = run_torch(torch.optim.Adam, p0, gs, **kw)
    assert_all_close(run_ref(RefLAMB, p0, gs, adam=True, adam_w_mode=False, **kw), want_l2)


def _adam_direction_first_step(g, eps, inside=False):
    # step 1 with bias correction: m_hat = g, v_hat = g^2
    return g / torch.sqrt(g * g + eps) if inside else g / (g.abs() + eps)


@pytest.mark.parametrize("inside", [False, True])
def test_lamb_trust_ratio_first_step_closed_form(inside):
    p0, gs = make_params(), make_grads(1)
    lr, wd, eps = 0.05, 0.1, 1e-6
    got = run_ref(RefLAMB, p0, gs, lr=lr, weight_decay=wd, eps=eps, eps_inside_sqrt=inside,
                  max_coeff=float("inf"), min_coeff=0.0)
    for p, g, q in zip(p0, gs[0], got):
        u = _adam_direction_first_step(g, eps, inside) + wd * p
        r = p.norm() / u.norm()
        torch.testing.assert_close(q, p - lr * r * u, rtol=1e-12, atol=1e-13)


def test_lamb_trust_ratio_clamp_and_nvlamb():
    p0, gs = make_params(scale=100.0), make_grads(1)  # big ||p|| -> ratio >> 10
    lr, eps = 1e-3, 1e-6
    # use_nvlamb + wd = 0: ratio applied and clamped at max_coeff
    got = run_ref(RefLAMB, p0, gs, lr=lr, eps=eps, use_nvlamb=True, max_coeff=10.0)
    for p, g, q in zip(p0, gs[0], got):
        u = _adam_direction_first_step(g, eps)
        assert (p.norm() / u.norm()) > 10
        torch.testing.assert_close(q, p - lr * 10.0 * u, rtol=1e-12, atol=1e-13)
    # min_coeff clamp: tiny params
    p0s = make_params(scale=1e-6)
    got = run_ref(RefLAMB, p0s, gs, lr=lr, eps=eps, use_nvlamb=True, min_coeff=0.01)
    for p, g, q in zip(p0s, gs[0], got):
        u = _adam_direction_first_step(g, eps)
        torch.testing.assert_close(q, p - lr * 0.01 * u, rtol=1e-12, atol=1e-13)
    # zero params -> r = 1
    zeros = [torch.zeros(s, dtype=DT) for s in SHAPES]
    got = run_ref(RefLAMB, zeros, gs, lr=lr, eps=eps, use_nvlamb=True, weight_decay=0.1)
    for g, q in zip(gs[0], got):
        torch.testing.assert_close(q, -lr * _adam_direction_first_step(g, eps), rtol=1e-12, atol=1e-13)


def test_lamb_per_param_weight_decay_groups():
    p0, gs = make_params(scale=5.0), make_grads(1)
    lr, eps = 1e-2, 1e-6
    wds = [0.1, 0.0, 0.1]
    got = run_ref(RefLAMB, p0, gs, lr=lr, eps=eps, weight_decay=wds, max_coeff=1e9, min_coeff=0.0)
    for p, g, q, wd in zip(p0, gs[0], got, wds):
        u = _adam_direction_first_step(g, eps) + wd * p
        r = (p.norm() / u.norm()) if wd != 0 else 1.0
        torch.testing.assert_close(q, p - lr * r * u, rtol=1e-12, atol=1e-13)


def test_lamb_global_grad_norm_clipping_equals_prescaled_grads():
    p0, gs = make_params(), make_grads()
    max_norm = 0.5
    scaled = []
    for grads in gs:
        n = math.sqrt(sum(float((g * g).sum()) for g in grads))
        assert n > max_norm
        scaled.append([g * (max_norm / n) for g in grads])
    kw = dict(lr=1e-2, weight_decay=0.01, use_nvlamb=True)
    got = run_ref(RefLAMB, p0, gs, max_grad_norm=max_norm, **kw)
    want = run_ref(RefLAMB, p0, scaled, **kw)
    assert_all_close(got, want)
    # a threshold above the norm does nothing
    assert_all_close(run_ref(RefLAMB, p0, gs, max_grad_norm=1e9, **kw), run_ref(RefLAMB, p0, gs, **kw))


def test_lamb_no_grad_averaging_first_step():
    p0, gs = make_params(), make_grads(1)
    lr, b1, eps = 1e-2, 0.9, 1e-6
    got = run_ref(RefLAMB, p0, gs, lr=lr, betas=(b1, 0.999), eps=eps, grad_averaging=False)
    for p, g, q in zip(p0, gs[0], got):
        # m = g, m_hat = g / (1 - b1); v_hat = g^2
        torch.testing.assert_close(q, p - lr * (g / (1 - b1)) / (g.abs() + eps), rtol=1e-12, atol=1e-13)


# ----------------------------------------------------------------------------------------- LARS
@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False)])
def test_lars_with_unit_trust_equals_torch_sgd(momentum, nesterov):
    # ||p|| >> ||g||, eeta = 1 and trust clipped to 1 -> trust == 1 every step
    p0, gs = make_params(scale=1e3), make_grads()
    wd = 1e-4
    got = run_ref(RefLARS, p0, gs, lrs=LRS, lr=1e-2, momentum=momentum, eeta=1.0, weight_decay=wd,
                  trust_clip=1.0, grad_clip=None)
    want = run_torch(torch.optim.SGD, p0, gs, lrs=LRS, lr=1e-2, momentum=momentum, weight_decay=wd)
    assert_all_close(got, want)


def test_lars_trust_ratio_and_grad_clip_single_step():
    p0, gs = make_params(), make_grads(1)
    lr, eeta, wd, eps = 0.1, 0.02, 0.01, 1e-3
    gs_big = [[g * 30 for g in gs[0]]]  # some entries beyond +-10
    got = run_ref(RefLARS, p0, gs_big, lr=lr, eeta=eeta, weight_decay=wd, epsilon=eps)
    for p, g, q in zip(p0, gs_big[0], got):
        trust = eeta * p.norm() / (g.norm() + wd * p.norm() + eps)
        d = torch.clamp(g + wd * p, -10, 10)
        assert (g.abs() > 10).any()
        torch.testing.assert_close(q, p - lr * trust * d, rtol=1e-12, atol=1e-13)


def test_lars_momentum_buffer_holds_unscaled_direction():
    p0, gs = make_params(), make_grads(2)
    lr, eeta, mom = 0.1, 0.01, 0.9
    ps = clone_all(p0)
    ref = RefLARS(ps, lr=lr, eeta=eeta, momentum=mom)
    ref.step(gs[0])
    for g, st in zip(gs[0], [ref.state[i] for i in range(len(SHAPES))]):
        torch.testing.assert_close(st["momentum_buffer"], g)
    p1 = clone_all(ps)
    ref.step(gs[1])
    for p, g0, g1, q in zip(p1, gs[0], gs[1], ps):
        trust = eeta * p.norm() / g1.norm()
        torch.testing.assert_close(q, p - lr * trust * (mom * g0 + g1), rtol=1e-12, atol=1e-13)
