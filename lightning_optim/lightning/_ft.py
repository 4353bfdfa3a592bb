r"""The fault-tolerant strategies (``ft_diloco``, ``ft_ddp``) on torchft, written once for both Lightning packages.

One Lightning process is one **replica group**: each replica is its own launch (``python train.py`` on every
machine, with its own ``replica_id``), and a torchft Lighthouse forms a quorum of the replicas at every
synchronisation (``ft_diloco``) or step (``ft_ddp``). A replica that dies costs the others the exchange in progress;
they go on with the replicas that are left, and a replica launched again is healed from a healthy peer
(``lightning_optim.distributed.diloco_replicas``, ``lightning_optim.fault_tolerance.ddp``). No math here.

The replica's settings (both strategies):

* ``replica_id``: this replica's name, kept across relaunches (default: the environment's ``REPLICA_ID``, then
  ``TORCHFT_REPLICA_ID``);
* ``lighthouse``: the Lighthouse's address (``http://host:29510``; default: the ``TORCHFT_LIGHTHOUSE``
  environment variable). On a cluster run torchft's ``torchft_lighthouse --min_replicas 1``
  on a machine every replica reaches and give its address to every replica. For a try on one machine,
  ``lighthouse="local"`` (``"local:PORT"``; port 29510 by default) starts a Lighthouse inside this replica's
  process (it lives as long as the process) and connects to it; the other replicas take
  ``lighthouse="http://localhost:PORT"``;
* ``min_replica_size``: the fewest replicas a synchronisation commits with (below it the replicas wait); a
  Lighthouse started with ``"local"`` forms quorums of at least this many;
* ``host``: the address the other replicas reach this one at (default: this machine's host name);
* ``timeout``: seconds each collective, commit decision and healing transfer may take (a replica cut off without
  a closed connection costs the others this much).

The arguments are checked when the strategy is made; the replica id and the Lighthouse are resolved (from the
environment where not given) when the Trainer is built, where a Trainer of more than one process per replica
group is refused. The torchft ``Manager`` is made when a fit sets up its optimizer and shut down when the fit ends.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from datetime import timedelta
from typing import Any, ClassVar

from lightning_optim.comm.stats import ring_allreduce_bytes
from lightning_optim.lightning._bases import DDPBase, attached
from lightning_optim.lightning._diloco import _DiLoCoMixin
from lightning_optim.lightning._failures import _CommFailureMixin
from lightning_optim.onebit.convert import retarget_schedulers

__all__ = ["DEFAULT_LIGHTHOUSE_PORT", "REPLICA_ID_ENV", "_FTDDPMixin", "_FTDiLoCoMixin", "resolve_lighthouse",
           "resolve_replica_id"]

REPLICA_ID_ENV = ("REPLICA_ID", "TORCHFT_REPLICA_ID")
DEFAULT_LIGHTHOUSE_PORT = 29510  # torchft_lighthouse's own default
DEFAULT_FT_TIMEOUT_S = 30.0
LOCAL = "local"
_NOT_OURS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")
log = logging.getLogger("lightning_optim")

_local_lighthouses: dict[int, Any] = {}  # port -> the Lighthouse this process started (lives until exit)
_local_lock = threading.Lock()


def resolve_replica_id(replica_id: object) -> str:
    """``replica_id``, else the environment's ``REPLICA_ID`` / ``TORCHFT_REPLICA_ID``; ``ValueError`` naming the
    argument when none is set."""
    if replica_id is None:
        replica_id = next((os.environ[name] for name in REPLICA_ID_ENV if os.environ.get(name)), None)
        if replica_id is None:
            raise ValueError(f"replica_id: give this replica group's name (e.g. replica_id='r0', the same across its "
                             f"relaunches, another on every replica) or set {' or '.join(REPLICA_ID_ENV)}")
    if not isinstance(replica_id, str) or not replica_id.strip():
        raise ValueError(f"replica_id must be a non-empty string naming this replica group, got {replica_id!r}")
    return replica_id


def _local_port(lighthouse: str) -> int | None:
    """The port of ``"local"`` / ``"local:PORT"`` (None: an address)."""
    if lighthouse == LOCAL:
        return DEFAULT_LIGHTHOUSE_PORT
    if not lighthouse.startswith(LOCAL + ":"):
        return None
    port = lighthouse[len(LOCAL) + 1:]
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"lighthouse={lighthouse!r}: 'local:PORT' needs a port in [1, 65535]")
    return int(port)


def check_lighthouse(lighthouse: object) -> None:
    """``ValueError``/``TypeError`` naming ``lighthouse`` unless it is None, ``"local"``, ``"local:PORT"`` or an
    ``http(s)://host:port`` address."""
    if lighthouse is None:
        return
    if not isinstance(lighthouse, str):
        raise TypeError(f"lighthouse must be None, 'local', 'local:PORT' or an address such as "
                        f"'http://host:29510', got {type(lighthouse).__name__}")
    if _local_port(lighthouse) is None and not lighthouse.startswith(("http://", "https://")):
        raise ValueError(f"lighthouse must be 'local', 'local:PORT' or the Lighthouse's address such as "
                         f"'http://host:{DEFAULT_LIGHTHOUSE_PORT}', got {lighthouse!r}")


