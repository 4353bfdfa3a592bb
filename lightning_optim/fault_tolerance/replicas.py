"""The Lighthouse and the per-replica-group ``torchft.Manager``, made with the settings our optimizers need.

    # once, anywhere the replicas can reach (or `torchft_lighthouse --min_replicas 1`):
    lighthouse = local_lighthouse(min_replicas=1)
    # in every replica group (each one its own launch: `python train.py`, `torchrun ...`):
    manager = replica_manager(replica_id="a", lighthouse=lighthouse.address())
    optimizer = lightning_optim.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=50, manager=manager)

A replica group may be one process (a store is started for it) or several launched by ``torchrun`` (its
``MASTER_ADDR``/``MASTER_PORT`` store and ``RANK``/``WORLD_SIZE``); rank ``g`` of every replica group
exchanges with rank ``g`` of the others.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import socket
import weakref
from datetime import timedelta
from typing import Any

import torch

from lightning_optim.optim.validation import check_int, check_positive

__all__ = ["LIGHTHOUSE_ENV", "local_lighthouse", "replica_manager", "require_torchft"]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable: the Lighthouse's address
# a one-process replica group's store lives as long as its manager
_STORES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # managers to shut down at exit (twice is harmless)


@atexit.register
def _shut_down_managers() -> None:
    """Stop the managers' servers and threads before the interpreter tears down: a manager left running at exit
    can abort the process ("terminate called without an active exception") after a run that succeeded."""
    for manager in list(_LIVE):
        with contextlib.suppress(Exception):  # exiting anyway: nothing to report to
            manager.shutdown(wait=False)


def require_torchft() -> Any:
    """The ``torchft`` module, or ``ImportError`` saying how to install it."""
    try:
        import torchft
    except ImportError as exc:
        raise ImportError("fault-tolerant training needs torchft: pip install 'lightning-optim[ft]'") from exc
    return torchft


def local_lighthouse(min_replicas: int = 1, *, join_timeout_ms: int = 60_000, heartbeat_timeout_ms: int = 5000,
                     bind: str = "[::]:0") -> Any:
    """Start torchft's Lighthouse in this process (a ``LighthouseServer``: ``.address()``, ``.shutdown()``).

    Args:
        min_replicas: the fewest replica groups a quorum forms with (>= 1).
        join_timeout_ms: how long a quorum waits for a live replica that has not asked yet (torchft's default,
            60 s: a replica that drifts behind its peers by more is left out of the round, waits for the next one
            and is healed, losing its steps; a dead replica is not waited for once its heartbeat stops).
        heartbeat_timeout_ms: a replica silent this long counts as gone: what a dead replica costs the
            survivors at their next synchronisation.
        bind: address to listen on (``[::]:0``: any interface, a free port).
    """
    check_int("min_replicas", min_replicas, 1)
    check_int("join_timeout_ms", join_timeout_ms, 1)
    check_int("heartbeat_timeout_ms", heartbeat_timeout_ms, 1)
    require_torchft()
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms)


def replica_manager(*, replica_id: str, min_replica_size: int = 1, lighthouse: str | None = None,
                    host: str | None = None, timeout_s: float = 30.0, quorum_timeout_s: float = 600.0) -> Any:
    """A ``torchft.Manager`` for this replica group, as DiLoCo and the ``ft_*`` strategies need it
    (synchronous quorum, gloo process group; no state registered yet: the optimizer registers its own).

    Args:
        replica_id: this replica group's name, the same on every rank of the group and kept across relaunches.
        min_replica_size: the fewest replica groups a step commits with; below it the replicas wait.
        lighthouse: the Lighthouse's address (default: the ``TORCHFT_LIGHTHOUSE`` environment variable).
        host: the address other replica groups reach this one at (its store and manager; default: the
            ``MASTER_ADDR`` of a torchrun launch, else this machine's host name).
        timeout_s: bound of each collective, commit decision and healing transfer: a replica cut off without a
            closed connection costs the survivors this long.
        quorum_timeout_s: how long a quorum may wait for enough replicas before it raises.
    """
    if not isinstance(replica_id, str) or not replica_id:
        raise ValueError(f"replica_id must be a non-empty string naming this replica group, got {replica_id!r}")
    check_int("min_replica_size", min_replica_size, 1)
    check_positive("timeout_s", timeout_s)
    check_positive("quorum_timeout_s", quorum_timeout_s)
    lighthouse = lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not lighthouse:
        raise ValueError(f"lighthouse: give the Lighthouse's address (or set {LIGHTHOUSE_ENV}); start one with "
                         "`torchft_lighthouse --min_replicas 1` or lightning_optim.fault_tolerance.local_lighthouse()")
    require_torchft()
    from torch.distributed import TCPStore
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "MASTER_PORT" in os.environ and world > 1:  # torchrun's store for the replica group
        store_host, store_port, store = os.environ.get("MASTER_ADDR", "localhost"), int(os.environ["MASTER_PORT"]), None
    else:  # one process: its own store
        store_host = host or socket.gethostname()
        store = TCPStore(store_host, 0, is_master=True, wait_for_workers=False)
        store_port = store.port
    timeout = timedelta(seconds=timeout_s)
    pg = ProcessGroupGloo(timeout=timeout)
    # healing state travels over the quorum's own process group (the addresses the collectives use), not over
    # HTTP to this machine's host name, which peers in other network namespaces or clusters may not resolve
    transport = PGTransport(pg, timeout=timeout, device=torch.device("cpu"))
    manager = Manager(pg=pg, load_state_dict=None, state_dict=None, checkpoint_transport=transport,
                      min_replica_size=min_replica_size, use_async_quorum=False, timeout=timeout,
                      quorum_timeout=timedelta(seconds=quorum_timeout_s), connect_timeout=timeout,
                      rank=rank, world_size=world, store_addr=store_host, store_port=store_port,
                      lighthouse_addr=lighthouse, replica_id=replica_id, hostname=host or socket.gethostname())
    if store is not None:
        _STORES[manager] = store
    _LIVE.add(manager)
    return manager
