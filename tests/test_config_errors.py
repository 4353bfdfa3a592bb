"""Probe: a bad value in any optimizer or strategy option of the main job is reported before anything
trains, with its full Hydra key; a zero-step run is valid."""

from __future__ import annotations

import re
import subprocess

import pytest
from omegaconf import OmegaConf

from lightning_optim.conf_dir import OPTIMIZER_ALIASES, STRATEGY_ALIASES, conf_dir
from lightning_optim.config_check import ConfigError, check_config
from tests.distributed import run_cli

CONF = conf_dir()
# A deprecated alias composes to its target's config (tests/test_configs.py): checked once, by its new name.
OPTIMIZERS = sorted(p.stem for p in (CONF / "optimizer").glob("*.yaml") if p.stem not in OPTIMIZER_ALIASES)
STRATEGIES = sorted(p.name[:-5] for p in (CONF / "strategy").iterdir()
                    if p.name.endswith(".yaml") and p.name[:-5] not in STRATEGY_ALIASES)
BAD = ["abc", float("nan"), -1.0]


def _numeric_fields(options: dict) -> list[str]:
    return [k for k, v in options.items() if not k.startswith("_") and not isinstance(v, bool)
            and isinstance(v, (int, float))]


def _cases():
    for option in OPTIMIZERS:
        yield "optimizer", option
    for option in STRATEGIES:
        yield "strategy", option


def _compose(compose_train, group: str, option: str) -> dict:
    if group == "optimizer":
        other = "strategy=auto"
    else:  # an optimizer the strategy converts
        other = "optimizer=fused_lamb" if option == "onebit_lamb" else "optimizer=adamw"
    return OmegaConf.to_container(compose_train(f"{group}={option}", other), resolve=True)


@pytest.mark.parametrize("group,option", list(_cases()))
def test_every_numeric_field_is_checked_up_front_with_its_key(compose_train, group, option):
    base = _compose(compose_train, group, option)
    check_config(base)  # the option as shipped is valid
    options = base[group] if group == "optimizer" else base["strategy"]
    fields = _numeric_fields(options)
    if group == "optimizer":
        assert "lr" in fields, option
    for field in fields:
        for bad in BAD:  # none of the shipped numeric fields admits a string, NaN or a negative value
            cfg = _compose(compose_train, group, option)
            cfg[group][field] = bad
            with pytest.raises(ConfigError) as info:
                check_config(cfg)
            assert str(info.value).startswith(f"{group}.{field}: "), (option, field, bad, str(info.value))


def test_scheduler_and_steps(compose_train):
    cfg = OmegaConf.to_container(compose_train("strategy=auto", "trainer.max_steps=0"), resolve=True)
    with pytest.raises(ConfigError, match=r"^trainer.max_steps: .* set scheduler=null"):
        check_config(cfg)
    cfg["scheduler"] = None
    check_config(cfg)  # a zero-step run without a scheduler is valid
    for key, bad in (("warmup_steps", -3), ("min_lr_ratio", 1.5), ("warmup_steps", "x")):
        cfg = OmegaConf.to_container(compose_train("strategy=auto"), resolve=True)
        cfg["scheduler"][key] = bad
        with pytest.raises(ConfigError, match=rf"^scheduler.{key}: "):
            check_config(cfg)


def _job(*overrides: str, cwd) -> subprocess.CompletedProcess:
    return run_cli(["trainer=smoke", *overrides], cwd=cwd, timeout=300)


REFUSED = [  # (overrides, the key the refusal names): each refused by the up-front check, before anything trains
    (("optimizer.lr=-1",), "optimizer.lr"),
    (("strategy.freeze_step=0",), "strategy.freeze_step"),
    (("optimizer=torch_adamw", "optimizer.eps=-1"), "optimizer.eps"),
    (("gradient_release=true", "strategy=ddp", "trainer.gradient_clip_val=1.0"), "gradient_release"),  # explicit clip
    # a strategy that cannot run on the world (the Trainer would start every rank first, then refuse in setup)
    (("strategy=onebit_fsdp", "strategy.replicate_size=3"), "strategy.replicate_size"),
    (("strategy=onebit_fsdp", "trainer.devices=3"), "strategy.replicate_size"),
    (("strategy=onebit_adam", "strategy.hierarchical=3"), "strategy.hierarchical"),
]


