"""Every option of every config group composes; optimizer options build a working optimizer."""

from __future__ import annotations

from pathlib import Path

import hydra
import pytest
import torch

import lightning_optim.conf
from lightning_optim.model import ByteGPT, param_groups
from lightning_optim.train import lightning_arg

CONF_DIR = Path(lightning_optim.conf.__file__).parent
GROUPS = ["optimizer", "strategy", "precision", "model", "data", "trainer"]


def options(group: str) -> list[str]:
    """The option names of a config group: one per .yaml file in its folder."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


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


@pytest.mark.parametrize("option", options("optimizer"))
def test_optimizer_option_builds_and_steps(compose_train, option):
    cfg = compose_train(f"optimizer={option}")
    model = ByteGPT(max_seq_len=8, n_layer=1, n_head=2, d_model=16)
    optimizer = hydra.utils.instantiate(cfg.optimizer, _convert_="all")(param_groups(model))
    assert isinstance(optimizer, torch.optim.Optimizer)
    tokens = torch.randint(0, 256, (2, 9))
    before = [p.detach().clone() for p in model.parameters()]
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "step changed nothing"


@pytest.mark.parametrize("option", options("strategy"))
def test_strategy_option_builds(compose_train, option):
    cfg = compose_train(f"strategy={option}")
    strategy = lightning_arg(dict(cfg.strategy))
    assert strategy is not None


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
