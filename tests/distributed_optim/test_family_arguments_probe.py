"""Probe over mlbench's distributed family and the compressors:

* ``add_param_group`` checks every group hyper-parameter as the constructor does (same message), or refuses
  the call outright where the params are fixed at construction (the centralized classes, DecentralizedSGD);
  nothing changes when it refuses;
* a param twice (in one group, across groups, added again) and a non-floating param are refused by every class;
* every numeric argument takes numpy scalars like Python numbers (same result, Python numbers kept) and
  refuses NaN / inf / -1 / 0 / True / a string where they are out of range, naming the argument.
"""
from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import lightning_optim as lo
from lightning_optim.catalogue import DISTRIBUTED
from lightning_optim.comm.compressors import (
    Blockwise,
    ErrorFeedback,
    Int4Quantizer,
    Int8Quantizer,
    PowerSGDCompressor,
    RandomK,
    SparseLoCo,
    TopK,
)
from lightning_optim.distributed import (
    CentralizedAdam,
    CentralizedSGD,
    CentralizedSparsifiedSGD,
    CustomCentralizedOptimizer,
    DecentralizedSGD,
    DiLoCo,
    GenericCentralizedOptimizer,
    PowerSGD,
)
from tests.distributed_optim.load_sweep import (
    DISTRIBUTED_BUILDS,
    EXTRA_BUILDS,
    GROUP_VARIANTS,
    model,
    snapshot,
    steps,
    trained,
    unchanged,
)

FAMILY = {**DISTRIBUTED_BUILDS, **EXTRA_BUILDS}
# add_param_group refused outright: the aggregated params were agreed on by every rank at construction
FIXED = {"generic_centralized", "centralized_sgd", "centralized_adam", "custom_centralized",
         "generic_centralized[torch.optim.Adam]", "diloco", "diloco[torch.optim.AdamW]"}
OPEN = {"powersgd": PowerSGD, "centralized_sparsified_sgd": CentralizedSparsifiedSGD}  # groups may be added


def _fresh() -> nn.Parameter:
    return nn.Parameter(torch.randn(3, 2))


def _error(fn: Callable[[], Any]) -> BaseException | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return exc
    return None


# ---------------------------------------------------------------- add_param_group
def test_the_probe_covers_the_family():
    assert set(DISTRIBUTED) <= set(FAMILY) and set(FAMILY) == FIXED | set(OPEN) | {"decentralized_sgd"}


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_add_param_group_checks_every_hyper_parameter(name):
    opt, m = trained(name)
    before, count = snapshot(opt, m), len(opt.param_groups)
    for key in (k for k in opt.param_groups[0] if k != "params"):
        for what, bad in GROUP_VARIANTS.items():
            error = _error(lambda: opt.add_param_group({"params": [_fresh()], key: bad}))
            if name in FIXED:
                assert isinstance(error, RuntimeError) and "fixed" in str(error), (key, what, error)
            elif name == "decentralized_sgd" and key not in str(error):  # refused for its params, after the
                # checks of the SGD it is: only a value SGD's own constructor takes may get that far
                assert isinstance(error, ValueError) and "fixed at construction" in str(error), (key, what, error)
                assert _error(lambda: lo.SGD([_fresh()], lr=0.1, **{key: bad})) is None, (key, what)
            else:
                assert isinstance(error, (ValueError, TypeError)) and key in str(error), (key, what, error)
            assert len(opt.param_groups) == count and unchanged(before, opt, m), (key, what)
    error = _error(lambda: opt.add_param_group({"params": [_fresh()]}))  # a valid group
    if name in OPEN:
        assert error is None and len(opt.param_groups) == count + 1
    else:
        assert isinstance(error, RuntimeError if name in FIXED else ValueError) and ("fixed" in str(error)), error


