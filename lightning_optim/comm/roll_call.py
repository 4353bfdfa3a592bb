"""Which rank failed: a roll call through the rendezvous store after a collective failed.

A backend only says that *a* peer is gone ("Connection closed by peer [127.0.0.1]:41151") or that the
wait ran out; and on 3+ ranks some survivors see the death at once while others only time out (they
wait on a survivor that already left the collective). So after a failure every survivor answers a roll
call: it writes ``lightning_optim/roll_call/<tag>/<its global rank>`` into the process group's store (the
one every rank joined at ``init_process_group``), then waits until ``until`` for the others' keys. The
ranks of ``group`` whose key is missing by then are the failed ones: dead, hung, or gone. ``tag`` names
the exchange (the same on every rank: e.g. the step and the fragment), so each failure has its own roll.

Callers give every survivor time to answer: the collective itself is waited on until ``bound - grace``
(``PendingCollective.wait(margin=grace)``) and the roll call runs until the bound. A survivor that
reached the exchange more than ``grace`` seconds after another is named too (as not answering in time).

The store may be gone as well (under ``init_method="tcp://"`` rank 0 hosts it): then the roll call says so
and names the store's host as the likely failure.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch.distributed as dist

from .agreement import fingerprint
from .timeouts import CommunicationError

__all__ = ["failed_ranks", "grace_for", "named_failure", "roll_call"]

_POLL_S = 0.05
MAX_GRACE_S = 1.0


def grace_for(bound: float) -> float:
    """Seconds kept from a collective's bound for the roll call: a quarter of it, at most one second."""
    return min(MAX_GRACE_S, bound / 4)


def _group_ranks(group) -> list[int]:
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def roll_call(tag: str, group=None, *, until: float) -> list[int] | None:
    """The global ranks of ``group`` whose answer to the roll call ``tag`` is missing at ``time.monotonic()
    == until`` (returns earlier when everyone answered); None when the store itself does not answer."""
    try:
        ranks = _group_ranks(group)
        prefix = f"lightning_optim/roll_call/{fingerprint(ranks):08x}/{tag}/"  # one roll per group and tag
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        store.set(prefix + str(me), "here")
        missing = [r for r in ranks if r != me]
        while missing:
            missing = [r for r in missing if not store.check([prefix + str(r)])]
            if not missing or time.monotonic() >= until:
                break
            time.sleep(_POLL_S)
    except Exception:  # noqa: BLE001 - the store failing is an answer too
        return None
    return missing


def failed_ranks(missing: Sequence[int] | None) -> str:
    """What the roll call found, as the sentence a person reads."""
    if missing is None:
        return ("the rendezvous store does not answer either: the process hosting it (rank 0 under "
                "init_method='tcp://', the launcher's agent under torchrun) probably failed")
    if not missing:
        return "every rank answered the roll call: the network or the backend failed, not a rank"
    ranks = ", ".join(str(r) for r in missing)
    return (f"rank{'s' if len(missing) > 1 else ''} {ranks} failed: no answer to the roll call within the "
            "collective timeout (dead, hung, or left the job)")


def named_failure(exc: BaseException, what: str, tag: str, group=None, *, until: float) -> CommunicationError:
    """``exc`` (a failed collective of ``what``) as a ``CommunicationError`` naming the ranks that failed."""
    missing = roll_call(tag, group, until=until)
    error = CommunicationError(f"{what} failed on rank {dist.get_rank()}: {failed_ranks(missing)}. {exc}")
    error.failed_ranks = None if missing is None else list(missing)
    return error
