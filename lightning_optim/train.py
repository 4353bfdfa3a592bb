"""The main job: train the byte-level GPT with any optimizer/strategy/precision config.

    python -m lightning_optim.train                                   # defaults: 2 processes, 1-bit Adam
    python -m lightning_optim.train strategy=auto trainer.devices=1   # one process, plain optimizer
    python -m lightning_optim.train optimizer=sgd strategy=ddp model=small trainer.max_steps=200
    python -m lightning_optim.train -m optimizer.lr=1e-3,3e-3 trainer=smoke   # a sweep

Outputs go to Hydra's run directory (``outputs/<date>/<time>``): metrics.csv, loss.png,
summary.json, checkpoints/, train.log and the resolved config under .hydra/. With several processes
(the default strategy, onebit_adam, runs trainer.devices=2) Lightning re-runs this command for the
other ranks in the same run directory (each logs to train_ddp_process_<rank>.log); only rank 0 writes
the outputs. The job's own messages (notes, the 1-bit stage switch, the summary table) and Lightning's
go through ``logging``: to the console and to the job log.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

try:
    import hydra
    import lightning as L
    from hydra.core.hydra_config import HydraConfig
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.utilities import rank_zero_only
    from omegaconf import DictConfig, OmegaConf

    from lightning_optim.conf_dir import conf_dir, deprecated_choices
    from lightning_optim.config_check import ConfigError, check_config, checked_datamodule, resolved, trainer_error
    from lightning_optim.model import LanguageModel
    from lightning_optim.report import format_table, plot_losses, stage_switch_step, write_summary
except ModuleNotFoundError:  # say which extra brings Hydra, Lightning and matplotlib (the report's plot)
    from lightning_optim.extras import require

    require("train", "the main job (lightning_optim.train)")
    raise

# Absolute, found at import: the repository's conf/ in a checkout, lightning_optim/conf in a wheel.
# --config-path replaces it, --config-dir adds a user's tree beside it, --config-name picks the primary.
CONFIG_PATH = str(conf_dir())
CONFIG_NAME = "train"
# Not __name__: that is "__main__" under ``python -m lightning_optim.train``.
log = logging.getLogger("lightning_optim.train")


def note(message: str) -> None:
    """One line for the console and the job log, from rank 0 only (every rank runs the same config)."""
    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # Lightning sets .rank on the function object
        log.info("lightning-optim: %s", message)


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


class CommTrace(L.Callback):
    """After every optimizer step of a strategy that counts its bytes (``comm_totals``: the 1-bit and
    comm-hook strategies), one point (step, bytes sent so far, fp32 DDP bytes so far, whether DDP's allreduce
    ran) for loss.png; says when the 1-bit stage starts. Steps are metrics.csv's (the step just taken, 0-based)."""

    def __init__(self) -> None:
        self.points: list[tuple[int, int, int, bool]] = []
        self.switch_step: int | None = None  # see report.stage_switch_step
        self._steps = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        totals = getattr(strategy, "comm_totals", None)
        if not totals or totals["steps"] == self._steps:  # no optimizer step since the last batch (accumulation)
            return
        self._steps = totals["steps"]
        ddp = bool(getattr(strategy, "comm_last_step", {}).get("ddp_allreduce", True))  # with comm_totals above
        self.points.append((trainer.global_step - 1, totals["bytes_sent"], totals["fp32_bytes"], ddp))
        if self.switch_step is None:  # the first switch only (ZeroOneAdam's variance steps come back to DDP's)
            self.switch_step = stage_switch_step(self.points[-2:])
            if self.switch_step is not None:
                optimizer = type(getattr(strategy, "onebit_optimizer", None)).__name__
                baseline = getattr(strategy, "fp32_baseline", "DDP's fp32 allreduce")
                note(f"step {self.switch_step}: the 1-bit stage starts: {optimizer} exchanges 1-bit compressed "
                     f"momentum instead of {baseline}")


def last_epoch(trainer: L.Trainer) -> int | None:
    """The index of the epoch the run ends in, for the progress bar: Lightning's ``max_epochs - 1``, or earlier
    where ``max_steps`` ends it (with max_steps alone Lightning sets max_epochs=-1: "Epoch 0/-2"); None when
    neither bounds it (an endless run, or an epoch of unknown length)."""
    max_epochs = trainer.max_epochs
    bound = max_epochs - 1 if max_epochs is not None and max_epochs >= 0 else None
    batches, steps = trainer.num_training_batches, trainer.max_steps
    if steps is not None and steps >= 0 and batches and math.isfinite(batches):
        steps_per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)  # the last partial one steps too
        by_steps = max(0, math.ceil(steps / steps_per_epoch) - 1)
        bound = by_steps if bound is None else min(bound, by_steps)
    return bound


class ProgressBar(RichProgressBar):
    """Lightning's rich progress bar, its epoch read "Epoch 2/5" (see :func:`last_epoch`)."""

    def _get_train_description(self, current_epoch: int) -> str:
        last = last_epoch(self.trainer)
        text = f"Epoch {current_epoch}" + ("" if last is None else f"/{last}")
        return f"{text:{len(self.validation_description)}}"  # as Lightning pads: no flicker against "Validation"


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
    if cfg["trainer"].get("enable_progress_bar", True) and _RICH_AVAILABLE:  # without rich: tqdm's, "Epoch 2"
        callbacks = [*callbacks, ProgressBar()]
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


def _set_on_command_line(overrides: Sequence[str], key: str) -> bool:
    """Whether a command-line override sets ``key`` (a group choice or a value) or a key under it."""
    for item in overrides:
        name = item.lstrip("+~").split("=", 1)[0]
        if name == key or name.startswith(key + "."):
            return True
    return False


