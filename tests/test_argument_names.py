"""One vocabulary for every optimizer class of the catalogue: torch.optim's argument names, the seeds' spellings as
aliases (the same result, a DeprecationWarning exactly where documented, both names given is a TypeError), and
no argument taken silently without effect.

Swept over every class (``lightning_optim.catalogue``), every alias (each class's ``__argument_aliases__``) and
every argument the classes take; compared with torch.optim's own signatures and with the same optimizer built
under the new name.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch

import lightning_optim as lo
from lightning_optim.catalogue import DISTRIBUTED, OPTIMIZERS
from lightning_optim.config_rules import parameter_rules
from lightning_optim.optim.base import BaseOptimizer
from lightning_optim.renames import Alias
from tests.optim.helpers import grad_stream, make_params, two_groups
from tests.optim.specs import SPECS

CLASSES = {e.export: e.cls for table in (OPTIMIZERS, DISTRIBUTED) for e in table.values()}
# wrappers over an optimizer they are given: its learning rate and decay are that optimizer's
WRAPPERS = {"GenericCentralizedOptimizer", "CustomCentralizedOptimizer", "DiLoCo"}
# our classes named after a torch.optim class, and drop-ins for it: every torch argument, its default, its place
TORCH_TWINS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD,
               "RAdam": torch.optim.RAdam}


def _chain(cls: type) -> list[type]:
    """The classes whose ``__init__`` a keyword given to ``cls`` may reach (each passing ``**kwargs`` on)."""
    chain = []
    for owner in cls.__mro__:
        if owner is object or "__init__" not in vars(owner) or owner is torch.optim.Optimizer:
            continue
        chain.append(owner)
        params = inspect.signature(owner.__init__).parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return chain


def _arguments(cls: type) -> dict[str, inspect.Parameter]:
    """Every keyword the class takes (not its aliases)."""
    out: dict[str, inspect.Parameter] = {}
    for owner in _chain(cls):
        for p in list(inspect.signature(owner.__init__).parameters.values())[1:]:
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                out.setdefault(p.name, p)
    return out


def _declared(cls: type) -> list[tuple[type, Alias]]:
    """``(declaring class, alias)`` for every alias a keyword given to ``cls`` meets."""
    return [(owner, a) for owner in _chain(cls) for a in getattr(vars(owner)["__init__"], "__argument_aliases__", ())]


def _aliases(cls: type) -> list[Alias]:
    return [a for _, a in _declared(cls)]


ALIASED = sorted(((name, alias) for name, cls in CLASSES.items()
                  for alias in {a.old: a for a in _aliases(cls)}.values()), key=lambda pair: (pair[0], pair[1].old))


# ---------------------------------------------------------------------------------------------- names
@pytest.mark.parametrize("name", sorted(TORCH_TWINS))
def test_a_torch_twin_takes_every_torch_argument_with_its_default_and_place(name):
    ours, theirs = _arguments(CLASSES[name]), inspect.signature(TORCH_TWINS[name]).parameters
    for arg, p in theirs.items():
        assert arg in ours, f"{name} lacks torch's {arg}"
        assert ours[arg].default == p.default, (name, arg, ours[arg].default, p.default)
    positional = [a for a, p in theirs.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert list(ours)[: len(positional)] == positional, name


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_class_names_the_shared_hyper_parameters_as_torch_does(name):
    """lr, weight_decay (every class that owns its step), eps and betas where the class has them; no seed
    spelling (the aliases' old names, unless the old name means another thing there) as a parameter."""
    args = _arguments(CLASSES[name])
    if name not in WRAPPERS:
        assert {"lr", "weight_decay"} <= set(args), name
    torch_vocabulary = {a for twin in TORCH_TWINS.values() for a in inspect.signature(twin).parameters}
    assert {"lr", "betas", "eps", "weight_decay", "foreach", "maximize"} <= torch_vocabulary  # the reference
    spellings = {a.old for cls in CLASSES.values() for a in _aliases(cls) if not a.deprecated}
    assert not spellings & set(args), f"{name} takes a seed spelling as its own name: {spellings & set(args)}"
    assert not {"epsilon", "learning_rate", "eeta", "decouple_wd", "adam_w_mode", "adamw_mode"} & set(args), name


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_every_single_process_optimizer_takes_foreach_and_maximize(spec):
    """torch's two flags on every optimizer of ``lightning_optim.optim``; maximize on g steps as minimize on -g."""
    assert {"foreach", "maximize"} <= set(_arguments(spec.cls))
    grads = grad_stream(steps=3)
    runs = []
    for maximize, sign in ((True, 1.0), (False, -1.0)):
        params = make_params()
        opt = spec.cls(params, maximize=maximize, **spec.kwargs)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = sign * g.to(p.dtype)
            opt.step()
        runs.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*runs)), spec.name


