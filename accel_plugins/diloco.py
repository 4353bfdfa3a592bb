r"""DiLoCo for Hugging Face Accelerate: one call after ``accelerator.prepare``.

    model, optimizer, scheduler, loader = accelerator.prepare(model, torch.optim.AdamW(...), scheduler, loader)
    diloco = accel_plugins.enable_diloco(accelerator, model, optimizer, sync_every=50, max_steps=1000)
    # the loop stays as it is: accelerator.accumulate, accelerator.backward, clip_grad_norm_, optimizer.step(),
    # scheduler.step(), accelerator.save_state / load_state
    diloco.finish()   # without max_steps: after the loop, on every rank (one model on every rank)

What ``enable_diloco`` does (the algorithm: :class:`lightning_optim.DiLoCo`, docs/guides/low_communication.md):

* builds ``DiLoCo(inner, sync_every=..., ...)`` over the prepared optimizer's own optimizer and makes the
  prepared optimizer step through it: every inner step is a local step of your optimizer on this rank's own
  gradients; every ``sync_every`` inner steps the ranks average their parameter change and take one outer
  Nesterov step together (the only communication);
* registers the DDP comm hook ``"local"`` on the prepared model: no gradient all-reduce at all, each rank
  keeps its own gradients; buffers stay each rank's own too (``broadcast_buffers`` off);
* gradient accumulation: ``accelerator.accumulate`` steps the optimizer at the accumulation boundary only, so
  one boundary is one inner step (``sync_every`` counts optimizer steps, not micro-batches);
* per-rank checkpoints: ``accelerator.save_state`` writes the optimizer and the model from the main process
  only, but between synchronisations each rank has its own params and every rank its own inner state (and
  residuals with a compressor). A save-state hook makes every rank write ``diloco_rank<r>.pt`` next to
  Accelerate's files; on ``accelerator.load_state`` each rank loads its own file instead of rank 0's optimizer
  state, and its own params over rank 0's model (bitwise resume, also between synchronisations);
* refuses, before it changes anything (``TypeError``/``ValueError`` naming the argument): bad DiLoCo arguments,
  an optimizer that communicates by itself (1-bit, compressed, gossip, or a DiLoCo already), a DDP model with a
  comm hook already, fp16's GradScaler (a rank skipping a step alone would desynchronise the schedule), master
  weights, DeepSpeed/FSDP, and a process group of several ranks that Accelerate left single-process.

* the end of the run: Accelerate has no event for it, so DiLoCo learns it from ``max_steps`` (the optimizer
  step the run ends at, counted from the start of training as a resumed checkpoint counts it), or from
  ``handle.finish()`` called after the loop. With ``max_steps``, rank 0 warns at the first step where no
  synchronisation falls within the run, and ``finish`` runs by itself right after step ``max_steps``. ``finish``
  takes one last synchronisation where the ranks hold different params (``final_sync=True``, the default) or
  warns that they do (``final_sync=False``): see :class:`lightning_optim.DiLoCo`.

``accelerator.clip_grad_norm_`` clips each rank's local gradients (DiLoCo's inner steps are local).

Fault-tolerant (``manager=``, a ``torchft.Manager``; ``lightning_optim.fault_tolerance``): the replica groups
average instead of Accelerate's ranks, every synchronisation a quorum round of the manager. A replica group that
dies costs the survivors the synchronisation in progress (discarded on every survivor), not the job; one that
starts late or is relaunched is healed from a peer when ``enable_diloco`` builds DiLoCo (which waits for a quorum)::

    lighthouse = "http://host:29510"  # torchft_lighthouse --min_replicas 1, or fault_tolerance.local_lighthouse()
    manager = fault_tolerance.replica_manager(replica_id=f"replica{i}", lighthouse=lighthouse)
    accelerator = Accelerator()           # one process: `python train.py`, once per replica group
    model, optimizer = accelerator.prepare(model, optimizer)
    diloco = accel_plugins.enable_diloco(accelerator, model, optimizer, sync_every=50, manager=manager)

Each replica group is one process (an Accelerate run of several processes is refused, naming ``manager``):
there is no DDP, so no hook. The checkpoint hooks stay: ``diloco_rank0.pt`` in each replica's own
``save_state`` folder holds its DiLoCo state with the manager's committed step, and ``load_state`` restores
both (the replicas resumed together from one save continue bitwise). ``max_steps`` and ``finish()`` as above:
the final synchronisation is one more round of the replicas still there.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from accel_plugins._diloco import check_settings, install, resume_rank_state, save_rank_state
from lightning_optim.comm import CommStats, comm_stats
from lightning_optim.comm.ddp_hooks import LocalHookState
from lightning_optim.distributed.diloco import DiLoCo
from lightning_optim.optim.validation import check_int

__all__ = ["DiLoCoHandle", "enable_diloco"]


@dataclass
class DiLoCoHandle:
    """What :func:`enable_diloco` set up: the DiLoCo the prepared optimizer steps through, DDP's ``"local"``
    hook state (None without DDP) and the checkpoint hooks."""

    diloco: DiLoCo
    optimizer: Any  # the prepared (Accelerated) optimizer
    model: nn.Module
    hook: LocalHookState | None
    accelerator: Any
    max_steps: int | None = None
    _handles: list = field(default_factory=list)
    _step_hooks: list = field(default_factory=list)
    _started: bool = False
    _load_dir: str | None = None

    def comm_stats(self) -> CommStats:
        """This process's byte counters (``lightning_optim.comm.comm_stats()``): DiLoCo's exchanges only."""
        return comm_stats()

    def summary(self) -> dict[str, Any]:
        stats = comm_stats()
        return {"bytes_sent": stats.bytes_sent, "inner_steps": self.diloco.inner_steps,
                "sync_every": self.diloco.sync_every, "fragments": self.diloco.fragments,
                "final_sync": self.diloco.final_sync, "max_steps": self.max_steps,
                "compressor": self.diloco.compressor_name, "density": self.diloco.density,
                "bits": self.diloco.bits,
                "buckets_local": self.hook.buckets_local if self.hook is not None else 0,
                "fault_tolerant": self.diloco.replicas is not None,
                "rounds_discarded": 0 if self.diloco.replicas is None else self.diloco.replicas.rounds_discarded}

    def finish(self) -> bool:
        """End the run on every rank (``DiLoCo.finish``): the last synchronisation, or a warning with
        ``final_sync=False``; whether it synchronised anything (a second call finds nothing left to do)."""
        return self.diloco.finish("enable_diloco")

    def _first_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Before the first inner step (after any ``load_state``): the run-length checks, once."""
        if self._started or self.max_steps is None:
            return
        self._started = True
        if self.diloco.inner_steps >= self.max_steps:
            if self.diloco._origin()[1] == 0:
                warnings.warn(f"enable_diloco: max_steps={self.max_steps}, but the optimizer is at inner step "
                              f"{self.diloco.inner_steps} already: finish() will not run by itself; call "
                              "handle.finish() after the loop", UserWarning, stacklevel=2)
            return
        self.diloco.warn_if_no_sync(self.max_steps, "enable_diloco")

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.diloco.inner_steps == self.max_steps:
            self.finish()

    def close(self) -> None:
        """Remove the checkpoint hooks (for teardown: the optimizer keeps stepping through DiLoCo, and DDP keeps
        its ``"local"`` hook, which torch cannot unregister)."""
        for h in self._handles + self._step_hooks:
            h.remove()
        self._handles.clear()
        self._step_hooks.clear()
        vars(self.optimizer).pop("load_state_dict", None)

    # ------------------------------------------------------------------ checkpoint hooks
    def _save_hook(self, models: list, weights: list, output_dir: str) -> None:
        save_rank_state(self.diloco, self.model, output_dir)

    def _load_hook(self, models: list, input_dir: str) -> None:
        self._load_dir = input_dir

    def _load_optimizer_state(self, state_dict: dict[str, Any]) -> None:
        """The prepared optimizer's ``load_state_dict``: inside ``accelerator.load_state`` (after the model), this
        rank's own file (where it is missing or from another world size: the state given, rank 0's, with a
        warning); otherwise the state given."""
        directory, self._load_dir = self._load_dir, None
        if directory is not None:
            resume_rank_state("enable_diloco", self.diloco, self.model, directory, state_dict)
        else:
            self.diloco.load_state_dict(state_dict)


