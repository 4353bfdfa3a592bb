"""Check the main job's whole config before anything is built, and name the Hydra key at fault.

Every key of every group has a rule, in one of two places:

- :data:`SCHEMA`, declared here, for the groups the job itself reads (top level, ``scheduler``, ``model``,
  ``data``) and for the ``trainer`` keys whose range the job knows (``devices``, ``max_steps``, ...);
- the constructor's signature, for a ``_target_`` option (optimizer, strategy, precision plugin) and for
  any other ``trainer.*`` key (``+trainer.<arg>``: an argument of ``lightning.Trainer``): the annotation
  gives the type, and the constructor itself, called once on a dummy parameter, checks the range.

A key without a rule is refused as unknown. Then the interplay of groups is checked (heads divide the width,
devices exist, gradient release or a strategy against precision and clipping). Anything wrong raises a
:class:`ConfigError` whose one-line message starts with the full key (``model.n_layer: must be ...``);
the job prints it and exits with status 2 before the Trainer is built, so no other rank ever starts.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import typing
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass
from typing import Any, cast

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from lightning_optim.config_rules import (
    BOOL,
    NULL,
    SECTION,
    TEXT,
    Rule,
    culprit,
    integer,
    is_int,
    named_key,
    number,
    one_of,
    parameter_rules,
    refused,
)
from lightning_optim.onebit import OnebitOptimizer

__all__ = ["ConfigError", "SCHEMA", "check_config", "checked_datamodule", "key_rules", "resolved", "trainer_error"]

GROUPS = ("optimizer", "strategy", "precision", "model", "data", "trainer")
_EMPTY = inspect.Parameter.empty


class ConfigError(ValueError):
    """A config value is wrong; the message starts with its Hydra key."""


_SEED = integer(0, 2**32 - 1)  # seed_everything's (numpy's) range
_DURATION = Rule(lambda v: isinstance(v, str) and re.fullmatch(r"\d+:\d\d:\d\d:\d\d", v) is not None,
                 "a 'DD:HH:MM:SS' duration")
_DEVICE_LIST = Rule(lambda v: isinstance(v, list) and bool(v) and all(is_int(i) and i >= 0 for i in v), "")
_DEVICE_TEXT = Rule(lambda v: isinstance(v, str) and re.fullmatch(r"\d+(,\d+)*,?", v.replace(" ", "")) is not None, "")


def _owned(group: str) -> Rule:
    return refused(f"left to the job (it passes trainer.{group} from the {group} group: use {group}=<option>)")


# ---------------------------------------------------------------------------------------------- schema
# The groups the job reads itself. Every key listed is required in these sections (the shipped options
# set them all); "trainer" keys are optional (lightning.Trainer's defaults) and extended by its signature.
SCHEMA: dict[str, dict[str, Rule]] = {
    "": {"seed": _SEED, "gradient_release": BOOL, "split_weight_decay": BOOL, "scheduler": NULL | SECTION,
         **dict.fromkeys(GROUPS, SECTION)},
    "scheduler": {"warmup_steps": integer(0), "min_lr_ratio": number(0, 1)},
    "model": {"n_layer": integer(1), "n_head": integer(1), "d_model": integer(1), "mlp_ratio": integer(1),
              "dropout": number(0, 1, open_high=True)},
    "data": {"path": NULL | TEXT, "glob": TEXT, "max_bytes": NULL | integer(1),
             "val_fraction": number(0, 1, open_low=True, open_high=True), "seq_len": integer(1),
             "batch_size": integer(1), "val_windows": integer(1), "num_workers": integer(0), "seed": _SEED},
    "trainer": {
        "accelerator": one_of("auto", "cpu", "gpu", "cuda", "mps", "tpu"),
        "devices": Rule((integer(1) | one_of(-1, "auto") | _DEVICE_LIST | _DEVICE_TEXT).test,
                        "an int >= 1, -1 (all), 'auto', a list of device indices or a string such as '0,1'"),
        "num_nodes": integer(1),
        "max_steps": integer(-1),  # -1: no limit (then max_epochs)
        "max_epochs": NULL | integer(-1),
        "min_steps": NULL | integer(0),
        "min_epochs": NULL | integer(0),
        "val_check_interval": NULL | integer(1) | number(0, 1, open_low=True) | _DURATION,
        "check_val_every_n_epoch": NULL | integer(1),
        "limit_val_batches": integer(1) | number(0, 1, open_low=True),  # never 0: the job reports val_loss
        "limit_train_batches": NULL | integer(0) | number(0, 1),
        "num_sanity_val_steps": NULL | integer(-1),
        "log_every_n_steps": NULL | integer(1),
        "gradient_clip_val": NULL | number(0),  # null or 0: no clipping
        "gradient_clip_algorithm": NULL | one_of("norm", "value"),
        "accumulate_grad_batches": integer(1),
        "fast_dev_run": BOOL | integer(0),  # Lightning checks these three after printing its device banner
        "overfit_batches": integer(0) | number(0, 1),
        "reload_dataloaders_every_n_epochs": integer(0),
        "enable_progress_bar": NULL | BOOL,
        "enable_checkpointing": NULL | BOOL,
        "enable_model_summary": NULL | BOOL,
        **{key: _owned(key) for key in ("strategy", "precision")},
        **{key: refused("left to the job") for key in ("plugins", "logger", "callbacks", "default_root_dir")},
    },
}
_REQUIRED_SECTIONS = ("", "scheduler", "model", "data")
_SECTIONS = ("scheduler", *GROUPS)  # keys holding a mapping of their own keys
_HYDRA_RULES = {"_target_": TEXT, "_partial_": BOOL, "_recursive_": BOOL,
                "_convert_": one_of("none", "partial", "object", "all")}


def _required_parameters(cls: Callable[..., Any], partial: bool) -> list[str]:
    params = [p for p in inspect.signature(cls).parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                  p.KEYWORD_ONLY)]
    return [p.name for p in params[1 if partial else 0:] if p.default is _EMPTY]  # a partial gets params later


@functools.cache
def _trainer_rules() -> dict[str, Rule]:
    import lightning

    return {**parameter_rules(lightning.Trainer), **SCHEMA["trainer"]}


def _names(group: str) -> Rule:
    """The ``name`` of a strategy/precision option without ``_target_``: a name Lightning knows."""
    if group == "strategy":
        from lightning.pytorch.strategies import StrategyRegistry

        names = one_of("auto", *StrategyRegistry.available_strategies())
        return Rule(names.test, "'auto' or a name in Lightning's StrategyRegistry (ddp, fsdp, onebit_adam, ...)")
    from lightning.fabric.connector import _PRECISION_INPUT_STR

    return one_of(*(n for n in typing.get_args(_PRECISION_INPUT_STR) if not n.startswith("transformer-engine")))


def _target_class(section: str, options: dict[str, Any]) -> Callable[..., Any]:
    # importlib, not hydra.utils.get_class: that one also logs the failure over several lines
    module, _, name = str(options["_target_"]).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{section}._target_: cannot import {options['_target_']!r} ({exc})") from None


def _section_rules(section: str, options: dict[str, Any]) -> dict[str, Rule]:
    if section in ("scheduler", "model", "data"):
        return SCHEMA[section]
    if section == "trainer":
        return _trainer_rules()
    if "_target_" in options:
        return {**_HYDRA_RULES, **parameter_rules(_target_class(section, options))}
    if section == "optimizer":
        return {"_target_": TEXT}  # always a class
    return {"name": _names(section)}


def key_rules(cfg: dict[str, Any]) -> dict[str, Rule]:
    """The rule of every key ``cfg`` may hold, by its full dotted name (``""`` section: the top level)."""
    rules = dict(SCHEMA[""])
    for section in _SECTIONS:
        options = cfg.get(section)
        if isinstance(options, dict):
            rules.update({f"{section}.{key}": rule for key, rule in _section_rules(section, options).items()})
    return rules


def _check_keys(cfg: dict[str, Any]) -> None:
    """Every key known and of its type and range; the required ones present."""
    rules = key_rules(cfg)
    for key, value in _leaves(cfg):
        if key not in rules:
            raise ConfigError(f"{key}: unknown key ({_valid_keys(key.rpartition('.')[0], rules)})")
        if not rules[key].test(value):
            raise ConfigError(f"{key}: must be {rules[key].says}, got {value!r}")
    _check_required(cfg)


def _check_required(cfg: dict[str, Any]) -> None:
    """The declared keys of the sections the job reads; a constructor's arguments without a default."""
    for section in _REQUIRED_SECTIONS:
        options = cfg if section == "" else cfg.get(section)
        if not isinstance(options, dict):
            continue
        for key in SCHEMA[section]:
            if key not in options:
                raise ConfigError(f"{_join(section, key)}: required, missing (it must be {SCHEMA[section][key].says})")
    for section in ("optimizer", "strategy", "precision"):
        options = cfg[section]
        if "_target_" in options:
            for key in _required_parameters(_target_class(section, options), bool(options.get("_partial_"))):
                if key not in options:
                    raise ConfigError(f"{section}.{key}: required, missing")
        elif "name" not in options:
            raise ConfigError(f"{section}: needs _target_ (a class) or name (a Lightning {section} name)")


