"""accel_plugins.hf: every lightning-optim name through the HF Trainer's ``optim`` argument, with the
hyper-parameters of TrainingArguments and typed ``optim_args``, parsed from a real command line;
bad names and values are refused by name; a Trainer run builds and steps the named optimizer."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("transformers")

from transformers import HfArgumentParser  # noqa: E402

from accel_plugins.hf import OPTIM_NAMES, Trainer, TrainingArguments, optimizer_cls_and_kwargs, parse_optim_args  # noqa: E402
from lightning_optim.catalogue import OPTIMIZERS  # noqa: E402

HYPER = dict(learning_rate=0.0123, weight_decay=0.02, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7)


@pytest.mark.parametrize("name", OPTIM_NAMES)
def test_every_name_builds_its_optimizer_with_the_training_arguments(tmp_path, name):
    args = TrainingArguments(str(tmp_path), optim=name, **HYPER)
    cls, kwargs = optimizer_cls_and_kwargs(args)
    assert cls is OPTIMIZERS[name].cls and args.optim == name
    group = cls([torch.zeros(3, requires_grad=True)], **kwargs).param_groups[0]
    accepted = inspect.signature(cls).parameters
    assert group["lr"] == 0.0123
    if "weight_decay" in accepted:
        assert group["weight_decay"] == 0.02
    if "betas" in accepted:  # two betas from adam_beta1/2; Adan keeps its three defaults
        want = (0.8, 0.95) if len(accepted["betas"].default) == 2 else accepted["betas"].default
        assert tuple(group["betas"]) == tuple(want)
    if "eps" in accepted:
        assert group["eps"] == 1e-7


def test_optim_args_are_typed():
    parsed = parse_optim_args("freeze_step=100, kahan_sum=False,betas=(0.9,0.99),eps=1e-6,foreach=none,x=True")
    assert parsed == {"freeze_step": 100, "kahan_sum": False, "betas": (0.9, 0.99), "eps": 1e-6, "foreach": None,
                      "x": True}
    assert type(parsed["freeze_step"]) is int and parsed["kahan_sum"] is False


def test_the_command_line_takes_our_names():
    argv = ["--output_dir", "/tmp/unused", "--optim", "onebit_adam", "--optim_args", "freeze_step=100,kahan_sum=False",
            "--learning_rate", "1e-3", "--adam_beta2", "0.99"]
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
    cls, kwargs = optimizer_cls_and_kwargs(args)
    assert cls.__name__ == "OnebitAdam"
    assert kwargs["freeze_step"] == 100 and kwargs["kahan_sum"] is False and kwargs["betas"] == (0.9, 0.99)
    (stock,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(["--output_dir", "/tmp/u", "--optim",
                                                                                "adamw_torch"])
    assert stock.lightning_optim_name is None  # HF's own names keep their meaning


@pytest.mark.parametrize("optim,optim_args,match", [
    ("nope", None, "optim: 'nope' is neither an HF optimizer name nor one of lightning-optim's"),
    ("onebit_adam", "freeze_step=0", "freeze_step"),
    ("lion", "momentum=0.9", "optim_args: Lion takes no momentum"),
    ("lion", "kahan_sum", "optim_args: 'kahan_sum' is not key=value"),
    ("adamw", "eps=abc", "optim_args: eps='abc' is not a number"),
    ("lamb", "betas=(0.9,)", "betas"),
])
def test_bad_names_and_optim_args_are_refused_by_name(tmp_path, optim, optim_args, match):
    with pytest.raises(ValueError, match=match):
        TrainingArguments(str(tmp_path), optim=optim, optim_args=optim_args)


def test_a_trainer_run_steps_the_named_optimizer(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    data = [{"input_ids": torch.randint(0, 256, (16,)), "labels": torch.randint(0, 256, (16,))} for _ in range(8)]
    args = TrainingArguments(str(tmp_path), optim="lion", optim_args="kahan_sum=False", learning_rate=1e-3,
                             max_steps=2, per_device_train_batch_size=4, report_to=[], save_strategy="no",
                             use_cpu=True)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer).__name__ == "Lion"
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
