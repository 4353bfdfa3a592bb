"""The compiled step helpers answer exactly what the Python reads they replace answer:
``grads_of`` (the params with a grad, their grads, all dense and contiguous), ``data_ptrs`` (where each
tensor's data starts) and ``same_items`` (identity, item by item); and a step through them routes and
updates every optimizer of the family bit for bit as the Python reads do, non-contiguous grads included."""

from __future__ import annotations

import struct
import sys

import pytest
import torch
from torch import nn

from lightning_optim import ops
from lightning_optim.ops import coalesce
from tests.ops.conftest import ext  # noqa: F401  (fixture: the built extension)
from tests.optim.specs import SPECS


class Tagged(torch.Tensor):
    """A Tensor subclass: its attributes may be overridden, so the helpers leave it to Python."""


def _param(*shape: int, grad: str | None = "dense", transposed: bool = False) -> nn.Parameter:
    data = torch.randn(*reversed(shape)).t() if transposed else torch.randn(*shape)
    p = nn.Parameter(data)
    if grad == "dense":
        p.grad = torch.randn(*shape)
    elif grad == "strided":  # same shape, non-contiguous
        p.grad = torch.randn(*reversed(shape)).t()
    elif grad == "sparse":
        p.grad = torch.randn(*shape).to_sparse()
    return p


CASES = {
    "all with grads": lambda: [_param(3, 4), _param(5), _param(2, 2)],
    "some without": lambda: [_param(3, 4, grad=None), _param(5), _param(2, 2, grad=None), _param(1)],
    "none with grads": lambda: [_param(3, grad=None), _param(4, grad=None)],
    "a non-contiguous grad": lambda: [_param(3, 4), _param(3, 4, grad="strided")],
    "a non-contiguous param": lambda: [_param(3, 4, transposed=True), _param(2)],
    "a sparse grad": lambda: [_param(3), _param(3, 4, grad="sparse")],
    "plain tensors": lambda: [torch.randn(3).requires_grad_(), torch.randn(2).requires_grad_()],
    "empty": lambda: [],
    "many": lambda: [_param(7, grad=None if i % 5 == 0 else "dense") for i in range(300)],
}


def _python_reads(params: list[torch.Tensor]) -> tuple[list, list, bool]:
    pairs = [(p, p.grad) for p in params if p.grad is not None]
    contiguous = all(p.is_contiguous() and not g.is_sparse and g.is_contiguous() for p, g in pairs)
    return [p for p, _ in pairs], [g for _, g in pairs], contiguous


@pytest.mark.parametrize("case", CASES)
def test_grads_of_answers_as_the_python_reads(ext, case):
    params = CASES[case]()
    for p in params:  # plain tensors: give them a grad through autograd
        if p.grad is None and type(p) is torch.Tensor:
            p.sum().backward()
    with_grad, grads, contiguous = ext.grads_of(params)
    ref_params, ref_grads, ref_contiguous = _python_reads(params)
    assert coalesce.same_items(with_grad, ref_params) and coalesce.same_items(grads, ref_grads)
    assert contiguous == ref_contiguous


def test_grads_of_leaves_subclasses_to_python(ext):
    params = [_param(3), _param(2)]
    params.insert(1, nn.Parameter(torch.randn(2).as_subclass(Tagged)))
    assert ext.grads_of(params) is None
    assert ext.data_ptrs(params) is None
    assert ops.grads_of(params) is None  # and the step then reads them in Python


def test_grads_of_keeps_reference_counts(ext):
    params = [_param(4) for _ in range(10)]
    before = [sys.getrefcount(p.grad) for p in params], [sys.getrefcount(p) for p in params]
    for _ in range(1000):
        ext.grads_of(params)
    assert ([sys.getrefcount(p.grad) for p in params], [sys.getrefcount(p) for p in params]) == before


@pytest.mark.parametrize("case", CASES)
def test_data_ptrs_are_the_packed_python_data_ptrs(ext, case):
    tensors = CASES[case]()
    assert ext.data_ptrs(tensors) == b"".join(struct.pack("P", t.data_ptr()) for t in tensors)


def test_same_items_is_identity_not_equality(ext):
    a = [torch.zeros(3), torch.ones(2), torch.zeros(1)]
    equal_values = [x.clone() for x in a]
    for b, expected in ((list(a), True), (a[:2], False), (a + [a[0]], False), (equal_values, False),
                        (a[:2] + [equal_values[2]], False), ([], False)):
        assert ext.same_items(a, b) is expected
        assert coalesce.same_items(a, b) is expected  # the Python fallback
        assert coalesce.same_items(a, b, ext) is expected
    assert ext.same_items([], []) is True


def _noncontiguous_grads(net: nn.Module) -> None:
    for p in net.parameters():
        if p.grad is not None and p.grad.dim() == 2:
            p.grad = p.grad.t().contiguous().t()  # same values, transposed strides


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous grads", "non-contiguous grads"])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_step_through_the_helpers_equals_the_python_reads(spec, strided, monkeypatch, ext):
    monkeypatch.setenv(ops.ENV_VAR, "cpu")
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [spec.cls(net.parameters(), **spec.kwargs) for net in nets]
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    python_reads = ops.grads_of
    for which, (net, opt) in enumerate(zip(nets, opts)):
        if which == 1:
            monkeypatch.setattr(ops, "grads_of", lambda params: None)
        for x in xs:
            torch.manual_seed(1)  # optimizers that draw (SparsifiedSGD's random mode) draw the same
            net(x).pow(2).mean().backward()
            if strided:
                _noncontiguous_grads(net)
            opt.step()
            opt.zero_grad()
    monkeypatch.setattr(ops, "grads_of", python_reads)
    for (name, a), b in zip(nets[0].named_parameters(), nets[1].parameters()):
        assert torch.equal(a, b), f"{spec}: {name} differs by {(a - b).abs().max()}"