def _shipped(group: str, option: str) -> Any:
    """An option of the shipped tree as a plain container (its ``group`` part for a ``_global_`` one)."""
    path = conf_dir() / group / f"{option}.yaml"
    data: Any = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return data.get(group) if "@package _global_" in path.read_text() else data


def release_defaults(cfg: dict[str, Any], overrides: Sequence[str] | None) -> list[str]:
    """With ``gradient_release=true``, the shipped defaults that cannot release give way (``cfg`` is changed
    in place; returns one note for each): the default trainer's gradient clipping is dropped, the default 1-bit
    strategy becomes DDP on the same processes. A value set on the command line (``overrides``) or changed
    from the shipped one in a config file stays and conflicts. ``overrides=None``: nothing gives way."""
    if overrides is None or cfg.get("gradient_release") is not True:
        return []
    notes = []
    clip = cfg["trainer"].get("gradient_clip_val")
    shipped_clip = _shipped("trainer", "default").get("gradient_clip_val")
    if clip and clip == shipped_clip and not _set_on_command_line(overrides, "trainer.gradient_clip_val"):
        cfg["trainer"]["gradient_clip_val"] = None
        notes.append(f"gradient_release=true: no gradient clipping (the default trainer.gradient_clip_val={clip} "
                     "is dropped: each gradient is stepped and freed during backward)")
    primary: Any = OmegaConf.to_container(OmegaConf.load(conf_dir() / f"{CONFIG_NAME}.yaml"))
    defaults = primary["defaults"]
    strategy = next((item["strategy"] for item in defaults if isinstance(item, dict) and "strategy" in item), None)
    if (strategy not in (None, "ddp", "auto") and cfg["strategy"] == _shipped("strategy", strategy)
            and not _set_on_command_line(overrides, "strategy")):
        cfg["strategy"] = _shipped("strategy", "ddp")
        devices = cfg["trainer"].get("devices")
        notes.append(f"gradient_release=true: strategy=ddp on trainer.devices={devices} instead of the default "
                     f"{strategy} (its 1-bit exchange needs the whole model's momentum at once); "
                     "strategy=auto trainer.devices=1 runs one process")
    return notes


def run(config: DictConfig, output_dir: Path, overrides: Sequence[str] | None = None) -> dict[str, Any]:
    """Validate, train, validate again if needed; on rank 0 write the outputs. Returns the summary.

    ``overrides``: the command line's, which tell a default from a chosen value (:func:`release_defaults`);
    None: every value counts as chosen."""
    # Plain containers from here on; a missing mandatory value ("???") fails now, naming its key.
    cfg = resolved(config)
    for message in release_defaults(cfg, overrides):
        note(message)
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
    meter, trace = ThroughputMeter(), CommTrace()
    try:
        trainer = build_trainer(cfg, output_dir, callbacks=[meter, trace])
    except Exception as exc:  # a +trainer.<arg> value Lightning refuses that no rule of check_config knows
        error = trainer_error(cfg, exc)
        if error is None:
            raise
        raise error from None

    initial_val = trainer.validate(model, datamodule=datamodule, verbose=False)[0]["val_loss"]
    trainer.fit(model, datamodule=datamodule)
    train_loss = trainer.callback_metrics.get("train_loss")  # a later validate() clears it
    final_train = None if train_loss is None else float(train_loss)  # None: no training step (max_steps=0)
    # validate again when the last scheduled validation was before the end, or when the strategy changed the
    # params after it (DiLoCo's final synchronisation): the final loss is the model's the job hands over
    if model.last_val_step != trainer.global_step or getattr(trainer.strategy, "params_changed_at_end", False):
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
        "train_seconds": meter.seconds,  # the training batches' wall time, validation left out
        "step_seconds": [round(s, 4) for s in meter.step_seconds],
        "wall_time_s": time.perf_counter() - start,
        "num_params": sum(p.numel() for p in model.parameters()),
        "world_size": trainer.world_size,
        "config": cfg,
    }
    comm_summary = getattr(trainer.strategy, "comm_summary", None)  # the 1-bit strategies' byte totals
    if callable(comm_summary):
        summary["comm"] = {**comm_summary(), "stage_switch_step": trace.switch_step}
    if trainer.is_global_zero:
        logger = cast(CSVLogger, trainer.logger)  # build_trainer's
        logger.save()
        plot_losses(Path(logger.log_dir) / "metrics.csv", output_dir / "loss.png", trace.points)
        write_summary(output_dir / "summary.json", summary)
        log.info(format_table(summary))
    return summary


@contextlib.contextmanager
def lightning_in_job_log() -> Iterator[None]:
    """Lightning's loggers print for themselves and do not propagate (set when Lightning was imported, before
    Hydra configured logging): the job log's file handlers join them for the job (a sweep's next job has its own)."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    added = [(lg, h) for lg in loggers if not lg.propagate for h in files if h not in lg.handlers]
    for logger, handler in added:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger, handler in added:
            logger.removeHandler(handler)


@hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Hydra entry point; returns the final validation loss (what a sweeper would minimise)."""
    hydra_cfg = HydraConfig.get()
    for message in deprecated_choices(hydra_cfg.runtime.choices):
        warnings.warn(message, FutureWarning, stacklevel=1)
    try:
        with lightning_in_job_log():
            summary = run(cfg, Path(hydra_cfg.runtime.output_dir), overrides=list(hydra_cfg.overrides.task))
        return summary["final_val_loss"]
    except ConfigError as exc:  # one line, not a traceback
        print(f"lightning-optim: bad config value: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
