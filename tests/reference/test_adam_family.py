"""Sanity tests of the Adam-family references (Adam/AdamW, Adan, RAdam, Lookahead/Ranger,
StableAdamW) against torch.optim, closed forms or an alternative algebraic form."""

from __future__ import annotations

import math

import pytest
import torch

from . import RefAdam, RefAdamW, RefAdan, RefLookahead, RefRAdam, RefRanger, RefStableAdamW
from ._harness import (
    DT,
    LRS,
    SHAPES,
    STEPS,
    assert_all_close,
    clone_all,
    make_grads,
    make_params,
    run_ref,
    run_torch,
)


# ----------------------------------------------------------------------------------------- Adam
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adam_matches_torch(amsgrad, wd):
    p0, gs = make_params(), make_grads()
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=wd, amsgrad=amsgrad)
    want = run_torch(torch.optim.Adam, p0, gs, lrs=LRS, **kw)
    got = run_ref(RefAdam, p0, gs, lrs=LRS, **kw)
    assert_all_close(got, want)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_matches_torch(amsgrad):
    p0, gs = make_params(), make_grads()
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.3, amsgrad=amsgrad)
    want = run_torch(torch.optim.AdamW, p0, gs, lrs=LRS, **kw)
    got = run_ref(RefAdamW, p0, gs, lrs=LRS, **kw)
    assert_all_close(got, want)
    got2 = run_ref(RefAdam, p0, gs, lrs=LRS, adam_w_mode=True, **kw)
    assert_all_close(got2, want)


def test_adam_no_bias_correction_first_step_closed_form():
    p0, gs = make_params(), make_grads(1)
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    got = run_ref(RefAdam, p0, gs, lr=lr, betas=(b1, b2), eps=eps, bias_correction=False)
    for p, g, q in zip(p0, gs[0], got):
        want = p - lr * (1 - b1) * g / (math.sqrt(1 - b2) * g.abs() + eps)
        torch.testing.assert_close(q, want, rtol=1e-12, atol=1e-13)


def test_adam_fully_decoupled_equals_scaled_adamw_at_constant_lr():
    p0, gs = make_params(), make_grads()
    lr, max_lr, wd = 1e-2, 4e-2, 0.05
    got = run_ref(RefAdam, p0, gs, lr=lr, weight_decay=wd, decouple_lr=True, max_lr=max_lr)
    want = run_torch(torch.optim.AdamW, p0, gs, lr=lr, weight_decay=wd / max_lr)
    assert_all_close(got, want)


# ----------------------------------------------------------------------------------------- Adan
def _adan_debiased_beta_form(params, grads_seq, lr, betas, eps, wd):
    """optimi's algebraic form: moments stored bias-corrected via beta_hat = (b^t - b)/(b^t - 1)."""
    b1, b2, b3 = betas
    ps = clone_all(params)
    m = [torch.zeros_like(p) for p in ps]
    n = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    neg_prev = [g.neg() for g in grads_seq[0]]
    for t, grads in enumerate(grads_seq, start=1):
        h = [(b**t - b) / (b**t - 1) for b in (b1, b2, b3)]
        for i, g in enumerate(grads):
            diff = neg_prev[i] + g
            m[i] = torch.lerp(m[i], g, 1 - h[0])
            n[i] = torch.lerp(n[i], diff, 1 - h[1])
            z = diff * b2 + g
            v[i] = v[i] * h[2] + (1 - h[2]) * z * z
            neg_prev[i] = g.neg()
            denom = v[i].sqrt() + eps
            ps[i] = ps[i] - lr * m[i] / denom - lr * b2 * n[i] / denom
            ps[i] = ps[i] / (1 + lr * wd)
    return ps


def test_adan_equals_debiased_beta_form():
    p0, gs = make_params(), make_grads()
    kw = dict(lr=1e-2, betas=(0.98, 0.92, 0.99), eps=1e-6, wd=0.02)
    want = _adan_debiased_beta_form(p0, gs, **kw)
    got = run_ref(RefAdan, p0, gs, lr=kw["lr"], betas=kw["betas"], eps=kw["eps"], weight_decay=kw["wd"])
    assert_all_close(got, want, rtol=1e-10, atol=1e-12)


def test_adan_zero_betas_is_normalised_gradient_step():
    p0, gs = make_params(), make_grads(3)
    lr, eps = 1e-2, 1e-6
    ps = clone_all(p0)
    ref = RefAdan(ps, lr=lr, betas=(0.0, 0.0, 0.0), eps=eps, weight_decay=0.0)
    for grads in gs:
        before = clone_all(ps)
        ref.step(grads)
        for p, g, q in zip(before, grads, ps):
            torch.testing.assert_close(q, p - lr * g / (g.abs() + eps), rtol=1e-12, atol=1e-13)


