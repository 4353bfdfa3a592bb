"""Old names that keep working, in one place: the seeds' spellings of constructor arguments, names of
strategies and config options, and arguments that are taken but change nothing.

* :func:`argument_aliases` (a class decorator): ``Lars(eeta=...)`` is ``Lars(trust_coefficient=...)``. The
  table goes into the class docstring and onto ``__init__`` (``__argument_aliases__``, read by the config and
  ``optim_args`` checks). An alias and its name given together raise ``TypeError`` naming both. An alias warns
  (``DeprecationWarning``) only where it is ``deprecated``: its old name means something else elsewhere
  (``PowerSGD(rank=...)`` reads like the process's rank).
  The same holds for the keys of a param group (given to the class or to ``add_param_group``) and of a
  state dict's groups (``load_state_dict``) wherever the new name is a group key.
* :func:`warn_renamed`: a renamed strategy, config option or HF ``optim`` name (``FutureWarning``).
* :func:`warn_ignored`: an argument that is taken but has no effect (``UserWarning`` saying what happens).

Cheap to import: the standard library only.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["FUSED_NOTE", "Alias", "argument_aliases", "resolve_aliases", "warn_ignored", "warn_renamed"]

# torch's fused=True asks for its CUDA kernel; ours pick their fastest path themselves, whatever fused says
FUSED_NOTE = "lightning_optim takes its fastest path by itself (its compiled kernel where built, else foreach)"

C = TypeVar("C", bound=type)

# a warning points at the first frame outside these packages: the user's call, not our constructor chain
_ROOT = Path(__file__).resolve().parent.parent
_OURS = tuple(f"{_ROOT / name}{os.sep}" for name in ("lightning_optim", "accel_plugins"))


def _warn(message: str, category: type[Warning]) -> None:
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OURS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


@dataclass(frozen=True)
class Alias:
    """``old`` is taken as ``new``; ``origin`` says whose spelling it is (``"ColossalAI's Lars"``)."""

    old: str
    new: str
    origin: str
    deprecated: str = ""  # why the old name misleads (it means something else elsewhere): then it warns

    def describe(self) -> str:
        why = f"; deprecated: {self.deprecated}" if self.deprecated else ""
        return f"``{self.old}`` for ``{self.new}`` ({self.origin}{why})"


def resolve_aliases(owner: str, table: tuple[Alias, ...], signature: inspect.Signature, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with every alias of ``table`` under its new name; ``TypeError`` where a call gives both
    (``args``: the positional arguments after ``self``, which may fill the new name)."""
    try:
        positional = set(signature.bind_partial(None, *args).arguments)
    except TypeError:
        positional = set()  # too many positional arguments: the call itself says so
    out = dict(kwargs)
    for alias in table:
        if alias.old not in out:
            continue
        if alias.new in out or alias.new in positional:
            raise TypeError(f"{owner}: got both {alias.old} and {alias.new}, two names of one argument "
                            f"({alias.old} is the spelling of {alias.origin}); give {alias.new} only")
        if alias.deprecated:
            _warn(f"{owner}({alias.old}=...) is deprecated ({alias.deprecated}); pass {alias.new}=... instead",
                  DeprecationWarning)
        out[alias.new] = out.pop(alias.old)
    return out


def argument_aliases(*table: Alias) -> Callable[[C], C]:
    """Class decorator: ``cls(old=v)`` is ``cls(new=v)`` for every :class:`Alias` of ``table`` (see the module
    docstring), and so is an ``old`` key of a param group given to it, to ``add_param_group`` or in a state
    dict given to ``load_state_dict`` (where ``new`` is a group key); appends an ``Aliases:`` section to the
    class docstring."""

    def decorate(cls: C) -> C:
        # this wraps methods of the decorated class in place; mypy refuses reading __init__ off a class object
        # and assigning methods or marks to it: the type ignores below are those
        init = cls.__init__  # type: ignore[misc]
        signature = inspect.signature(init)
        owner = cls.__name__
        missing = [a.new for a in table if a.new not in signature.parameters]
        if missing:
            raise TypeError(f"{owner}.__init__ has no parameter {', '.join(missing)} for its aliases")

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **resolve_aliases(owner, table, signature, args, kwargs))

        __init__.__argument_aliases__ = table  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[misc]
        add = getattr(cls, "add_param_group", None)
        if callable(add):  # torch.optim.Optimizer.__init__ adds the constructor's groups through it too
            @functools.wraps(add)
            def add_param_group(self: Any, param_group: Any) -> None:
                add(self, _renamed_group(param_group, table, self.defaults, f"{owner}: param group", TypeError))

            cls.add_param_group = add_param_group  # type: ignore[attr-defined]
        load = getattr(cls, "load_state_dict", None)
        if callable(load):  # a dict saved under the old group keys (ColossalAI's Lars: eeta)
            @functools.wraps(load)
            def load_state_dict(self: Any, state_dict: Any) -> None:
                load(self, _renamed_group_keys(self, state_dict))

            cls.load_state_dict = load_state_dict  # type: ignore[attr-defined]
        lines = "\n".join(f"    {alias.describe()}" for alias in table)
        heading = "Aliases (the same argument under another name):"
        cls.__doc__ = f"{inspect.cleandoc(cls.__doc__ or '')}\n\n{heading}\n{lines}\n"
        return cls

    return decorate


def _renamed_group(group: Any, table: tuple[Alias, ...], keys: Mapping[str, Any], where: str,
                   error: type[Exception]) -> Any:
    """``group`` with its old keys under their new names (where the new name is one of ``keys``); the same
    object when it holds none. Both names in one group: ``error`` naming them."""
    aliases = [a for a in table if a.new in keys]
    if not isinstance(group, Mapping) or not any(a.old in group for a in aliases):
        return group
    renamed = dict(group)
    for alias in aliases:
        if alias.old in renamed:
            if alias.new in renamed:
                raise error(f"{where} holds both {alias.old} and {alias.new}, two names of one setting "
                            f"({alias.old} is the spelling of {alias.origin}); keep {alias.new} only")
            renamed[alias.new] = renamed.pop(alias.old)
    return renamed


def _renamed_group_keys(optimizer: Any, state_dict: Any) -> Any:
    """``state_dict`` with its param groups' old keys (``eeta``) under their new names (``trust_coefficient``),
    by the aliases of ``optimizer``'s class; the same object when no group holds one. A group holding both
    names is refused (``ValueError``)."""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("param_groups"), list):
        return state_dict  # the loader's own checks say what is wrong
    table = tuple(a for owner in type(optimizer).__mro__
                  for a in getattr(vars(owner).get("__init__"), "__argument_aliases__", ()))
    groups = [_renamed_group(group, table, optimizer.defaults, f"state_dict: param group {i}", ValueError)
              for i, group in enumerate(state_dict["param_groups"])]
    if all(a is b for a, b in zip(groups, state_dict["param_groups"])):
        return state_dict
    return {**state_dict, "param_groups": groups}


def warn_renamed(what: str, old: str, new: str) -> None:
    """One ``FutureWarning``: the ``what`` (``"strategy"``, ``"optimizer name"``, ``"hook name"``) ``old`` is now
    called ``new``."""
    _warn(f"{what} {old!r} is a deprecated name; use {new!r} (the same thing under the name it has everywhere)",
          FutureWarning)


def warn_ignored(owner: str, argument: str, value: Any, instead: str) -> None:
    """One ``UserWarning``: ``owner``'s ``argument=value`` is taken but changes nothing; ``instead`` says what
    happens."""
    _warn(f"{owner}: {argument}={value!r} has no effect: {instead}", UserWarning)
