"""The Hugging Face Trainer's ``optim`` argument for every lightning-optim optimizer.

    from accel_plugins.hf import TrainingArguments, Trainer
    args = TrainingArguments("out", optim="lion", optim_args="kahan_sum=False,betas=(0.95,0.98)")
    Trainer(model, args, ...)                       # or, with the stock classes:
    transformers.Trainer(model, stock_args, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args))

From the command line, ``HfArgumentParser(accel_plugins.hf.TrainingArguments)`` accepts our names:
``--optim onebit_adam --optim_args "freeze_step=100"``.

Hyper-parameters: ``learning_rate`` -> ``lr``; ``weight_decay``; ``adam_beta1``/``adam_beta2`` ->
``betas`` (two-beta classes; Adan's three come from ``optim_args``) and ``adam_epsilon`` -> ``eps`` where the
class takes them; then ``optim_args``
(``key=value`` pairs separated by commas, values typed: ints, floats, ``True``/``False`` (also
lower case), ``None``, tuples such as ``betas=(0.9,0.99)``) override. An unknown name or key, a key
given twice, a pair without ``=`` or key, or a bad value (of the wrong type for the class's annotation,
or out of its range) raises ``ValueError`` naming it (HF's own parser would read ``kahan_sum=False`` as
the string "False", which is truthy, and keep the last of ``lr=1e-3,lr=2``).

Names (``lightning_optim.catalogue``): adam, adamw, sgd, lamb, lars, lion, adan, radam, ranger,
stable_adamw, sign_sgd, sparsified_sgd, cpu_adam, fused_adam, fused_lamb, fused_sgd, onebit_adam,
zero_one_adam, onebit_lamb. In these classes ``sgd`` and ``stable_adamw`` mean ours (HF's own:
torch.optim.SGD and optimi's StableAdamW; ours are drop-ins for both); every other HF name keeps its
meaning. The old names ``signsgd`` and ``stableadamw`` (``lightning_optim.catalogue.OPTIMIZER_ALIASES``) are
taken too: a FutureWarning, then the new name.

Stock classes: ``accel_plugins.hf.register()`` (transformers >= 4.47) makes ``transformers.TrainingArguments``,
``HfArgumentParser`` instances created after it, and ``transformers.Trainer`` take our names with the
same hyper-parameters; there ``sgd`` and ``stable_adamw`` keep HF's meaning. ``unregister()`` undoes it
(``_hf_register.py``). For the 1-bit names the patched stock Trainer then has :class:`Trainer`'s own
methods (``_hf_trainer.py``): DDP's allreduce off in the compression stage, per-rank checkpoints, byte logs.

DiLoCo: ``callbacks=[DiLoCoCallback(sync_every=50)]`` around whatever optimizer ``optim`` builds (a callback, not
an ``optim`` name: DiLoCo wraps an optimizer rather than being one); ``DiLoCoArguments`` gives its
``--diloco_*`` command-line options (``_hf_diloco.py``, docs/guides/hf_trainer.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import transformers

from accel_plugins._hf_diloco import DiLoCoArguments, DiLoCoCallback
from accel_plugins._hf_optim import OPTIM_NAMES, optimizer_cls_and_kwargs, parse_optim_args
from accel_plugins._hf_register import register, unregister
from accel_plugins._hf_trainer import TRAINER_METHODS
from lightning_optim.catalogue import OPTIMIZER_ALIASES, OPTIMIZERS, optimizer_name

__all__ = ["TrainingArguments", "Trainer", "optimizer_cls_and_kwargs", "parse_optim_args", "OPTIM_NAMES", "register",
           "unregister", "DiLoCoCallback", "DiLoCoArguments"]

_HF_NAMES = tuple(o.value for o in transformers.training_args.OptimizerNames)


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """HF's TrainingArguments whose ``optim`` also takes lightning-optim's names (CLI included)."""

    optim: str = field(
        default="adamw_torch",
        metadata={"help": f"An HF optimizer name or one of lightning-optim's: {', '.join(OPTIM_NAMES)}"},
    )
    lightning_optim_name: str | None = field(default=None, metadata={"help": "Set from optim; leave unset."})

    def __post_init__(self) -> None:
        name = str(getattr(self.optim, "value", self.optim))
        if name in OPTIMIZER_ALIASES and name not in _HF_NAMES:
            name = optimizer_name(name)  # an old name of ours (signsgd): warns, then it is the new one
        ours = name in OPTIMIZERS
        if not ours and name not in _HF_NAMES:
            raise ValueError(f"optim: {name!r} is neither an HF optimizer name nor one of lightning-optim's "
                             f"({', '.join(OPTIM_NAMES)})")
        if ours:
            self.optim = "adamw_torch"  # HF's own checks run on a name it knows; ours is restored below
        super().__post_init__()
        if ours:
            self.lightning_optim_name = name
            self.optim = name
            optimizer_cls_and_kwargs(self)  # bad optim_args fail here, at parse time


class Trainer(transformers.Trainer):
    """HF's Trainer that builds lightning-optim optimizers from ``args.optim`` and runs the 1-bit ones
    right under DDP: DDP's allreduce switched off in their compression stage (``enable_onebit``),
    each rank's error-feedback state saved next to ``optimizer.pt`` (``onebit_rank<r>.pt``) and
    restored by ``resume_from_checkpoint`` (HF makes every rank load rank 0's ``optimizer.pt``), and
    ``comm/bytes_sent`` / ``comm/compression_ratio`` (fp32 ring-allreduce bytes / bytes sent, since the
    last log) in the logs. ``max_grad_norm`` (default 1.0) clips each rank's local gradients in the
    compression stage, as DeepSpeed's 1-bit Adam does. The methods doing this are ``_hf_trainer``'s,
    the same that ``register()`` puts on ``transformers.Trainer``.
    """

    __init__ = TRAINER_METHODS["__init__"]
    _save_optimizer_and_scheduler = TRAINER_METHODS["_save_optimizer_and_scheduler"]
    _load_optimizer_and_scheduler = TRAINER_METHODS["_load_optimizer_and_scheduler"]
    log = TRAINER_METHODS["log"]
    onebit_optimizer = TRAINER_METHODS["onebit_optimizer"]

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> tuple[Any, Any]:
        if getattr(args, "lightning_optim_name", None):
            return optimizer_cls_and_kwargs(args)
        return transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
