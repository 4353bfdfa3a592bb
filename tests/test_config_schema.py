"""Probe sweep of the main job's up-front config check (lightning_optim.config_check).

Every key of every config group x bad values (wrong type, out of range, missing, unknown) is refused with a
one-line message that starts with the key; every key the shipped options hold has a rule (so a new key
cannot slip through without one); a few real runs of the job exit with status 2, one line on stderr and
nothing started. Base configs are composed with Hydra's compose API once per option; each probe is a
command-line override parsed by Hydra's own override parser and applied to a copy.
"""

from __future__ import annotations

import copy
import functools
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from lightning_optim.conf_dir import ALIASES, conf_dir
from lightning_optim.config_check import (
    SCHEMA,
    ConfigError,
    check_config,
    checked_datamodule,
    key_rules,
    resolved,
    trainer_error,
)
from tests.distributed import run_cli

CONF = conf_dir()
README = Path(__file__).resolve().parents[1] / "README.md"
GROUPS = ("optimizer", "strategy", "precision", "model", "data", "trainer")
TARGET_GROUPS = ("optimizer", "strategy", "precision")
PLAIN_SECTIONS = ("", "scheduler", "model", "data")  # the job reads these itself: declared rules only
PARSER = OverridesParser.create()


def options(group: str) -> list[str]:
    names = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    return [n for n in names if n not in ALIASES.get(group, {})]  # a deprecated name: the same config as the new one


def pairing(group: str, option: str) -> tuple[str, ...]:
    """What an option needs beside it to be valid as shipped."""
    if group in ("optimizer", "precision"):
        return ("strategy=auto",)  # not every optimizer converts to 1-bit Adam
    if group == "strategy" and option == "onebit_lamb":
        return ("optimizer=fused_lamb",)
    if group == "data" and option == "text":
        return (f"data.path={README}",)
    return ()


@functools.cache
def _composed(overrides: tuple[str, ...]) -> dict[str, Any]:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return resolved(compose(config_name="train", overrides=list(overrides)))


def composed(*overrides: str) -> dict[str, Any]:
    return copy.deepcopy(_composed(overrides))


def override(cfg: dict[str, Any], text: str) -> dict[str, Any]:
    """``cfg`` with one command-line override applied, its value typed as Hydra types it."""
    (parsed,) = PARSER.parse_overrides([text])
    section, _, key = parsed.key_or_group.rpartition(".")
    target = cfg[section] if section else cfg
    if parsed.is_delete():
        del target[key]
    else:
        target[key] = parsed.value()
    return cfg