def resolve_lighthouse(lighthouse: str | None) -> str:
    """The Lighthouse setting to use: ``lighthouse``, else the ``TORCHFT_LIGHTHOUSE`` environment variable;
    ``ValueError`` naming the argument and saying how to start one when neither is set."""
    from lightning_optim.fault_tolerance.replicas import LIGHTHOUSE_ENV

    value = lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not value:
        raise ValueError(
            f"lighthouse: no Lighthouse address (argument or {LIGHTHOUSE_ENV}). Start one where every replica reaches "
            f"it, `torchft_lighthouse --min_replicas 1`, and pass "
            f"lighthouse='http://<its host>:{DEFAULT_LIGHTHOUSE_PORT}' (or set {LIGHTHOUSE_ENV}) on every replica; "
            "for a try on one machine, lighthouse='local' starts one inside this replica")
    check_lighthouse(value)
    return value


def _start_local(port: int, min_replicas: int) -> str:
    """The address of the Lighthouse this process runs on ``port`` (started now if it is not running yet)."""
    from lightning_optim.fault_tolerance import local_lighthouse

    with _local_lock:
        server = _local_lighthouses.get(port)
        if server is None:
            try:
                server = local_lighthouse(min_replicas=min_replicas, bind=f"[::]:{port}")
            except Exception as exc:  # torchft says why in its own words (the port is taken, ...)
                raise RuntimeError(f"lighthouse='local:{port}': could not start a Lighthouse on port {port} ({exc}); "
                                   f"if another replica hosts it, pass lighthouse='http://localhost:{port}' here") \
                    from exc
            _local_lighthouses[port] = server
            atexit.register(server.shutdown)
            log.info("lightning-optim: a torchft Lighthouse runs in this replica at %s (min_replicas=%d); start the "
                     "other replicas with lighthouse='http://localhost:%d' (it lives as long as this process)",
                     server.address(), min_replicas, port)
        return str(server.address())


