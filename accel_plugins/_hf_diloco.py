"""DiLoCo under the Hugging Face Trainer: a callback, because DiLoCo wraps whatever optimizer the Trainer builds
(``--optim`` keeps choosing the inner one: HF's ``adamw_torch``, ours such as ``lion``, or ``optimizers=``).

    trainer = accel_plugins.hf.Trainer(model, args, train_dataset=data,
                                       callbacks=[accel_plugins.hf.DiLoCoCallback(sync_every=50)])
    # stock classes: accel_plugins.hf.register(), then transformers.Trainer(..., callbacks=[DiLoCoCallback(...)])
    # command line: HfArgumentParser((TrainingArguments, DiLoCoArguments)) -> --diloco_sync_every 50 ...

At ``on_train_begin`` (the Trainer's setup callback, which knows the trainer, calls :meth:`DiLoCoCallback.setup`)
the prepared optimizer is made to step through ``DiLoCo`` and the DDP model gets the ``"local"`` comm hook (no
gradient all-reduce at all): ``accel_plugins._diloco.install``, the same as ``enable_diloco``. Checkpoints:
every rank writes ``diloco_rank<r>.pt`` into each ``checkpoint-N`` folder (this rank's DiLoCo state and params),
and ``resume_from_checkpoint`` loads it after HF has loaded rank 0's model and optimizer (the Trainer's
``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler``, ``_hf_trainer.py``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import transformers

from accel_plugins._diloco import check_settings, install, load_rank_state, save_rank_state
from lightning_optim.comm import CommStats, comm_stats
from lightning_optim.distributed.diloco import DiLoCo

__all__ = ["DiLoCoArguments", "DiLoCoCallback", "diloco_callback"]


class DiLoCoCallback(transformers.TrainerCallback):
    """Train with :class:`lightning_optim.DiLoCo` around the Trainer's optimizer (arguments: DiLoCo's, checked
    here). Needs ``accel_plugins.hf.Trainer`` or the stock ``transformers.Trainer`` after
    ``accel_plugins.hf.register()`` (their setup callback installs it and keeps its per-rank checkpoints)."""

    def __init__(self, *, sync_every: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, fragments: int = 1, overlap: bool = False, mixing: float | None = None,
                 compressor: Any = None) -> None:
        self.settings = check_settings(sync_every, outer_lr, outer_momentum, nesterov, fragments, overlap, mixing,
                                       compressor)
        self.diloco: DiLoCo | None = None
        self.hook: Any = None
        self._resume_dir: str | None = None

    def comm_stats(self) -> CommStats:
        """This process's byte counters (``lightning_optim.comm.comm_stats()``): DiLoCo's exchanges only."""
        return comm_stats()

    def setup(self, trainer: Any) -> None:
        """Install DiLoCo on ``trainer``'s prepared optimizer and DDP model (collective: every rank, before the
        first step); then this rank's own state where ``resume_from_checkpoint`` gave a folder with it."""
        if self.diloco is not None and getattr(trainer.optimizer, "optimizer", None) is self.diloco:
            return  # a second train() on the same trainer keeps it
        self.diloco, self.hook = install("DiLoCoCallback", trainer.accelerator, trainer.model_wrapped,
                                         trainer.optimizer, self.settings)
        if getattr(trainer.args, "average_tokens_across_devices", False) and trainer.accelerator.num_processes > 1:
            warnings.warn("DiLoCoCallback: average_tokens_across_devices=True gathers the token count across ranks "
                          "at every step and weights each rank's loss by its share of the tokens (made for DDP's "
                          "gradient average, which DiLoCo does not take); pass average_tokens_across_devices=False "
                          "(each rank's loss is its own mean)",
                          stacklevel=2)
        directory, self._resume_dir = self._resume_dir, None
        if directory is not None:
            load_rank_state(self.diloco, trainer.model_wrapped, directory)

    def save(self, trainer: Any, output_dir: str) -> None:
        if self.diloco is not None:
            save_rank_state(self.diloco, trainer.model_wrapped, output_dir)

    def resume_from(self, checkpoint: str) -> None:
        """Remember the folder: HF loads the checkpoint before ``on_train_begin``, DiLoCo is installed at it."""
        self._resume_dir = checkpoint

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.diloco is None:  # before the first backward: nothing has been all-reduced yet
            raise RuntimeError("DiLoCoCallback was not installed: use accel_plugins.hf.Trainer, or call "
                               "accel_plugins.hf.register() before building transformers.Trainer")


def diloco_callback(trainer: Any) -> DiLoCoCallback | None:
    """The trainer's DiLoCoCallback, or None; more than one is refused."""
    found = [c for c in trainer.callback_handler.callbacks if isinstance(c, DiLoCoCallback)]
    if len(found) > 1:
        raise ValueError(f"callbacks: {len(found)} DiLoCoCallbacks given; one wraps the optimizer (pass one)")
    return found[0] if found else None


@dataclass
class DiLoCoArguments:
    """DiLoCo's arguments for ``HfArgumentParser`` (prefixed: they share the parser with TrainingArguments);
    ``--diloco_sync_every`` unset means no DiLoCo. ``callback()`` builds the DiLoCoCallback."""

    diloco_sync_every: int | None = field(default=None, metadata={"help": "DiLoCo: inner steps between syncs"})
    diloco_outer_lr: float = field(default=0.7, metadata={"help": "DiLoCo: outer SGD learning rate (> 0)"})
    diloco_outer_momentum: float = field(default=0.9, metadata={"help": "DiLoCo: outer momentum in [0, 1)"})
    diloco_nesterov: bool = field(default=True, metadata={"help": "DiLoCo: Nesterov outer momentum"})
    diloco_fragments: int = field(default=1, metadata={"help": "Streaming DiLoCo: fragments (divides sync_every)"})
    diloco_overlap: bool = field(default=False, metadata={"help": "Streaming DiLoCo: overlap each exchange"})
    diloco_mixing: float | None = field(default=None, metadata={"help": "Streaming DiLoCo: mixing alpha in [0, 1]"})
    diloco_compressor: str | None = field(default=None, metadata={
        "help": "DiLoCo: compress the pseudo-gradients: int8, int4, onebit, sign, topk, powersgd"})

    def __post_init__(self) -> None:
        if self.diloco_sync_every is not None:
            self.callback()  # bad values fail at parse time

    def callback(self) -> DiLoCoCallback | None:
        if self.diloco_sync_every is None:
            return None
        try:
            return DiLoCoCallback(sync_every=self.diloco_sync_every, outer_lr=self.diloco_outer_lr,
                                  outer_momentum=self.diloco_outer_momentum, nesterov=self.diloco_nesterov,
                                  fragments=self.diloco_fragments, overlap=self.diloco_overlap,
                                  mixing=self.diloco_mixing, compressor=self.diloco_compressor)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"diloco_{exc}") from None  # the messages start with the argument's name
