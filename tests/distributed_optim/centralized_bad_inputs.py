"""The bad-input sweep of the centralized optimizers: every argument of every class, the step's
inputs, and mistakes made on one rank only. ``sweep(rank, world)`` runs every case on this rank
(also in one process without a group, ``world=1``) and reports what each raised and whether the
model (params and gradients) was left untouched.

A case: (label, action(model, rank), expected exception type, a word the message must contain —
the argument's name). The model starts different on every rank, so a weight averaging that ran
before the refusal would show.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_optim.comm import set_collective_timeout
from lightning_optim.distributed.centralized import (
    CentralizedAdam,
    CentralizedSGD,
    CustomCentralizedOptimizer,
    GenericCentralizedOptimizer,
)
from lightning_optim.optim import SGD, prepare_for_gradient_release, remove_gradient_release

from .centralized_workers import ParamModel, rank_grads


def _sgd(m, **kw):
    return CentralizedSGD(**{"world_size": None, "model": m, "lr": 0.1, **kw})


def _adam(m, **kw):
    return CentralizedAdam(**{"world_size": None, "model": m, "lr": 0.1, **kw})


def _generic(m, **kw):
    kw.setdefault("optimizer", torch.optim.SGD(m.parameters(), lr=0.1))
    return GenericCentralizedOptimizer(**{"world_size": None, "model": m, **kw})


def _custom(m, **kw):
    kw.setdefault("optimizer", torch.optim.SGD(m.parameters(), lr=0.1))
    return CustomCentralizedOptimizer(**{"model": m, "world_size": None, "average_world": True, **kw})


CLASSES = {"CentralizedSGD": _sgd, "CentralizedAdam": _adam, "GenericCentralizedOptimizer": _generic,
           "CustomCentralizedOptimizer": _custom}


def constructor_cases(world: int) -> list:
    cases = []
    for cls, make in CLASSES.items():
        for kw, exc in (
            (dict(world_size=0), ValueError), (dict(world_size=world + 1), ValueError),
            (dict(world_size="2"), TypeError), (dict(world_size=2.0), TypeError), (dict(world_size=True), TypeError),
            (dict(model=None), TypeError), (dict(model="net"), TypeError),
            (dict(use_cuda="no"), TypeError), (dict(by_layer=1), TypeError), (dict(agg_grad=None), TypeError),
        ):
            cases.append((f"{cls} {kw}", lambda m, r, make=make, kw=kw: make(m, **kw), exc, next(iter(kw))))
    for cls, make in (("CentralizedSGD", CentralizedSGD), ("CentralizedAdam", CentralizedAdam)):
        cases.append((f"{cls} without lr", lambda m, r, make=make: make(None, m), TypeError, "lr"))
    local = [  # (class, arguments, exception, the word its message must hold)
        (_sgd, dict(lr=-1.0), ValueError, "lr"), (_sgd, dict(lr="0.1"), TypeError, "lr"),
        (_sgd, dict(momentum=-0.5), ValueError, "momentum"), (_sgd, dict(dampening=1.5), ValueError, "dampening"),
        (_sgd, dict(weight_decay=-1.0), ValueError, "weight_decay"),
        (_sgd, dict(nesterov="yes"), TypeError, "nesterov"), (_sgd, dict(nesterov=True), ValueError, "nesterov"),
        (_adam, dict(lr=-1.0), ValueError, "lr"), (_adam, dict(betas=(0.9,)), TypeError, "betas"),
        (_adam, dict(betas=(0.9, 1.0)), ValueError, "betas"), (_adam, dict(eps=0.0), ValueError, "eps"),
        (_adam, dict(weight_decay=-1.0), ValueError, "weight_decay"), (_adam, dict(amsgrad="x"), TypeError, "amsgrad"),
        (_generic, dict(divide_before="n"), TypeError, "divide_before"),
        (_custom, dict(divide_before="n"), TypeError, "divide_before"),
        (_custom, dict(grad_clip=0.0), ValueError, "grad_clip"),
        (_custom, dict(grad_clip=-1.0), ValueError, "grad_clip"),
        (_custom, dict(grad_clip="1"), TypeError, "grad_clip"),
        (_custom, dict(grad_clip=math.nan), ValueError, "grad_clip"),
        (_custom, dict(grad_clip=True), TypeError, "grad_clip"),
        (_custom, dict(average_world="y"), TypeError, "average_world"),
        (_custom, dict(average_world=False, average_custom=1), TypeError, "average_custom"),
        (_custom, dict(average_custom=True), ValueError, "average_custom"),  # both averages
        (_custom, dict(agg_grad=False, average_world=False, average_custom=True), ValueError, "average_world"),
        (_custom, dict(agg_grad=False, average_world=False), ValueError, "average_world"),  # a sum of weights
        (_custom, dict(agg_grad=False, grad_clip=1.0), ValueError, "grad_clip"),
    ]
    for make, kw, exc, word in local:
        cases.append((f"{make.__name__} {kw}", lambda m, r, make=make, kw=kw: make(m, **kw), exc, word))
    other = nn.Linear(2, 2)
    for make in (_generic, _custom):
        for value, exc in ((None, TypeError), ("sgd", TypeError), (torch.optim.SGD(other.parameters(), lr=0.1),
                                                                    ValueError)):
            cases.append((f"{make.__name__} optimizer={value!r:.20}",
                          lambda m, r, make=make, value=value: make(m, optimizer=value), exc, "optimizer"))
        cases.append((f"{make.__name__} optimizer=centralized",
                      lambda m, r, make=make: make(m, optimizer=_sgd(m)), TypeError, "optimizer"))
    return cases


def _custom_denom(m):
    return _custom(m, average_world=False, average_custom=True)


def step_cases() -> list:
    cases = [(f"step(denom={d!r})", lambda m, r, d=d: _custom_denom(m).step(denom=d), exc, "denom")
             for d, exc in ((None, ValueError), (0, ValueError), (-1.0, ValueError), (math.nan, ValueError),
                            ("3", TypeError), (torch.ones(2), TypeError), (True, TypeError),
                            (torch.tensor(True), TypeError))]
    cases += [
        ("step(denom=) with average_world", lambda m, r: _custom(m).step(denom=4.0), ValueError, "denom"),
        ("step(denom=) with a sum", lambda m, r: _custom(m, average_world=False).step(denom=4.0), ValueError, "denom"),
        ("step(denom=) on CentralizedSGD", lambda m, r: _sgd(m).step(denom=4.0), TypeError, "denom"),
        ("step(closure='x')", lambda m, r: _sgd(m).step("x"), TypeError, "closure"),
        ("step(tracker=object())", lambda m, r: _adam(m).step(tracker=object()), TypeError, "tracker"),
        ("add_param_group", lambda m, r: _sgd(m).add_param_group({"params": [nn.Parameter(torch.ones(1))]}),
         RuntimeError, "fixed"),
    ]
    return cases


def one_rank_cases(world: int) -> list:
    """Mistakes on one rank only: every rank must raise (no rank left blocked in a collective); and
    a DDP-wrapped model (DDP needs the process group)."""
    return [
        ("a DDP model", lambda m, r: _sgd(nn.parallel.DistributedDataParallel(nn.Linear(2, 2))),
         ValueError, "model"),
        ("world_size wrong on rank 1", lambda m, r: _sgd(m, world_size=world + r), ValueError, "world_size"),
        ("lr wrong on rank 0", lambda m, r: _adam(m, lr=-1.0 if r == 0 else 0.1), ValueError, "lr"),
        ("optimizer missing on rank 1", lambda m, r: _generic(m, optimizer=None if r == 1 else torch.optim.SGD(
            m.parameters(), lr=0.1)), (TypeError, ValueError), "optimizer"),
        ("other model on rank 1", lambda m, r: _sgd(nn.Linear(3, 2 + r)), ValueError, "param shapes"),
        ("other dtype on rank 1", lambda m, r: _sgd(nn.Linear(3, 2).to(torch.float64 if r else torch.float32)),
         ValueError, "param dtypes"),
        ("by_layer differs", lambda m, r: _sgd(m, by_layer=r == 1), ValueError, "by_layer"),
        ("grad_clip differs", lambda m, r: _custom(m, grad_clip=1.0 + r), ValueError, "grad_clip"),
        ("denom differs", lambda m, r: _custom_denom(m).step(denom=4.0 + r), ValueError, "denom"),
        ("denom missing on rank 1", lambda m, r: _custom_denom(m).step(denom=None if r == 1 else 4.0),
         ValueError, "denom"),
    ]


def single_process_cases() -> list:
    def released(m, r):
        inner = SGD(m.parameters(), lr=0.1)
        prepare_for_gradient_release(m, inner)
        try:
            return _custom(m, optimizer=inner)
        finally:
            remove_gradient_release(m)

    def sparse(m, r):
        emb = nn.Embedding(5, 2, sparse=True)
        opt = _sgd(emb)
        emb(torch.tensor([1, 2])).sum().backward()
        before = emb.weight.detach().clone()
        try:
            return opt.step()
        finally:
            if not torch.equal(before, emb.weight):
                raise AssertionError("the sparse case moved the embedding")  # noqa: B012 - shows as a wrong type

    return [("optimizer under gradient release", released, ValueError, "optimizer"),
            ("sparse gradients", sparse, TypeError, "sparse")]


def _model(rank: int) -> nn.Module:
    model = ParamModel(torch.float64, seed=100 + rank)
    for p, g in zip(model.weights, rank_grads("sgd", 1, rank)):
        p.grad = g
    return model


def _snapshot(model):
    return [(p.detach().clone(), None if p.grad is None else p.grad.clone()) for p in model.weights]


def sweep(rank: int, world: int) -> list[tuple]:
    """(label, raised type or None, message, expected types, expected word, model untouched) per case."""
    set_collective_timeout(30)
    cases = constructor_cases(world) + step_cases()
    cases += one_rank_cases(world) if world > 1 else single_process_cases()
    out = []
    for label, action, expected, word in cases:
        model = _model(rank)
        before = _snapshot(model)
        raised, message = None, ""
        try:
            action(model, rank)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            raised, message = type(exc), str(exc)
        after = _snapshot(model)
        untouched = all(torch.equal(p0, p1) and (g0 is None) == (g1 is None) and (g0 is None or torch.equal(g0, g1))
                        for (p0, g0), (p1, g1) in zip(before, after))
        out.append((label, raised, message, expected, word, untouched))
    return out
