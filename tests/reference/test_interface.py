"""What every reference shares: optimi's fully decoupled decay (``decouple_lr``/``max_lr``) and the
common interface (in place, float32, None grads skipped, grads checked)."""

from __future__ import annotations

import pytest
import torch

from . import (
    RefAdam,
    RefAdamW,
    RefAdan,
    RefLAMB,
    RefLARS,
    RefLion,
    RefRAdam,
    RefRanger,
    RefSignSGD,
    RefSparsifiedSGD,
    RefStableAdamW,
)
from ._harness import assert_all_close, make_grads, make_params, run_ref


def test_fully_decoupled_equals_rescaled_decoupled_at_constant_lr():
    # decouple_lr: p *= 1 - (lr / max_lr) wd  ==  decoupled with wd' = wd / max_lr
    p0, gs = make_params(), make_grads()
    lr, max_lr, wd = 1e-2, 5e-2, 1e-3
    cases = [
        (RefLion, {}),
        (RefAdan, {}),
        (RefAdan, {"adam_wd": True}),
        (RefStableAdamW, {}),
        (RefRAdam, {"decoupled_weight_decay": True}),
        (RefAdam, {"adam_w_mode": True}),
    ]
    for cls, extra in cases:
        got = run_ref(cls, p0, gs, lr=lr, weight_decay=wd, decouple_lr=True, max_lr=max_lr, **extra)
        want = run_ref(cls, p0, gs, lr=lr, weight_decay=wd / max_lr, **extra)
        assert_all_close(got, want)
    # max_lr defaults to the initial lr
    got = run_ref(RefLion, p0, gs, lr=lr, weight_decay=wd, decouple_lr=True)
    want = run_ref(RefLion, p0, gs, lr=lr, weight_decay=wd / lr)
    assert_all_close(got, want)


# ---------------------------------------------------------------------------------- interface
ALL = [
    (RefAdam, {}), (RefAdamW, {}), (RefAdan, {}), (RefLAMB, {"weight_decay": 0.01}),
    (RefLARS, {"momentum": 0.9}), (RefLion, {}), (RefRAdam, {}), (RefRanger, {}),
    (RefSignSGD, {"momentum": 0.9}), (RefSparsifiedSGD, {"sparse_grad_size": 2}), (RefStableAdamW, {}),
]


@pytest.mark.parametrize("cls,kw", ALL, ids=[c.__name__ for c, _ in ALL])
def test_float32_runs_in_place_and_skips_none(cls, kw):
    ps = [p.float() for p in make_params()]
    ids = [id(p) for p in ps]
    ref = cls(ps, lr=1e-2, **kw)
    skip_before = ps[1].clone()
    for grads in make_grads(3):
        grads = [g.float() for g in grads]
        grads[1] = None
        ref.step(grads)
    assert [id(p) for p in ps] == ids
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in ps)
    assert torch.equal(ps[1], skip_before)
    with pytest.raises(ValueError):
        ref.step([torch.zeros(1)] * len(ps))
