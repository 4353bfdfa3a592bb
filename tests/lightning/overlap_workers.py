"""Rank side of the Lightning overlap test: ``OnebitAdamStrategy(overlap=True)`` in a real Trainer on the
main job's model (tiny sizes), next to the same run with the units compressed at step() time, and a
resume from Lightning's checkpoint inside the compression stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.lightning.workers import DATA, MODEL, RESUME_EPOCH, SEQ_LEN, _flat_params, _lightning_env, _optimizer


def _fit(rank: int, world: int, out: Path, *, step_time: bool = False, ckpt_in: str | None = None,
         checkpoint_dir: str | None = None) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_optim.data import ByteDataModule
    from lightning_optim.lightning import OnebitAdamStrategy
    from lightning_optim.model import LanguageModel

    class Trace(pl.Callback):
        def __init__(self) -> None:
            self.params: dict[int, Any] = {}

        def on_train_start(self, trainer, pl_module) -> None:
            if step_time:  # the reference: the same units, compressed in optimizer.step()
                trainer.strategy.overlap_state.overlap = False

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            self.params[trainer.global_step] = _flat_params(pl_module)

    pl.seed_everything(7, workers=True)
    model = LanguageModel(MODEL, SEQ_LEN, optimizer=_optimizer("torch_adamw"), scheduler=None)
    trace = Trace()
    callbacks = [trace]
    if checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=-1, every_n_train_steps=RESUME_EPOCH))
    strategy = OnebitAdamStrategy(freeze_step=4, overlap=True, overlap_unit_mb=0.02, timeout=60, telemetry=False)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=2 * RESUME_EPOCH,
                         limit_train_batches=RESUME_EPOCH, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                         callbacks=callbacks, enable_checkpointing=bool(checkpoint_dir), enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, datamodule=ByteDataModule(**DATA), ckpt_path=ckpt_in)
    opt = trainer.strategy.onebit_optimizer
    return {"params": trace.params, "units_overlapped": trainer.strategy.overlap_state.units_overlapped,
            "units": len(opt._units(opt._layout)), "global_step": opt.global_step}


def overlap_suite(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_optim.lightning import OnebitAdamStrategy

    _lightning_env(rank, world)
    tmp = Path(tmp)
    full = _fit(rank, world, tmp / "full", checkpoint_dir=str(tmp / "ckpts"))
    step_time = _fit(rank, world, tmp / "step_time", step_time=True)
    resumed = _fit(rank, world, tmp / "resumed", ckpt_in=str(tmp / "ckpts" / f"epoch=0-step={RESUME_EPOCH}.ckpt"))
    try:
        pl.Trainer(accelerator="cpu", devices=world, gradient_clip_val=1.0, logger=False,
                   strategy=OnebitAdamStrategy(freeze_step=4, overlap=True)).strategy.setup(
            pl.Trainer(accelerator="cpu", devices=world, gradient_clip_val=1.0, logger=False))
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    return {"full": full, "step_time": step_time, "resumed": resumed, "clip_refused": refused}