def _valid_keys(section: str, rules: dict[str, Rule]) -> str:
    if section == "trainer":
        return "no argument of lightning.Trainer"  # some 50: the list would not help
    names = sorted(k.rpartition(".")[2] for k in rules if k.rpartition(".")[0] == section)
    return f"{section or 'the top level'} takes {', '.join(n for n in names if not n.startswith('_'))}"


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _leaves(cfg: dict[str, Any]) -> Iterable[tuple[str, Any]]:
    """(full key, value) for every key: the top level's first (``data.seed: ${seed}`` is reported as seed),
    then each section's."""
    yield from cfg.items()
    for key, value in cfg.items():
        if key in _SECTIONS and isinstance(value, dict):
            yield from ((f"{key}.{inner}", v) for inner, v in value.items())


# ------------------------------------------------------------------------------ built by the classes
def _check(group: str, options: dict[str, Any], build: Callable[[dict[str, Any]], Any]) -> Any:
    try:
        return build(options)
    except Exception as exc:  # hydra wraps constructor errors in InstantiationException, cause attached
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        if isinstance(cause, (TypeError, ValueError)):
            key = culprit(options, build, cause)
            raise ConfigError(f"{group}.{key}: {cause}" if key else f"{group}: {cause}") from None
        raise


def _optimizer(options: dict[str, Any]) -> torch.optim.Optimizer:
    factory = hydra.utils.instantiate(options)
    return factory([torch.zeros(4, 3, requires_grad=True), torch.zeros(3, requires_grad=True)])