def test_a_deprecated_alias_is_one_whose_old_name_means_something_else_elsewhere():
    """The policy behind the warnings: an alias warns only where its old name is another argument of another
    class (PowerSGD's rank beside DecentralizedSGD's process rank); the others stay silent seed spellings."""
    owners = {name: set(_arguments(cls)) for name, cls in CLASSES.items()}
    assert ALIASED, "the sweep sees no alias"
    for name, alias in ALIASED:
        elsewhere = [other for other, args in owners.items() if other != name and alias.old in args]
        assert bool(alias.deprecated) == bool(elsewhere), (name, alias, elsewhere)
        assert alias.new in owners[name] and alias.old not in owners[name], (name, alias)
        owner = next(o for o, a in _declared(CLASSES[name]) if a == alias)
        assert f"``{alias.old}`` for ``{alias.new}``" in (owner.__doc__ or ""), (owner, alias)  # documented
        assert alias.old in parameter_rules(CLASSES[name])  # configs and HF optim_args take it too


# ---------------------------------------------------------------------------------------------- aliases
def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(t) for t in make_params(shapes=[(4, 3), (5,)])]


def _build(name: str, **kwargs: Any) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    params = _params()
    if "model_params" not in kwargs and "params" not in kwargs:
        kwargs = {"params": params, **kwargs} if name != "PowerSGD" else {"model": params, **kwargs}
    else:
        params = kwargs.get("model_params") or kwargs.get("params")
    if name != "PowerSGD" and "lr" not in kwargs:
        kwargs["lr"] = 1e-2
    if name == "PowerSGD":
        kwargs.setdefault("lr", 1e-2)
    return CLASSES[name](**kwargs), params


def _value(name: str, alias: Alias) -> Any:
    """A value for the alias that is not the argument's default (so an ignored alias shows)."""
    if alias.new == "params":
        return _params()
    default = _arguments(CLASSES[name])[alias.new].default
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    return default / 2 if default else 0.25


