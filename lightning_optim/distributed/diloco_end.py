r"""The two ends of a DiLoCo run: whether a run of a given length reaches a synchronisation at all, and, when it
stops, which fragments the ranks still hold apart (``diloco.py`` takes the last synchronisation or warns).

A fragment is *apart* when some rank's params of it differ from the global copy :math:`\theta_g` (compared
exactly, in the params' dtype): the ranks then end with different models. Right after a synchronisation without
mixing every rank holds :math:`\theta_g`, so a fit that stops at a multiple of ``sync_every`` (one fragment, no
overlap) has nothing apart, and that is known from the schedule alone; otherwise the ranks agree on the answer
in one all-reduce of one flag per fragment.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim.comm.dense import world_size
from lightning_optim.comm.stats import CommStats, comm_stats, ring_allreduce_bytes
from lightning_optim.comm.timeouts import collective

__all__ = ["first_sync_after", "fragments_apart", "no_sync_message", "apart_message", "settled_by_schedule"]


def first_sync_after(step: int, sync_every: int, fragments: int) -> int:
    """The first inner step after ``step`` whose end starts an exchange (of some fragment)."""
    period = sync_every // fragments
    return step + period - step % period


def settled_by_schedule(step: int, sync_every: int, fragments: int, overlap: bool) -> bool:
    """Whether the schedule alone says every rank holds the global params after inner step ``step``: one
    fragment, no overlap, ``step`` a multiple of ``sync_every`` (the synchronisation just happened)."""
    return step > 0 and fragments == 1 and not overlap and step % sync_every == 0


@torch.no_grad()
def fragments_apart(params: Sequence[Tensor], global_params: Sequence[Tensor], bounds: Sequence[tuple[int, int]],
                    group: Any, stats: CommStats | None = None) -> list[int]:
    """The fragments whose params differ from the global copy on at least one rank (the same list on every
    rank: one all-reduce of a flag per fragment, counted as control bytes)."""
    apart = [int(any(not torch.equal(p.detach(), g.to(p.dtype)) for p, g in zip(params[lo:hi], global_params[lo:hi])))
             for lo, hi in bounds]
    world = world_size(group)
    if world > 1:
        flags = torch.tensor(apart, dtype=torch.int64, device=global_params[0].device)
        collective("all_reduce(DiLoCo fragments apart)", dist.all_reduce, flags, op=dist.ReduceOp.MAX, group=group)
        (comm_stats() if stats is None else stats).add_control(ring_allreduce_bytes(len(bounds), world, 8))
        apart = [int(v) for v in flags.tolist()]
    return [f for f, v in enumerate(apart) if v]


def no_sync_message(caller: str, sync_every: int, fragments: int, first: int, last: int, final_sync: bool) -> str:
    """The warning of a run that ends (after inner step ``last``) before its first synchronisation."""
    setting = f"sync_every={sync_every}" + (f", fragments={fragments}" if fragments > 1 else "")
    then = ("the ranks average their models only once, at its end (final_sync=True)" if final_sync else
            "the ranks never average: each trains its own model and ends with it (final_sync=False)")
    return (f"{caller}: {setting}, but this run ends at inner step {last} and the first synchronisation would "
            f"follow step {first}: {then}. Pass a sync_every the run spans several times (the DiLoCo papers use "
            "100 to 500 inner steps) for DiLoCo's periodic averaging")


def apart_message(caller: str, step: int, apart: int, fragments: int, sync_every: int) -> str:
    """The warning of a run that ends between synchronisations with ``final_sync=False``."""
    what = "the params" if fragments == 1 else f"{apart} of the {fragments} fragments of the params"
    return (f"{caller}: the run ends after inner step {step}, between two synchronisations (sync_every={sync_every}):"
            f" {what} differ between the ranks, every rank keeps its own (and a save from the main process alone "
            "keeps rank 0's). Pass final_sync=True to end with one synchronisation, or end the run right after a "
            "synchronisation")
