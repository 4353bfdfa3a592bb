"""The HF ``optim`` surface takes the old optimizer names (``lightning_optim.catalogue.OPTIMIZER_ALIASES``): one
FutureWarning naming both, then the arguments hold the new name and build its class, with accel_plugins.hf's
TrainingArguments (every old name) and with the stock classes after register() (the old names of the names it
adds; ``stableadamw``'s new name ``stable_adamw`` is HF's own there)."""

from __future__ import annotations

import warnings

import pytest

transformers = pytest.importorskip("transformers")

import accel_plugins.hf as hf  # noqa: E402
from lightning_optim.catalogue import OPTIMIZER_ALIASES, OPTIMIZERS  # noqa: E402


def _future_warnings(build, *args, **kwargs):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = build(*args, **kwargs)
    return out, [str(w.message) for w in record if issubclass(w.category, FutureWarning)
                 and "deprecated name" in str(w.message)]


@pytest.fixture
def registered():
    names = hf.register()
    yield names
    hf.unregister()


@pytest.mark.parametrize("old,new", sorted(OPTIMIZER_ALIASES.items()))
def test_our_arguments_take_an_old_name_as_the_new_one(tmp_path, old, new):
    args, messages = _future_warnings(hf.TrainingArguments, str(tmp_path), optim=old, report_to=[], use_cpu=True)
    assert len(messages) == 1 and f"'{old}'" in messages[0] and f"'{new}'" in messages[0]
    assert args.optim == new and args.lightning_optim_name == new
    (cls, _), again = _future_warnings(hf.optimizer_cls_and_kwargs, args)
    assert cls is OPTIMIZERS[new].cls and again == []  # warned once, at parse time
    parser = transformers.HfArgumentParser(hf.TrainingArguments)
    (parsed,), messages = _future_warnings(parser.parse_args_into_dataclasses,
                                           ["--output_dir", str(tmp_path), "--optim", old, "--use_cpu"])
    assert parsed.optim == new and len(messages) == 1


def test_the_stock_classes_take_the_old_names_of_the_names_registered(tmp_path, registered):
    olds = sorted(old for old, new in OPTIMIZER_ALIASES.items() if new in registered)
    assert olds == ["signsgd"]
    for old in olds:
        new = OPTIMIZER_ALIASES[old]
        args, messages = _future_warnings(transformers.TrainingArguments, str(tmp_path), optim=old, report_to=[],
                                          use_cpu=True)
        assert len(messages) == 1 and args.optim.value == new
        assert transformers.Trainer.get_optimizer_cls_and_kwargs(args)[0] is OPTIMIZERS[new].cls
        parser = transformers.HfArgumentParser(transformers.TrainingArguments)
        (parsed,), messages = _future_warnings(parser.parse_args_into_dataclasses,
                                               ["--output_dir", str(tmp_path), "--optim", old, "--use_cpu"])
        assert parsed.optim.value == new and len(messages) == 1
    with pytest.raises(ValueError, match="stableadamw"):  # stable_adamw is HF's there: no old name of ours
        transformers.TrainingArguments(str(tmp_path), optim="stableadamw", report_to=[], use_cpu=True)


def test_unregister_takes_the_old_names_back(tmp_path):
    hf.register()
    hf.unregister()
    with pytest.raises(ValueError):
        transformers.TrainingArguments(str(tmp_path), optim="signsgd", report_to=[], use_cpu=True)