def test_adan_weight_decay_forms_with_zero_grads():
    p0 = make_params()
    zero = [[torch.zeros(s, dtype=DT) for s in SHAPES] for _ in range(5)]
    lr, wd = 0.1, 0.5
    prox = run_ref(RefAdan, p0, zero, lr=lr, weight_decay=wd)
    adamwd = run_ref(RefAdan, p0, zero, lr=lr, weight_decay=wd, adam_wd=True)
    for p, a, b in zip(p0, prox, adamwd):
        torch.testing.assert_close(a, p / (1 + lr * wd) ** 5, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(b, p * (1 - lr * wd) ** 5, rtol=1e-12, atol=1e-13)


# ----------------------------------------------------------------------------------------- RAdam
@pytest.mark.parametrize("decoupled", [False, True])
def test_radam_matches_torch(decoupled):
    p0, gs = make_params(), make_grads(20)  # rho_t > 5 from step 6 with b2 = 0.999
    lrs = [1e-2 * (0.97**t) for t in range(20)]
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled_weight_decay=decoupled)
    want = run_torch(torch.optim.RAdam, p0, gs, lrs=lrs, **kw)
    got = run_ref(RefRAdam, p0, gs, lrs=lrs, **kw)
    assert_all_close(got, want)


def test_radam_eps_placement_only_difference():
    p0, gs = make_params(), make_grads(20)
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=0.0)
    a = run_ref(RefRAdam, p0, gs, eps_on_debiased=False, **kw)
    b = run_ref(RefRAdam, p0, gs, eps_on_debiased=True, **kw)
    assert_all_close(a, b, rtol=1e-10, atol=1e-12)
    c = run_ref(RefRAdam, p0, gs, eps_on_debiased=True, lr=1e-2, betas=(0.9, 0.99), eps=1e-1)
    assert any(not torch.allclose(x, y) for x, y in zip(a, c))


def test_radam_unrectified_first_steps_are_momentum_sgd():
    # b2 = 0.999: rho_1..rho_5 <= 5 -> p -= lr * m_hat
    p0, gs = make_params(), make_grads(3)
    lr, b1 = 1e-2, 0.9
    ps = clone_all(p0)
    ref = RefRAdam(ps, lr=lr, betas=(b1, 0.999))
    m = [torch.zeros_like(p) for p in ps]
    want = clone_all(p0)
    for t, grads in enumerate(gs, start=1):
        ref.step(grads)
        for i, g in enumerate(grads):
            m[i] = b1 * m[i] + (1 - b1) * g
            want[i] = want[i] - lr * m[i] / (1 - b1**t)
    assert_all_close(ps, want)


# ------------------------------------------------------------------------------ Lookahead/Ranger
def test_lookahead_alpha_one_is_identity():
    p0, gs = make_params(), make_grads(13)
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, decoupled_weight_decay=True,
              eps_on_debiased=True)
    want = run_ref(RefRAdam, p0, gs, **kw)
    ps = clone_all(p0)
    la = RefLookahead(RefRAdam(ps, **kw), k=3, alpha=1.0)
    for grads in gs:
        la.step(grads)
    assert_all_close(ps, want)
    got = run_ref(RefRanger, p0, gs, lr=1e-2, weight_decay=0.01, k=3, alpha=1.0)
    assert_all_close(got, want)


def test_ranger_interpolates_every_k_steps():
    p0, gs = make_params(), make_grads(6)
    k, alpha = 6, 0.5
    fast = run_ref(RefRAdam, p0, gs, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, eps_on_debiased=True)
    got = run_ref(RefRanger, p0, gs, lr=1e-2, k=k, alpha=alpha)
    for p, f, q in zip(p0, fast, got):
        torch.testing.assert_close(q, p + alpha * (f - p), rtol=1e-12, atol=1e-13)


def test_ranger_lr_attribute_forwards():
    ps = make_params()
    r = RefRanger(ps, lr=1e-2)
    r.lr = 3e-3
    assert r.inner.lr == 3e-3


# ---------------------------------------------------------------------------------- StableAdamW
def test_stableadamw_with_constant_grads_equals_torch_adamw():
    # constant g -> v_hat == g^2 exactly -> RMS == 1 -> no clipping
    p0 = make_params()
    g = make_grads(1)[0]
    gs = [g] * STEPS
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
    want = run_torch(torch.optim.AdamW, p0, gs, lrs=LRS, **kw)
    got = run_ref(RefStableAdamW, p0, gs, lrs=LRS, **kw)
    assert_all_close(got, want, rtol=1e-10, atol=1e-12)


def test_stableadamw_clips_lr_by_rms():
    p0 = make_params()
    base = make_grads(4)
    gs = base[:3] + [[10 * g for g in base[3]]]  # a spike -> RMS > 1 on the last step
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-6, 0.1
    ps = clone_all(p0)
    ref = RefStableAdamW(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    want = clone_all(p0)
    clipped = False
    for t, grads in enumerate(gs, start=1):
        ref.step(grads)
        for i, g in enumerate(grads):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            v_hat = v[i] / (1 - b2**t)
            rms = float((g * g / v_hat.clamp(min=eps * eps)).mean().sqrt())
            clipped |= rms > 1
            lr_t = lr / max(1.0, rms)
            want[i] = want[i] * (1 - lr_t * wd) - lr_t * (m[i] / (1 - b1**t)) / (v_hat.sqrt() + eps)
    assert clipped
    assert_all_close(ps, want)
