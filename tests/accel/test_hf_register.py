"""accel_plugins.hf.register(): the stock TrainingArguments, HfArgumentParser and Trainer take every
lightning-optim name (HF's own names keep HF's meaning), build the optimizer optimizer_cls_and_kwargs
gives, refuse bad values by name, and refuse to register on a transformers they cannot patch."""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.training_args import OptimizerNames  # noqa: E402

import accel_plugins._hf_register as hf_register  # noqa: E402
import accel_plugins.hf as hf  # noqa: E402
from lightning_optim.catalogue import OPTIMIZER_ALIASES, OPTIMIZERS  # noqa: E402
from tests.accel.test_hf import HYPER  # noqa: E402

HF_NAMES = frozenset(o.value for o in OptimizerNames)  # read before any register()
OURS = sorted(name for name in OPTIMIZERS if name not in HF_NAMES)
OLD_NAMES = sorted(old for old, new in OPTIMIZER_ALIASES.items() if new in OURS)  # signsgd; stableadamw is HF's


@pytest.fixture
def registered():
    names = hf.register()
    yield names
    hf.unregister()  # the other tests see stock transformers


@pytest.fixture
def stock():
    hf.unregister()
    yield
    hf.unregister()  # even where a test registered by mistake


class _Tiny(torch.nn.Module):
    """A weight (decayed) and a bias (not): the Trainer builds two param groups."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}


def _stock_args(tmp_path, **kwargs):
    return transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", **kwargs)


def _stock_optimizer(args):
    return transformers.Trainer(model=_Tiny(), args=args).create_optimizer()


def test_register_adds_every_catalogue_name_hf_does_not_use(registered):
    assert registered == tuple(OURS) and {"sgd", "stable_adamw"} <= HF_NAMES - set(registered)
    assert hf.register() == registered  # idempotent
    assert len(OptimizerNames) == len(HF_NAMES) + len(OURS) + len(OLD_NAMES)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_stock_arguments_and_parser_take_every_name(tmp_path, registered, name):
    args = _stock_args(tmp_path, optim=name, **HYPER)
    assert args.optim is OptimizerNames(name) and args.optim.value == name
    assert args.optim.name.startswith("LIGHTNING_OPTIM_") == (name in registered)  # HF's own member for sgd
    parser = transformers.HfArgumentParser(transformers.TrainingArguments)
    (parsed,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--optim", name])
    assert parsed.optim is args.optim


def test_the_stock_command_line_takes_optim_args(tmp_path, registered):
    argv = ["--output_dir", str(tmp_path), "--optim", "onebit_adam", "--optim_args", "freeze_step=100",
            "--adam_beta2", "0.99"]
    (args,) = transformers.HfArgumentParser(transformers.TrainingArguments).parse_args_into_dataclasses(argv)
    cls, kwargs = hf.optimizer_cls_and_kwargs(args)
    assert cls is OPTIMIZERS["onebit_adam"].cls and kwargs["freeze_step"] == 100 and kwargs["betas"] == (0.9, 0.99)


@pytest.mark.parametrize("name", OURS)
def test_the_stock_trainer_builds_our_optimizer_with_the_same_hyper_parameters(tmp_path, registered, name):
    args = _stock_args(tmp_path, optim=name, **HYPER)
    built = _stock_optimizer(args)
    cls, kwargs = hf.optimizer_cls_and_kwargs(args)
    reference = cls([torch.zeros(2, requires_grad=True)], **kwargs)
    assert type(built) is cls is OPTIMIZERS[name].cls
    want = {k: v for k, v in reference.param_groups[0].items() if k != "params"}
    decayed, plain = ({k: v for k, v in g.items() if k != "params"} for g in built.param_groups)
    assert decayed == want and plain == {**want, "weight_decay": 0.0}  # the Trainer's no-decay group (bias)
    if OPTIMIZERS[name].onebit:
        assert built.average_grads is False


def test_hf_names_keep_their_meaning(tmp_path, registered):
    assert type(_stock_optimizer(_stock_args(tmp_path, optim="adamw_torch"))) is torch.optim.AdamW
    assert type(_stock_optimizer(_stock_args(tmp_path, optim="sgd"))) is torch.optim.SGD
    # our subclass still means ours by sgd, in the stock Trainer too
    ours = hf.TrainingArguments(str(tmp_path), optim="sgd", report_to=[], use_cpu=True)
    assert type(_stock_optimizer(ours)) is OPTIMIZERS["sgd"].cls


def test_a_stock_trainer_run_steps_a_registered_optimizer(tmp_path, registered):
    torch.manual_seed(0)
    model = _Tiny()
    data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(8)]
    args = _stock_args(tmp_path, optim="onebit_adam", optim_args="freeze_step=1", learning_rate=1e-2, max_steps=3,
                       per_device_train_batch_size=4, logging_steps=1)
    before = model.linear.weight.detach().clone()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)) is OPTIMIZERS["onebit_adam"].cls
    assert trainer.onebit_optimizer is getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert trainer._onebit_handle is None  # one process: no DDP to switch
    logged = [row["comm/bytes_sent"] for row in trainer.state.log_history if "loss" in row]
    assert logged == [0.0, 0.0, 0.0]  # the byte logs of accel_plugins.hf.Trainer (nothing sent by one process)
    assert not torch.equal(before, model.linear.weight)


@pytest.mark.parametrize("optim,optim_args,match", [
    ("nope", None, "optim: 'nope' is neither an HF optimizer name nor one of lightning-optim's"),
    ("lion", "momentum=0.9", "optim_args: Lion takes no momentum"),
    ("adamw", "eps=abc", "optim_args: eps='abc' is not a number"),
    ("onebit_adam", "freeze_step=0", "freeze_step"),
])
def test_bad_names_and_optim_args_are_refused_by_name(tmp_path, registered, optim, optim_args, match):
    with pytest.raises(ValueError, match=match):
        _stock_args(tmp_path, optim=optim, optim_args=optim_args)


def test_the_stock_trainer_gets_the_library_trainers_own_methods(registered):
    # the same functions, not copies: DDP switch, per-rank checkpoints and byte logs as accel_plugins.hf.Trainer
    for name in ("__init__", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "log",
                 "onebit_optimizer"):
        assert vars(transformers.Trainer)[name] is vars(hf.Trainer)[name], name
    # which call HF's own methods, once (a class deriving from the patched Trainer does not run them twice)
    assert vars(hf.Trainer)["log"].__wrapped__ is hf_register.HF_METHODS["log"] is not vars(transformers.Trainer)["log"]
    assert "optimizer_cls_and_kwargs" in inspect.signature(transformers.Trainer.__init__).parameters


def test_unregister_restores_stock_transformers(tmp_path, stock):
    stock = vars(transformers.Trainer)["get_optimizer_cls_and_kwargs"]
    methods = {name: vars(transformers.Trainer)[name] for name in hf_register.HF_METHODS}
    hf.register()
    hf.unregister()
    hf.unregister()  # a second call is a no-op
    assert vars(transformers.Trainer)["get_optimizer_cls_and_kwargs"] is stock
    assert {name: vars(transformers.Trainer)[name] for name in hf_register.HF_METHODS} == methods
    assert not hasattr(transformers.Trainer, "onebit_optimizer")
    assert {o.value for o in OptimizerNames} == HF_NAMES
    with pytest.raises(ValueError, match="lion is not a valid OptimizerNames"):
        _stock_args(tmp_path, optim="lion")


def test_an_old_transformers_is_refused_with_the_alternative(monkeypatch, stock):
    monkeypatch.setattr(hf_register, "_installed_version", lambda: "4.46.3")
    with pytest.raises(RuntimeError, match=r"transformers >= 4\.47; transformers 4\.46\.3 .*accel_plugins\.hf\."
                                           r"TrainingArguments"):
        hf.register()
    assert "lion" not in {o.value for o in OptimizerNames}


def test_missing_internals_are_refused_by_name(monkeypatch, stock):
    monkeypatch.delattr(transformers.Trainer, "get_optimizer_cls_and_kwargs")
    with pytest.raises(RuntimeError, match=r"transformers \S+ lacks the staticmethod transformers\.Trainer\."
                                           r"get_optimizer_cls_and_kwargs.*optimizer_cls_and_kwargs"):
        hf.register()
    assert "lion" not in {o.value for o in OptimizerNames}


def test_a_trainer_method_changed_after_import_is_refused_by_name(monkeypatch, stock):
    monkeypatch.setattr(transformers.Trainer, "log", lambda self, logs, *args, **kwargs: None)
    with pytest.raises(RuntimeError, match=r"transformers\.Trainer\.log changed after accel_plugins\.hf was imported"):
        hf.register()
    assert "lion" not in {o.value for o in OptimizerNames}