@dataclass
class _Built:
    optimizer: torch.optim.Optimizer
    strategy: Any  # None for a {name: ...} option
    precision: Any  # the plugin, None for a {name: ...} option


def _build(cfg: dict[str, Any]) -> _Built:
    """Each ``_target_`` once, on a dummy parameter: the ranges its constructor checks, by key."""
    optimizer = _check("optimizer", cfg["optimizer"], _optimizer)
    strategy = precision = None
    if "_target_" in cfg["strategy"]:
        strategy = _check("strategy", cfg["strategy"], hydra.utils.instantiate)
        target = getattr(strategy, "optimizer_class", None)
        if target is not None and not isinstance(optimizer, OnebitOptimizer):  # the strategy will convert it
            from lightning_optim.onebit.convert import to_onebit

            try:
                to_onebit(optimizer, target, getattr(strategy, "_knobs", {}))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"optimizer (converted by strategy={cfg['strategy']['_target_']}): {exc}") from None
    if "_target_" in cfg["precision"]:
        precision = _check("precision", cfg["precision"], hydra.utils.instantiate)
    return _Built(optimizer, strategy, precision)


# ----------------------------------------------------------------------------------------- interplay
def _accelerator(trainer: dict[str, Any]) -> str:
    """The accelerator Lightning will pick: auto/gpu resolved on this machine."""
    name = trainer.get("accelerator", "auto")
    if name not in ("auto", "gpu"):
        return name
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu" if name == "auto" else "cuda"