def enable_diloco(accelerator: Any, model: nn.Module, optimizer: Any, *, sync_every: int,
                  outer_lr: float | None = None, outer_momentum: float | None = None, nesterov: bool | None = None,
                  fragments: int = 1, overlap: bool = False, mixing: float | None = None, compressor: Any = None,
                  density: float | None = None, bits: int | None = None, final_sync: bool = True,
                  max_steps: int | None = None, manager: Any = None) -> DiLoCoHandle:
    """Train ``model`` with DiLoCo over ``optimizer``'s own optimizer (see the module doc). Call it on every rank
    right after ``accelerator.prepare``, before the first backward; the arguments are :class:`DiLoCo`'s (the outer
    ones left None: the recipe's defaults; ``compressor="sparseloco"`` with ``density`` and ``bits``), and
    ``max_steps`` (None or an int >= 1, the same on every rank) the optimizer step the run ends at: the
    run-length warning, and ``finish()`` right after that step (without it: call ``handle.finish()``).
    ``manager``: a ``torchft.Manager`` (``lightning_optim.fault_tolerance.replica_manager``): the replica groups,
    one process each, average fault-tolerantly; building DiLoCo then waits for a quorum."""
    settings = check_settings(sync_every, outer_lr, outer_momentum, nesterov, fragments, overlap, mixing, compressor,
                              final_sync, manager, density, bits)
    if max_steps is not None:
        check_int("max_steps", max_steps, 1)
    diloco, hook = install("enable_diloco", accelerator, model, optimizer, settings)
    handle = DiLoCoHandle(diloco=diloco, optimizer=optimizer, model=model, hook=hook, accelerator=accelerator,
                          max_steps=max_steps)
    if max_steps is not None:  # DiLoCo's own step hooks: they see inner steps, not accumulated micro-batches
        handle._step_hooks.append(diloco.register_step_pre_hook(handle._first_step))
        handle._step_hooks.append(diloco.register_step_post_hook(handle._after_step))
    optimizer.load_state_dict = handle._load_optimizer_state  # this instance only; close() removes it
    handle._handles.append(accelerator.register_save_state_pre_hook(handle._save_hook))
    handle._handles.append(accelerator.register_load_state_pre_hook(handle._load_hook))
    return handle
