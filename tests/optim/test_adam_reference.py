"""Adam family flags that torch.optim lacks (FusedAdam's bias_correction, fully decoupled decay)
against the paper-equation reference ``tests/reference/adam.py``."""

from __future__ import annotations

import pytest
import torch

import lightning_optim.optim as lo
from tests.optim.helpers import clone_params, grad_stream, make_params, max_abs_diff
from tests.reference.adam import RefAdam

CASES = [
    ("FusedAdam", dict(bias_correction=False, adam_w_mode=True, weight_decay=0.1), dict(bias_correction=False, adam_w_mode=True, weight_decay=0.1)),
    ("FusedAdam", dict(bias_correction=False, adam_w_mode=False, weight_decay=0.1, amsgrad=True), dict(bias_correction=False, adam_w_mode=False, weight_decay=0.1, amsgrad=True)),
    ("CPUAdam", dict(adamw_mode=True, weight_decay=0.1), dict(adam_w_mode=True, weight_decay=0.1)),
    ("Adam", dict(decouple_lr=True, weight_decay=1e-3, max_lr=2e-2), dict(decouple_lr=True, weight_decay=1e-3, max_lr=2e-2)),
    ("AdamW", dict(decouple_lr=True, weight_decay=1e-3), dict(decouple_lr=True, adam_w_mode=True, weight_decay=1e-3)),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("name,ours_kwargs,ref_kwargs", CASES)
def test_adam_family_matches_reference(name, ours_kwargs, ref_kwargs, dtype, tol):
    base = make_params(dtype)
    p_ours, p_ref = clone_params(base), [p.detach().clone().double() for p in base]
    ours = getattr(lo, name)(p_ours, lr=1e-2, **ours_kwargs)
    ref = RefAdam(p_ref, lr=1e-2, **ref_kwargs)
    for i, grads in enumerate(grad_stream(steps=12)):
        lr = 1e-2 if i < 6 else 4e-3  # a scheduler-like change mid-run
        for group in ours.param_groups:
            group["lr"] = lr
        ref.lr = lr
        for p, g in zip(p_ours, grads):
            p.grad = g.to(dtype)
        ours.step()
        ref.step(grads)
    assert max_abs_diff(p_ours, p_ref) < tol
