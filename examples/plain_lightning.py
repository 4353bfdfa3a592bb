"""Train the demo byte-level GPT with a plain Lightning Trainer: no Hydra, no config files.

    python examples/plain_lightning.py [path/to/text/or/folder]

Without an argument it trains on the Python standard library's own sources.
"""

import functools
import sys

import lightning as L
import torch

from lightning_optim.data import ByteDataModule
from lightning_optim.model import LanguageModel


def main() -> None:
    L.seed_everything(0)
    path = sys.argv[1] if len(sys.argv) > 1 else None
    datamodule = ByteDataModule(path=path, glob="*.py" if path is None else "*.txt", max_bytes=500_000)
    model = LanguageModel(
        model_kwargs={"n_layer": 2, "n_head": 4, "d_model": 128},
        max_seq_len=datamodule.seq_len,
        # Any callable taking param groups works; this is what a Hydra `_partial_` config produces.
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1),
        scheduler={"warmup_steps": 10, "min_lr_ratio": 0.1},
    )
    trainer = L.Trainer(max_steps=60, val_check_interval=30, check_val_every_n_epoch=None,
                        limit_val_batches=4, logger=False, enable_checkpointing=False)
    before = trainer.validate(model, datamodule=datamodule, verbose=False)[0]["val_loss"]
    trainer.fit(model, datamodule=datamodule)
    after = trainer.validate(model, datamodule=datamodule, verbose=False)[0]["val_loss"]
    print(f"validation loss {before:.3f} -> {after:.3f} (nats per byte)")


if __name__ == "__main__":
    main()
