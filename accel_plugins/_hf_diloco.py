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
``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler``, ``_hf_trainer.py``); where a rank's file
is missing, that rank resumes from the DiLoCo state in rank 0's ``optimizer.pt`` (step, global params, outer
momentum and rank 0's inner state), with a warning, as ``enable_diloco`` does under ``accelerator.load_state``.
The ends of ``train()``: at its start rank 0 warns where ``max_steps`` reaches no synchronisation; at
``on_train_end`` (after the last checkpoint) ``DiLoCo.finish`` takes one last synchronisation where the ranks
hold different params (``final_sync=True``, ``--diloco_final_sync``; False: a warning instead).

Fault-tolerant (``lightning_optim.fault_tolerance``, torchft): the replica groups average instead of the
Trainer's ranks, each synchronisation a quorum round; a replica group that dies costs the others the
synchronisation in progress, not the job, and one that starts late or is relaunched is healed from a peer at
``on_train_begin`` (which waits for a quorum). Each replica group is one process of its own launch (``python
train.py ...``; a Trainer of several processes is refused). Either give the manager yourself,
``DiLoCoCallback(sync_every=50, manager=replica_manager(replica_id="a", lighthouse=...))``, or let the callback
build it at ``on_train_begin``: ``DiLoCoCallback(sync_every=50, fault_tolerant=True, replica_id="a",
lighthouse="http://host:29510", min_replica_size=1)`` (``lighthouse`` unset: the ``TORCHFT_LIGHTHOUSE``
environment variable), from the command line ``--diloco_replica_id a --diloco_lighthouse http://host:29510``. The
manager it builds is ``callback.manager`` and lives as long as the process. Checkpoints as above
(``diloco_rank0.pt`` holds the manager's committed step too): replicas resumed together from one save continue
bitwise.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import transformers

from accel_plugins._diloco import check_settings, install, resume_rank_state, save_rank_state
from lightning_optim.comm import CommStats, comm_stats
from lightning_optim.distributed.diloco import DiLoCo
from lightning_optim.fault_tolerance.replicas import LIGHTHOUSE_ENV, replica_manager
from lightning_optim.optim.validation import check_flag, check_int

__all__ = ["DiLoCoArguments", "DiLoCoCallback", "diloco_callback"]

_OPTIMIZER_FILE = getattr(transformers.trainer, "OPTIMIZER_NAME", "optimizer.pt")  # where HF saves the optimizer


def check_replica_options(manager: Any, fault_tolerant: Any, replica_id: Any, lighthouse: Any,
                          min_replica_size: Any) -> dict[str, Any] | None:
    """The ``replica_manager`` arguments the callback builds its manager from (``fault_tolerant=True``), checked
    (``TypeError``/``ValueError`` naming the argument); None without ``fault_tolerant``."""
    check_flag("fault_tolerant", fault_tolerant)
    given = {"replica_id": replica_id, "lighthouse": lighthouse, "min_replica_size": min_replica_size}
    if not fault_tolerant:
        for name, value in given.items():
            if value is not None:
                raise ValueError(f"{name}: only used with fault_tolerant=True (the callback then builds the replica "
                                 f"manager from replica_id, lighthouse and min_replica_size), got {name}={value!r}"
                                 + ("; a manager given as manager= has its own" if manager is not None else ""))
        return None
    if manager is not None:
        raise ValueError("fault_tolerant: True makes the callback build a replica manager, and manager= gives one: "
                         "pass one of them")
    if not isinstance(replica_id, str) or not replica_id:
        raise ValueError(f"replica_id: fault_tolerant=True needs this replica group's name (a non-empty string, kept "
                         f"across relaunches), got {replica_id!r}")
    if lighthouse is not None and (not isinstance(lighthouse, str) or not lighthouse):
        raise ValueError(f"lighthouse: the Lighthouse's address, e.g. 'http://host:29510' (or None: "
                         f"{LIGHTHOUSE_ENV}), got {lighthouse!r}")
    if lighthouse is None and not os.environ.get(LIGHTHOUSE_ENV):
        raise ValueError(f"lighthouse: give the Lighthouse's address or set {LIGHTHOUSE_ENV} (start one with "
                         "`torchft_lighthouse --min_replicas 1` or lightning_optim.fault_tolerance.local_lighthouse())")
    size = 1 if min_replica_size is None else check_int("min_replica_size", min_replica_size, 1)
    return {"replica_id": replica_id, "lighthouse": lighthouse, "min_replica_size": size}


class DiLoCoCallback(transformers.TrainerCallback):
    """Train with :class:`lightning_optim.DiLoCo` around the Trainer's optimizer (arguments: DiLoCo's, checked
    here; the outer ones left None take the recipe's defaults; ``compressor="sparseloco"`` with ``density`` and
    ``bits``). Needs ``accel_plugins.hf.Trainer`` or the stock ``transformers.Trainer`` after
    ``accel_plugins.hf.register()`` (their setup callback installs it and keeps its per-rank checkpoints).

    Fault-tolerant (see the module doc; one process per replica group): ``manager``, a ``torchft.Manager``, or
    ``fault_tolerant=True`` with ``replica_id`` (this replica group's name), ``lighthouse`` (the Lighthouse's
    address; None: ``TORCHFT_LIGHTHOUSE``) and ``min_replica_size`` (None: 1), from which the callback builds
    one with ``lightning_optim.fault_tolerance.replica_manager`` when training starts."""

    def __init__(self, *, sync_every: int, outer_lr: float | None = None, outer_momentum: float | None = None,
                 nesterov: bool | None = None, fragments: int = 1, overlap: bool = False, mixing: float | None = None,
                 compressor: Any = None, density: float | None = None, bits: int | None = None,
                 final_sync: bool = True, manager: Any = None, fault_tolerant: bool = False,
                 replica_id: str | None = None, lighthouse: str | None = None,
                 min_replica_size: int | None = None) -> None:
        self.settings = check_settings(sync_every, outer_lr, outer_momentum, nesterov, fragments, overlap, mixing,
                                       compressor, final_sync, manager, density, bits)
        self.replica_options = check_replica_options(manager, fault_tolerant, replica_id, lighthouse,
                                                     min_replica_size)
        self.manager: Any = manager  # the torchft manager (built at setup with fault_tolerant=True)
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
        settings, make_manager = self.settings, None
        options = self.replica_options
        if options is not None and self.manager is not None:  # built by an earlier setup
            settings = {**settings, "manager": self.manager}
        elif options is not None:
            def make_manager() -> Any:  # after every check of install(): nothing is built for a refused setup
                self.manager = replica_manager(**options)
                return self.manager
        self.diloco, self.hook = install("DiLoCoCallback", trainer.accelerator, trainer.model_wrapped,
                                         trainer.optimizer, settings, make_manager=make_manager,
                                         argument="fault_tolerant" if self.replica_options else "manager")
        if getattr(trainer.args, "average_tokens_across_devices", False) and trainer.accelerator.num_processes > 1:
            warnings.warn("DiLoCoCallback: average_tokens_across_devices=True gathers the token count across ranks "
                          "at every step and weights each rank's loss by its share of the tokens (made for DDP's "
                          "gradient average, which DiLoCo does not take); pass average_tokens_across_devices=False "
                          "(each rank's loss is its own mean)",
                          stacklevel=2)
        directory, self._resume_dir = self._resume_dir, None
        if directory is not None:
            saved = os.path.join(directory, _OPTIMIZER_FILE)  # rank 0's, which HF loaded into the inner optimizer
            state = torch.load(saved, map_location="cpu", weights_only=True) if os.path.isfile(saved) else None
            resume_rank_state("DiLoCoCallback", self.diloco, trainer.model_wrapped, directory, state)
        state = trainer.state  # the run's length: max_steps optimizer steps, global_step of them taken
        if state.max_steps > 0:
            self.diloco.warn_if_no_sync(self.diloco.inner_steps + max(0, state.max_steps - state.global_step),
                                        "DiLoCoCallback")

    def save(self, trainer: Any, output_dir: str) -> None:
        if self.diloco is not None:
            save_rank_state(self.diloco, trainer.model_wrapped, output_dir)

    def resume_from(self, checkpoint: str) -> None:
        """Remember the folder: HF loads the checkpoint before ``on_train_begin``, DiLoCo is installed at it."""
        self._resume_dir = checkpoint

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The end of ``train()``, after its last checkpoint (which keeps the state before this and resumes
        bitwise): ``DiLoCo.finish`` on every rank. Not where HF has just loaded the best checkpoint's model
        (``load_best_model_at_end``): every rank holds that one model, which a synchronisation would move."""
        if self.diloco is None:
            return
        if getattr(args, "load_best_model_at_end", False) and state.best_model_checkpoint is not None:
            return
        self.diloco.finish("DiLoCoCallback")

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
    ``--diloco_sync_every`` unset means no DiLoCo; ``--diloco_replica_id`` set means fault-tolerant DiLoCo (one
    process per replica group; ``--diloco_lighthouse``, ``--diloco_min_replica_size``). ``callback()`` builds the
    DiLoCoCallback."""

    diloco_sync_every: int | None = field(default=None, metadata={"help": "DiLoCo: inner steps between syncs"})
    diloco_outer_lr: float | None = field(default=None, metadata={
        "help": "DiLoCo: outer SGD learning rate (> 0; unset: the recipe default, see DiLoCo)"})
    diloco_outer_momentum: float | None = field(default=None, metadata={
        "help": "DiLoCo: outer momentum in [0, 1); sparseloco: its accumulator's decay in [0, 1] (unset: the recipe "
                "default)"})
    diloco_nesterov: bool | None = field(default=None, metadata={
        "help": "DiLoCo: Nesterov outer momentum, True or False (unset: the recipe default; not with sparseloco)"})
    diloco_fragments: int = field(default=1, metadata={"help": "Streaming DiLoCo: fragments (divides sync_every)"})
    diloco_overlap: bool = field(default=False, metadata={"help": "Streaming DiLoCo: overlap each exchange"})
    diloco_mixing: float | None = field(default=None, metadata={"help": "Streaming DiLoCo: mixing alpha in [0, 1]"})
    diloco_compressor: str | None = field(default=None, metadata={
        "help": "DiLoCo: compress the pseudo-gradients: int8, int4, onebit, sign, topk, powersgd, sparseloco"})
    diloco_density: float | None = field(default=None, metadata={
        "help": "SparseLoCo (--diloco_compressor sparseloco): share of each chunk sent, in (0, 1] (unset: 1/64)"})
    diloco_bits: int | None = field(default=None, metadata={
        "help": "SparseLoCo (--diloco_compressor sparseloco): bits per sent value, in [1, 8] (unset: 2)"})
    diloco_final_sync: bool = field(default=True, metadata={
        "help": "DiLoCo: a run that ends between syncs takes one more (False: the ranks end apart, with a warning)"})
    diloco_replica_id: str | None = field(default=None, metadata={
        "help": "fault-tolerant DiLoCo (torchft): this replica group's name (one process per replica group)"})
    diloco_lighthouse: str | None = field(default=None, metadata={
        "help": "fault-tolerant DiLoCo: the Lighthouse's address, http://host:port (unset: TORCHFT_LIGHTHOUSE)"})
    diloco_min_replica_size: int | None = field(default=None, metadata={
        "help": "fault-tolerant DiLoCo: the fewest replica groups a synchronisation commits with (unset: 1)"})

    def __post_init__(self) -> None:
        if self.diloco_sync_every is None:
            given = [f"--{f.name} {getattr(self, f.name)}" for f in fields(self)
                     if f.name != "diloco_sync_every" and getattr(self, f.name) != f.default]
            if given:
                raise ValueError(f"diloco_sync_every: unset (no DiLoCo), but {', '.join(given)} given; pass "
                                 "--diloco_sync_every N (inner steps between syncs, an int >= 1) to train with "
                                 "DiLoCo, or drop the other --diloco_* options")
            return
        self.callback()  # bad values fail at parse time

    def callback(self) -> DiLoCoCallback | None:
        """The DiLoCoCallback these options give (None without ``--diloco_sync_every``); fault-tolerant with
        ``--diloco_replica_id`` (its manager is built when training starts)."""
        if self.diloco_sync_every is None:
            return None
        replica: dict[str, Any] = {"replica_id": self.diloco_replica_id, "lighthouse": self.diloco_lighthouse,
                                   "min_replica_size": self.diloco_min_replica_size}
        if self.diloco_replica_id is None:
            given = [f"--diloco_{k} {v}" for k, v in replica.items() if v is not None]
            if given:
                raise ValueError(f"diloco_replica_id: unset (DiLoCo over the Trainer's ranks), but {', '.join(given)} "
                                 "given; pass --diloco_replica_id NAME (this replica group's name) to train "
                                 "fault-tolerantly, or drop the other option(s)")
        try:
            return DiLoCoCallback(sync_every=self.diloco_sync_every, outer_lr=self.diloco_outer_lr,
                                  outer_momentum=self.diloco_outer_momentum, nesterov=self.diloco_nesterov,
                                  fragments=self.diloco_fragments, overlap=self.diloco_overlap,
                                  mixing=self.diloco_mixing, compressor=self.diloco_compressor,
                                  density=self.diloco_density, bits=self.diloco_bits,
                                  final_sync=self.diloco_final_sync, fault_tolerant=self.diloco_replica_id is not None,
                                  **replica)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"diloco_{exc}") from None  # the messages start with the argument's name