def _observed(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[Any]:
    """What the optimizer is after two steps: its groups' settings, the params, the compressor's rank."""
    for step in grad_stream(shapes=[(4, 3), (5,)], steps=2):
        for p, g in zip(params, step):
            p.grad = g.to(p.dtype)
        opt.step()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return [groups, [p.detach().clone() for p in params], getattr(getattr(opt, "compressor", None), "rank", None)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("name,alias", ALIASED, ids=[f"{n}-{a.old}" for n, a in ALIASED])
def test_an_alias_is_its_argument_and_warns_exactly_when_documented(name, alias):
    value = _value(name, alias)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        old = _observed(*_build(name, **{alias.old: value}))
    deprecations = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == (1 if alias.deprecated else 0), [str(w.message) for w in deprecations]
    if alias.deprecated:
        message = str(deprecations[0].message)
        assert alias.old in message and alias.new in message and deprecations[0].filename == __file__
    new = _observed(*_build(name, **{alias.new: value if alias.new != "params" else _params()}))
    assert _same(old, new), (name, alias)
    if alias.new != "params":  # the value took effect: the default builds something else
        assert not _same(old, _observed(*_build(name))), (name, alias)


@pytest.mark.parametrize("name,alias", ALIASED, ids=[f"{n}-{a.old}" for n, a in ALIASED])
def test_an_alias_and_its_name_together_are_a_type_error_naming_both(name, alias):
    value = _value(name, alias)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError) as info:
            _build(name, **{alias.old: value, alias.new: value})
    assert alias.old in str(info.value) and alias.new in str(info.value)


# the aliases of per-group settings (PowerSGD's rank belongs to its compressor, CPUAdam's model_params is no setting)
GROUP_ALIASED = [(n, a) for n, a in ALIASED if issubclass(CLASSES[n], BaseOptimizer) and a.new != "params"]


@pytest.mark.parametrize("name,alias", GROUP_ALIASED, ids=[f"{n}-{a.old}" for n, a in GROUP_ALIASED])
def test_a_param_group_and_a_state_dict_may_use_the_old_key(name, alias):
    assert alias.new in _build(name)[0].defaults
    value = _value(name, alias)
    old, new = _params(), _params()
    by_old, _ = _build(name, params=two_groups(old, **{alias.old: value}))
    by_new, _ = _build(name, params=two_groups(new, **{alias.new: value}))
    assert _same(_observed(by_old, old), _observed(by_new, new))
    with pytest.raises(TypeError, match=f"both {alias.old} and {alias.new}"):
        _build(name, params=two_groups(_params(), **{alias.old: value, alias.new: value}))
    saved = by_new.state_dict()
    saved["param_groups"] = [{(alias.old if k == alias.new else k): v for k, v in g.items()}
                             for g in saved["param_groups"]]
    fresh, _ = _build(name, params=two_groups(_params()))
    fresh.load_state_dict(saved)
    assert _same([{k: v for k, v in g.items() if k != "params"} for g in fresh.param_groups],
                 [{k: v for k, v in g.items() if k != "params"} for g in by_new.param_groups])
    saved["param_groups"][1][alias.new] = value
    with pytest.raises(ValueError, match=f"both {alias.old} and {alias.new}"):
        fresh.load_state_dict(saved)


# -------------------------------------------------------------------------------- taken without effect
def _takes(argument: str) -> list[str]:
    return sorted(n for n, cls in CLASSES.items() if argument in _arguments(cls))


def _user_warnings(build: Any, *args: Any, **kwargs: Any) -> list[str]:
    """The UserWarnings of ``build(*args, **kwargs)``."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        build(*args, **kwargs)
    return [str(w.message) for w in record if issubclass(w.category, UserWarning)
            and not issubclass(w.category, (DeprecationWarning, FutureWarning))]


@pytest.mark.parametrize("name", _takes("fused"))
def test_fused_true_warns_once_naming_it_and_what_happens(name):
    """torch's fused=True asks for a kernel; ours take their fastest path whatever it says: True warns, once."""
    (message,) = _user_warnings(_build, name, fused=True)
    assert "fused=True has no effect" in message and "fastest path" in message and name in message
    for quiet in (False, None):
        assert _user_warnings(_build, name, fused=quiet) == []


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_foreach_true_warns_where_the_optimizer_steps_tensor_by_tensor(spec):
    messages = _user_warnings(spec.cls, make_params(), foreach=True, **spec.kwargs)
    tensor_by_tensor = getattr(spec.cls, "per_tensor", False)
    assert len(messages) == tensor_by_tensor and all("foreach=True has no effect" in m for m in messages)
    assert _user_warnings(spec.cls, make_params(), foreach=False, **spec.kwargs) == []


def _distributed(name: str, **kwargs: Any) -> Any:
    model = torch.nn.Linear(3, 2)
    local = lo.SGD(model.parameters(), lr=0.1)
    return {
        "GenericCentralizedOptimizer": lambda: lo.GenericCentralizedOptimizer(None, model, optimizer=local, **kwargs),
        "CustomCentralizedOptimizer": lambda: lo.CustomCentralizedOptimizer(model, None, local, **kwargs),
        "CentralizedSGD": lambda: lo.CentralizedSGD(model=model, lr=0.1, **kwargs),
        "CentralizedAdam": lambda: lo.CentralizedAdam(model=model, lr=0.1, **kwargs),
        "PowerSGD": lambda: lo.PowerSGD(model, lr=0.1, **kwargs),
        "DecentralizedSGD": lambda: lo.DecentralizedSGD(model=model, lr=0.1, **kwargs),
    }[name]()


@pytest.mark.parametrize("name", _takes("use_cuda"))
def test_use_cuda_true_warns_where_the_params_are_not_on_cuda(name):
    (message,) = _user_warnings(_distributed, name, use_cuda=True)
    assert "use_cuda=True has no effect" in message and "(cpu)" in message and name in message
    assert _user_warnings(_distributed, name, use_cuda=False) == []


@pytest.mark.parametrize("name", ["SparsifiedSGD", "CentralizedSparsifiedSGD"])
def test_a_sparsified_setting_that_another_overrides_warns(name):
    cls = CLASSES[name]

    def build(**kwargs: Any) -> Any:
        return cls(make_params(), lr=0.1, sparse_grad_size=1, **kwargs)

    pick = lambda i, flat, k: torch.arange(k)  # noqa: E731
    cases = {"random_sparse": dict(random_sparse=True, mode="topk"), "mode": dict(mode="random", index_fn=pick),
             "generator": dict(mode="topk", generator=torch.Generator())}
    for argument, kwargs in cases.items():
        if not set(kwargs) <= set(_arguments(cls)):
            continue  # CentralizedSparsifiedSGD takes no index_fn
        messages = _user_warnings(build, **kwargs)
        assert any(m.startswith(f"{name}: {argument}=") and "has no effect" in m for m in messages), messages
    for quiet in (dict(random_sparse=True), dict(mode="topk"), dict(mode="random", generator=torch.Generator())):
        assert _user_warnings(build, **quiet) == [], quiet


@pytest.mark.parametrize("name", sorted(n for n, e in OPTIMIZERS.items() if e.onebit))
def test_the_onebit_arguments_deepspeed_needs_and_we_do_not_warn(name):
    cls = OPTIMIZERS[name].cls
    for argument, value in (("cuda_aware", True), ("comm_backend_name", "mpi"), ("max_grad_norm", 1.0)):
        (message,) = _user_warnings(cls, make_params(), **{argument: value})
        assert argument in message, (argument, message)
    assert _user_warnings(cls, make_params()) == []