def _devices_exist(cfg: dict[str, Any], built: _Built) -> None:
    from lightning.pytorch.accelerators import AcceleratorRegistry

    trainer = cfg["trainer"]
    name = _accelerator(trainer)
    accelerator = AcceleratorRegistry[name]["accelerator"]
    if not accelerator.is_available():
        raise ConfigError(f"trainer.accelerator: {trainer.get('accelerator')!r} ({name}) is not available on this "
                          "machine; use auto or cpu")
    devices = trainer.get("devices", "auto")
    if devices == "auto":
        return
    if name == "cpu":
        processes = int(devices) if isinstance(devices, str) and devices.isdigit() else devices
        if not (is_int(processes) and processes >= 1):
            raise ConfigError(f"trainer.devices: on CPU must be a number of processes >= 1 or 'auto', got {devices!r}")
        return
    count = accelerator.auto_device_count()
    if isinstance(devices, str):
        devices = [int(i) for i in devices.replace(" ", "").split(",") if i]
    if (is_int(devices) and devices > count) or (isinstance(devices, list) and max(devices) >= count):
        raise ConfigError(f"trainer.devices: {devices!r} asks for more than the {count} {name} device(s) here")


def _heads_divide_width(cfg: dict[str, Any], built: _Built) -> None:
    model = cfg["model"]
    if model["d_model"] % model["n_head"]:
        raise ConfigError(f"model.d_model: must be divisible by model.n_head={model['n_head']} (each head gets "
                          f"d_model / n_head), got {model['d_model']}")


def _validation_is_by_steps(cfg: dict[str, Any], built: _Built) -> None:
    trainer = cfg["trainer"]
    interval = trainer.get("val_check_interval")
    if isinstance(interval, float) and trainer.get("check_val_every_n_epoch", 1) is None:
        raise ConfigError(f"trainer.val_check_interval: must be an int (steps) or a duration while "
                          f"trainer.check_val_every_n_epoch is null, got {interval!r}")


def _scheduler_has_steps(cfg: dict[str, Any], built: _Built) -> None:
    max_steps = cfg["trainer"].get("max_steps", -1)
    if cfg.get("scheduler") and max_steps < 1:
        raise ConfigError(f"trainer.max_steps: the scheduler decays over trainer.max_steps, which must be >= 1 here "
                          f"(got {max_steps!r}); set scheduler=null to train without it")


def _grad_scaler(cfg: dict[str, Any]) -> bool:
    """Whether Lightning will use torch's GradScaler (16-mixed on CUDA; on CPU it runs bf16-mixed)."""
    return cfg["precision"].get("name") == "16-mixed" and _accelerator(cfg["trainer"]) == "cuda"