@pytest.mark.parametrize("name", sorted(OPEN))
def test_add_param_group_says_what_the_constructor_says(name):
    cls = OPEN[name]
    base = dict(lr=0.1, sparse_grad_size=2) if cls is CentralizedSparsifiedSGD else dict(lr=0.1)
    accepted = set(inspect.signature(cls).parameters)
    opt = cls([_fresh()], **base)
    for key in (k for k in opt.param_groups[0] if k != "params" and k in accepted):
        for bad in GROUP_VARIANTS.values():
            built = _error(lambda: cls([_fresh()], **{**base, key: bad}))
            added = _error(lambda: opt.add_param_group({"params": [_fresh()], key: bad}))
            assert type(built) is type(added) and str(built) == str(added), (key, bad, built, added)
    numpy_group = {"params": [_fresh()], "lr": np.float32(0.5), "weight_decay": np.float64(0.25)}
    if cls is CentralizedSparsifiedSGD:
        numpy_group["sparse_grad_size"] = np.int64(3)
    opt.add_param_group(numpy_group)  # numpy scalars are taken as the Python numbers they are
    assert all(type(opt.param_groups[-1][k]) in (int, float) for k in numpy_group if k != "params")


# ---------------------------------------------------------------- repeated and non-floating params
def _local(params: Any) -> torch.optim.Optimizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "duplicate parameters" warning
        return lo.SGD(params, lr=0.1)


def _duplicate_cases() -> list[tuple[str, Callable[[], Any]]]:
    m = model()
    p, q = list(m.parameters())[:2]
    cases = []
    for name, cls in OPEN.items():
        kw = dict(lr=0.1, sparse_grad_size=2) if cls is CentralizedSparsifiedSGD else dict(lr=0.1)
        cases += [(f"{name} within a group", lambda cls=cls, kw=kw: cls([p, q, p], **kw)),
                  (f"{name} across groups", lambda cls=cls, kw=kw: cls([{"params": [p]}, {"params": [q, p]}], **kw)),
                  (f"{name} added again", lambda cls=cls, kw=kw: cls([p, q], **kw).add_param_group({"params": [p]}))]
    cases += [
        ("generic_centralized within a group",
         lambda: GenericCentralizedOptimizer(None, m, optimizer=_local([p, q, p]))),
        ("custom_centralized within a group", lambda: CustomCentralizedOptimizer(m, None, _local([p, q, p]))),
        ("custom_centralized across groups",
         lambda: CustomCentralizedOptimizer(m, None, _local([{"params": [p]}, {"params": [p, q]}]))),
        ("decentralized_sgd added again", lambda: DecentralizedSGD(model=m, lr=0.1).add_param_group({"params": [p]})),
    ]
    return cases


@pytest.mark.parametrize("label,build", _duplicate_cases(), ids=[c[0] for c in _duplicate_cases()])
def test_a_repeated_param_is_refused(label, build):
    with pytest.raises(ValueError, match="param"):
        build()


def _odd_model(dtype: torch.dtype) -> nn.Module:
    m = nn.Linear(2, 2)
    m.extra = nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=dtype.is_complex)
    return m


NON_FLOATING: dict[str, Callable[[torch.dtype], Any]] = {
    "powersgd": lambda dt: PowerSGD([_fresh(), torch.zeros(3, dtype=dt)], lr=0.1),
    "centralized_sparsified_sgd": lambda dt: CentralizedSparsifiedSGD(
        [_fresh(), torch.zeros(3, dtype=dt)], lr=0.1, sparse_grad_size=1),
    "decentralized_sgd": lambda dt: DecentralizedSGD(model=_odd_model(dt), lr=0.1),
    "centralized_sgd": lambda dt: CentralizedSGD(None, _odd_model(dt), lr=0.1),
    "centralized_adam": lambda dt: CentralizedAdam(None, _odd_model(dt), lr=0.1),
    "generic_centralized": lambda dt: (lambda m: GenericCentralizedOptimizer(
        None, m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)))(_odd_model(dt)),
    "custom_centralized": lambda dt: (lambda m: CustomCentralizedOptimizer(
        m, None, torch.optim.SGD(m.parameters(), lr=0.1)))(_odd_model(dt)),
    "diloco": lambda dt: DiLoCo(torch.optim.SGD([_fresh(), torch.zeros(3, dtype=dt)], lr=0.1), sync_every=2),
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64], ids=str)
@pytest.mark.parametrize("name", sorted(NON_FLOATING))
def test_a_non_floating_param_is_refused_naming_its_dtype(name, dtype):
    assert set(NON_FLOATING) == set(DISTRIBUTED)
    with pytest.raises(TypeError, match=str(dtype)):
        NON_FLOATING[name](dtype)


