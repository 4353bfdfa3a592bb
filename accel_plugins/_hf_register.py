"""``register()``: lightning-optim's names in the stock ``transformers.TrainingArguments``, the
parsers built from it and ``transformers.Trainer``; opt-in, process-wide, undone by ``unregister()``.

Four patches, each undone by :func:`unregister`:

- ``OptimizerNames`` (HF's enum of ``optim`` values) gains one member per name of ours that HF does
  not use itself, so ``OptimizerNames("lion")`` works, and ``HfArgumentParser`` (which takes the
  enum's members as the ``--optim`` choices when it is created) offers them.
- ``TrainingArguments.__post_init__`` refuses an unknown ``optim`` by name and checks our names'
  ``optim_args`` at construction, as ``accel_plugins.hf.TrainingArguments`` does.
- ``Trainer.get_optimizer_cls_and_kwargs`` sends our names to ``optimizer_cls_and_kwargs``; HF's
  names go to HF's code as before.
- ``Trainer.__init__``, ``_save_optimizer_and_scheduler``, ``_load_optimizer_and_scheduler``, ``log`` and
  the ``onebit_optimizer`` property become ``accel_plugins.hf.Trainer``'s own (``_hf_trainer.py``): a 1-bit
  optimizer runs with DDP's allreduce off in its compression stage, per-rank checkpoints and byte logs;
  for any other optimizer they do what HF's do.

Where HF already uses a name (``sgd``, ``stable_adamw``) HF's meaning stays in the stock classes;
ours is reachable through ``accel_plugins.hf.TrainingArguments``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import transformers
from packaging.version import Version

from accel_plugins._hf_optim import optimizer_cls_and_kwargs
from accel_plugins._hf_trainer import HF_METHODS, TRAINER_METHODS
from lightning_optim.catalogue import OPTIMIZER_ALIASES, OPTIMIZERS, optimizer_name

__all__ = ["register", "unregister", "MIN_TRANSFORMERS"]

MIN_TRANSFORMERS = "4.47"  # first release with Trainer(optimizer_cls_and_kwargs=...)
_MEMBER_PREFIX = "LIGHTNING_OPTIM_"  # member names that cannot clash with HF's (HF's LION is "lion_32bit")


@dataclass(frozen=True)
class _Registration:
    names: tuple[str, ...]  # the values added to OptimizerNames
    post_init: Callable[..., None]
    get_optimizer_cls_and_kwargs: staticmethod
    trainer_attributes: dict[str, Any]  # transformers.Trainer's own, None where it had none (onebit_optimizer)
    old_names: tuple[str, ...] = ()  # also added: old names of ours (signsgd), each meaning its new name


_registration: _Registration | None = None


def _optimizer_names() -> Any:
    return getattr(getattr(transformers, "training_args", None), "OptimizerNames", None)


def _missing_internals() -> list[str]:
    """What register() patches, checked rather than assumed (private attributes can move)."""
    missing = []
    names = _optimizer_names()
    maps = (("_member_names_", list), ("_member_map_", dict), ("_value2member_map_", dict))
    if not (isinstance(names, type) and issubclass(names, Enum) and issubclass(names, str)
            and all(isinstance(getattr(names, attr, None), kind) for attr, kind in maps)):
        missing.append("transformers.training_args.OptimizerNames (a str Enum with its member maps)")
    if not isinstance(vars(transformers.Trainer).get("get_optimizer_cls_and_kwargs"), staticmethod):
        missing.append("the staticmethod transformers.Trainer.get_optimizer_cls_and_kwargs")
    if "optimizer_cls_and_kwargs" not in inspect.signature(transformers.Trainer.__init__).parameters:
        missing.append("transformers.Trainer(optimizer_cls_and_kwargs=...)")
    missing += [f"transformers.Trainer.{name}" for name, original in HF_METHODS.items() if not callable(original)]
    if not callable(vars(transformers.TrainingArguments).get("__post_init__")):
        missing.append("transformers.TrainingArguments.__post_init__")
    return missing


def _installed_version() -> str:
    # one seam for tests: importing transformers.Trainer swaps the module object in sys.modules, so
    # patching ``transformers.__version__`` from outside may not reach the object bound here
    return transformers.__version__


def _check_supported() -> None:
    installed = _installed_version()
    alternative = "use accel_plugins.hf.TrainingArguments with accel_plugins.hf.Trainer"
    if Version(installed) < Version(MIN_TRANSFORMERS):
        raise RuntimeError(f"accel_plugins.hf.register() needs transformers >= {MIN_TRANSFORMERS}; transformers "
                           f"{installed} is installed: upgrade it, or {alternative}")
    missing = _missing_internals()
    if missing:
        raise RuntimeError(f"accel_plugins.hf.register(): transformers {installed} lacks {'; '.join(missing)}: "
                           f"{alternative}, or pass transformers.Trainer(optimizer_cls_and_kwargs="
                           "accel_plugins.hf.optimizer_cls_and_kwargs(args))")
    # our methods call HF's as accel_plugins found them: installing them over a later replacement would drop it
    replaced = [name for name, original in HF_METHODS.items() if vars(transformers.Trainer).get(name) is not original]
    if replaced:
        raise RuntimeError(f"accel_plugins.hf.register(): {', '.join(f'transformers.Trainer.{n}' for n in replaced)} "
                           "changed after accel_plugins.hf was imported (another library's patch?), and register() "
                           f"would drop that change: import accel_plugins.hf after it, or {alternative}")


def _optim_value(optim: Any) -> str:
    return str(getattr(optim, "value", optim))


def _add_member(enum_cls: Any, value: str) -> None:
    member = str.__new__(enum_cls, value)  # what Enum itself does for a str member, without the class body
    member._value_ = value
    member._name_ = _MEMBER_PREFIX + value.upper()
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_names_.append(member._name_)
    enum_cls._member_map_[member._name_] = member
    enum_cls._value2member_map_[value] = member


def _remove_member(enum_cls: Any, value: str) -> None:
    member = enum_cls._value2member_map_.pop(value)
    enum_cls._member_map_.pop(member._name_)
    enum_cls._member_names_.remove(member._name_)


def _is_ours(args: Any, names: tuple[str, ...]) -> bool:
    # accel_plugins.hf.TrainingArguments marks its names (``sgd`` there is ours) with lightning_optim_name
    return bool(getattr(args, "lightning_optim_name", None)) or _optim_value(args.optim) in names


def _checking_post_init(original: Callable[..., None], names: tuple[str, ...]) -> Callable[..., None]:
    enum_cls = _optimizer_names()

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        name = _optim_value(self.optim)
        if name in OPTIMIZER_ALIASES and OPTIMIZER_ALIASES[name] in names:
            name = self.optim = optimizer_name(name)  # an old name of ours: warns, then it is the new one
        if name not in enum_cls._value2member_map_:
            raise ValueError(f"optim: {name!r} is neither an HF optimizer name nor one of lightning-optim's "
                             f"registered ones ({', '.join(names)})")
        original(self)
        if name in names:
            optimizer_cls_and_kwargs(self)  # bad optim_args fail here, at parse time, not at the first step

    return __post_init__


def _dispatching(original: Callable[..., Any], names: tuple[str, ...]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_optimizer_cls_and_kwargs(args: Any, *rest: Any, **kwargs: Any) -> tuple[Any, Any]:
        if _is_ours(args, names):
            return optimizer_cls_and_kwargs(args)
        return original(args, *rest, **kwargs)

    return get_optimizer_cls_and_kwargs


def register() -> tuple[str, ...]:
    """Make the stock ``TrainingArguments``, ``HfArgumentParser`` (created after this call) and ``Trainer``
    take lightning-optim's optimizer names; returns the names added (HF's own, ``sgd`` and
    ``stable_adamw``, keep HF's meaning). The old names of those added (``signsgd``) are taken too, with a
    FutureWarning. Idempotent. ``RuntimeError`` where transformers is older
    than 4.47 or lacks what this patches."""
    global _registration
    if _registration is not None:
        return _registration.names
    _check_supported()
    enum_cls = _optimizer_names()
    names = tuple(sorted(name for name in OPTIMIZERS if name not in enum_cls._value2member_map_))
    post_init = vars(transformers.TrainingArguments)["__post_init__"]
    get_cls_and_kwargs = vars(transformers.Trainer)["get_optimizer_cls_and_kwargs"]
    trainer_attributes = {name: vars(transformers.Trainer).get(name) for name in TRAINER_METHODS}
    old_names = tuple(sorted(old for old, new in OPTIMIZER_ALIASES.items()
                             if new in names and old not in enum_cls._value2member_map_))
    for name in names + old_names:
        _add_member(enum_cls, name)
    # replaced on purpose (unregister() puts HF's own back)
    transformers.TrainingArguments.__post_init__ = _checking_post_init(post_init, names)  # type: ignore[method-assign]
    transformers.Trainer.get_optimizer_cls_and_kwargs = staticmethod(  # type: ignore[method-assign]
        _dispatching(get_cls_and_kwargs.__func__, names))
    for name, method in TRAINER_METHODS.items():
        setattr(transformers.Trainer, name, method)
    _registration = _Registration(names, post_init, get_cls_and_kwargs, trainer_attributes, old_names)
    return names


def unregister() -> None:
    """Undo :func:`register` (nothing to do if it was not called). Parsers built meanwhile keep our
    names as choices; arguments built meanwhile keep their members."""
    global _registration
    if _registration is None:
        return
    enum_cls = _optimizer_names()
    for name in _registration.names + _registration.old_names:
        _remove_member(enum_cls, name)
    transformers.TrainingArguments.__post_init__ = _registration.post_init  # type: ignore[method-assign]
    transformers.Trainer.get_optimizer_cls_and_kwargs = (  # type: ignore[method-assign]
        _registration.get_optimizer_cls_and_kwargs)
    for name, original in _registration.trainer_attributes.items():
        if original is None:
            delattr(transformers.Trainer, name)
        else:
            setattr(transformers.Trainer, name, original)
    _registration = None