def _release_conflicts(cfg: dict[str, Any], built: _Built) -> None:
    """``gradient_release``: none of what GradientRelease refuses at fit start, said now."""
    from lightning_optim.lightning._base import _OnebitStrategyMixin
    from lightning_optim.lightning.precision import MasterWeightsPrecision
    from lightning_optim.optim.base import BaseOptimizer

    if not cfg["gradient_release"]:
        return
    clip = cfg["trainer"].get("gradient_clip_val")
    if clip:
        raise ConfigError(f"gradient_release: conflicts with trainer.gradient_clip_val={clip} (each gradient is "
                          "stepped and freed during backward); add trainer.gradient_clip_val=null")
    if cfg["precision"].get("name") == "16-mixed" or isinstance(built.precision, MasterWeightsPrecision):
        raise ConfigError("gradient_release: conflicts with precision (loss scaling checks the whole model before "
                          "stepping); use precision=32-true, bf16-mixed or bf16_kahan")
    if isinstance(built.strategy, _OnebitStrategyMixin):
        raise ConfigError("gradient_release: conflicts with the 1-bit strategy (it communicates the whole model's "
                          "momentum in one step); use strategy=ddp or strategy=auto")
    from lightning.pytorch.strategies import DDPStrategy

    name = cfg["strategy"].get("name", "")
    plain_ddp = built.strategy is None or type(built.strategy) is DDPStrategy  # a name: auto, ddp, ... by Lightning
    if not plain_ddp or name.startswith(("fsdp", "deepspeed", "xla")):
        raise ConfigError(f"gradient_release: conflicts with strategy {cfg['strategy'].get('_target_', name)} (it "
                          "steps inside its own DDP comm hook); use strategy=ddp or strategy=auto")
    if not isinstance(built.optimizer, BaseOptimizer):
        raise ConfigError(f"gradient_release: needs a lightning_optim optimizer, got {cfg['optimizer']['_target_']}")


def _strategy_conflicts(cfg: dict[str, Any], built: _Built) -> None:
    """What the 1-bit and comm-hook strategies refuse at setup (on every rank), said now."""
    from lightning_optim.lightning._base import _OnebitStrategyMixin
    from lightning_optim.lightning._comm_hook_strategies import _CommHookStrategyMixin, _communicates_itself
    from lightning_optim.lightning._ft import _FTDDPMixin

    strategy = built.strategy
    # (DiLoCo's overlap is of its exchange with the next step: clipping the local gradients is untouched)
    if isinstance(strategy, _OnebitStrategyMixin) and cfg["strategy"].get("overlap") and cfg["trainer"].get(
            "gradient_clip_val"):
        raise ConfigError("strategy.overlap: true steps the momentum during backward, before "
                          "trainer.gradient_clip_val could clip; add trainer.gradient_clip_val=null or drop overlap")
    scaler_refused = isinstance(strategy, _OnebitStrategyMixin) or getattr(strategy, "_refuses_grad_scaler", False)
    if scaler_refused and _grad_scaler(cfg):
        raise ConfigError(f"precision: 16-mixed (GradScaler: each rank skips steps alone) conflicts with strategy "
                          f"{cfg['strategy']['_target_']}; use bf16-mixed, 32-true or fp16_master")
    if isinstance(strategy, (_CommHookStrategyMixin, _FTDDPMixin)) and _communicates_itself(built.optimizer):
        raise ConfigError(f"optimizer: {cfg['optimizer']['_target_']} communicates by itself, and strategy "
                          f"{cfg['strategy']['_target_']} already hands it averaged gradients; use a local optimizer")


