"""Every option of every config group composes; optimizer options build a working optimizer.

The optimizer and strategy groups are checked against the one catalogue of names
(``lightning_optim.catalogue.OPTIMIZERS``, ``lightning_optim.lightning.registry.NAMES``): every name
has its option, and every option is a catalogue name, a deprecated alias or a listed baseline.
"""

from __future__ import annotations

import hydra
import pytest
import torch

from lightning_optim.catalogue import OPTIMIZERS
from lightning_optim.conf_dir import ALIASES, OPTIMIZER_ALIASES, STRATEGY_ALIASES, conf_dir, deprecated_choices
from lightning_optim.lightning.registry import NAMES as STRATEGY_NAMES
from lightning_optim.model import ByteGPT, param_groups
from lightning_optim.train import lightning_arg

CONF_DIR = conf_dir()
GROUPS = ["optimizer", "strategy", "precision", "model", "data", "trainer"]
# Optimizer options outside the catalogue: plain torch, the yardstick the project is measured against.
BASELINES: dict[str, type] = {"torch_adamw": torch.optim.AdamW}
# Strategy options outside the 1-bit names: Lightning's own.
LIGHTNING_STRATEGIES = {"auto", "ddp"}


def options(group: str) -> list[str]:
    """The option names of a config group: one per .yaml file in its folder."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def optimizer_class(option: str) -> type:
    return OPTIMIZERS[option].cls if option in OPTIMIZERS else BASELINES[option]


def test_every_group_has_options_and_a_default(compose_train):
    cfg = compose_train()
    for group in GROUPS:
        assert options(group), f"conf/{group}/ has no options"
        assert group in cfg, f"train.yaml selects no default for {group}"


@pytest.mark.parametrize(
    "group,option", [(group, option) for group in GROUPS for option in options(group)]
)
def test_option_composes(compose_train, group, option):
    extra = ["data.path=README.md"] if (group, option) == ("data", "text") else []
    cfg = compose_train(f"{group}={option}", *extra)
    assert cfg[group] is not None and len(cfg[group]) > 0


def test_optimizer_group_is_the_catalogue():
    files = set(options("optimizer"))
    missing = sorted(set(OPTIMIZERS) - files)
    assert not missing, f"catalogue names without conf/optimizer/<name>.yaml: {missing}"
    unknown = sorted(files - set(OPTIMIZERS) - set(OPTIMIZER_ALIASES) - set(BASELINES))
    assert not unknown, f"conf/optimizer options that are no catalogue name, alias or listed baseline: {unknown}"
    assert not set(OPTIMIZER_ALIASES) & set(OPTIMIZERS), "an alias may not shadow a catalogue name"
    assert set(OPTIMIZER_ALIASES.values()) <= set(OPTIMIZERS), "an alias must point to a catalogue name"
    assert not set(BASELINES) & set(OPTIMIZERS)


@pytest.mark.parametrize("option", [*sorted(OPTIMIZERS), *sorted(BASELINES)])
def test_optimizer_option_builds_its_class_and_steps(compose_train, option):
    """The composed option's ``_target_`` is the catalogue's class, built with the composed values."""
    cfg = compose_train(f"optimizer={option}")
    assert hydra.utils.get_class(cfg.optimizer._target_) is optimizer_class(option)
    model = ByteGPT(max_seq_len=8, n_layer=1, n_head=2, d_model=16)
    optimizer = hydra.utils.instantiate(cfg.optimizer, _convert_="all")(param_groups(model))
    assert type(optimizer) is optimizer_class(option)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(cfg.optimizer.lr)
    tokens = torch.randint(0, 256, (2, 9))
    before = [p.detach().clone() for p in model.parameters()]
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "step changed nothing"


@pytest.mark.parametrize("group,old,new", [(g, old, new) for g, table in ALIASES.items() for old, new in table.items()])
def test_deprecated_name_composes_to_the_catalogue_name(compose_train, group, old, new):
    key = {"optimizer": "optimizer.lr=0.01", "strategy": "strategy.timeout=60"}[group]
    for extra in ([], [key]):  # as is, and with a command-line override
        assert compose_train(f"{group}={old}", *extra) == compose_train(f"{group}={new}", *extra)
    text = (CONF_DIR / group / f"{old}.yaml").read_text()
    assert text.startswith("# DEPRECATED") and f"{group}={new}" in text  # said where users look
    other = {"optimizer": "strategy", "strategy": "optimizer"}[group]
    (message,) = deprecated_choices({group: old, other: "sgd" if other == "optimizer" else "auto"})
    assert f"{group}={old} is a deprecated name; use {group}={new}" in message  # and by the job (train.main)
    assert deprecated_choices({group: new}) == []


def test_strategy_group_has_every_registry_name():
    files = set(options("strategy"))
    missing = sorted(set(STRATEGY_NAMES) - files)
    assert not missing, f"1-bit strategy names without conf/strategy/<name>.yaml: {missing}"
    unknown = sorted(files - set(STRATEGY_NAMES) - LIGHTNING_STRATEGIES - set(STRATEGY_ALIASES))
    assert not unknown, f"conf/strategy options that are no registry name, alias or Lightning strategy: {unknown}"
    assert not set(STRATEGY_ALIASES) & set(STRATEGY_NAMES), "an alias may not shadow a catalogue name"
    assert set(STRATEGY_ALIASES.values()) <= set(STRATEGY_NAMES), "an alias must point to a catalogue name"


@pytest.mark.parametrize("option", options("strategy"))
def test_strategy_option_builds(compose_train, option):
    cfg = compose_train(f"strategy={option}")
    strategy = lightning_arg(dict(cfg.strategy))
    assert strategy is not None
    if option in STRATEGY_NAMES:  # the option builds the class Lightning's registry has under that name
        from lightning.pytorch.strategies import StrategyRegistry

        assert type(strategy) is dict.get(StrategyRegistry, option)["strategy"]


def test_model_options_build(compose_train):
    sizes = {}
    for option in options("model"):
        cfg = compose_train(f"model={option}")
        model = ByteGPT(max_seq_len=cfg.data.seq_len, **cfg.model)
        sizes[option] = sum(p.numel() for p in model.parameters())
    assert sizes["tiny"] < sizes["small"]


def test_command_line_style_overrides(compose_train):
    cfg = compose_train("optimizer.lr=3e-4", "trainer.max_steps=200", "model=small", "data.path=README.md")
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.trainer.max_steps == 200
    assert cfg.model.d_model > 128
    assert cfg.data.path == "README.md"
    assert cfg.data.seed == cfg.seed  # interpolation resolves


def test_param_groups_exclude_norms_biases_embeddings():
    model = ByteGPT(max_seq_len=8, n_layer=1, n_head=2, d_model=16)
    decay, no_decay = param_groups(model)
    assert "weight_decay" not in decay  # the optimizer's own setting applies
    assert no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"])
    no_decay_ids = {id(p) for p in no_decay["params"]}
    assert id(model.tok_emb.weight) in no_decay_ids and id(model.pos_emb.weight) in no_decay_ids
    assert id(model.ln_out.weight) in no_decay_ids
    # every parameter exactly once (the head is tied to the token embedding)
    ids = [id(p) for group in (decay, no_decay) for p in group["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