# ---------------------------------------------------------------- numpy scalars and bad values
BAD = {"nan": math.nan, "inf": math.inf, "-1": -1, "0": 0, "True": True, "str": "x"}


def _stepped(build: Callable[..., Any]) -> Callable[..., Any]:
    """An optimizer factory as a factory of (optimizer, params after two steps)."""
    def run(**kw: Any) -> tuple[Any, list[torch.Tensor]]:
        m = model()
        opt = build(m, **kw)
        steps(opt, m, 2)
        return opt, [p.detach().clone() for p in m.parameters()]
    return run


def _reduced(cls: type) -> Callable[..., Any]:
    """A compressor factory as a factory of (compressor, what it makes of two tensors with error feedback)."""
    def run(**kw: Any) -> tuple[Any, list[torch.Tensor]]:
        compressor = cls(**kw)
        tensors = [torch.arange(12.0).reshape(4, 3).sin(), torch.arange(5.0).cos()]
        feedback = ErrorFeedback()
        out = compressor.reduce(tensors, feedback.residuals([0, 1], tensors))
        return compressor, out + [feedback.residual(i, t) for i, t in enumerate(tensors)]
    return run


def _sparse_kw(kw: dict) -> dict:
    return kw if "k" in kw or "ratio" in kw else {"k": 2, **kw}


# name -> (factory, {argument: (its value here, the BAD names it accepts)})
ARGUMENTS: dict[str, tuple[Callable[..., Any], dict[str, tuple[float | int, set[str]]]]] = {
    "CentralizedSGD": (_stepped(lambda m, **kw: CentralizedSGD(**{"model": m, "lr": 0.1, **kw})),
                       {"lr": (0.1, {"0"}), "momentum": (0.9, {"0"}), "dampening": (0.1, {"0"}),
                        "weight_decay": (0.01, {"0"}), "world_size": (1, set())}),
    "CentralizedAdam": (_stepped(lambda m, **kw: CentralizedAdam(**{"model": m, "lr": 0.1, **kw})),
                        {"lr": (0.1, {"0"}), "eps": (1e-6, set()), "weight_decay": (0.01, {"0"}),
                         "world_size": (1, set())}),
    "CustomCentralizedOptimizer": (_stepped(lambda m, **kw: CustomCentralizedOptimizer(
        m, kw.pop("world_size", None), lo.SGD(m.parameters(), lr=0.1), **kw)),
        {"grad_clip": (0.5, {"inf"}), "world_size": (1, set())}),
    "GenericCentralizedOptimizer": (_stepped(lambda m, **kw: GenericCentralizedOptimizer(
        kw.pop("world_size", None), m, optimizer=lo.SGD(m.parameters(), lr=0.1))), {"world_size": (1, set())}),
    "CentralizedSparsifiedSGD": (_stepped(lambda m, **kw: CentralizedSparsifiedSGD(**{
        "params": m.parameters(), "lr": 0.1, "sparse_grad_size": 2, "generator": torch.Generator().manual_seed(0),
        **kw})), {"lr": (0.1, {"0"}), "weight_decay": (0.01, {"0"}), "sparse_grad_size": (2, set()),
                  "world_size": (1, set())}),
    "PowerSGD": (_stepped(lambda m, **kw: PowerSGD(**{"model": m, "lr": 0.1, **kw})),
                 {"lr": (0.1, {"0"}), "momentum": (0.9, {"0"}), "weight_decay": (0.01, {"0"}),
                  "dampening": (0.1, {"0"}), "world_size": (1, set()), "matrix_approximation_rank": (2, set()),
                  "seed": (3, {"0"})}),
    "DecentralizedSGD": (_stepped(lambda m, **kw: DecentralizedSGD(**{"model": m, "lr": 0.1, **kw})),
                         {"rank": (0, {"0"}), "lr": (0.1, {"0"}), "momentum": (0.9, {"0"}),
                          "dampening": (0.1, {"0"}), "weight_decay": (0.01, {"0"})}),
    "DiLoCo": (_stepped(lambda m, **kw: DiLoCo(lo.SGD(m.parameters(), lr=0.1), **{"sync_every": 2, "overlap": True,
                                                                               **kw})),
               {"sync_every": (2, set()), "fragments": (2, set()), "outer_lr": (0.7, set()),
                "outer_momentum": (0.9, set()), "mixing": (0.5, {"0"})}),
    "TopK": (lambda **kw: _reduced(TopK)(**_sparse_kw(kw)), {"k": (2, set()), "ratio": (0.5, set())}),
    "RandomK": (lambda **kw: _reduced(RandomK)(**_sparse_kw(kw)),
                {"k": (2, set()), "ratio": (0.5, set()), "seed": (3, {"0"})}),
    "Blockwise": (lambda **kw: _reduced(Blockwise)(**_sparse_kw(kw)),
                  {"k": (2, set()), "ratio": (0.5, set()), "seed": (3, {"0"})}),
    "PowerSGDCompressor": (_reduced(PowerSGDCompressor), {"rank": (2, set()), "seed": (3, {"0"})}),
    "Int8Quantizer": (_reduced(Int8Quantizer), {"chunk": (4, set()), "seed": (3, {"0"})}),
    "Int4Quantizer": (_reduced(Int4Quantizer), {"chunk": (4, set()), "seed": (3, {"0"})}),
    "SparseLoCo": (_reduced(SparseLoCo), {"density": (0.5, set()), "bits": (3, set()), "chunk": (4, set()),
                                          "decay": (0.9, {"0"})}),
    "DiLoCo[sparseloco]": (_stepped(lambda m, **kw: DiLoCo(lo.SGD(m.parameters(), lr=0.1), **{
        "sync_every": 2, "compressor": "sparseloco", **kw})),
        {"density": (0.5, set()), "bits": (3, set()), "outer_momentum": (0.9, {"0"}), "outer_lr": (0.7, set())}),
}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _numpy_left(obj: Any) -> list[str]:
    """Settings still held as numpy scalars (groups of an optimizer, attributes of a compressor)."""
    holders = obj.param_groups if isinstance(obj, torch.optim.Optimizer) else [vars(obj)]
    return [k for h in holders for k, v in h.items() if isinstance(v, np.generic)]


