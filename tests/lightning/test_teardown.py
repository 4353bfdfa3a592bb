"""Every Lightning plugin, callback and strategy of ours leaves the user's module a plain torch module
after ``fit``: no hook and no attribute of ours on any submodule or parameter,
``model.float()`` then an fp32 forward equal to a fresh fp32 module with the same weights,
``model.to(torch.bfloat16)`` then a bf16 forward, pickling, and a second ``fit`` with the same plugin
and callback objects that trains (and puts the same machinery back for its run, no more).

The sweep is derived from the catalogues: every precision plugin and callback that
``lightning_optim.lightning`` exports and every strategy name of ``lightning_optim.catalogue`` has a case
(the strategies run in-process on one CPU device: world 1, gloo). Each case is two 3-step fits of a
tiny model with a LayerNorm (about a second each)."""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

import lightning_optim
import lightning_optim.lightning as lol
from lightning_optim.catalogue import STRATEGIES
from lightning_optim.lightning import (CommTelemetry, GradientRelease, KahanPrecision, MasterWeightsPrecision,
                                       OnebitAdamStrategy)
from lightning_optim.lightning.strategies import ConsensusTelemetry
from tests.distributed import free_port

# What Lightning itself leaves on the root LightningModule after a fit (the "plain" and "ddp" cases, with
# none of ours, show it): the lazily made ``_hparams``, and ``forward`` from DDP's forward redirection.
LIGHTNING_OWN_ROOT_ATTRS = {"_hparams", "forward"}