@pytest.mark.parametrize("overrides,key", REFUSED)
def test_a_bad_job_is_refused_up_front_naming_its_key(compose_train, overrides, key):
    cfg = OmegaConf.to_container(compose_train("trainer=smoke", *overrides), resolve=True)
    with pytest.raises(ConfigError) as info:
        check_config(cfg)
    assert str(info.value).startswith(f"{key}: "), str(info.value)


def test_the_job_exits_in_one_line_before_any_rank_starts(tmp_path):
    """The command line, as users run it: exit status 2 and one line naming the key, no traceback, no rank."""
    done = _job("strategy=onebit_fsdp", "strategy.replicate_size=3", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("lightning-optim: bad config value: strategy.replicate_size: "), \
        lines[-5:]
    assert "val_loss" not in done.stdout  # nothing validated or trained


def test_a_zero_step_run_reports(tmp_path):
    done = _job("trainer.max_steps=0", "scheduler=null", "strategy=auto", "trainer.devices=1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "train loss (last step)  n/a (no training step)" in done.stdout


PRECISIONS = sorted(p.name[:-5] for p in (CONF / "precision").iterdir() if p.name.endswith(".yaml"))


@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p.endswith(("_master", "_kahan"))])
def test_precision_plugin_options_are_checked_by_key(compose_train, precision):
    cfg = OmegaConf.to_container(compose_train(f"precision={precision}", "strategy=auto"), resolve=True)
    check_config(cfg)
    numeric = _numeric_fields(cfg["precision"])
    for key in numeric:
        bad = dict(cfg, precision={**cfg["precision"], key: -1.0})
        with pytest.raises(ConfigError, match=rf"^precision.{key}: "):
            check_config(bad)


@pytest.mark.parametrize("overrides,conflict", [
    (("strategy=ddp",), "trainer.gradient_clip_val=1.0"),
    (("strategy=ddp", "trainer.gradient_clip_val=null", "precision=fp16_master"), "conflicts with precision"),
    (("strategy=ddp", "trainer.gradient_clip_val=null", "precision=16-mixed"), "conflicts with precision"),
    (("trainer.gradient_clip_val=null",), "conflicts with the 1-bit strategy"),
])
def test_gradient_release_conflicts_are_reported_up_front(compose_train, overrides, conflict):
    cfg = OmegaConf.to_container(compose_train("gradient_release=true", *overrides), resolve=True)
    with pytest.raises(ConfigError, match=rf"^gradient_release: {conflict}" if conflict.startswith("conf")
                       else rf"^gradient_release: conflicts with {conflict}"):
        check_config(cfg)
    cfg["gradient_release"] = "yes"
    with pytest.raises(ConfigError, match="^gradient_release: must be true or false"):
        check_config(cfg)


@pytest.mark.parametrize("strategy,optimizer", [("onebit_adam", "adamw"), ("zero_one_adam", "adamw"),
                                                ("onebit_lamb", "lamb")])
def test_strategy_hierarchical_is_checked_by_key(compose_train, strategy, optimizer):
    chosen = (f"strategy={strategy}", f"optimizer={optimizer}")
    for good in ("true", "2"):
        check_config(OmegaConf.to_container(compose_train(*chosen, f"strategy.hierarchical={good}"), resolve=True))
    for bad, says in (("0", "the number of ranks per node (an int >= 1), got 0"), ("abc", "must be true or false or an int")):
        cfg = OmegaConf.to_container(compose_train(*chosen, f"strategy.hierarchical={bad}"), resolve=True)
        with pytest.raises(ConfigError, match=rf"^strategy.hierarchical: .*{re.escape(says)}"):
            check_config(cfg)


# The strategy keys whose valid values depend on the world (trainer.devices x trainer.num_nodes), and, written
# here from each strategy's documented rule, whether a value fits `per_node` processes on each of `nodes` nodes.
def _replicas(value, nodes):
    return nodes if value == "auto" else value


