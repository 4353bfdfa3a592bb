"""One replica group of the fault-tolerant strategy tests, launched as users launch one:

    python tests/lightning/ft_workers.py --replica r0 --fit ft_diloco=http://host:port --out DIR

A Lightning fit on CPU (one process, ``devices=1``) of a small regression model, AdamW inner optimizer, on this
replica's own batches (:func:`batches`, seeded by the replica's index), ``STEPS`` steps in two epochs of ``HALF``;
Lightning's distributed sampler shuffles them every epoch (:func:`batch_at`). ``ft_diloco`` is built as the class
(``FTDiLoCoStrategy(sync_every=SYNC_EVERY, ...)``); ``ft_ddp`` by its registry name, ``Trainer(strategy="ft_ddp")``,
its replica id and Lighthouse from the environment (``REPLICA_ID``, ``TORCHFT_LIGHTHOUSE``), as a launcher sets them.

Each ``--fit STRATEGY=LIGHTHOUSE`` is one fit (several: one after the other, in the same process), writing
``DIR/STRATEGY/events.jsonl`` (one line per step: the step, loss, the manager's committed step, the replicas of the
last quorum) and, at its end, ``DIR/STRATEGY/result.pt``: the params after every step and after the fit, the
strategy's summary. ``--checkpoint`` saves a checkpoint after step ``HALF`` (the end of the first epoch);
``--resume-from DIR`` resumes that of an earlier launch. ``--start-with N --start-dir D``: wait until N replicas'
processes are up before the first fit (launched together).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

FEATURES, BATCH = 8, 16
STEPS, HALF, SYNC_EVERY = 14, 7, 4  # syncs after steps 4, 8, 12; the fit ends between two (a final sync at 14)
LR = 0.02


def batches(replica: int, count: int = HALF) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Replica ``replica``'s batches of one epoch (every epoch sees them again, in the same order)."""
    teacher = torch.randn(FEATURES, generator=torch.Generator().manual_seed(7))
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(1000 * replica + i)
        x = torch.randn(BATCH, FEATURES, generator=g)
        out.append((x, (x @ teacher).tanh().unsqueeze(-1) + 0.05 * torch.randn(BATCH, 1, generator=g)))
    return out


def batch_at(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch replica ``replica`` trains on at step ``step`` (1, 2, ...): Lightning's ``DistributedSampler`` over
    the replica's one process shuffles every epoch (seed 0, ``set_epoch(epoch)``), as it does under DDP."""
    xs, ys = (torch.cat(parts) for parts in zip(*batches(replica)))
    sampler = torch.utils.data.DistributedSampler(range(len(xs)), num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch((step - 1) // HALF)
    index = list(sampler)[(step - 1) % HALF * BATCH:][:BATCH]
    return xs[index], ys[index]


def network() -> torch.nn.Module:
    torch.manual_seed(0)  # every replica starts alike
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def inner(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def loss_of(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(x), y)


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def _fit(strategy_name: str, lighthouse: str, replica: str, out: Path, args: argparse.Namespace) -> None:
    """One fit of this replica with ``strategy_name``; its events and result under ``out``."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_optim

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = network()

        def training_step(self, batch, batch_idx):
            return loss_of(self.net, *batch)

        def configure_optimizers(self):
            return inner(self.parameters())

    class Recorder(pl.Callback):
        def __init__(self, events) -> None:
            self.events, self.params = events, []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.params.append(flat(pl_module))
            self.events.write(json.dumps({"step": trainer.global_step, "loss": float(outputs["loss"]),
                                          "committed": trainer.strategy.manager.current_step(), "time": time.time(),
                                          "replicas": trainer.strategy.replica_summary()["replicas"]}) + "\n")
            self.events.flush()
            time.sleep(args.step_sleep)

    if strategy_name == "ft_diloco":
        strategy: Any = lightning_optim.FTDiLoCoStrategy(sync_every=SYNC_EVERY, outer_lr=0.7, outer_momentum=0.9,
                                                         replica_id=replica, lighthouse=lighthouse,
                                                         min_replica_size=args.min_replicas, host="localhost",
                                                         timeout=10)
    else:  # the registry name, its settings from the environment
        os.environ.update(REPLICA_ID=replica, TORCHFT_LIGHTHOUSE=lighthouse)
        strategy = strategy_name
    out.mkdir(parents=True, exist_ok=True)
    model = Regression()
    init = flat(model)
    data = torch.utils.data.DataLoader([pair for x, y in batches(int(replica.lstrip("r"))) for pair in zip(x, y)],
                                       batch_size=BATCH)
    checkpoints = out / "ckpts"
    with open(out / "events.jsonl", "a") as events:
        recorder = Recorder(events)
        callbacks: list[Any] = [recorder]
        if args.checkpoint:
            callbacks.append(ModelCheckpoint(dirpath=checkpoints, save_top_k=-1, every_n_train_steps=HALF))
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps,
                             limit_val_batches=0, num_sanity_val_steps=0, logger=False, callbacks=callbacks,
                             enable_checkpointing=args.checkpoint, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=str(out))
        resume = None
        if args.resume_from:
            resume = Path(args.resume_from) / out.name / "ckpts" / f"epoch=0-step={HALF}.ckpt"
        trainer.fit(model, train_dataloaders=data, ckpt_path=resume)
    torch.save({"init": init, "steps": recorder.params, "params": flat(model), "global_step": trainer.global_step,
                "summary": trainer.strategy.comm_summary()}, out / "result.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", required=True)
    parser.add_argument("--fit", action="append", required=True, metavar="STRATEGY=LIGHTHOUSE",
                        help="a fit with this strategy against this Lighthouse (repeat: fits one after the other)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--checkpoint", action="store_true", help=f"save a checkpoint after step {HALF}")
    parser.add_argument("--resume-from", default=None, help="the --out of a launch with --checkpoint")
    parser.add_argument("--start-with", type=int, default=0)
    parser.add_argument("--start-dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*litlogger.*")
    import lightning.pytorch  # noqa: F401 - imported before the start line, as every fit needs it

    if args.start_with:  # the replicas start their fits together, as a scheduler starts a job's replicas
        start_dir = Path(args.start_dir)
        (start_dir / args.replica).touch()
        deadline = time.monotonic() + 120
        while len(list(start_dir.iterdir())) < args.start_with:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{args.start_with} replicas did not start within 120 s")
            time.sleep(0.02)
    for fit in args.fit:
        strategy, lighthouse = fit.split("=", 1)
        _fit(strategy, lighthouse, args.replica, Path(args.out) / strategy, args)
    sys.exit(0)


if __name__ == "__main__":
    main()