def test_the_argument_table_covers_the_family_and_the_compressors():
    assert {DISTRIBUTED[n].export for n in DISTRIBUTED} <= set(ARGUMENTS)
    assert {"TopK", "RandomK", "Blockwise", "PowerSGDCompressor", "SparseLoCo"} <= set(ARGUMENTS)


@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_numpy_scalars_work_like_python_numbers(name):
    run, args = ARGUMENTS[name]
    for arg, (value, _) in args.items():
        numpy_value = np.int64(value) if isinstance(value, int) else np.float32(value)
        python_obj, python_out = run(**{arg: type(value)(numpy_value)})
        numpy_obj, numpy_out = run(**{arg: numpy_value})
        assert _same(python_out, numpy_out), arg
        assert _same(python_obj.state_dict(), numpy_obj.state_dict()), arg
        assert not _numpy_left(numpy_obj), (arg, _numpy_left(numpy_obj))


@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_bad_values_are_refused_naming_the_argument(name):
    run, args = ARGUMENTS[name]
    for arg, (_, accepted) in args.items():
        for label, bad in BAD.items():
            error = _error(lambda: run(**{arg: bad}))
            if label in accepted:
                assert error is None, (arg, label, error)
                continue
            expected = TypeError if label in ("True", "str") else (ValueError, TypeError)
            assert isinstance(error, expected) and arg in str(error), (arg, label, error)


def test_a_custom_denominator_takes_numpy_scalars_and_refuses_bad_ones():
    def stepped(denom: Any) -> list[torch.Tensor]:
        m = model()
        opt = CustomCentralizedOptimizer(m, None, lo.SGD(m.parameters(), lr=0.1), average_custom=True)
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        opt.step(denom=denom)
        return [p.detach().clone() for p in m.parameters()]

    assert _same(stepped(np.float32(3.0)), stepped(3.0)) and _same(stepped(np.int64(3)), stepped(3))
    for label, bad in BAD.items():
        with pytest.raises(TypeError if label in ("True", "str") else ValueError, match="denom"):
            stepped(bad)
