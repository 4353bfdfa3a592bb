"""`LanguageModel`: the LightningModule that trains `ByteGPT` (the one module of the model package that
imports Lightning; ``lightning_optim.model`` loads it on first use of the name)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from lightning_optim.model.gpt import ByteGPT, param_groups, warmup_cosine

__all__ = ["LanguageModel"]


class LanguageModel(L.LightningModule):
    """Next-byte prediction with cross-entropy; logs ``train_loss``, ``val_loss`` and ``tokens``.

    Args:
        model_kwargs: keyword arguments for `ByteGPT` (the ``model/`` config group).
        max_seq_len: longest sequence the position embedding supports (``data.seq_len``).
        optimizer: a callable taking param groups and returning an optimizer (a Hydra partial).
        split_weight_decay: put biases, norms and embeddings in a no-decay group.
        scheduler: ``None`` or a dict with ``warmup_steps`` and ``min_lr_ratio`` (warmup + cosine
            over ``trainer.max_steps``).
    """

    def __init__(
        self,
        model_kwargs: dict[str, Any],
        max_seq_len: int,
        optimizer: Callable[..., torch.optim.Optimizer],
        split_weight_decay: bool = True,
        scheduler: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.net = ByteGPT(max_seq_len=max_seq_len, **model_kwargs)
        self.optimizer_factory = optimizer
        self.split_weight_decay = split_weight_decay
        self.scheduler_cfg = scheduler
        self.tokens_seen = 0  # global count, all ranks
        self.last_val_step = -1  # optimizer step of the latest validation run

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self.net(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.tokens_seen += (batch.shape[0] * (batch.shape[1] - 1)) * self.trainer.world_size
        self.log("train_loss", loss, prog_bar=True)
        self.log("tokens", float(self.tokens_seen))
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.last_val_step = self.global_step

    def configure_optimizers(self) -> Any:
        if self.split_weight_decay:
            optimizer = self.optimizer_factory(param_groups(self.net))
        else:
            optimizer = self.optimizer_factory(self.net.parameters())
        if not self.scheduler_cfg:
            return optimizer
        total = self.trainer.max_steps
        if total is None or total < 1:
            raise ValueError("scheduler needs trainer.max_steps >= 1 (set scheduler=null to disable it)")
        schedule = functools.partial(
            warmup_cosine,
            warmup_steps=int(self.scheduler_cfg["warmup_steps"]),
            total_steps=total,
            min_lr_ratio=float(self.scheduler_cfg["min_lr_ratio"]),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
