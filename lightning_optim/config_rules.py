"""Rules for config values: what one key takes, declared (:func:`integer`, :func:`number`, :func:`one_of`)
or read off a constructor's signature (:func:`parameter_rules`: the annotation gives the type), and which key
a constructor's error is about (:func:`culprit`). Used by the main job's check (``config_check``) and the HF
Trainer's ``optim_args`` (``accel_plugins.hf``); no knowledge of either here.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ANYTHING", "BOOL", "NULL", "SECTION", "TEXT", "Rule", "annotation_rule", "culprit", "integer", "is_int",
           "is_number", "named_key", "number", "one_of", "parameter_rules", "refused"]

_EMPTY = inspect.Parameter.empty


# ----------------------------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Rule:
    """What one key takes: ``test(value)`` says yes or no; ``says`` is the valid range in words."""

    test: Callable[[Any], bool]
    says: str

    def __or__(self, other: Rule) -> Rule:
        return Rule(lambda v: self.test(v) or other.test(v), f"{self.says} or {other.says}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML's true is no 1 here


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _within(value: float, low: float | None, high: float | None, open_low: bool, open_high: bool) -> bool:
    above = low is None or value > low or (value == low and not open_low)
    below = high is None or value < high or (value == high and not open_high)
    return above and below


def _bounds(low: float | None, high: float | None, open_low: bool = False, open_high: bool = False) -> str:
    if low is not None and high is not None:
        return f" in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    if low is not None:
        return f" {'>' if open_low else '>='} {low}"
    return "" if high is None else f" {'<' if open_high else '<='} {high}"


def integer(low: int | None = None, high: int | None = None) -> Rule:
    return Rule(lambda v: is_int(v) and _within(v, low, high, False, False), "an int" + _bounds(low, high))


def number(low: float | None = None, high: float | None = None, *, open_low: bool = False,
           open_high: bool = False) -> Rule:
    """A finite int or float in the range: NaN and inf never are."""
    return Rule(lambda v: is_number(v) and math.isfinite(v) and _within(v, low, high, open_low, open_high),
                "a number" + _bounds(low, high, open_low, open_high))


def one_of(*choices: Any) -> Rule:
    # same type too: YAML's true must not pass for a Literal[1], nor 1 for True
    return Rule(lambda v: any(v == c and type(v) is type(c) for c in choices),
                "one of " + ", ".join(map(repr, choices)))


def refused(says: str) -> Rule:
    return Rule(lambda v: False, says)


ANYTHING = Rule(lambda v: True, "anything")
NULL = Rule(lambda v: v is None, "null")
BOOL = Rule(lambda v: isinstance(v, bool), "true or false")
TEXT = Rule(lambda v: isinstance(v, str) and v != "", "a non-empty string")
SECTION = Rule(lambda v: isinstance(v, dict), "a mapping")


# ------------------------------------------------------------------------ rules from a constructor
def annotation_rule(annotation: Any, default: Any = _EMPTY) -> Rule | None:
    """The values a config can give a parameter so annotated; None where it can give none (a class, a
    callable). No annotation: the default's type."""
    if annotation is _EMPTY:
        kind = type(default)
        return annotation_rule(kind) if kind in (bool, int, float, str) else ANYTHING
    if annotation in (Any, object):
        return ANYTHING
    scalars = {bool: BOOL, int: Rule(is_int, "an int"), float: Rule(is_number, "a number"),
               str: Rule(lambda v: isinstance(v, str), "a string"), type(None): NULL}
    if annotation in scalars:
        return scalars[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [rule for rule in map(annotation_rule, args) if rule is not None]
        return functools.reduce(operator.or_, members) if members else None
    if origin is typing.Literal:
        return one_of(*args)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return _sequence([annotation_rule(a) for a in args])
    if origin in (list, tuple, Sequence, Iterable):
        item = annotation_rule(args[0]) if args else ANYTHING
        if item is None:
            return None
        return Rule(lambda v: isinstance(v, (list, tuple)) and all(map(item.test, v)), f"a list (each {item.says})")
    if origin in (dict, Mapping):
        value = annotation_rule(args[1]) if len(args) == 2 else ANYTHING
        if value is None:
            return None
        return Rule(lambda v: isinstance(v, dict) and all(map(value.test, v.values())),
                    f"a mapping (each value {value.says})")
    return None


def _sequence(items: list[Rule | None]) -> Rule | None:
    rules = [rule for rule in items if rule is not None]
    if len(rules) != len(items):
        return None
    says = {rule.says for rule in rules}
    each = f"each {rules[0].says}" if len(says) == 1 else ", ".join(rule.says for rule in rules)
    return Rule(lambda v: isinstance(v, (list, tuple)) and len(v) == len(rules)
                and all(rule.test(x) for rule, x in zip(rules, v)), f"a list of {len(rules)} values ({each})")


def _hints(function: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 - one unresolvable name (a TYPE_CHECKING import) must not hide the rest
        hints = {}
        for name, param in inspect.signature(function).parameters.items():
            text = param.annotation
            try:  # the class's own annotation text, as get_type_hints would evaluate it
                hints[name] = eval(text, function.__globals__) if isinstance(text, str) else text  # noqa: S307
            except Exception:  # noqa: BLE001
                hints[name] = Any
        return hints


def _init_chain(target: Callable[..., Any]) -> list[Callable[..., Any]]:
    """The functions a keyword given to ``target`` may reach: a class's ``__init__`` along the MRO while each
    passes ``**kwargs`` on (Lightning's DDPStrategy passes its own to torch's DistributedDataParallel)."""
    from lightning.pytorch.strategies import DDPStrategy

    if not inspect.isclass(target):
        return [target]  # a factory function
    chain = []
    for owner in target.__mro__:
        if owner is object or "__init__" not in vars(owner):
            continue
        init = vars(owner)["__init__"]
        chain.append(init)
        if owner is DDPStrategy:
            chain.append(torch.nn.parallel.DistributedDataParallel.__init__)
            break
        if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(init).parameters.values()):
            break
    return chain


_SET_BY_LIGHTNING = {"module", "device_ids", "output_device", "process_group", "device_mesh"}  # DDP's


@functools.cache
def parameter_rules(target: Callable[..., Any]) -> dict[str, Rule]:
    """Every keyword ``target(...)`` takes -> the values a config may give it (annotation, else the default's type);
    an argument's aliases take what it takes."""
    rules: dict[str, Rule] = {}
    for function in _init_chain(target):
        hints = _hints(function)
        params = list(inspect.signature(function).parameters.items())
        for name, param in params[1:] if inspect.isclass(target) else params:  # [0]: self
            if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL) or name in _SET_BY_LIGHTNING:
                continue
            rule = annotation_rule(hints.get(name, _EMPTY), param.default)
            rules.setdefault(name, rule or refused("not settable from a config (it takes an object)"))
        for alias in getattr(function, "__argument_aliases__", ()):  # the seeds' spellings (lightning_optim.renames)
            if alias.new in rules:
                rules.setdefault(alias.old, rules[alias.new])
    return rules


def named_key(keys: Iterable[str], text: str) -> str | None:
    """The key of ``keys`` that ``text`` names first (as a whole word), if any."""
    found = [(m.start(), k) for k in keys for m in [re.search(rf"(?<![\w.]){re.escape(k)}(?!\w)", text)] if m]
    return min(found)[1] if found else None


def culprit(options: dict[str, Any], build: Callable[[dict[str, Any]], Any], exc: Exception) -> str | None:
    """The key of ``options`` that ``exc`` (raised by ``build(options)``) is about: named in the message,
    else the one whose removal (back to the default) makes ``build`` succeed; else None."""
    keys = [k for k in options if not k.startswith("_")]
    key = named_key(keys, str(exc))
    if key is not None:
        return key
    for key in keys:
        try:
            build({k: v for k, v in options.items() if k != key})
        except Exception:  # noqa: BLE001, S112 - still failing: not this key
            continue
        return key
    return None
