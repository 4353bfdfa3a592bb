"""Probe sweep of the HF route's ``optim_args`` parser: malformed strings (a repeated key, an empty key, a
pair without '=', an invalid name, a value that is no literal), a key the chosen optimizer does not take and
a value of the wrong type or range are refused with a ValueError naming the key (or the pair), for every
optimizer name: through ``accel_plugins.hf.TrainingArguments`` and through the stock, ``register()``-ed
``transformers.TrainingArguments``."""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import accel_plugins.hf as hf  # noqa: E402
from accel_plugins.hf import OPTIM_NAMES, TrainingArguments, parse_optim_args  # noqa: E402
from lightning_optim.catalogue import OPTIMIZERS  # noqa: E402
from lightning_optim.config_rules import parameter_rules  # noqa: E402

HF_NAMES = frozenset(o.value for o in transformers.training_args.OptimizerNames)
OURS = sorted(name for name in OPTIMIZERS if name not in HF_NAMES)  # what register() adds to the stock classes

# (optim_args, what the message says): the same for every optimizer (the string is refused before the class is asked)
MALFORMED = [
    ("lr=1e-3,lr=2", "optim_args: lr is given twice (lr=0.001, then 'lr=2'); give it once"),
    ("lr=1e-3, lr = 1e-3", "optim_args: lr is given twice"),  # even with the same value
    ("=1", "optim_args: '=1' has no key before '='"),
    ("lr=1e-3, =2", "optim_args: '=2' has no key before '='"),
    ("lr", "optim_args: 'lr' is not key=value (no '=')"),
    ("lr=1e-3,eps", "optim_args: 'eps' is not key=value (no '=')"),
    ("1x=3", "optim_args: '1x=3' has no valid key ('1x') before '='"),
    ("a.b=3", "optim_args: 'a.b=3' has no valid key ('a.b') before '='"),
    ("lr=", "optim_args: lr='' is not a number"),
    ("lr=(1e-3", "optim_args: lr='(1e-3' is not a number"),
]
# a bare word parses (freeze_step=auto), and is refused where the argument's annotation does not name it
WORDS = [("lr=abc", "optim_args: lr='abc' is not a number")]


def _build(route: str, name: str, optim_args: str) -> None:
    if route == "ours":
        TrainingArguments("/tmp/unused", optim=name, optim_args=optim_args, report_to=[], use_cpu=True)
    else:
        transformers.TrainingArguments("/tmp/unused", optim=name, optim_args=optim_args, report_to=[], use_cpu=True)


@pytest.fixture
def registered():
    hf.register()
    yield
    hf.unregister()  # the other tests see stock transformers


@pytest.mark.parametrize("text,says", MALFORMED)
def test_the_parser_refuses_malformed_strings_naming_the_key(text, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_optim_args(text)


def test_what_the_parser_still_takes():
    assert parse_optim_args("lr=1e-3,") == {"lr": 1e-3}  # a trailing comma
    assert parse_optim_args(" betas = (0.9, 0.99) , kahan_sum = false ") == {"betas": (0.9, 0.99), "kahan_sum": False}
    assert parse_optim_args(None) == parse_optim_args("") == {}
    assert parse_optim_args("freeze_step=auto") == {"freeze_step": "auto"}


def test_a_word_is_taken_where_the_annotation_names_it():
    args = TrainingArguments("/tmp/unused", optim="onebit_adam", optim_args="freeze_step=auto,auto_freeze_window=5",
                             report_to=[], use_cpu=True)
    cls, kwargs = hf.optimizer_cls_and_kwargs(args)
    assert kwargs["freeze_step"] == "auto" and type(kwargs["freeze_step"]) is str and kwargs["auto_freeze_window"] == 5
    assert cls([torch.zeros(2, requires_grad=True)], **kwargs).auto_freeze


def _wrong_type(rule_test) -> str:
    """A literal the parameter's annotated type refuses; a dict where it takes anything (its constructor must)."""
    return next((v for v in ("{'a': 1}", "'zzz'") if not rule_test(eval(v))), "{'a': 1}")  # noqa: S307 - ours


def _probes(name: str) -> list[tuple[str, str]]:
    """(optim_args, what the message must say) for one optimizer: malformed, unknown, wrong type, bad range."""
    cls = OPTIMIZERS[name].cls
    rules = {k: r for k, r in parameter_rules(cls).items() if k not in ("params", "model_params")}
    probes = [(text, says) for text, says in MALFORMED + WORDS]
    probes += [("not_an_argument=1", f"optim_args: {cls.__name__} takes no not_an_argument; its arguments: "),
               ("params=1", f"optim_args: {cls.__name__} takes no params"),
               ("lr=-1", "optim_args: lr=-1: ")]  # the constructor's range, led by the key
    for key, rule in rules.items():  # every argument the class takes
        value = _wrong_type(rule.test)
        probes.append((f"{key}={value}", f"optim_args: {key}="))
    return probes


@pytest.mark.parametrize("name", OPTIM_NAMES)
def test_every_name_refuses_bad_optim_args_naming_the_key(name):
    for text, says in _probes(name):
        with pytest.raises(ValueError) as info:
            _build("ours", name, text)
        assert says in str(info.value), (name, text, str(info.value))


@pytest.mark.parametrize("name", OURS)
def test_the_registered_stock_arguments_refuse_the_same(registered, name):
    for text, says in _probes(name):
        with pytest.raises(ValueError) as info:
            _build("stock", name, text)
        assert says in str(info.value), (name, text, str(info.value))


def test_a_bad_training_argument_is_named_as_such(tmp_path):
    with pytest.raises(ValueError, match=r"^learning_rate \(the lion optimizer's lr\): "):
        TrainingArguments(str(tmp_path), optim="lion", learning_rate=-1.0, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=r"^adam_beta1/adam_beta2 \(the adamw optimizer's betas\): "):
        TrainingArguments(str(tmp_path), optim="adamw", adam_beta1=1.5, report_to=[], use_cpu=True)


def test_open_keyword_classes_are_checked_along_what_they_forward():
    """AdamW(**kwargs), FusedAdam(**flags): the keys Adam takes pass, others are refused up front."""
    for name in ("adamw", "fused_adam", "cpu_adam", "fused_sgd"):
        cls, kwargs = hf.optimizer_cls_and_kwargs(TrainingArguments("/tmp/unused", optim=name, report_to=[],
                                                                    optim_args="kahan_sum=False", use_cpu=True))
        assert kwargs["kahan_sum"] is False
        with pytest.raises(ValueError, match=rf"^optim_args: {cls.__name__} takes no typo; its arguments: .*kahan_sum"):
            _build("ours", name, "typo=1")
