"""Rank side of the Lightning strategy tests: real Trainer runs inside ``run_workers`` ranks.

``run_workers`` starts the gloo process group itself; the Lightning environment variables set
here (LOCAL_RANK, NODE_RANK, WORLD_SIZE) make Lightning see an already-launched world, so a
``Trainer(accelerator="cpu", devices=W, strategy=...)`` in each rank trains without launching
processes. Everything runs on the main job's model and data (tiny sizes).
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Any

import torch

MODEL = dict(n_layer=1, n_head=2, d_model=32, mlp_ratio=2)
SEQ_LEN = 32
DATA = dict(max_bytes=60_000, seq_len=SEQ_LEN, batch_size=8, val_windows=16, seed=1)
SCHEDULER = {"warmup_steps": 2, "min_lr_ratio": 0.1}
RESUME_EPOCH = 7  # steps per epoch; ModelCheckpoint saves after the last batch of every epoch
HIERARCHICAL_EPOCH = 5  # the 4-rank runs: their checkpoint lands one step past every case's freeze step (4)

# name -> (strategy class name, strategy kwargs, optimizer source)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "onebit_adam": ("OnebitAdamStrategy", {"freeze_step": 4}, "torch_adamw"),
    "zero_one_adam": (
        "ZeroOneAdamStrategy",
        {"var_freeze_step": 4, "var_update_scaler": 1, "local_step_scaler": 2, "local_step_clipper": 4},
        "lo_adamw",
    ),
    "onebit_lamb": ("OnebitLambStrategy", {"freeze_step": 4, "coeff_beta": 0.5}, "fused_lamb"),
}


def _optimizer(source: str):
    import lightning_optim

    if source == "torch_adamw":
        return functools.partial(torch.optim.AdamW, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    if source == "lo_adamw":
        return functools.partial(lightning_optim.AdamW, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    if source == "fused_lamb":
        return functools.partial(lightning_optim.FusedLamb, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    if source == "onebit_adam":  # already 1-bit, with its own freeze_step
        return functools.partial(lightning_optim.OnebitAdam, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1,
                                 freeze_step=3)
    raise ValueError(source)


def _lightning_env(rank: int, world: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*litlogger.*")


def _flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def _fit(rank: int, world: int, case: str, out: Path, *, max_steps: int, accumulate: int = 1,
         limit_train_batches: int | None = None, ckpt_in: str | None = None, ckpt_out: str | None = None,
         source: str | None = None, checkpoint_dir: str | None = None, strategy: Any = None,
         num_nodes: int = 1) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    import lightning_optim.lightning.strategies as strategies
    from lightning_optim.data import ByteDataModule
    from lightning_optim.model import LanguageModel

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []
            self.synced: dict[int, torch.Tensor] = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # before Lightning clips
            self.local_norm = float(torch.cat([p.grad.flatten() for p in pl_module.parameters()
                                               if p.grad is not None]).norm())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            strategy = trainer.strategy
            opt = strategy.onebit_optimizer
            row = {"loss": float(outputs["loss"]), "enabled": strategy.allreduce_switch.enabled,
                   "step": trainer.global_step, "epoch": trainer.current_epoch, **strategy.comm_last_step,
                   "local_norm": getattr(self, "local_norm", None), "clip_norm": strategy.last_clip_norm}
            self.rows.append(row)
            if opt.params_synchronized:
                self.synced[trainer.global_step] = _flat_params(pl_module)

    cls_name, kwargs, default_source = CASES[case]
    pl.seed_everything(7, workers=True)
    model = LanguageModel(MODEL, SEQ_LEN, optimizer=_optimizer(source or default_source), scheduler=SCHEDULER)
    recorder = Recorder()
    callbacks = [recorder]
    if checkpoint_dir:  # after the last batch of every epoch, all kept: Lightning's own checkpoint path
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=-1, every_n_train_steps=limit_train_batches))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        num_nodes=num_nodes,
        strategy=strategy if strategy is not None else getattr(strategies, cls_name)(**kwargs, timeout=60),
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        limit_train_batches=limit_train_batches,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=CSVLogger(str(out), name="", version=""),
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=bool(checkpoint_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
    )
    trainer.fit(model, datamodule=ByteDataModule(**DATA), ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    strategy = trainer.strategy
    opt = strategy.onebit_optimizer
    return {
        "rows": recorder.rows,
        "synced": recorder.synced,
        "params": _flat_params(model),
        "optimizer": type(opt).__name__,
        "average_grads": opt.average_grads,
        "global_step": opt.global_step,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "group_sizes": [len(g["params"]) for g in opt.param_groups],
        "scheduler_bound": all(c.scheduler.optimizer is opt for c in strategy.lr_scheduler_configs),
        "summary": strategy.comm_summary(),
        "skipped": strategy.allreduce_switch.buckets_skipped if strategy.allreduce_switch else None,
        "hierarchical": opt.hierarchical,
        "made_per_node": opt.compressor.made_per_node,
        "metrics_csv": str(out / "metrics.csv"),
    }


def suite(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Everything the 2-rank tests check, in one spawn (starting ranks dominates the runtime).

    Per case: two uninterrupted epochs of RESUME_EPOCH steps crossing the stage change, with
    Lightning's ModelCheckpoint after each epoch (``full``), then the first epoch's checkpoint
    resumed for the second (``resumed``). Then OnebitAdam with gradient accumulation, with an
    already-1-bit optimizer, and resumed from a checkpoint whose rank-1 file is missing.
    """
    import shutil

    import torch.distributed as dist

    import lightning_optim.lightning.strategies as strategies

    _lightning_env(rank, world)
    tmp = Path(tmp)
    out: dict[str, Any] = {}
    common = dict(max_steps=2 * RESUME_EPOCH, limit_train_batches=RESUME_EPOCH)
    for case in CASES:
        full = _fit(rank, world, case, tmp / case / "full", checkpoint_dir=str(tmp / case / "ckpts"), **common)
        ckpt = str(tmp / case / "ckpts" / f"epoch=0-step={RESUME_EPOCH}.ckpt")
        resumed = _fit(rank, world, case, tmp / case / "resumed", ckpt_in=ckpt,
                       checkpoint_dir=str(tmp / case / "ckpts_resumed"), **common)
        out[case] = {**full, "resumed": resumed, "ckpt": ckpt}
    out["accumulate"] = _fit(rank, world, "onebit_adam", tmp / "accumulate", max_steps=8, accumulate=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["given_onebit"] = _fit(rank, world, "onebit_adam", tmp / "given", max_steps=6, source="onebit_adam")
    out["given_onebit"]["warnings"] = [str(w.message) for w in caught if "used as is" in str(w.message)]
    # freeze_step="auto" on a 20-step fit: the strategy caps the warmup at 15% of the run (3 steps)
    out["auto"] = _fit(rank, world, "onebit_adam", tmp / "auto", max_steps=20,
                       strategy=strategies.OnebitAdamStrategy(freeze_step="auto", timeout=60))
    lonely = str(tmp / "no_rank_file.ckpt")  # the main checkpoint without its rank-1 file
    if rank == 0:
        shutil.copy(out["onebit_adam"]["ckpt"], lonely)
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["no_rank_file"] = _fit(rank, world, "onebit_adam", tmp / "no_rank_file", ckpt_in=lonely, **common)
    out["no_rank_file"]["warnings"] = [str(w.message) for w in caught if "re-initialised" in str(w.message)]
    return out


def resume_elsewhere(rank: int, world: int, ckpt: str, case: str, tmp: str) -> dict[str, Any]:
    """Resume a checkpoint written on another world size; record the warnings."""
    _lightning_env(rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _fit(rank, world, case, Path(tmp), max_steps=2 * RESUME_EPOCH, limit_train_batches=RESUME_EPOCH,
                      ckpt_in=ckpt)
    result["warnings"] = [str(w.message) for w in caught if "re-initialised" in str(w.message)]
    return result


def hierarchical(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """4 ranks as Lightning sees 2 nodes of 2 devices (NODE_RANK, LOCAL_RANK), each strategy with
    ``hierarchical=True``: a fit across the stage change with checkpoints, then a resume of the first epoch."""
    os.environ.update(LOCAL_RANK=str(rank % 2), NODE_RANK=str(rank // 2), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    import lightning_optim.lightning.strategies as strategies

    tmp = Path(tmp)
    out: dict[str, Any] = {}
    common = dict(max_steps=2 * HIERARCHICAL_EPOCH, limit_train_batches=HIERARCHICAL_EPOCH)
    for case, (cls_name, kwargs, _) in CASES.items():
        def strategy():
            return getattr(strategies, cls_name)(**kwargs, timeout=60, hierarchical=True)

        full = _fit(rank, 2, case, tmp / case / "full", checkpoint_dir=str(tmp / case / "ckpts"), strategy=strategy(),
                    num_nodes=2, **common)
        ckpt = str(tmp / case / "ckpts" / f"epoch=0-step={HIERARCHICAL_EPOCH}.ckpt")
        resumed = _fit(rank, 2, case, tmp / case / "resumed", ckpt_in=ckpt, strategy=strategy(), num_nodes=2, **common)
        out[case] = {**full, "resumed": resumed}
    return out
