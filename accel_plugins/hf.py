"""The Hugging Face Trainer's ``optim`` argument for every lightning-optim optimizer.

    from accel_plugins.hf import TrainingArguments, Trainer
    args = TrainingArguments("out", optim="lion", optim_args="kahan_sum=False,betas=(0.95,0.98)")
    Trainer(model, args, ...)                       # or, with the stock classes:
    transformers.Trainer(model, stock_args, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args))

From the command line, ``HfArgumentParser(accel_plugins.hf.TrainingArguments)`` accepts our names:
``--optim onebit_adam --optim_args "freeze_step=100"``.

Hyper-parameters: ``learning_rate`` -> ``lr``; ``weight_decay``; ``adam_beta1``/``adam_beta2`` ->
``betas`` (two-beta classes; Adan's three come from ``optim_args``) and ``adam_epsilon`` -> ``eps`` where the class takes them; then ``optim_args``
(``key=value`` pairs separated by commas, values typed: ints, floats, ``True``/``False`` (also
lower case), ``None``, tuples such as ``betas=(0.9,0.99)``) override. An unknown name or key, a key
given twice, a pair without ``=`` or key, or a bad value (of the wrong type for the class's annotation,
or out of its range) raises ``ValueError`` naming it (HF's own parser would read ``kahan_sum=False`` as
the string "False", which is truthy, and keep the last of ``lr=1e-3,lr=2``).

Names (``lightning_optim.catalogue``): adam, adamw, sgd, lamb, lars, lion, adan, radam, ranger,
stable_adamw, sign_sgd, sparsified_sgd, cpu_adam, fused_adam, fused_lamb, fused_sgd, onebit_adam,
zero_one_adam, onebit_lamb. In these classes ``sgd`` and ``stable_adamw`` mean ours (HF's own:
torch.optim.SGD and optimi's StableAdamW; ours are drop-ins for both); every other HF name keeps its
meaning.

Stock classes: ``accel_plugins.hf.register()`` (transformers >= 4.47) makes ``transformers.TrainingArguments``,
``HfArgumentParser`` instances created after it, and ``transformers.Trainer`` take our names with the
same hyper-parameters; there ``sgd`` and ``stable_adamw`` keep HF's meaning. ``unregister()`` undoes it
(``_hf_register.py``). For the 1-bit names use :class:`Trainer`: the stock one keeps DDP's allreduce on.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field
from typing import Any

import transformers

from lightning_optim.catalogue import OPTIMIZERS, optimizer_class
from lightning_optim.config_rules import culprit, parameter_rules

__all__ = ["TrainingArguments", "Trainer", "optimizer_cls_and_kwargs", "parse_optim_args", "OPTIM_NAMES", "register",
           "unregister"]

OPTIM_NAMES = tuple(sorted(OPTIMIZERS))
_HF_NAMES = tuple(o.value for o in transformers.training_args.OptimizerNames)


def _split_pairs(text: str) -> list[str]:
    """``a=1,b=(2,3)`` -> ``["a=1", "b=(2,3)"]`` (commas inside brackets stay)."""
    pairs, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            pairs.append(current)
            current = ""
        else:
            current += ch
    pairs.append(current)
    return [p.strip() for p in pairs if p.strip()]


def _value(key: str, text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[lowered]
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        raise ValueError(f"optim_args: {key}={text!r} is not a number, bool, None or tuple") from None


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """HF's ``optim_args`` string as typed keyword arguments; a malformed pair or a repeated key raises
    ``ValueError`` naming it (HF's own parser keeps the last of ``lr=1e-3,lr=2`` silently)."""
    out: dict[str, Any] = {}
    for pair in _split_pairs(text or ""):
        key, sep, raw = (part.strip() for part in pair.partition("="))
        if not sep:
            raise ValueError(f"optim_args: {pair!r} is not key=value (no '=')")
        if not key.isidentifier():
            what = f"no valid key ({key!r})" if key else "no key"
            raise ValueError(f"optim_args: {pair!r} has {what} before '='")
        if key in out:
            raise ValueError(f"optim_args: {key} is given twice ({key}={out[key]!r}, then {pair!r}); give it once")
        out[key] = _value(key, raw)
    return out


# where optimizer_cls_and_kwargs takes a keyword from, when optim_args does not set it
_FROM_ARGS = {"lr": "learning_rate", "weight_decay": "weight_decay", "betas": "adam_beta1/adam_beta2",
              "eps": "adam_epsilon"}
_SUPPLIED = ("params", "model_params")  # the Trainer passes the model's parameters


def _check_optim_args(cls: type, extra: dict[str, Any]) -> None:
    """Every key one ``cls`` takes (along the ``**kwargs`` it forwards), every value of its annotated type."""
    rules = parameter_rules(cls)
    unknown = sorted(k for k in extra if k not in rules or k in _SUPPLIED)
    if unknown:
        raise ValueError(f"optim_args: {cls.__name__} takes no {', '.join(unknown)}; its arguments: "
                         f"{', '.join(sorted(set(rules) - set(_SUPPLIED)))}")
    for key, value in extra.items():
        if not rules[key].test(value):
            raise ValueError(f"optim_args: {key}={value!r} must be {rules[key].says}")


def _refusal(name: str, cls: type, kwargs: dict[str, Any], extra: dict[str, Any], exc: Exception) -> ValueError:
    """The constructor's error, led by the argument it is about: ``optim_args: key=...`` or the
    TrainingArguments field the value came from."""
    import torch

    key = culprit(kwargs, lambda options: cls([torch.zeros(2, requires_grad=True)], **options), exc)
    if key in extra:
        return ValueError(f"optim_args: {key}={extra[key]!r}: {exc}")
    if key in _FROM_ARGS:
        return ValueError(f"{_FROM_ARGS[key]} (the {name} optimizer's {key}): {exc}")
    return ValueError(f"optim / optim_args ({name}): {exc}")


def optimizer_cls_and_kwargs(args: Any) -> tuple[type, dict[str, Any]]:
    """``(class, kwargs)`` for ``args.optim`` (one of :data:`OPTIM_NAMES`), from ``args`` (see the module doc);
    pass it to ``transformers.Trainer(optimizer_cls_and_kwargs=...)`` (transformers >= 4.47)."""
    name = getattr(args, "lightning_optim_name", None) or str(getattr(args.optim, "value", args.optim))
    try:
        cls = optimizer_class(name)
    except ValueError as exc:
        raise ValueError(f"optim: {exc}") from None
    signature = inspect.signature(cls).parameters
    accepted = set(signature)
    kwargs: dict[str, Any] = {"lr": args.learning_rate}
    if "weight_decay" in accepted:
        kwargs["weight_decay"] = args.weight_decay
    if "betas" in accepted and len(signature["betas"].default) == 2:  # Adan's three betas: via optim_args
        kwargs["betas"] = (args.adam_beta1, args.adam_beta2)
    if "eps" in accepted:
        kwargs["eps"] = args.adam_epsilon
    if OPTIMIZERS[name].onebit:
        kwargs["average_grads"] = False  # the Trainer's DDP averages the warmup steps (switched off after)
    extra = parse_optim_args(getattr(args, "optim_args", None))
    _check_optim_args(cls, extra)
    kwargs.update(extra)
    try:  # check every value now, by name, on a dummy param (not at the first training step)
        import torch

        cls([torch.zeros(2, requires_grad=True)], **kwargs)
    except (TypeError, ValueError) as exc:
        raise _refusal(name, cls, kwargs, extra, exc) from None
    return cls, kwargs


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


class _OnebitSetup(transformers.TrainerCallback):
    """Registers the DDP switch on the wrapped model before the first step (``model_wrapped`` is the
    DDP model by ``on_train_begin``)."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        if trainer.onebit_optimizer is not None and _world() > 1 and trainer._onebit_handle is None:
            from accel_plugins.accelerate import enable_onebit

            trainer._onebit_handle = enable_onebit(trainer.accelerator, trainer.model_wrapped, trainer.optimizer)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Trainer(transformers.Trainer):
    """HF's Trainer that builds lightning-optim optimizers from ``args.optim`` and runs the 1-bit ones
    right under DDP: DDP's allreduce switched off in their compression stage (``enable_onebit``),
    each rank's error-feedback state saved next to ``optimizer.pt`` (``onebit_rank<r>.pt``) and
    restored by ``resume_from_checkpoint`` (HF makes every rank load rank 0's ``optimizer.pt``), and
    ``comm/bytes_sent`` / ``comm/compression_ratio`` (fp32 ring-allreduce bytes / bytes sent, since the
    last log) in the logs. ``max_grad_norm`` (default 1.0) clips each rank's local gradients in the
    compression stage, as DeepSpeed's 1-bit Adam does.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._onebit_handle = None
        self._comm_at_last_log = (0, 0)
        self.add_callback(_OnebitSetup(self))

    @property
    def onebit_optimizer(self) -> Any:
        from lightning_optim.onebit import OnebitOptimizer

        opt = getattr(self.optimizer, "optimizer", self.optimizer)
        return opt if isinstance(opt, OnebitOptimizer) else None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.onebit_optimizer is not None and _world() > 1:
            from accel_plugins.accelerate import save_rank_state

            save_rank_state(self.onebit_optimizer, self.model_wrapped, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.onebit_optimizer is not None and _world() > 1:
            from accel_plugins.accelerate import load_rank_state

            load_rank_state(self.onebit_optimizer, self.model_wrapped, checkpoint)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.onebit_optimizer is not None and "loss" in logs:
            from lightning_optim.comm import comm_stats

            stats = comm_stats()
            sent, fp32 = stats.bytes_sent - self._comm_at_last_log[0], stats.fp32_equivalent_bytes - self._comm_at_last_log[1]
            self._comm_at_last_log = (stats.bytes_sent, stats.fp32_equivalent_bytes)
            logs["comm/bytes_sent"] = float(sent)
            if sent:
                logs["comm/compression_ratio"] = fp32 / sent
        super().log(logs, *args, **kwargs)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> tuple[Any, Any]:
        if getattr(args, "lightning_optim_name", None):
            return optimizer_cls_and_kwargs(args)
        return transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)


# last: _hf_register reads optimizer_cls_and_kwargs from this module when it registers
from accel_plugins._hf_register import register, unregister  # noqa: E402