class _ReplicaMixin(DDPBase):
    """One replica group per Lightning process: its settings, its torchft ``Manager`` (with a strategy that owns
    ``timeout``: ``_CommFailureMixin``)."""

    _manager: Any = None
    _timeout_s: float

    def _init_replica(self, replica_id: str | None, min_replica_size: int, lighthouse: str | None,
                      host: str | None) -> None:
        from lightning_optim.optim.validation import check_int

        name = type(self).__name__
        try:
            if replica_id is not None:
                resolve_replica_id(replica_id)
            check_int("min_replica_size", min_replica_size, 1)
            check_lighthouse(lighthouse)
            if host is not None and (not isinstance(host, str) or not host):
                raise ValueError(f"host must be None or this machine's address as the others reach it, got {host!r}")
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        self.replica_id, self.min_replica_size, self.lighthouse, self.host = (replica_id, min_replica_size,
                                                                               lighthouse, host)
        self._summary: dict[str, Any] = {"replica_id": replica_id, "replicas": None, "committed_step": None}

    @property
    def manager(self) -> Any:
        """The torchft ``Manager`` of this replica group while a fit runs (None otherwise)."""
        return self._manager

    def _replica_settings(self) -> tuple[str, str]:
        """(replica id, Lighthouse setting), from the arguments or the environment; errors name the argument."""
        try:
            return resolve_replica_id(self.replica_id), resolve_lighthouse(self.lighthouse)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{type(self).__name__}: {exc}") from None

    def _configure_launcher(self) -> None:  # the Trainer is being built: its world is known, nothing launched yet
        world = self.num_processes * self.num_nodes
        if world > 1:
            raise ValueError(
                f"{type(self).__name__} runs one process per replica group, but this Trainer has devices="
                f"{self.num_processes} x num_nodes={self.num_nodes} = {world} processes: use devices=1 and launch "
                f"{world} replica groups instead (each its own launch with its own replica_id, all with the same "
                "lighthouse)")
        self._replica_settings()
        super()._configure_launcher()

    def _open_manager(self) -> Any:
        """This replica group's torchft ``Manager`` (a Lighthouse started first with ``lighthouse="local"``)."""
        from lightning_optim.fault_tolerance import replica_manager

        replica_id, lighthouse = self._replica_settings()
        port = _local_port(lighthouse)
        address = lighthouse if port is None else _start_local(port, self.min_replica_size)
        self._manager = replica_manager(replica_id=replica_id, min_replica_size=self.min_replica_size,
                                        lighthouse=address, host=self.host, timeout_s=self._timeout_s)
        self._summary = {"replica_id": replica_id, "replicas": None, "committed_step": None}
        return self._manager

    def _close_manager(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            self._summary = self._replica_summary(manager)
            manager.shutdown(wait=False)

    def _replica_summary(self, manager: Any) -> dict[str, Any]:
        return {**self._summary, "replicas": manager.num_participants(), "committed_step": manager.current_step()}

    def replica_summary(self) -> dict[str, Any]:
        """This replica's view of the replicas (of the fit in progress, else of the last one): its id, the replicas
        of the last quorum and the manager's committed step."""
        return self._summary if self._manager is None else self._replica_summary(self._manager)

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._close_manager()

    def teardown(self) -> None:
        self._close_manager()
        super().teardown()


class _FTDiLoCoMixin(_ReplicaMixin, _DiLoCoMixin):
    """Fault-tolerant DiLoCo across replica groups (torchft): the optimizer of ``configure_optimizers`` wrapped in
    :class:`lightning_optim.DiLoCo` with this replica's torchft ``Manager``; each synchronisation is a quorum of
    the replicas that are alive, an exchange that fails is discarded, a replica that returns is healed from a peer.

    Args:
        sync_every, outer_lr, outer_momentum, nesterov, fragments, overlap, mixing, compressor, final_sync,
            density, bits: as :class:`DiLoCoStrategy` (launch every replica with the same values).
        replica_id, lighthouse, min_replica_size, host: this replica's settings (see below).
        timeout: seconds a collective, commit decision or healing transfer may take (30).
        telemetry: log ``comm/*`` per step (``comm/fp32_bytes``: an fp32 ring all-reduce over the replicas of the
            last quorum).
        **kwargs: ``DDPStrategy`` arguments (of this replica's one process).

    One process per replica group (``devices=1``), each its own launch with its own ``replica_id``, all with the
    same ``lighthouse``: an address (``http://host:29510``, torchft's ``torchft_lighthouse --min_replicas 1``;
    default ``$TORCHFT_LIGHTHOUSE``) or, on one machine, ``"local"``/``"local:PORT"`` on
    one replica (it starts the Lighthouse in its process) and ``http://localhost:PORT`` on the others. ``replica_id``
    defaults to ``$REPLICA_ID``/``$TORCHFT_REPLICA_ID``; ``min_replica_size``: the fewest replicas a
    synchronisation commits with; ``host``: where the others reach this replica (default: its host name).

    Each replica feeds its own data: Lightning's distributed sampler sees one process (it shuffles every epoch, as
    under DDP, but shards nothing across replicas). Checkpoints: each replica saves its own (params, inner optimizer
    state, DiLoCo's state with the manager's committed step and this replica's params) and resumes from it.
    """

    def __init__(self, sync_every: int = 100, outer_lr: float | None = None, outer_momentum: float | None = None,
                 nesterov: bool | None = None, fragments: int | None = None, overlap: bool | None = None,
                 mixing: float | None = None, compressor: Any = None, final_sync: bool = True,
                 density: float | None = None, bits: int | None = None, replica_id: str | None = None,
                 min_replica_size: int = 1, lighthouse: str | None = None,
                 host: str | None = None, timeout: float | timedelta = DEFAULT_FT_TIMEOUT_S, **kwargs: Any) -> None:
        self._init_replica(replica_id, min_replica_size, lighthouse, host)
        super().__init__(sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
                         fragments=fragments, overlap=overlap, mixing=mixing, compressor=compressor,
                         final_sync=final_sync, density=density, bits=bits, timeout=timeout, **kwargs)

    def setup_optimizers(self, trainer: Any) -> None:
        self._diloco_kwargs["manager"] = self._open_manager()  # DiLoCo joins the replicas when it is made
        try:
            super().setup_optimizers(trainer)
        except BaseException:
            self._close_manager()
            raise
        finally:
            self._diloco_kwargs.pop("manager", None)

    def _fp32_step_bytes(self) -> int:  # DDP's fp32 all-reduce over the replicas of the last quorum
        manager = self._manager
        replicas = manager.num_participants() if manager is not None else 1
        return ring_allreduce_bytes(self._trained_numel, max(1, replicas))

    def comm_summary(self) -> dict[str, Any]:
        d = self.diloco
        rounds = None if d is None or d.replicas is None else d.replicas.rounds_discarded
        return {**super().comm_summary(), **self.replica_summary(), "rounds_discarded": rounds}


class _FTDDPMixin(_ReplicaMixin, _CommFailureMixin):
    """Fault-tolerant data parallelism across replica groups (torchft): every optimizer step is a quorum of the
    replicas that are alive; the gradients are averaged over them
    (:func:`lightning_optim.fault_tolerance.fault_tolerant_ddp`) and the local optimizer steps only if every
    replica of the quorum commits; a replica that starts late or returns takes the model and optimizer state
    from a peer.

    Args:
        comm_hook: None (the gradients' dtype), ``"fp16_compress"`` or ``"bf16_compress"`` (half the bytes).
        replica_id, lighthouse, min_replica_size, host, timeout: as :class:`FTDiLoCoStrategy`.
        **kwargs: ``DDPStrategy`` arguments of this replica's one process, not those of its DDP wrapper (the model
            is wrapped by ``fault_tolerant_ddp``) nor the comm-hook ones (the strategy's).

    Any local optimizer (ours or torch's) from ``configure_optimizers``; the 1-bit and the other communicating
    optimizers are refused by name (their error feedback is tied to one fixed set of ranks). Automatic
    optimization only; no ``precision="16-mixed"`` (GradScaler steps outside the quorum's step). One process per
    replica group and each replica's own data, as :class:`FTDiLoCoStrategy`. Checkpoints: each replica saves its
    own; the optimizer's state carries the manager's committed step.
    """

    _refuses_grad_scaler: ClassVar[bool] = True  # the main job's up-front check reads it (as the comm-hook ones')

    def __init__(self, comm_hook: str | None = None, replica_id: str | None = None, min_replica_size: int = 1,
                 lighthouse: str | None = None, host: str | None = None,
                 timeout: float | timedelta = DEFAULT_FT_TIMEOUT_S, **kwargs: Any) -> None:
        from lightning_optim.fault_tolerance.ddp import _hook_dtype

        name = type(self).__name__
        for key in _NOT_OURS:
            if kwargs.get(key) is not None:
                raise TypeError(f"{name}: {key} is not supported: the gradients are averaged over the replicas "
                                "through torchft's manager (comm_hook=None, 'fp16_compress' or 'bf16_compress')")
            kwargs.pop(key, None)
        try:
            _hook_dtype(comm_hook)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        self._init_replica(replica_id, min_replica_size, lighthouse, host)
        self.comm_hook = comm_hook
        super().__init__(timeout=self._init_timeout(timeout), **kwargs)
        ddp_kwargs = sorted(getattr(self, "_ddp_kwargs", {}))
        if ddp_kwargs:
            raise TypeError(f"{name}: {', '.join(ddp_kwargs)}: arguments of Lightning's DDP wrapper, which this "
                            "strategy does not use (the model is wrapped by lightning_optim.fault_tolerance."
                            "fault_tolerant_ddp, with find_unused_parameters=True)")
        self.ft_optimizer: Any = None

    def setup(self, trainer: Any) -> None:
        name = type(self).__name__
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(f"{name}: precision='16-mixed' steps through torch's GradScaler after the quorum's step "
                             "has closed; use precision='bf16-mixed' or '32-true'")
        module = attached(self.lightning_module, "lightning_module")
        if trainer.state.fn == "fit" and any(type(cb).__name__ == "GradientRelease" for cb in trainer.callbacks):
            raise ValueError(f"{name}: GradientRelease steps inside its own DDP comm hook, and torch allows one per "
                             "model; this strategy's averages the gradients over the replicas")
        if trainer.state.fn == "fit" and not module.automatic_optimization:
            raise ValueError(f"{name}: needs automatic optimization (Lightning's optimizer.step(closure) runs forward "
                             "and backward inside the quorum's step)")
        super().setup(trainer)

    def _setup_model(self, model: Any) -> Any:
        return model  # wrapped in torchft's DDP with the optimizer, in setup_optimizers

    def _register_ddp_hooks(self) -> None:
        """None of Lightning's: the averaging hook is fault_tolerant_ddp's."""

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        from lightning_optim.fault_tolerance import fault_tolerant_ddp
        from lightning_optim.fault_tolerance.ddp import _refuse_communicating

        name = type(self).__name__
        if len(self.optimizers) != 1:
            raise ValueError(f"{name} needs exactly one optimizer from configure_optimizers, "
                             f"got {len(self.optimizers)}")
        inner = getattr(self.optimizers[0], "_optimizer", self.optimizers[0])
        try:
            _refuse_communicating(inner)  # before anything joins the replicas
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        manager = self._open_manager()
        try:
            self.model, self.ft_optimizer = fault_tolerant_ddp(attached(self.model, "model"), inner, manager,
                                                               comm_hook=self.comm_hook)
        except BaseException:
            self._close_manager()
            raise
        retarget_schedulers([config.scheduler for config in self.lr_scheduler_configs], inner, self.ft_optimizer)
        self.optimizers = [self.ft_optimizer]

    def comm_summary(self) -> dict[str, Any]:
        """Steps committed and discarded by this replica, and its view of the replicas."""
        opt = self.ft_optimizer
        return {**self.replica_summary(), "comm_hook": self.comm_hook,
                "steps_committed": None if opt is None else opt.steps_committed,
                "steps_discarded": None if opt is None else opt.steps_discarded}
