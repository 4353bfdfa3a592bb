"""How an HF ``optim`` name and ``optim_args`` become a lightning-optim optimizer class and its keyword
arguments: :func:`optimizer_cls_and_kwargs`. Shared by ``accel_plugins.hf`` (its TrainingArguments and
Trainer) and ``_hf_register`` (the stock classes); the rules are in ``accel_plugins.hf``'s module doc.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

import torch

from lightning_optim.catalogue import OPTIMIZERS, optimizer_class, optimizer_name
from lightning_optim.config_rules import culprit, parameter_rules

__all__ = ["OPTIM_NAMES", "optimizer_cls_and_kwargs", "parse_optim_args"]

OPTIM_NAMES = tuple(sorted(OPTIMIZERS))


def _split_pairs(text: str) -> list[str]:
    """``a=1,b=(2,3)`` -> ``["a=1", "b=(2,3)"]`` (commas inside brackets stay)."""
    pairs, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            pairs.append(current)
            current = ""
        else:
            current += ch
    pairs.append(current)
    return [p.strip() for p in pairs if p.strip()]


def _value(key: str, text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[lowered]
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        if text.strip().isidentifier():  # a word such as freeze_step=auto, if the argument's rule takes it
            return _Word(text.strip())
        raise ValueError(f"optim_args: {key}={text!r} is not a number, bool, None or tuple") from None


class _Word(str):
    """A bare word of ``optim_args``: taken only where the argument's annotation names it (``"auto"``)."""


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """HF's ``optim_args`` string as typed keyword arguments; a malformed pair or a repeated key raises
    ``ValueError`` naming it (HF's own parser keeps the last of ``lr=1e-3,lr=2`` silently)."""
    out: dict[str, Any] = {}
    for pair in _split_pairs(text or ""):
        key, sep, raw = (part.strip() for part in pair.partition("="))
        if not sep:
            raise ValueError(f"optim_args: {pair!r} is not key=value (no '=')")
        if not key.isidentifier():
            what = f"no valid key ({key!r})" if key else "no key"
            raise ValueError(f"optim_args: {pair!r} has {what} before '='")
        if key in out:
            raise ValueError(f"optim_args: {key} is given twice ({key}={out[key]!r}, then {pair!r}); give it once")
        out[key] = _value(key, raw)
    return out


# where optimizer_cls_and_kwargs takes a keyword from, when optim_args does not set it
_FROM_ARGS = {"lr": "learning_rate", "weight_decay": "weight_decay", "betas": "adam_beta1/adam_beta2",
              "eps": "adam_epsilon"}
_SUPPLIED = ("params", "model_params")  # the Trainer passes the model's parameters


def _check_optim_args(cls: type, extra: dict[str, Any]) -> None:
    """Every key one ``cls`` takes (along the ``**kwargs`` it forwards), every value of its annotated type."""
    rules = parameter_rules(cls)
    unknown = sorted(k for k in extra if k not in rules or k in _SUPPLIED)
    if unknown:
        raise ValueError(f"optim_args: {cls.__name__} takes no {', '.join(unknown)}; its arguments: "
                         f"{', '.join(sorted(set(rules) - set(_SUPPLIED)))}")
    for key, value in list(extra.items()):
        if isinstance(value, _Word):
            value = extra[key] = str(value)  # a plain str from here on (Literal rules compare types)
            if not rules[key].test(value):
                raise ValueError(f"optim_args: {key}={value!r} is not a number, bool, None or tuple")
        if not rules[key].test(value):
            raise ValueError(f"optim_args: {key}={value!r} must be {rules[key].says}")


def _refusal(name: str, cls: type, kwargs: dict[str, Any], extra: dict[str, Any], exc: Exception) -> ValueError:
    """The constructor's error, led by the argument it is about: ``optim_args: key=...`` or the
    TrainingArguments field the value came from."""
    key = culprit(kwargs, lambda options: cls([torch.zeros(2, requires_grad=True)], **options), exc)
    if key in extra:
        return ValueError(f"optim_args: {key}={extra[key]!r}: {exc}")
    if key in _FROM_ARGS:
        return ValueError(f"{_FROM_ARGS[key]} (the {name} optimizer's {key}): {exc}")
    return ValueError(f"optim / optim_args ({name}): {exc}")


def optimizer_cls_and_kwargs(args: Any) -> tuple[type, dict[str, Any]]:
    """``(class, kwargs)`` for ``args.optim`` (one of :data:`OPTIM_NAMES`), from ``args`` (see the module doc);
    pass it to ``transformers.Trainer(optimizer_cls_and_kwargs=...)`` (transformers >= 4.47)."""
    given = getattr(args, "lightning_optim_name", None) or str(getattr(args.optim, "value", args.optim))
    name = optimizer_name(given)  # an old name (signsgd) warns and becomes the new one
    try:
        cls = optimizer_class(name)
    except ValueError as exc:
        raise ValueError(f"optim: {exc}") from None
    signature = inspect.signature(cls).parameters
    accepted = set(signature)
    kwargs: dict[str, Any] = {"lr": args.learning_rate}
    if "weight_decay" in accepted:
        kwargs["weight_decay"] = args.weight_decay
    if "betas" in accepted and len(signature["betas"].default) == 2:  # Adan's three betas: via optim_args
        kwargs["betas"] = (args.adam_beta1, args.adam_beta2)
    if "eps" in accepted:
        kwargs["eps"] = args.adam_epsilon
    if OPTIMIZERS[name].onebit:
        kwargs["average_grads"] = False  # the Trainer's DDP averages the warmup steps (switched off after)
    extra = parse_optim_args(getattr(args, "optim_args", None))
    _check_optim_args(cls, extra)
    kwargs.update(extra)
    try:  # check every value now, by name, on a dummy param (not at the first training step)
        cls([torch.zeros(2, requires_grad=True)], **kwargs)
    except (TypeError, ValueError) as exc:
        raise _refusal(name, cls, kwargs, extra, exc) from None
    return cls, kwargs
