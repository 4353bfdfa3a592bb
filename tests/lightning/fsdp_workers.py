"""Rank side of the ``onebit_fsdp`` strategy tests: real Trainer fits on 4 gloo ranks that Lightning sees as
2 nodes of 2 devices (so ``replicate_size="auto"`` is 2), on the main job's model and data (tiny sizes)."""

from __future__ import annotations

import os
from datetime import timedelta
import warnings
from pathlib import Path
from typing import Any

import torch

from tests.lightning.workers import DATA, MODEL, SCHEDULER, SEQ_LEN, _optimizer

FREEZE = 3
EPOCH = 4  # steps per epoch; the checkpoint after the first epoch is mid-compression
STEPS = 2 * EPOCH
ZERO_ONE_EPOCH = 7  # ZeroOneAdam (the knobs below) synchronises after steps 6 and 8: step 7 is a local step
ZERO_ONE_STEPS = 9  # the resume crosses the synchronisation after step 8 and ends on a local step


def _full_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in module.parameters()])


def _local_state(optimizer: Any) -> list[dict[str, torch.Tensor]]:
    """exp_avg / exp_avg_sq of every param as local shards, in param order (torch's DTensor or our views)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            out.append({k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
                        for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")})
    return out


def _unwrapped(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer


def _fit(out: Path, strategy: Any, *, ckpt_in: str | None = None, checkpoint_dir: str | None = None,
         sharded_model: bool = False, epoch: int = EPOCH, max_steps: int = STEPS) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_optim.data import ByteDataModule
    from lightning_optim.model import LanguageModel

    class ShardedInConfigureModel(LanguageModel):
        """Plain HSDP as a ModelParallelStrategy user writes it: fully_shard in configure_model."""

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            for block in self.net.blocks:
                fully_shard(block, mesh=self.device_mesh)
            fully_shard(self.net, mesh=self.device_mesh)

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []
            self.states: dict[str, Any] = {}

        def on_train_start(self, trainer, pl_module):  # what a resume loaded
            self.states["start"] = _local_state(_unwrapped(trainer.strategy.optimizers[0]))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == epoch:
                self.states["epoch"] = _local_state(_unwrapped(trainer.strategy.optimizers[0]))
            strategy = trainer.strategy
            opt = getattr(strategy, "onebit_optimizer", None)
            self.rows.append({"loss": float(outputs["loss"]), "step": trainer.global_step,
                              "compressing": opt is not None and not opt.needs_averaged_grads,
                              "clip_norm": getattr(strategy, "last_clip_norm", None),
                              "synchronized": getattr(opt, "params_synchronized", True),
                              **getattr(strategy, "comm_last_step", {})})

    pl.seed_everything(7, workers=True)
    cls = ShardedInConfigureModel if sharded_model else LanguageModel
    model = cls(MODEL, SEQ_LEN, optimizer=_optimizer("torch_adamw"), scheduler=SCHEDULER)
    recorder = Recorder()
    callbacks: list[Any] = [recorder]
    if checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=-1, every_n_train_steps=epoch))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=max_steps, limit_train_batches=epoch,
        limit_val_batches=0, num_sanity_val_steps=0, logger=CSVLogger(str(out), name="", version=""),
        log_every_n_steps=1, callbacks=callbacks, enable_checkpointing=bool(checkpoint_dir),
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
    )
    trainer.fit(model, datamodule=ByteDataModule(**DATA), ckpt_path=ckpt_in)
    opt = _unwrapped(trainer.strategy.optimizers[0])
    return {"rows": recorder.rows, "params": _full_params(model), "optimizer": type(opt).__name__,
            "global_step": getattr(opt, "global_step", None), "states": recorder.states,
            "summary": trainer.strategy.comm_summary() if hasattr(trainer.strategy, "comm_summary") else None,
            "mesh": tuple(trainer.strategy.device_mesh.shape)}


def suite(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """A fit across the stage change with checkpoints; the first epoch's checkpoint resumed; a plain HSDP
    fit (ModelParallelStrategy + AdamW, sharded in configure_model) whose checkpoint the strategy resumes."""
    os.environ.update(LOCAL_RANK=str(rank % 2), NODE_RANK=str(rank // 2), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*ModelParallelStrategy.*experimental.*")
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_optim.lightning import OnebitFSDPStrategy

    tmp = Path(tmp)

    def ours() -> Any:
        return OnebitFSDPStrategy(freeze_step=FREEZE, timeout=60)

    def zero_one() -> Any:  # local steps between synchronisations: the checkpoint keeps each rank's params
        return OnebitFSDPStrategy(optimizer="zero_one_adam", var_freeze_step=FREEZE, var_update_scaler=1,
                                  local_step_scaler=2, local_step_clipper=4, timeout=60)

    out: dict[str, Any] = {}
    out["full"] = _fit(tmp / "full", ours(), checkpoint_dir=str(tmp / "ckpts"))
    ckpt = str(tmp / "ckpts" / f"epoch=0-step={EPOCH}.ckpt")
    out["resumed"] = _fit(tmp / "resumed", ours(), ckpt_in=ckpt)
    zero_one_fit = dict(epoch=ZERO_ONE_EPOCH, max_steps=ZERO_ONE_STEPS)
    out["zero_one"] = _fit(tmp / "zero_one", zero_one(), checkpoint_dir=str(tmp / "zero_one_ckpts"), **zero_one_fit)
    out["zero_one_resumed"] = _fit(tmp / "zero_one_resumed", zero_one(), **zero_one_fit,
                                   ckpt_in=str(tmp / "zero_one_ckpts" / f"epoch=0-step={ZERO_ONE_EPOCH}.ckpt"))
    plain = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, timeout=timedelta(seconds=60))
    # only its first epoch's checkpoint and moments are used: no second epoch
    out["plain"] = _fit(tmp / "plain", plain, checkpoint_dir=str(tmp / "plain_ckpts"), sharded_model=True,
                        max_steps=EPOCH)
    plain_ckpt = str(tmp / "plain_ckpts" / f"epoch=0-step={EPOCH}.ckpt")  # past FREEZE: compresses at once
    out["from_plain"] = _fit(tmp / "from_plain", ours(), ckpt_in=plain_ckpt)
    return out
