"""A 2-process Lightning run (Lightning's own launcher re-runs this script for rank 1) in which
rank 1 stops answering at a given step: it hangs (``--mode hang``) or exits (``--mode exit``).

    python tests/lightning/fail_script.py --mode hang --at-step 3 --timeout 5
    python tests/lightning/fail_script.py --strategy diloco --mode exit --at-step 3   # inside the exchange's step
    python tests/lightning/fail_script.py --strategy diloco --at-step 2   # between syncs: the next batch's broadcast

Rank 0 must then stop with the strategy's clear error within about ``--timeout`` seconds
(the process-group timeout bounds every collective) instead of waiting forever. Each rank prints when
Lightning reports the failure to its callbacks (``on_exception``), for the tests to time the report.
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
READY = "rank-1-is-up"  # in the job's working directory, which Lightning's launcher gives rank 1 too


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
                print(f"rank 1: stops answering at step {args.at_step} ({args.mode}) at {time.time():.3f}", file=sys.stderr,
                      flush=True)
                if args.mode == "exit":
                    os._exit(3)
                time.sleep(3600)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if args.strategy == "onebit_adam":
                self._stop(trainer, trainer.global_step)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if args.strategy == "diloco":
                self._stop(trainer, trainer.global_step + 1)  # the step about to be taken

        def on_exception(self, trainer, pl_module, exception):
            print(f"rank {trainer.global_rank}: failure reported at {time.time():.3f}", file=sys.stderr, flush=True)

    strategy = (OnebitAdamStrategy(freeze_step=2, timeout=args.timeout) if args.strategy == "onebit_adam"
                else DiLoCoStrategy(sync_every=3, timeout=args.timeout))
    _join_once_rank_1_is_up(strategy)
    model = LanguageModel(MODEL, SEQ_LEN, optimizer=functools.partial(torch.optim.AdamW, lr=3e-3), scheduler=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=50,
        limit_val_batches=0,
        logger=False,
        callbacks=[StopAnswering()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=ByteDataModule(**DATA))


def _join_once_rank_1_is_up(strategy) -> None:
    """``timeout`` bounds the rendezvous too, and what is under test is a rank lost mid-training: on a loaded
    machine rank 1's start (Lightning's launcher re-runs this script; its imports, model and Trainer) can take
    longer than the bound. Rank 1 leaves a file as it joins the group; rank 0 joins once the file is there, so
    the bound only has to cover the two joins and the steps before the hang."""
    setup_environment = strategy.setup_environment  # after Lightning's launcher has started rank 1

    def ready_then_setup() -> None:
        Path(READY).touch()
        setup_environment()

    def wait_then_setup() -> None:
        deadline = time.monotonic() + 300
        while not os.path.exists(READY):
            if time.monotonic() > deadline:
                raise TimeoutError("rank 1 did not start within 300 s")
            time.sleep(0.1)
        setup_environment()

    strategy.setup_environment = wait_then_setup if os.environ.get("LOCAL_RANK", "0") == "0" else ready_then_setup


if __name__ == "__main__":
    main()