def _processes_per_node(trainer: dict[str, Any]) -> int | None:
    """The processes Lightning starts on each node for ``trainer.devices`` (None: it cannot tell here)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    accelerator = AcceleratorRegistry[_accelerator(trainer)]["accelerator"]
    devices = trainer.get("devices", "auto")
    try:
        if devices == "auto":
            return int(accelerator.auto_device_count())
        return len(accelerator.get_parallel_devices(accelerator.parse_devices(devices)))
    except Exception:  # noqa: BLE001 - Lightning refuses such devices itself (its message names trainer.devices)
        return None


def _strategy_fits_the_world(cfg: dict[str, Any], built: _Built) -> None:
    """What a strategy refuses for the world it runs on (``check_world``: node sizes, meshes, topologies)."""
    check_world = getattr(built.strategy, "check_world", None)
    per_node = _processes_per_node(cfg["trainer"])
    if check_world is None or per_node is None:
        return
    nodes = cfg["trainer"].get("num_nodes", 1)
    try:
        check_world(per_node, nodes)
    except (TypeError, ValueError) as exc:
        key = named_key([k for k in cfg["strategy"] if not k.startswith("_")], str(exc))
        world = (f"trainer.devices={cfg['trainer'].get('devices', 'auto')!r} x trainer.num_nodes={nodes}: "
                 f"{per_node * nodes} processes")
        raise ConfigError(f"strategy{'.' + key if key else ''}: {exc} [{world}]") from None


_INTERPLAY = (_devices_exist, _heads_divide_width, _validation_is_by_steps, _scheduler_has_steps,
              _release_conflicts, _strategy_conflicts, _strategy_fits_the_world)


def check_config(cfg: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` for the first bad key: unknown, of a wrong type or range, or in conflict."""
    _check_keys(cfg)
    built = _build(cfg)
    for check in _INTERPLAY:
        check(cfg, built)


# ------------------------------------------------------------------------------------------ the job
def resolved(config: DictConfig) -> dict[str, Any]:
    """Plain containers; a missing mandatory value (``???``) or a broken interpolation names its key."""
    try:
        return cast(dict[str, Any], OmegaConf.to_container(config, resolve=True, throw_on_missing=True))  # a dict
    except MissingMandatoryValue as exc:
        raise ConfigError(f"{exc.full_key}: required, no default (set {exc.full_key}=<value>)") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{exc.full_key}: {str(exc).splitlines()[0]}") from None


def checked_datamodule(cfg: dict[str, Any]) -> Any:
    """The data module with its corpus loaded now (Lightning's own ``setup`` then reuses it): a missing path,
    no matching file or too little text names its ``data.*`` key before any rank starts."""
    from lightning_optim.data import ByteDataModule

    datamodule = ByteDataModule(**cfg["data"])
    try:
        datamodule.setup()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{named_key([f'data.{k}' for k in cfg['data']], str(exc)) or 'data.path'}: {exc}") from None
    _interval_fits_an_epoch(cfg, len(cast(Sized, datamodule.train_set)))  # set by setup()
    return datamodule


def _interval_fits_an_epoch(cfg: dict[str, Any], windows: int) -> None:
    """Lightning refuses, at the first epoch, more steps between validations than an epoch has (unless
    validation counts steps across epochs: check_val_every_n_epoch null)."""
    trainer = cfg["trainer"]
    interval, limit = trainer.get("val_check_interval"), trainer.get("limit_train_batches")
    if not is_int(interval) or trainer.get("check_val_every_n_epoch", 1) is None:
        return
    devices = trainer.get("devices")
    world = (devices if is_int(devices) and devices > 0 else 1) * trainer.get("num_nodes", 1)
    batches = -(-windows // world) // cfg["data"]["batch_size"]  # DistributedSampler pads, the loader drops
    if limit is not None:
        batches = min(batches, limit) if is_int(limit) else int(batches * limit)
    if interval > batches:
        raise ConfigError(f"trainer.val_check_interval: {interval} is more than the {batches} training batches of an "
                          "epoch; use a smaller value or trainer.check_val_every_n_epoch=null")


def trainer_error(cfg: dict[str, Any], exc: Exception) -> ConfigError | None:
    """A ConfigError for an error of ``lightning.Trainer(...)`` that names one of its config keys, else None."""
    key = named_key([*cfg["trainer"], "precision", "strategy"], str(exc))
    if key is not None:
        key = key if key in ("precision", "strategy") else f"trainer.{key}"
    else:  # an argument the strategy resolves when the Trainer is built (the ft_* replica id from the environment)
        own = named_key([k for k in cfg["strategy"] if not k.startswith("_")], str(exc))
        key = None if own is None else f"strategy.{own}"
    if key is None:
        return None
    return ConfigError(f"{key}: {' '.join(str(exc).split())}")
