"""A 2-process Lightning run (Lightning's own launcher re-runs this script for rank 1) in which
rank 1 stops answering at a given step: it hangs (``--mode hang``) or exits (``--mode exit``).

    python tests/lightning/fail_script.py --mode hang --at-step 3 --timeout 5
    python tests/lightning/fail_script.py --strategy diloco --mode exit --at-step 3   # inside the exchange's step

Rank 0 must then stop with the strategy's clear error within about ``--timeout`` seconds
(the process-group timeout bounds every collective) instead of waiting forever.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when run as a script


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["hang", "exit"], default="hang")
    parser.add_argument("--at-step", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--strategy", choices=["onebit_adam", "diloco"], default="onebit_adam",
                        help="diloco (sync_every=3): rank 1 stops after the backward of step --at-step, so rank 0 "
                             "meets it in the exchange of that step")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    import lightning.pytorch as pl
    import torch

    from lightning_optim.data import ByteDataModule
    from lightning_optim.lightning import DiLoCoStrategy, OnebitAdamStrategy
    from lightning_optim.model import LanguageModel
    from tests.lightning.workers import DATA, MODEL, SEQ_LEN

    class StopAnswering(pl.Callback):
        def _stop(self, trainer, step):
            if trainer.global_rank == 1 and step == args.at_step:
                print(f"rank 1: stops answering at step {args.at_step} ({args.mode})", file=sys.stderr, flush=True)
                if args.mode == "exit":
                    os._exit(3)
                time.sleep(3600)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if args.strategy == "onebit_adam":
                self._stop(trainer, trainer.global_step)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if args.strategy == "diloco":
                self._stop(trainer, trainer.global_step + 1)  # the step about to be taken

    model = LanguageModel(MODEL, SEQ_LEN, optimizer=functools.partial(torch.optim.AdamW, lr=3e-3), scheduler=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=OnebitAdamStrategy(freeze_step=2, timeout=args.timeout) if args.strategy == "onebit_adam"
        else DiLoCoStrategy(sync_every=3, timeout=args.timeout),
        max_steps=50,
        limit_val_batches=0,
        logger=False,
        callbacks=[StopAnswering()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=ByteDataModule(**DATA))


if __name__ == "__main__":
    main()