WORLD_KEYS = {
    "hierarchical": ([False, True, 1, 2, 3, 4], lambda v, per_node, nodes: isinstance(v, bool)
                     or (per_node * nodes) % v == 0),
    "replicate_size": (["auto", 2, 3, 4], lambda v, per_node, nodes: _replicas(v, nodes) >= 2
                       and (per_node * nodes) % _replicas(v, nodes) == 0
                       and (per_node * nodes) // _replicas(v, nodes) >= 2),
    "neighbors": (["ring", "torus", "exponential", "torus:2x2", [[1], [0]]],
                  lambda v, per_node, nodes: {"torus:2x2": 4, "[[1], [0]]": 2}.get(str(v), per_node * nodes)
                  == per_node * nodes),
}
WORLDS = [(per_node, nodes) for nodes in (1, 2) for per_node in (1, 2, 3, 4)]


@pytest.mark.parametrize("option", STRATEGIES)
def test_every_strategy_is_checked_against_the_world_before_the_trainer(compose_train, option):
    """Every strategy option on every world of 1-4 processes per node and 1-2 nodes, each world-dependent key
    at each value: refused up front (naming the key and the world) exactly where the rule says it cannot run."""
    base = _compose(compose_train, "strategy", option)
    keys = [k for k in WORLD_KEYS if k in base["strategy"]]
    cases = [(None, None)] + [(k, v) for k in keys for v in WORLD_KEYS[k][0]]
    refused = 0
    for key, value in cases:
        for per_node, nodes in WORLDS:
            cfg = _compose(compose_train, "strategy", option)
            cfg["trainer"].update(devices=per_node, num_nodes=nodes)
            if key is not None:
                cfg["strategy"][key] = value
            fits = all(WORLD_KEYS[k][1](cfg["strategy"][k], per_node, nodes) for k in keys)
            where = (option, key, value, per_node, nodes)
            if fits:
                check_config(cfg)
                continue
            with pytest.raises(ConfigError) as info:
                check_config(cfg)
            message = str(info.value)
            assert re.match(rf"^strategy\.({'|'.join(keys)}): ", message), (where, message)
            assert f"trainer.devices={per_node} x trainer.num_nodes={nodes}: {per_node * nodes} processes" in message
            refused += 1
    assert refused if keys else not refused  # the sweep reaches worlds each world-dependent key cannot run on


@pytest.mark.parametrize("option", ["onebit_adam", "onebit_lamb", "onebit_fsdp", "zero_one_adam"])
def test_the_onebit_strategies_take_their_optimizers_auto_freeze_keys(compose_train, option):
    """`strategy.freeze_step=auto` with the rule's keys where the strategy's optimizer takes them (its signature);
    a bad value is named by its key; a strategy whose optimizer takes none has no such key."""
    import inspect

    base = _compose(compose_train, "strategy", option)
    cls = check_config.__globals__["_target_class"]("strategy", base["strategy"])
    optimizer = cls.optimizer_class
    takes = [n for n in inspect.signature(optimizer).parameters if n.startswith("auto_freeze_")]
    if not takes:
        assert not [k for k in base["strategy"] if k.startswith("auto_freeze_")]
        cfg = _compose(compose_train, "strategy", option)
        cfg["strategy"]["auto_freeze_window"] = 5
        with pytest.raises(ConfigError, match=r"^strategy.auto_freeze_window: unknown key"):
            check_config(cfg)
        return
    assert sorted(k for k in base["strategy"] if k.startswith("auto_freeze_")) == sorted(takes)  # in the yaml
    good = {"freeze_step": "auto", "auto_freeze_window": 5, "auto_freeze_tolerance": 0.2, "auto_freeze_max": 40}
    cfg = _compose(compose_train, "strategy", option)
    cfg["strategy"].update(good)
    check_config(cfg)
    for key, bad in (("auto_freeze_window", 0), ("auto_freeze_window", "x"), ("auto_freeze_tolerance", 1.0),
                     ("auto_freeze_tolerance", float("nan")), ("auto_freeze_max", -1), ("auto_freeze_max", 2.5)):
        cfg = _compose(compose_train, "strategy", option)
        cfg["strategy"].update({**good, key: bad})
        with pytest.raises(ConfigError, match=rf"^strategy.{key}: "):
            check_config(cfg)
    cfg = _compose(compose_train, "strategy", option)  # the rule's keys only with freeze_step=auto
    cfg["strategy"]["auto_freeze_max"] = 40
    with pytest.raises(ConfigError, match=r"^strategy.auto_freeze_max: .*only with freeze_step='auto'"):
        check_config(cfg)
