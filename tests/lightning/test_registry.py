"""``import lightning_optim`` registers the strategy names in both Lightning packages, in any
import order, through the registries' own ``register`` (no import hook)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import lightning_optim  # noqa: F401 - registers
from lightning_optim.lightning import registry

CHECK = """
import sys
{first}
hooks = list(sys.meta_path)
import lightning.pytorch as pl, pytorch_lightning
from lightning.pytorch.strategies import StrategyRegistry as A
from pytorch_lightning.strategies import StrategyRegistry as B
from lightning_optim.lightning import strategies, pl_strategies
assert sys.meta_path == hooks  # importing Lightning after lightning_optim runs no finder of ours
for name in {names!r}:
    assert A[name]['strategy'] is strategies.STRATEGIES[name], name
    assert B[name]['strategy'] is pl_strategies.STRATEGIES[name], name
if {lightning_first}:  # the Trainer checks below once are enough
    print('ok'); raise SystemExit
t = pl.Trainer(accelerator='cpu', devices=2, strategy='zero_one_adam', logger=False, precision='bf16-mixed')
assert type(t.strategy) is strategies.ZeroOneAdamStrategy
assert type(t.precision_plugin).__name__ == 'MixedPrecision'  # the Trainer's precision, not the strategy's
t = pytorch_lightning.Trainer(accelerator='cpu', devices=2, strategy='onebit_lamb', logger=False)
assert type(t.strategy) is pl_strategies.OnebitLambStrategy
print('ok')
"""


@pytest.mark.parametrize("lightning_first", [False, True], ids=["lightning_optim_first", "lightning_first"])
def test_names_resolve_in_both_registries(lightning_first):
    first = ("import lightning.pytorch, pytorch_lightning; import lightning_optim" if lightning_first
             else "import lightning_optim")
    code = CHECK.format(first=first, lightning_first=lightning_first, names=registry.NAMES)
    out = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_names_in_this_process():
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_optim.lightning import OnebitAdamStrategy

    assert StrategyRegistry["onebit_adam"]["strategy"] is OnebitAdamStrategy
    assert registry.register("lightning.pytorch") == []  # idempotent
    instance = StrategyRegistry.get("onebit_adam")
    assert isinstance(instance, OnebitAdamStrategy) and instance.timeout_s == 300.0


def test_strategy_classes_at_the_top_level_are_the_registered_ones():
    import lightning_optim
    from lightning_optim.lightning import strategies

    for name in ("OnebitAdamStrategy", "ZeroOneAdamStrategy", "OnebitLambStrategy"):
        assert name in lightning_optim.__all__
        assert getattr(lightning_optim, name) is getattr(strategies, name)
