"""The main job: train the byte-level GPT with any optimizer/strategy/precision config.

    python -m lightning_optim.train                                   # defaults: 2 processes, 1-bit Adam
    python -m lightning_optim.train strategy=auto trainer.devices=1   # one process, plain optimizer
    python -m lightning_optim.train optimizer=sgd strategy=ddp model=small trainer.max_steps=200
    python -m lightning_optim.train -m optimizer.lr=1e-3,3e-3 trainer=smoke   # a sweep

Outputs go to Hydra's run directory (``outputs/<date>/<time>``): metrics.csv, loss.png,
summary.json, train.log and the resolved config under .hydra/. With several processes (the
default strategy, onebit_adam, runs trainer.devices=2) Lightning re-runs this command for the
other ranks in the same run directory; only rank 0 writes the outputs.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig

from lightning_optim.conf_dir import conf_dir, deprecated_choices
from lightning_optim.config_check import ConfigError, check_config, checked_datamodule, resolved, trainer_error
from lightning_optim.model import LanguageModel
from lightning_optim.report import format_table, plot_losses, write_summary

# Absolute, found at import: the repository's conf/ in a checkout, lightning_optim/conf in a wheel.
# --config-path replaces it, --config-dir adds a user's tree beside it, --config-name picks the primary.
CONFIG_PATH = str(conf_dir())
CONFIG_NAME = "train"


class ThroughputMeter(L.Callback):
    """The wall time of each training batch (forward, backward, optimizer step), not validation."""

    def __init__(self) -> None:
        self.step_seconds: list[float] = []
        self._batch_start = 0.0

    @property
    def seconds(self) -> float:
        return sum(self.step_seconds)

    def on_train_batch_start(self, *args: Any) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.step_seconds.append(time.perf_counter() - self._batch_start)


def lightning_arg(option: dict[str, Any]) -> Any:
    """A strategy/precision option: ``{name: <registry name>}`` or a ``_target_`` to instantiate."""
    if "_target_" in option:
        return hydra.utils.instantiate(option)
    return option["name"]


def build_trainer(cfg: dict[str, Any], output_dir: Path, callbacks: list[L.Callback]) -> L.Trainer:
    """A Lightning Trainer from the ``trainer``, ``strategy`` and ``precision`` groups (a precision
    plugin option, ``_target_``, goes to ``plugins``) and the ``gradient_release`` switch."""
    # name="" and version="" put metrics.csv (and checkpoints/) straight into the run directory.
    logger = CSVLogger(save_dir=str(output_dir), name="", version="")
    precision = lightning_arg(cfg["precision"])
    plugin = not isinstance(precision, str)
    if cfg.get("gradient_release"):
        from lightning_optim.lightning import GradientRelease

        callbacks = [*callbacks, GradientRelease()]
    return L.Trainer(
        **cfg["trainer"],
        strategy=lightning_arg(cfg["strategy"]),
        precision=None if plugin else precision,
        plugins=[precision] if plugin else None,
        logger=logger,
        callbacks=callbacks,
        default_root_dir=str(output_dir),
    )


def build_model(cfg: dict[str, Any]) -> LanguageModel:
    """The LightningModule, with the optimizer config as a partial taking param groups."""
    return LanguageModel(
        model_kwargs=cfg["model"],
        max_seq_len=cfg["data"]["seq_len"],
        optimizer=hydra.utils.instantiate(cfg["optimizer"]),
        split_weight_decay=cfg["split_weight_decay"],
        scheduler=cfg["scheduler"],
    )


def run(config: DictConfig, output_dir: Path) -> dict[str, Any]:
    """Validate, train, validate again if needed; on rank 0 write the outputs. Returns the summary."""
    # Plain containers from here on; a missing mandatory value ("???") fails now, naming its key.
    cfg = resolved(config)
    check_config(cfg)  # every key of every group, with its key, before anything is built or any rank starts
    # The data is one in-memory tensor; DataLoader workers would only compete for the CPU.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    # Hydra's run directory always holds .hydra/ already; CSVLogger only rewrites its own files.
    warnings.filterwarnings("ignore", ".*Experiment logs directory .* exists and is not empty.*")
    # Lightning 2.6 calls a torch.utils._pytree API that torch 2.13 deprecates; nothing to act on.
    warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\).*")
    start = time.perf_counter()
    datamodule = checked_datamodule(cfg)  # the corpus is read now: a bad data.path stops rank 0 alone
    L.seed_everything(cfg["seed"], workers=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg)
    meter = ThroughputMeter()
    try:
        trainer = build_trainer(cfg, output_dir, callbacks=[meter])
    except Exception as exc:  # a +trainer.<arg> value Lightning refuses that no rule of check_config knows
        error = trainer_error(cfg, exc)
        if error is None:
            raise
        raise error from None

    initial_val = trainer.validate(model, datamodule=datamodule, verbose=False)[0]["val_loss"]
    trainer.fit(model, datamodule=datamodule)
    train_loss = trainer.callback_metrics.get("train_loss")  # a later validate() clears it
    final_train = None if train_loss is None else float(train_loss)  # None: no training step (max_steps=0)
    if model.last_val_step != trainer.global_step:  # last scheduled validation was before the end
        trainer.validate(model, datamodule=datamodule, verbose=False)
    summary = {
        "output_dir": str(output_dir),
        "initial_val_loss": float(initial_val),
        "final_val_loss": float(trainer.callback_metrics.get("val_loss", initial_val)),  # 0 steps: the initial
        "final_train_loss": final_train,
        "steps": trainer.global_step,
        "tokens": model.tokens_seen,
        "train_tokens_per_sec": model.tokens_seen / max(meter.seconds, 1e-9),
        "median_step_s": statistics.median(meter.step_seconds) if meter.step_seconds else None,
        "wall_time_s": time.perf_counter() - start,
        "num_params": sum(p.numel() for p in model.parameters()),
        "world_size": trainer.world_size,
        "config": cfg,
    }
    comm_summary = getattr(trainer.strategy, "comm_summary", None)  # the 1-bit strategies' byte totals
    if callable(comm_summary):
        summary["comm"] = comm_summary()
    if trainer.is_global_zero:
        trainer.logger.save()
        plot_losses(Path(trainer.logger.log_dir) / "metrics.csv", output_dir / "loss.png")
        write_summary(output_dir / "summary.json", summary)
        print(format_table(summary), flush=True)
    return summary


@hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Hydra entry point; returns the final validation loss (what a sweeper would minimise)."""
    for message in deprecated_choices(HydraConfig.get().runtime.choices):
        warnings.warn(message, FutureWarning, stacklevel=1)
    try:
        return run(cfg, Path(HydraConfig.get().runtime.output_dir))["final_val_loss"]
    except ConfigError as exc:  # one line, not a traceback
        print(f"lightning-optim: bad config value: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