class Tiny(pl.LightningModule):
    def __init__(self, lamb: bool = False) -> None:
        super().__init__()
        self.lamb = lamb  # OnebitLambStrategy converts LAMB only
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.lamb:
            return lightning_optim.Lamb(self.parameters(), lr=1e-2, weight_decay=0.01)
        return lightning_optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(24, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


class HookCount(pl.Callback):
    """Counts the hooks on the module while it trains (the plugin's machinery is there during the run)."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.counts.append(sum(len(v) for v in _machinery(pl_module).values() if isinstance(v, dict)))


# FSDP strategies (onebit_fsdp) shard the module in place, as Lightning's ModelParallelStrategy does (fully_shard
# changes its class): a sharded module is what the fit leaves; they also need 4 ranks (tests/lightning/test_onebit_fsdp.py)
SHARDING = {name for name, entry in STRATEGIES.items() if entry.base != "DDPStrategy"}
# The fault-tolerant strategies need a replica id and a Lighthouse (tests/lightning/test_ft_strategies.py)
REPLICATED = {"ft_diloco", "ft_ddp"}


@dataclass
class Case:
    plugins: list[Any] = field(default_factory=list)  # the same objects in both fits
    callbacks: list[Any] = field(default_factory=list)
    strategy: Callable[[], Any] = lambda: "auto"  # a fresh strategy per fit (Lightning's are single-use)
    clip: float | None = None
    lamb: bool = False


CASES: dict[str, Callable[[], Case]] = {
    "plain": Case,
    "ddp": lambda: Case(strategy=lambda: "ddp"),
    "master_weights_fp16": lambda: Case(plugins=[MasterWeightsPrecision("16-true")], clip=1.0),
    "master_weights_bf16": lambda: Case(plugins=[MasterWeightsPrecision("bf16-true")]),
    "kahan": lambda: Case(plugins=[KahanPrecision()]),
    "kahan_ddp": lambda: Case(plugins=[KahanPrecision()], strategy=lambda: "ddp"),
    "gradient_release": lambda: Case(callbacks=[GradientRelease()]),
    "gradient_release_kahan": lambda: Case(plugins=[KahanPrecision()], callbacks=[GradientRelease()]),
    "gradient_release_ddp": lambda: Case(callbacks=[GradientRelease()], strategy=lambda: "ddp"),
    "comm_telemetry": lambda: Case(callbacks=[CommTelemetry()]),
    "consensus_telemetry": lambda: Case(callbacks=[ConsensusTelemetry()]),
    # the 1-bit stage from step 1, with clipping: the strategy wraps the plugin's clip_grad_by_norm
    "onebit_adam_master_weights_clip": lambda: Case(plugins=[MasterWeightsPrecision("16-true")], clip=1.0,
                                                    strategy=lambda: OnebitAdamStrategy(freeze_step=1)),
    **{f"strategy_{name}": (lambda name=name: Case(strategy=lambda: name, lamb=name == "onebit_lamb"))
       for name in STRATEGIES if name not in SHARDING | REPLICATED},
    # the fault-tolerant strategies: one replica, hosting a Lighthouse in this process (it lives until the exit; a
    # new one per fit, which waits for no replica of an earlier quorum)
    **{f"strategy_{name}": (lambda name=name: Case(strategy=lambda: getattr(lol, STRATEGIES[name].export)(
        replica_id="teardown", lighthouse=f"local:{free_port()}", host="localhost",
        **({"sync_every": 2} if name == "ft_diloco" else {})))) for name in REPLICATED},
}


def _machinery(model: nn.Module) -> dict[str, Any]:
    """Everything hook- or attribute-like on ``model``: per module its hook dicts and attribute names,
    per parameter its hooks and attributes."""
    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if "hooks" in key and isinstance(value, dict):
                out[f"{name or '<root>'}.{key}"] = {k: getattr(h, "__qualname__", repr(h)) for k, h in value.items()}
        attrs = set(vars(module)) - (LIGHTNING_OWN_ROOT_ATTRS if not name else set())
        out[f"{name or '<root>'} attrs"] = sorted(attrs)
    for name, p in model.named_parameters():
        out[f"{name} post_accumulate_grad_hooks"] = dict(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        out[f"{name} backward_hooks"] = dict(p._backward_hooks or {})
        out[f"{name} attrs"] = sorted(vars(p))
    return out


def _global_hooks() -> list[int]:
    m = nn.modules.module
    return [len(getattr(m, name)) for name in dir(m) if name.startswith("_global_") and name.endswith("hooks")]


def _fit(model: Tiny, case: Case, probe: HookCount) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=case.strategy(), plugins=case.plugins,
                         callbacks=[*case.callbacks, probe], gradient_clip_val=case.clip, max_steps=3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # freeze_step / no-Kahan / dataloader-worker notes
        trainer.fit(model)


def _assert_plain(model: Tiny, fresh: Tiny, global_before: list[int], when: str) -> None:
    now, expected = _machinery(model), _machinery(fresh)
    leaked = {k: (expected.get(k), v) for k, v in now.items() if expected.get(k) != v}
    assert not leaked, f"{when}: left on the module (fresh copy, now): {leaked}"
    assert _global_hooks() == global_before, f"{when}: global module hooks left"
    plugin = model.trainer.precision_plugin  # a strategy's wrapper of the plugin goes with the strategy
    assert "clip_grad_by_norm" not in vars(plugin), f"{when}: the strategy's clipping wrapper is left on the plugin"


def _same_weights_fp32(model: nn.Module) -> Tiny:
    twin = Tiny()
    twin.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return twin


@pytest.mark.parametrize("name", sorted(CASES))
def test_fit_leaves_a_plain_module(name):
    case = CASES[name]()
    torch.manual_seed(0)
    model = Tiny(lamb=case.lamb)
    fresh = copy.deepcopy(model)
    global_before = _global_hooks()
    probe = HookCount()

    _fit(model, case, probe)
    _assert_plain(model, fresh, global_before, "after the first fit")
    restored = pickle.loads(pickle.dumps(model))
    x = torch.randn(4, 8)
    assert torch.equal(restored.float()(x), _same_weights_fp32(model)(x))

    model.float()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(x), _same_weights_fp32(model)(x))
        bf16 = model.to(torch.bfloat16)(x.bfloat16())
        assert bf16.dtype == torch.bfloat16 and torch.isfinite(bf16).all()

    model.float()
    before = [p.detach().clone() for p in model.parameters()]
    _fit(model, case, probe)  # the same plugin and callback objects
    assert any(not torch.equal(a, b.float()) for a, b in zip(before, model.parameters())), "the second fit did not train"
    assert probe.counts[0] == probe.counts[1], f"hooks during the two fits differ: {probe.counts}"
    _assert_plain(model, fresh, global_before, "after the second fit")
    with torch.no_grad():
        assert torch.equal(model.float()(x), _same_weights_fp32(model)(x))


def test_the_sweep_covers_every_plugin_callback_and_strategy():
    used: set[type] = set()
    for make in CASES.values():
        case = make()
        used |= {type(obj) for obj in (*case.plugins, *case.callbacks)}
    exported = {getattr(lol, name) for name in lol.__all__}
    ours = {cls for cls in exported if isinstance(cls, type) and issubclass(cls, (Precision, pl.Callback))}
    assert ours and ours <= used, f"no teardown case for {sorted(c.__name__ for c in ours - used)}"
    assert {f"strategy_{name}" for name in STRATEGIES if name not in SHARDING} <= set(CASES)


def test_kahan_hooks_are_there_while_a_trainer_runs_and_only_then():
    model, plugin = Tiny(), KahanPrecision()
    probe = HookCount()
    _fit(model, Case(plugins=[plugin]), probe)
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[probe])
    seen = []

    class Check(pl.Callback):
        def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            norm = pl_module.net[1]
            seen.append((len(norm._forward_pre_hooks), len(norm._forward_hooks), norm.weight.dtype))

    trainer.callbacks.append(Check())
    out = trainer.predict(model, torch.utils.data.DataLoader(torch.randn(4, 8), batch_size=4))
    assert probe.counts == [2]  # one cast in, one cast out on the LayerNorm during the fit
    assert seen == [(1, 1, torch.float32)] and out[0].dtype == torch.bfloat16  # predict put them back once
    assert not model.net[1]._forward_pre_hooks and not model.net[1]._forward_hooks  # and took them off
    assert plugin._cast_hooks == []


class Failing(Tiny):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("name", ["gradient_release", "kahan", "onebit_adam_master_weights_clip"])
def test_a_failed_fit_leaves_a_plain_module_too(name):
    # Lightning calls neither on_train_end nor the callbacks' teardown when the fit raises
    case, model = CASES[name](), Failing()
    fresh, global_before = copy.deepcopy(model), _global_hooks()
    with pytest.raises(RuntimeError, match="boom"):
        _fit(model, case, HookCount())
    _assert_plain(model, fresh, global_before, "after a failed fit")
    assert not any(getattr(o, "_released", False) for o in model.trainer.optimizers)
