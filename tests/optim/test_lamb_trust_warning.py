"""The LAMB trap: apex's rule gives a trust ratio only to groups with weight decay, so with
weight_decay=0 everywhere (HF's Trainer default) and use_nvlamb=False, Lamb steps exactly like AdamW.
That case warns once, naming weight_decay and use_nvlamb; the trust-scaled variants (FusedLamb, Lars,
OnebitLamb) and a Lamb that scales something do not warn, and step unlike AdamW."""

from __future__ import annotations

import warnings

import pytest
import torch

import lightning_optim as lo


def _steps(make, steps: int = 3) -> tuple[list[torch.Tensor], list[str]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (64, 8)]
    opt = make(params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
    messages = [str(w.message) for w in caught if "trust ratio" in str(w.message)]
    return [p.detach().clone() for p in params], messages


def _adamw(params):  # LAMB's update form with trust ratio 1: Adam with LAMB's eps and no decay
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6, weight_decay=0.0)


def test_lamb_without_decay_or_nvlamb_warns_once_and_is_adamw():
    params, messages = _steps(lambda ps: lo.Lamb(ps, lr=1e-2))
    adamw, _ = _steps(_adamw)
    assert len(messages) == 1 and "weight_decay" in messages[0] and "use_nvlamb" in messages[0]
    for a, b in zip(params, adamw):
        torch.testing.assert_close(a, b)  # the trap is real: this is what the warning is about


@pytest.mark.parametrize("make", [
    lambda ps: lo.Lamb(ps, lr=1e-2, weight_decay=0.01),
    lambda ps: lo.Lamb([{"params": ps[:1], "weight_decay": 0.01}, {"params": ps[1:]}], lr=1e-2),
    lambda ps: lo.Lamb(ps, lr=1e-2, use_nvlamb=True),
    lambda ps: lo.FusedLamb(ps, lr=1e-2),
    lambda ps: lo.Lars(ps, lr=1e-2),
], ids=["lamb-decay", "lamb-one-group-decays", "lamb-nvlamb", "fused_lamb", "lars"])
def test_trust_scaled_variants_do_not_warn_and_differ_from_adamw(make):
    params, messages = _steps(make)
    adamw, _ = _steps(_adamw)
    assert messages == []
    assert any(not torch.allclose(a, b) for a, b in zip(params, adamw))


def test_lamb_asked_to_be_adam_does_not_warn():
    _, messages = _steps(lambda ps: lo.Lamb(ps, lr=1e-2, adam=True))
    assert messages == []


def test_onebit_lamb_scales_without_decay():
    """OnebitLamb's warmup gives every tensor a trust ratio (no apex rule): no trap, no warning."""
    params, messages = _steps(lambda ps: lo.OnebitLamb(ps, lr=1e-2, freeze_step=10))
    adamw, _ = _steps(_adamw)
    assert messages == []
    assert any(not torch.allclose(a, b) for a, b in zip(params, adamw))


def test_hf_optim_lamb_with_hf_defaults_warns(tmp_path):
    """``--optim lamb`` as the HF Trainer builds it: TrainingArguments' weight_decay defaults to 0."""
    pytest.importorskip("transformers")
    from accel_plugins.hf import TrainingArguments, optimizer_cls_and_kwargs

    cls, kwargs = optimizer_cls_and_kwargs(TrainingArguments(str(tmp_path), optim="lamb"))
    _, messages = _steps(lambda ps: cls(ps, **kwargs), steps=1)
    assert len(messages) == 1
    cls, kwargs = optimizer_cls_and_kwargs(TrainingArguments(str(tmp_path), optim="lamb", weight_decay=0.01))
    assert _steps(lambda ps: cls(ps, **kwargs), steps=1)[1] == []
