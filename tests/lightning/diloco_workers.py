"""Rank side of the DiLoCo strategy tests: real Trainer fits inside ``run_workers`` ranks (Lightning sees an
already-launched world) on the main job's tiny model, AdamW inner optimizer, no clipping, no scheduler (so a
one-process simulation can replay the same inner steps from the recorded batches).

Per case: a full fit of ``STEPS`` steps (two epochs) with a checkpoint after ``RESUME`` (between synchronisations), then
that checkpoint resumed to the end; both end between synchronisations, so the strategy's final synchronisation
runs after their last step. Then two fits of 3 steps with ``sync_every=100``, ``final_sync`` True and False.
Each step records the batch, the params after it, the strategy's byte count and the bytes this process's gloo
sockets sent during it (``ss``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from tests.lightning.workers import DATA, MODEL, SEQ_LEN, _flat_params, _lightning_env
from tests.wire import wire_bytes_sent

STEPS, RESUME = 14, 7
LR, BETAS, WEIGHT_DECAY = 3e-3, (0.9, 0.99), 0.1
# name -> (strategy class name, its arguments)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "diloco": ("DiLoCoStrategy", dict(sync_every=3)),
    "streaming": ("StreamingDiLoCoStrategy", dict(sync_every=4, fragments=2)),  # overlap: the default
    "diloco_int8": ("DiLoCoStrategy", dict(sync_every=3, compressor="int8")),
    "diloco_sparseloco": ("DiLoCoStrategy", dict(sync_every=3, compressor="sparseloco", density=0.05, bits=2,
                                                 outer_lr=1.0, outer_momentum=0.9)),
}


def inner_adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)


def _fit(case: str, out: Path, *, ckpt_in: str | None = None, checkpoint_dir: str | None = None) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_optim.lightning.strategies as strategies
    from lightning_optim.data import ByteDataModule
    from lightning_optim.model import LanguageModel

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []
            self._wire = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not self.rows:
                self._wire = wire_bytes_sent()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # from the end of the last step: an overlapped exchange also sends between two steps
            now = wire_bytes_sent()
            wire, self._wire = now - self._wire, now
            self.rows.append({"step": trainer.global_step, "loss": float(outputs["loss"]), "batch": batch.clone(),
                              "params": _flat_params(pl_module), "wire": wire, **trainer.strategy.comm_last_step})

    name, kwargs = CASES[case]
    pl.seed_everything(7, workers=True)
    model = LanguageModel(MODEL, SEQ_LEN, optimizer=inner_adamw, scheduler=None)
    init = [p.detach().clone() for p in model.parameters()]
    recorder = Recorder()
    callbacks = [recorder]
    if checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=-1, every_n_train_steps=RESUME))
    strategy = getattr(strategies, name)(**kwargs, timeout=60)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS,
                         limit_train_batches=RESUME, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                         callbacks=callbacks, enable_checkpointing=bool(checkpoint_dir), enable_progress_bar=False,
                         enable_model_summary=False, gradient_clip_val=None)
    trainer.fit(model, datamodule=ByteDataModule(**DATA), ckpt_path=ckpt_in)
    return {"rows": recorder.rows, "params": _flat_params(model), "init": init, "summary": strategy.comm_summary(),
            "optimizer": type(trainer.optimizers[0]).__name__, "numels": [p.numel() for p in model.parameters()]}


def _refused(out: Path, **kwargs: Any) -> str:
    import lightning.pytorch as pl

    import lightning_optim
    from lightning_optim.data import ByteDataModule
    from lightning_optim.model import LanguageModel

    model = LanguageModel(MODEL, SEQ_LEN, optimizer=kwargs.pop("optimizer"), scheduler=None)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=lightning_optim.DiLoCoStrategy(sync_every=2, timeout=60),
                         max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out), **kwargs)
    try:
        trainer.fit(model, datamodule=ByteDataModule(**DATA))
    except Exception as exc:  # noqa: BLE001 - the message goes back to the test
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _short(out: Path, final_sync: bool) -> dict[str, Any]:
    """A fit of 3 steps with sync_every=100 (no synchronisation in it): the warnings each rank gave, its params."""
    import warnings

    import lightning.pytorch as pl

    import lightning_optim
    from lightning_optim.data import ByteDataModule
    from lightning_optim.model import LanguageModel

    pl.seed_everything(7, workers=True)
    model = LanguageModel(MODEL, SEQ_LEN, optimizer=inner_adamw, scheduler=None)
    strategy = lightning_optim.DiLoCoStrategy(sync_every=100, final_sync=final_sync, timeout=60)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, limit_val_batches=0,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(out))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=ByteDataModule(**DATA))
    return {"warnings": [str(w.message) for w in caught if "DiLoCoStrategy" in str(w.message)],
            "params": _flat_params(model), "summary": strategy.comm_summary()}


def suite(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Everything the 2-rank DiLoCo strategy tests check, in one spawn."""
    import lightning_optim

    _lightning_env(rank, world)
    tmp_path = Path(tmp)
    out: dict[str, Any] = {}
    for case in CASES:
        full = _fit(case, tmp_path / case / "full", checkpoint_dir=str(tmp_path / case / "ckpts"))
        ckpt = str(tmp_path / case / "ckpts" / f"epoch=0-step={RESUME}.ckpt")
        out[case] = {**full, "resumed": _fit(case, tmp_path / case / "resumed", ckpt_in=ckpt), "ckpt": ckpt}
    out["short"] = {flag: _short(tmp_path / f"short_{flag}", flag) for flag in (True, False)}
    out["refused"] = {
        "onebit_optimizer": _refused(tmp_path / "r1", optimizer=functools.partial(lightning_optim.OnebitAdam, lr=1e-3)),
    }
    return out
