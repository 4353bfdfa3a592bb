"""Rank side of test_from_ddp.py: a plain-DDP job's checkpoint resumed under the 1-bit strategies,
and the warning when freeze_step lies beyond the fit."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from tests.lightning.workers import DATA, MODEL, RESUME_EPOCH, SCHEDULER, SEQ_LEN, _fit, _lightning_env, _optimizer


def _plain_ddp(world: int, source: str, ckpt_dir: Path) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_optim.data import ByteDataModule
    from lightning_optim.model import LanguageModel

    pl.seed_everything(7, workers=True)
    model = LanguageModel(MODEL, SEQ_LEN, optimizer=_optimizer(source), scheduler=SCHEDULER)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=DDPStrategy(), max_steps=RESUME_EPOCH,
        limit_train_batches=RESUME_EPOCH, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        callbacks=[ModelCheckpoint(dirpath=str(ckpt_dir), save_top_k=-1, every_n_train_steps=RESUME_EPOCH)],
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
    )
    trainer.fit(model, datamodule=ByteDataModule(**DATA))
    opt = trainer.optimizers[0]
    state = opt.state[next(iter(model.parameters()))]
    return {"exp_avg_sq": state["exp_avg_sq"].clone(), "lr": opt.param_groups[0]["lr"]}


def from_ddp(rank: int, world: int, tmp: str) -> dict[str, Any]:
    _lightning_env(rank, world)
    tmp = Path(tmp)
    out: dict[str, Any] = {}
    for case, source in (("onebit_adam", "torch_adamw"), ("zero_one_adam", "torch_adamw"), ("onebit_adam", "lo_adamw")):
        plain = _plain_ddp(world, source, tmp / source / "ckpts")
        ckpt = str(tmp / source / "ckpts" / f"epoch=0-step={RESUME_EPOCH}.ckpt")
        resumed = _fit(rank, world, case, tmp / source / case, ckpt_in=ckpt, max_steps=2 * RESUME_EPOCH,
                       limit_train_batches=RESUME_EPOCH)
        out[(case, source)] = {"plain": plain, "resumed": resumed}
    return out


def freeze_beyond_the_fit(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Every strategy with its freeze step (4) beyond a 3-step fit and inside a 6-step fit, and
    ``strategy="onebit_adam"`` by name (DeepSpeed's freeze_step=100000): the warnings each emits."""
    _lightning_env(rank, world)
    out: dict[str, list[str]] = {}
    runs = [(case, steps, None) for case in ("onebit_adam", "zero_one_adam", "onebit_lamb") for steps in (3, 6)]
    runs.append(("onebit_adam", 3, "onebit_adam"))
    for case, steps, by_name in runs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fit(rank, world, case, Path(tmp) / f"{case}-{steps}-{by_name}", max_steps=steps, strategy=by_name)
        out[f"{case}/{steps}/{by_name}"] = [str(w.message) for w in caught if "will not engage" in str(w.message)]
    return out
