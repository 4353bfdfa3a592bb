"""Rank side of the precision / gradient-release Lightning tests: real Trainer runs on the main
job's model and data (tiny sizes), one process or inside ``run_workers`` ranks."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from tests.lightning.workers import DATA, MODEL, SEQ_LEN, _flat_params, _lightning_env

EPOCH = 3  # optimizer steps per epoch; ModelCheckpoint saves after each epoch


def _optimizer(name: str):
    import lightning_optim

    if name == "lo_adamw":
        return functools.partial(lightning_optim.AdamW, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    if name == "torch_adamw":
        return functools.partial(torch.optim.AdamW, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    if name == "lo_sgd":
        return functools.partial(lightning_optim.SGD, lr=0.1, momentum=0.9)
    raise ValueError(name)


def fit(rank: int, world: int, out: str, *, plugin: str | None = None, release: bool = False,
        strategy: str = "ddp", optimizer: str = "lo_adamw", accumulate: int = 1, max_steps: int = 2 * EPOCH,
        ckpt_in: str | None = None, checkpoint_dir: str | None = None, clip: float | None = None,
        precision: str | None = None, scheduler: bool = True, extra_plugins: Any = None) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_optim.data import ByteDataModule
    from lightning_optim.lightning import GradientRelease, KahanPrecision, MasterWeightsPrecision, OnebitAdamStrategy
    from lightning_optim.model import LanguageModel

    if world > 1:
        _lightning_env(rank, world)

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.params: list[torch.Tensor] = []
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.params.append(_flat_params(pl_module).float())
            self.losses.append(float(outputs["loss"]))

    pl.seed_everything(7, workers=True)
    model = LanguageModel(MODEL, SEQ_LEN, optimizer=_optimizer(optimizer),
                          scheduler={"warmup_steps": 2, "min_lr_ratio": 0.1} if scheduler else None)
    plugins = {None: [], "fp16_master": [MasterWeightsPrecision("16-true", init_scale=2.0**10, growth_interval=2)],
               "bf16_master": [MasterWeightsPrecision("bf16-true")], "bf16_kahan": [KahanPrecision()]}[plugin]
    plugins += extra_plugins() if extra_plugins else []
    recorder = Recorder()
    callbacks = [recorder] + ([GradientRelease()] if release else [])
    if checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=-1, every_n_train_steps=EPOCH))
    if strategy == "onebit_adam":
        strategy_obj: Any = OnebitAdamStrategy(freeze_step=2, timeout=60)
    elif world > 1:
        strategy_obj = "ddp"
    else:
        strategy_obj = "auto"
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy_obj, plugins=plugins, precision=precision,
        max_steps=max_steps, accumulate_grad_batches=accumulate, limit_train_batches=EPOCH * accumulate,
        limit_val_batches=0, num_sanity_val_steps=0, logger=CSVLogger(str(out), name="", version=""),
        log_every_n_steps=1, callbacks=callbacks, enable_checkpointing=bool(checkpoint_dir),
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
    )
    trainer.fit(model, datamodule=ByteDataModule(**DATA), ckpt_path=ckpt_in)
    opt = trainer.optimizers[0]
    plugin_obj = trainer.precision_plugin
    result = {
        "params": _flat_params(model).float(),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "per_batch": recorder.params,
        "losses": recorder.losses,
        "opt_param_dtypes": sorted({str(p.dtype) for g in opt.param_groups for p in g["params"]}),
        "state_steps": sorted({int(s["step"]) for s in opt.state.values() if "step" in s}),
        "kahan_states": sum("kahan_comp" in s for s in opt.state.values()),
        "metrics_csv": str(Path(out) / "metrics.csv"),
        "global_step": trainer.global_step,
    }
    masters = getattr(plugin_obj, "masters", None)
    if masters is not None:
        result["masters"] = torch.cat([m.detach().reshape(-1).clone() for m in masters.masters])
        scaler = plugin_obj.loss_scaler
        result["loss_scale"] = None if scaler is None else scaler.loss_scale
        result["skipped"] = plugin_obj.skipped_steps
    return result


def fit_and_resume(rank: int, world: int, tmp: str, name: str, **kwargs: Any) -> dict[str, Any]:
    """Two epochs uninterrupted (checkpoint after each), then epoch 0's checkpoint resumed."""
    tmp_path = Path(tmp) / name
    full = fit(rank, world, str(tmp_path / "full"), checkpoint_dir=str(tmp_path / "ckpts"), **kwargs)
    ckpts = sorted((tmp_path / "ckpts").glob("epoch=0-*.ckpt"))
    resumed = fit(rank, world, str(tmp_path / "resumed"), ckpt_in=str(ckpts[0]), **kwargs)
    return {"full": full, "resumed": resumed}


def two_rank_suite(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Everything the 2-rank precision tests check, in one spawn."""
    out: dict[str, Any] = {}
    out["fp16_master_ddp"] = fit_and_resume(rank, world, tmp, "fp16_master_ddp", plugin="fp16_master")
    out["fp16_master_onebit"] = fit_and_resume(rank, world, tmp, "fp16_master_onebit", plugin="fp16_master",
                                               strategy="onebit_adam", optimizer="torch_adamw")
    out["release_ddp"] = fit_and_resume(rank, world, tmp, "release_ddp", release=True)
    out["plain_ddp"] = fit(rank, world, str(Path(tmp) / "plain_ddp"))
    out["release_ddp_acc"] = fit(rank, world, str(Path(tmp) / "release_acc"), release=True, accumulate=2,
                                 optimizer="lo_sgd")
    out["plain_ddp_acc"] = fit(rank, world, str(Path(tmp) / "plain_acc"), accumulate=2, optimizer="lo_sgd")
    return out