def refusal(cfg: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        check_config(cfg)
    message = str(info.value)
    assert "\n" not in message, message  # one line
    return message


def leaf_keys(cfg: dict[str, Any]) -> list[str]:
    """Every key of the composed config: the top level's, and each group's (and scheduler's) own."""
    keys = list(cfg)
    for section in ("scheduler", *GROUPS):
        if isinstance(cfg.get(section), dict):
            keys += [f"{section}.{key}" for key in cfg[section]]
    return keys


ALL_OPTIONS = [(group, option) for group in GROUPS for option in options(group)]


# ----------------------------------------------------------------------------------------- coverage
@pytest.mark.parametrize("group,option", ALL_OPTIONS)
def test_every_key_of_every_option_has_a_rule(group, option):
    cfg = composed(f"{group}={option}", *pairing(group, option))
    check_config(cfg)  # valid as shipped
    rules = key_rules(cfg)
    for key in leaf_keys(cfg):
        section, _, name = key.rpartition(".")
        assert key in rules, f"{group}={option}: {key} has no rule (add it to config_check.SCHEMA)"
        if section in PLAIN_SECTIONS or section == "trainer":  # a range the job declares, not just a type
            assert name in SCHEMA[section], f"{key} is in conf/ but not declared in config_check.SCHEMA"


def test_a_key_without_a_rule_is_refused(monkeypatch):
    """The mechanism the coverage test relies on: drop a declared rule and the shipped config fails."""
    monkeypatch.setitem(SCHEMA, "model", {k: v for k, v in SCHEMA["model"].items() if k != "dropout"})
    message = refusal(composed())
    assert message.startswith("model.dropout: unknown key (model takes d_model, mlp_ratio, n_head, n_layer)")


def test_the_override_parser_types_values_as_compose_does():
    for text in ("model.n_layer=abc", "trainer.devices=[0,1]", "+trainer.benchmark=true", "~model.n_head",
                 "scheduler.min_lr_ratio=nan", "data.glob=''"):
        assert composed(text).keys() == override(composed(), text).keys()
        assert str(composed(text)) == str(override(composed(), text)), text


# ------------------------------------------------------------------- declared keys x bad values
# Each declared key, as a user would type it: wrong type, out of range, null where not allowed.
INTS_FROM_1 = ["0", "-1", "1.5", "abc", "true", "null", "[1]"]
BAD: dict[str, list[str]] = {
    "seed": ["-1", "4294967296", "1.5", "abc", "true", "null"],
    "gradient_release": ["1", "yes", "null"],
    "split_weight_decay": ["0", "no", "null"],
    "scheduler": ["5", "abc", "[1]"],
    "optimizer": ["5"], "strategy": ["5"], "precision": ["5"], "model": ["5"], "data": ["5"], "trainer": ["5"],
    "scheduler.warmup_steps": ["-1", "1.5", "abc", "true", "null"],
    "scheduler.min_lr_ratio": ["-0.1", "1.5", "nan", "inf", "abc", "null"],
    "model.n_layer": INTS_FROM_1, "model.n_head": INTS_FROM_1, "model.d_model": INTS_FROM_1,
    "model.mlp_ratio": INTS_FROM_1,
    "model.dropout": ["-0.1", "1.0", "nan", "abc", "null"],
    "data.path": ["5", "''", "[a]", "true"],
    "data.glob": ["5", "''", "null"],
    "data.max_bytes": ["0", "-1", "1.5", "abc"],
    "data.val_fraction": ["0", "1", "-0.5", "1.5", "nan", "abc", "null"],
    "data.seq_len": INTS_FROM_1, "data.batch_size": INTS_FROM_1, "data.val_windows": INTS_FROM_1,
    "data.num_workers": ["-1", "1.5", "abc", "null"],
    "data.seed": ["-1", "1.5", "abc", "null"],
    "trainer.accelerator": ["abc", "5", "null"],
    "trainer.devices": ["0", "-2", "1.5", "abc", "[]", "[-1]", "true", "null"],
    "trainer.num_nodes": ["0", "1.5", "abc"],
    "trainer.max_steps": ["-2", "1.5", "abc", "null"],
    "trainer.max_epochs": ["-2", "1.5", "abc"],
    "trainer.min_steps": ["-1", "abc"], "trainer.min_epochs": ["-1", "abc"],
    "trainer.val_check_interval": ["0", "-1", "1.5", "abc", "true"],
    "trainer.check_val_every_n_epoch": ["0", "-1", "1.5", "abc"],
    "trainer.limit_val_batches": ["0", "0.0", "-1", "1.5", "abc", "null"],
    "trainer.limit_train_batches": ["-1", "1.5", "abc"],
    "trainer.num_sanity_val_steps": ["-2", "abc"],
    "trainer.log_every_n_steps": ["0", "-1", "abc"],
    "trainer.gradient_clip_val": ["-1", "-0.5", "nan", "abc", "true"],
    "trainer.gradient_clip_algorithm": ["abc", "5"],
    "trainer.accumulate_grad_batches": ["0", "-1", "1.5", "abc", "null"],
    "trainer.enable_progress_bar": ["1", "abc"], "trainer.enable_checkpointing": ["1", "abc"],
    "trainer.enable_model_summary": ["1", "abc"],
    "trainer.fast_dev_run": ["-1", "1.5", "abc"],
    "trainer.overfit_batches": ["-1", "1.5", "abc"],
    "trainer.reload_dataloaders_every_n_epochs": ["-1", "abc"],
    # set by the job from their own groups: refused whatever the value
    "trainer.strategy": ["ddp"], "trainer.precision": ["bf16-mixed"], "trainer.plugins": ["null"],
    "trainer.logger": ["false"], "trainer.callbacks": ["null"], "trainer.default_root_dir": ["out"],
}


def test_every_declared_key_has_probes():
    declared = {f"{section}.{key}" if section else key for section, keys in SCHEMA.items() for key in keys}
    assert declared == set(BAD), f"probes missing: {sorted(declared - set(BAD))}, stale: {sorted(set(BAD) - declared)}"


@pytest.mark.parametrize("key", sorted(BAD))
def test_bad_values_are_refused_naming_the_key(key):
    base = composed()
    section, _, name = key.rpartition(".")
    plus = "" if name in (base[section] if section else base) else "+"  # a Trainer argument conf/ does not set
    for value in BAD[key]:
        message = refusal(override(composed(), f"{plus}{key}={value}"))
        assert message.startswith(f"{key}: "), (key, value, message)


REQUIRED = [f"{section}.{key}" if section else key for section in PLAIN_SECTIONS for key in SCHEMA[section]]


@pytest.mark.parametrize("key", REQUIRED)
def test_a_missing_key_is_refused_naming_it(key):
    assert refusal(override(composed(), f"~{key}")).startswith(f"{key}: required, missing")


def test_a_mandatory_value_left_unset_names_its_key():
    with pytest.raises(ConfigError, match=r"^data\.path: required, no default \(set data\.path=<value>\)$"):
        _composed(("data=text",))


@pytest.mark.parametrize("section", ["", "scheduler", "model", "data", "optimizer", "strategy", "precision"])
def test_an_unknown_key_is_refused_naming_it(section):
    key = f"{section}.typo" if section else "typo"
    for option in options(section) if section in GROUPS else [None]:
        cfg = composed(*((f"{section}={option}", *pairing(section, option)) if option else ()))
        assert refusal(override(cfg, f"+{key}=1")).startswith(f"{key}: unknown key ("), option


def test_trainer_takes_lightning_trainer_arguments_by_their_signature():
    for good in ("+trainer.deterministic=true", "+trainer.deterministic=warn", "+trainer.benchmark=false",
                 "+trainer.max_time=00:00:10:00", "+trainer.accumulate_grad_batches=2",
                 "+trainer.inference_mode=false"):
        check_config(override(composed(), good))
    for bad, key in (("+trainer.typo=1", "trainer.typo: unknown key (no argument of lightning.Trainer)"),
                     ("+trainer.deterministic=maybe", "trainer.deterministic: must be "),
                     ("+trainer.benchmark=1", "trainer.benchmark: must be "),
                     ("+trainer.sync_batchnorm=yes", "trainer.sync_batchnorm: must be "),
                     ("+trainer.max_time=5", "trainer.max_time: must be ")):
        assert refusal(override(composed(), bad)).startswith(key), bad


# ------------------------------------------------------------- constructor keys x wrong types
def _wrong_values(rule_accepts_text: bool) -> list[str]:
    return ["{a: 1}"] if rule_accepts_text else ["abc", "{a: 1}"]


@pytest.mark.parametrize("group,option", [(g, o) for g, o in ALL_OPTIONS if g in TARGET_GROUPS])
def test_every_constructor_key_refuses_a_wrong_type_naming_it(group, option):
    base = composed(f"{group}={option}", *pairing(group, option))
    rules = key_rules(base)
    for name in [k for k in base[group] if not k.startswith("_")]:
        key = f"{group}.{name}"
        for value in _wrong_values(rules[key].test("abc")):
            cfg = override(copy.deepcopy(base), f"{key}={value}")
            assert refusal(cfg).startswith(f"{key}: "), (option, key, value)


# ----------------------------------------------------------------------------------- interplay
@pytest.mark.parametrize("overrides,start", [
    (("model.d_model=130",), "model.d_model: must be divisible by model.n_head=4"),
    (("trainer.val_check_interval=0.5",), "trainer.val_check_interval: must be an int (steps) or a duration"),
    (("trainer.devices=-1",), "trainer.devices: on CPU must be a number of processes"),
    (("trainer.devices=[0,1]",), "trainer.devices: on CPU must be a number of processes"),
    (("trainer.max_steps=0",), "trainer.max_steps: the scheduler decays over trainer.max_steps"),
    (("strategy.overlap=true",), "strategy.overlap: true steps the momentum during backward"),
    (("strategy=topk", "optimizer=onebit_adam"), "optimizer: lightning_optim.onebit.OnebitAdam communicates by itself"),
    (("gradient_release=true", "strategy=topk", "trainer.gradient_clip_val=null"),
     "gradient_release: conflicts with strategy"),
    (("gradient_release=true", "strategy=ddp", "trainer.gradient_clip_val=null", "optimizer=torch_adamw"),
     "gradient_release: needs a lightning_optim optimizer"),
    (("gradient_release=true", "strategy=auto", "strategy.name=fsdp", "trainer.gradient_clip_val=null"),
     "gradient_release: conflicts with strategy fsdp"),
])
def test_conflicting_groups_are_refused_naming_a_key(overrides, start):
    assert refusal(composed(*overrides)).startswith(start)


def test_an_accelerator_this_machine_lacks_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert refusal(composed("trainer.accelerator=gpu")).startswith("trainer.accelerator: 'gpu' (cuda) is not available")


def test_cuda_corners_with_one_pretended_gpu(monkeypatch):
    """The CUDA branches (no GPU here): a device index past the count, and 16-mixed's GradScaler with a
    strategy whose ranks must step together."""
    import torch
    from lightning.pytorch.accelerators import CUDAAccelerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(CUDAAccelerator, "auto_device_count", staticmethod(lambda: 1))
    check_config(composed("strategy=auto", "trainer.accelerator=gpu", "trainer.devices=1"))
    for devices in ("2", "[1]", "'0,1'"):
        message = refusal(composed("trainer.accelerator=gpu", f"trainer.devices={devices}"))
        assert message.startswith("trainer.devices: ") and "more than the 1 cuda device(s)" in message, message
    assert refusal(composed("precision=16-mixed", "trainer.devices=1")).startswith(
        "precision: 16-mixed (GradScaler: each rank skips steps alone) conflicts with strategy")
    check_config(composed("precision=16-mixed", "strategy=ddp", "trainer.devices=1"))  # plain DDP: fine


def test_the_valid_corners_pass():
    for overrides in (("trainer.gradient_clip_val=0",), ("trainer.gradient_clip_val=null",),
                      ("trainer.max_steps=0", "scheduler=null"), ("trainer.devices=auto",), ("trainer.devices='2'",),
                      ("trainer.check_val_every_n_epoch=1", "trainer.val_check_interval=0.5"),
                      ("trainer.val_check_interval=00:00:05:00",), ("model.dropout=0.5",), ("data.max_bytes=null",),
                      ("gradient_release=true", "strategy=ddp", "trainer.gradient_clip_val=null"),
                      ("strategy=decentralized", "strategy.neighbors=[[1],[0]]")):
        check_config(composed(*overrides))


# -------------------------------------------------------------------------- data and Lightning
def test_the_corpus_is_checked_before_any_rank_starts(text_folder: Path, tmp_path: Path):
    def data_error(*overrides: str) -> str:
        cfg = composed(*overrides)
        check_config(cfg)  # each of these passes the key rules: only the corpus tells
        with pytest.raises(ConfigError) as info:
            checked_datamodule(cfg)
        return str(info.value)

    assert data_error(f"data.path={tmp_path / 'nope'}").startswith("data.path: data.path=")
    assert data_error(f"data.path={text_folder}", "data.glob=*.nothing").startswith("data.path: ")
    assert data_error(f"data.path={text_folder / 'doc0.txt'}", "data.seq_len=4096").startswith("data.seq_len: ")
    small = ("data=text", f"data.path={text_folder}", "data.seq_len=16", "data.batch_size=4",
             "trainer.check_val_every_n_epoch=1")
    assert data_error(*small, "trainer.val_check_interval=1000").startswith(
        "trainer.val_check_interval: 1000 is more than the ")
    assert len(checked_datamodule(composed(*small, "trainer.val_check_interval=5")).train_set) > 20


def test_a_lightning_trainer_refusal_names_its_key(tmp_path: Path):
    """What no rule knows (a profiler name) Lightning refuses when the Trainer is built: still one key."""
    from lightning_optim.train import build_trainer

    cfg = composed("strategy=auto", "trainer.devices=1", "+trainer.profiler=nope")
    check_config(cfg)
    with pytest.raises(Exception) as info:
        build_trainer(cfg, tmp_path, callbacks=[])
    assert str(trainer_error(cfg, info.value)).startswith("trainer.profiler: ")
    assert trainer_error(cfg, RuntimeError("something else")) is None  # not a config problem: re-raised


# -------------------------------------------------------------------------------- the real job
def _job(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_cli(["hydra.run.dir=run", *overrides], cwd=cwd, timeout=300)


@pytest.mark.parametrize("overrides,message", [
    # the defaults: 1-bit Adam on 2 processes; nothing may start, and the error is printed once
    (("trainer.gradient_clip_val=-1",), "trainer.gradient_clip_val: must be null or a number >= 0, got -1"),
    (("+model.n_layers=2",), "model.n_layers: unknown key (model takes d_model, dropout, mlp_ratio, n_head, n_layer)"),
    (("data.path=missing.txt",), "data.path: data.path='missing.txt' does not exist"),
])
def test_the_job_exits_2_with_one_line_before_anything_starts(tmp_path, overrides, message):
    done = _job(*overrides, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == f"lightning-optim: bad config value: {message}", done.stderr[-3000:]
    assert done.stdout == ""  # no Lightning banner: no Trainer was built
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == [".hydra", "train.log"]  # Hydra's own files only
