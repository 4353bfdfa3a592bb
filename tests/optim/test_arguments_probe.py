"""Probe: every numeric constructor argument of every optimizer takes numpy scalars like Python
numbers and refuses a string or NaN with a message naming it; every optimizer steps meta tensors."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from lightning_optim.catalogue import OPTIMIZERS, optimizer_class
from tests.optim.specs import SPECS, Spec


def _numeric_args(spec: Spec) -> list[tuple[str, float | int]]:
    out = []
    for name, param in inspect.signature(spec.cls).parameters.items():
        default = param.default
        if name in spec.kwargs:
            default = spec.kwargs[name]
        if isinstance(default, bool) or not isinstance(default, (int, float)):
            continue
        out.append((name, default))
    return out


def _build(spec: Spec, **override):
    return spec.cls([torch.zeros(4, 3, requires_grad=True)], **{**spec.kwargs, **override})


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_numpy_scalars_work_like_python_numbers(spec):
    args = _numeric_args(spec)
    assert any(name == "lr" for name, _ in args), spec  # the sweep sees the arguments
    for name, value in args:
        numpy_value = np.int64(value) if isinstance(value, int) else np.float32(value)
        python = _build(spec, **{name: type(value)(numpy_value)})
        numpy = _build(spec, **{name: numpy_value})
        assert numpy.param_groups[0].get(name, getattr(numpy, name, None)) == pytest.approx(
            python.param_groups[0].get(name, getattr(python, name, None))), name
        for opt in (python, numpy):  # and they step alike
            for p in (q for g in opt.param_groups for q in g["params"]):
                p.grad = torch.ones_like(p)
            opt.step()
        assert torch.equal(python.param_groups[0]["params"][0], numpy.param_groups[0]["params"][0]), name


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_string_or_nan_is_refused_naming_the_argument(spec):
    for name, value in _numeric_args(spec):
        for bad, error in (("1e-3", TypeError), (float("nan"), (ValueError, TypeError))):
            with pytest.raises(error) as info:
                _build(spec, **{name: bad})
            assert name in str(info.value), (name, bad, str(info.value))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_every_optimizer_steps_meta_tensors(spec):
    params = [torch.zeros(4, 3, device="meta", requires_grad=True), torch.zeros(5, device="meta", requires_grad=True)]
    opt = spec.cls(params, **spec.kwargs)
    for p in params:
        p.grad = torch.zeros(p.shape, device="meta")
    opt.step()
    assert all(p.is_meta and p.shape == s for p, s in zip(params, [(4, 3), (5,)]))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_bare_tensor_or_a_repeated_param_is_refused(name):
    # every optimizer of the catalogue, the 1-bit ones included; torch only warns about a param repeated
    # within a group, and it would be stepped twice per step()
    cls, kwargs = optimizer_class(name), {"lr": 1e-3}
    p, q = torch.zeros(4, 3, requires_grad=True), torch.zeros(5, requires_grad=True)
    with pytest.raises(TypeError, match="iterable"):
        cls(p, **kwargs)  # one Parameter, not a list
    with pytest.raises(ValueError, match="params: param 1 of the group .* appears more than once"):
        cls([p, p], **kwargs)
    with pytest.raises(ValueError, match="more than one parameter group"):
        cls([{"params": [p]}, {"params": [q, p]}], **kwargs)
    opt = cls([p], **kwargs)
    for group in ({"params": [q, q]}, {"params": [p]}):
        with pytest.raises(ValueError, match="more than once|more than one parameter group"):
            opt.add_param_group(group)
        assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == [p]
