"""Several runs ("phases") in one ``torchrun`` launch, for the scripts of tests/accel.

Starting torchrun and two ranks costs ~5-7 s of CPU per rank before any work (fresh interpreters importing
torch, accelerate, transformers and lightning_optim), so a test file that needs several runs of one script (a full run, the run resumed from
its checkpoint, another route) launches it once with a list of phases: each phase is the argument list one
launch took before, and ``then`` separates them:

    python -m torch.distributed.run --nproc_per_node 2 script.py OUT/full save_at=6 then OUT/resumed load=... start=6

The ranks run the phases in turn, each into its own output directory. Before each, :func:`start_phase` puts back
the process-wide state a freshly launched rank starts with, so a phase sees what its own launch saw:

* Accelerate's singletons: ``AcceleratorState`` (the accelerator's configuration) and ``GradientState``
  (gradient accumulation), reset as Accelerate's own torchrun test scripts reset them between their parts.
  ``PartialState`` stays: it holds the launch's process group, which every run of one launch shares anyway;
* lightning-optim's process-wide byte counter behind ``comm_stats()`` (zeroed), the compressed allreduce's plan
  and scratch caches (emptied), and any module global of lightning_optim / accel_plugins rebound since the first
  phase began (a warn-once flag, ``set_collective_timeout``'s bound), put back;
* the previous phase's objects (its DDP models, optimizers, Trainer) collected, so that a phase's socket byte
  counts (``tests/wire.py``, cumulative per process: the scripts take differences within a phase) and memory are
  its own.

Left to the scripts: random seeds (each phase seeds as its launch did) and ``accel_plugins.hf.register()``, whose
patches of transformers are process-wide: the HF scripts call ``register()`` or ``unregister()`` at the start of
each phase, as its route needs. What no phase gets anew: modules imported by an earlier phase are not imported
again, and the process group is already connected.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Iterable, Sequence

from tests.library_state import KEPT_BY_DEFAULT, library_globals, restore_library_state

SEPARATOR = "then"  # a bare word: torchrun hands it to the script untouched, and no option value is "then"

# module globals kept across phases: the loaded C++ extension (a cache of the disk) and register()'s own record
# of its patches (unregister() needs it; the HF scripts choose the route per phase themselves)
_KEPT_MODULES = KEPT_BY_DEFAULT | {"accel_plugins._hf_register"}

_first_globals: dict[str, dict[str, object]] | None = None  # module globals as the first phase found them


# ---------------------------------------------------------------------------------------- the test's side

def join_phases(phases: Iterable[Sequence[str | Path]]) -> list[str]:
    """The command line of one launch that runs ``phases`` (argument lists) in turn."""
    joined: list[str] = []
    for phase in phases:
        if joined:
            joined.append(SEPARATOR)
        joined += [str(arg) for arg in phase]
    return joined


def run_phases(script: Path, phases: Sequence[Sequence[str | Path]], *, cwd: Path, nproc: int = 2):
    """One ``torchrun`` launch of ``script`` running ``phases``; each phase keeps the time one launch had."""
    from tests.distributed import run_torchrun

    return run_torchrun(script, *join_phases(phases), cwd=cwd, nproc=nproc, timeout=300 * len(phases))


def rank_results(out: Path, stem: str = "rank", nproc: int = 2) -> list:
    """The objects a phase saved as ``out/<stem><r>.pt``, in rank order."""
    import torch

    return [torch.load(Path(out) / f"{stem}{r}.pt", weights_only=False) for r in range(nproc)]


# ---------------------------------------------------------------------------------------- the ranks' side

def split_phases(argv: Sequence[str]) -> list[list[str]]:
    """``argv`` (the script's arguments) cut at each ``then``: one argument list per phase."""
    phases: list[list[str]] = [[]]
    for arg in argv:
        if arg == SEPARATOR:
            phases.append([])
        else:
            phases[-1].append(arg)
    return phases


def start_phase() -> None:
    """Put back the process-wide state a freshly launched rank starts with (see the module docstring)."""
    global _first_globals
    gc.collect()
    reset_accelerate(keep_process_group=True)  # the launch's process group serves every phase
    if _first_globals is None:
        _first_globals = library_globals(_KEPT_MODULES)
    restore_library_state(_first_globals)


def end_launch() -> None:
    """What ``accelerator.end_training()`` does at the end of a script: destroy the launch's process group
    (exiting with a live gloo group can abort at teardown)."""
    from accelerate import PartialState

    PartialState().destroy_process_group()


def reset_accelerate(*, keep_process_group: bool) -> None:
    """Accelerate keeps its state in class-level singletons (the distributed type, the process group it took,
    gradient accumulation): reset as Accelerate's own tests reset them, so the next ``Accelerator()`` sets
    itself up as in a fresh process (``keep_process_group``: ``PartialState``, which holds the group, stays)."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=not keep_process_group)
        state.GradientState._reset_state()
