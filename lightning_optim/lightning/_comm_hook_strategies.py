"""The comm-hook strategies, written once for both Lightning packages: ``DDPStrategy`` with one of the
DDP comm hooks of :mod:`lightning_optim.comm.ddp_hooks` registered on any device (Lightning's own
``ddp_comm_hook`` is skipped off CUDA), its per-rank state in checkpoints (``_hook_checkpoints.py``),
bytes per step (``_telemetry.py``) and the collective timeout (``_failures.py``). No math here.

Any optimizer, except those that communicate by themselves (the 1-bit optimizers, mlbench's
distributed family): with a hook, DDP's gradients are already the hook's aggregate.
"""

from __future__ import annotations

import inspect
import math
import warnings
from datetime import timedelta
from typing import Any, ClassVar

import torch

from lightning_optim.comm.ddp_hooks import HookState, make_state, register_comm_hook
from lightning_optim.lightning._bases import DDPBase, attached
from lightning_optim.lightning._failures import DEFAULT_TIMEOUT_S, _CommFailureMixin
from lightning_optim.lightning._hook_checkpoints import _HookCheckpointMixin
from lightning_optim.lightning._telemetry import _ByteCountingMixin

__all__ = ["_CommHookStrategyMixin", "_ConsensusTelemetryMixin", "_DecentralizedMixin", "_FP16CompressMixin",
           "_PowerSGDMixin", "_RandomKMixin", "_SignSGDMixin", "_TopKMixin"]

_NOT_OURS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")
# torch >= 2.13 renamed DDP's per-forward buffer broadcast (the old name warns)
_NO_BUFFER_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
    torch.nn.parallel.DistributedDataParallel.__init__).parameters else "broadcast_buffers")


def _communicates_itself(optimizer: torch.optim.Optimizer) -> bool:
    """The 1-bit optimizers and mlbench's distributed family (all in ``lightning_optim.distributed``'s base or
    modules) average by themselves in ``step()``."""
    from lightning_optim.distributed.communicating import CommunicatingOptimizer

    return isinstance(optimizer, CommunicatingOptimizer) or type(optimizer).__module__.startswith(
        "lightning_optim.distributed")


class _AfterStepMixin(DDPBase):
    """Runs ``_after_step`` after each optimizer step, inside the byte count of that step (MRO: after
    ``_ByteCountingMixin``)."""

    def _after_step(self, optimizer: Any) -> None:
        """What the hook needs after the optimizer's step (nothing by default)."""

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._after_step(optimizer)
        return output


class _CommHookStrategyMixin(_ByteCountingMixin, _AfterStepMixin, _HookCheckpointMixin, _CommFailureMixin):
    """DDP whose gradient communication is the comm hook ``hook_name``; see the module docstring."""

    hook_name: ClassVar[str]
    telemetry_callback_class: ClassVar[type]  # set by the package-specific module
    _refuses_grad_scaler: ClassVar[bool] = True  # error feedback would keep loss-scaled (or inf) residuals
    _grad_scaler_refusal: ClassVar[str] = ("scales the gradients the hook compresses, so its error feedback would keep "
                                           "loss-scaled residuals (and an overflow would poison them for good)")

    def __init__(self, *, hook_kwargs: dict[str, Any], timeout: float | timedelta = DEFAULT_TIMEOUT_S,
                 telemetry: bool = True, **kwargs: Any) -> None:
        name = type(self).__name__
        for key in _NOT_OURS:
            if kwargs.get(key) is not None:
                raise TypeError(f"{name}: {key} is not supported: the strategy registers its own DDP comm hook "
                                f"({self.hook_name!r}) on every device")
            kwargs.pop(key, None)
        if not isinstance(telemetry, bool):
            raise TypeError(f"{name}: telemetry must be True or False, got {telemetry!r}")
        try:  # the hook state's own checks name the argument and its range
            make_state(self.hook_name, **hook_kwargs)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        self._hook_kwargs = hook_kwargs
        self._telemetry = telemetry
        super().__init__(timeout=self._init_timeout(timeout), **kwargs)
        self._init_counting()

    @property
    def hook_state(self) -> HookState | None:
        """The comm hook's state (after ``setup``): its counters, ``state_dict()``, ..."""
        return self._hook_state

    def _register_ddp_hooks(self) -> None:
        state = make_state(self.hook_name, **self._hook_kwargs)
        register_comm_hook(attached(self.model, "model"), state)  # any device; collective for the decentralized hook
        self._hook_state = state
        self._restore_hook_state()

    def _telemetry_callbacks(self) -> list[type]:
        return [self.telemetry_callback_class]

    def setup(self, trainer: Any) -> None:
        name, fitting = type(self).__name__, trainer.state.fn == "fit"
        if fitting and any(type(cb).__name__ == "GradientRelease" for cb in trainer.callbacks):
            raise ValueError(f"{name}: GradientRelease steps inside its own DDP comm hook, and torch allows one per "
                             f"model; this strategy's is {self.hook_name!r}. Use DDPStrategy for gradient release")
        if self._refuses_grad_scaler and getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(f"{name}: precision='16-mixed' {self._grad_scaler_refusal}; use precision='bf16-mixed' "
                             "or '32-true'")
        if fitting and self._telemetry:
            for cls in self._telemetry_callbacks():
                if not any(isinstance(cb, cls) for cb in trainer.callbacks):
                    trainer.callbacks.append(cls())
        super().setup(trainer)
        if fitting:
            self._start_counting()

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            if _communicates_itself(optimizer):
                raise ValueError(f"{type(self).__name__}: {type(optimizer).__name__} communicates by itself; with the "
                                 f"{self.hook_name!r} hook DDP already hands it aggregated gradients. Use a local "
                                 "optimizer (e.g. torch.optim.AdamW), or its own strategy/DDPStrategy")
        model = attached(self.model, "model")
        self._trained_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def comm_summary(self) -> dict[str, Any]:
        return {**super().comm_summary(), "hook": self.hook_name}


class _PowerSGDMixin(_CommHookStrategyMixin):
    """DDP + torch's PowerSGD comm hook (``powerSGD_hook``, ``PowerSGDState``), on every device (on gloo one
    bucket's chain of all-reduces at a time: :mod:`lightning_optim.comm.ddp_hooks.powersgd`). Warns once (rank 0,
    at the start of a fit) when the fit ends before ``start_powerSGD_iter``: it would be plain DDP throughout.

    Args:
        matrix_approximation_rank: rank r of the P Q^T approximation, >= 1.
        start_powerSGD_iter: plain fp32 allreduce before this iteration, >= 2 with error feedback or warm start.
        min_compression_rate: compress a param when (n + m) r * rate < n m, >= 0.
        use_error_feedback, warm_start, orthogonalization_epsilon, random_seed, batch_tensors_with_same_shape:
            ``PowerSGDState``'s.
        timeout: collective timeout in seconds (or a ``timedelta``).
        telemetry: log ``comm/*`` metrics per step (adds :class:`CommTelemetry`).
        **kwargs: ``DDPStrategy`` arguments.
    """

    hook_name = "powersgd"

    def __init__(self, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2.0, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, random_seed: int = 0,
                 batch_tensors_with_same_shape: bool = False, **kwargs: Any) -> None:
        hook_kwargs = dict(matrix_approximation_rank=matrix_approximation_rank, start_powerSGD_iter=start_powerSGD_iter,
                           min_compression_rate=min_compression_rate, use_error_feedback=use_error_feedback,
                           warm_start=warm_start, orthogonalization_epsilon=orthogonalization_epsilon,
                           random_seed=random_seed, batch_tensors_with_same_shape=batch_tensors_with_same_shape)
        super().__init__(hook_kwargs=hook_kwargs, **kwargs)

    def on_train_start(self) -> None:
        super().on_train_start()
        state, trainer = self._hook_state, attached(self.lightning_module, "lightning_module").trainer
        total = trainer.estimated_stepping_batches
        if state is None or self.global_rank != 0 or not math.isfinite(total):
            return
        ts = state.torch_state  # its iter counts the synchronised backwards (restored on resume)
        last = ts.iter + max(0, int(total) - trainer.global_step)
        if last <= ts.start_powerSGD_iter:
            warnings.warn(
                f"{type(self).__name__}: start_powerSGD_iter={ts.start_powerSGD_iter}, but this fit ends at iteration "
                f"{last}: PowerSGD will not engage (every step is a plain fp32 DDP all-reduce). Pass "
                "start_powerSGD_iter=... below that (>= 2, e.g. 10% of the run) for compressed gradients",
                UserWarning,
                stacklevel=2,
            )


class _TopKMixin(_CommHookStrategyMixin):
    """DDP + top-k sparsification with error feedback: each param's ``ratio`` largest-magnitude gradient
    elements (values + int32 indices all-gathered), averaged over ranks.

    Args:
        ratio: fraction of each param's elements sent, in (0, 1] (at least one per param).
        error_feedback: keep what was not sent for the next step (per rank, per param).
        timeout, telemetry, **kwargs: as :class:`PowerSGDStrategy`.
    """

    hook_name = "topk"

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True, **kwargs: Any) -> None:
        super().__init__(hook_kwargs=dict(ratio=ratio, error_feedback=error_feedback), **kwargs)


class _RandomKMixin(_CommHookStrategyMixin):
    """DDP + random-k sparsification with error feedback.

    Args:
        ratio: fraction of each param's elements sent, in (0, 1].
        seed: the positions' generator seed, int >= 0.
        shared_indices: every rank draws the same positions and only the values are all-reduced (default);
            False: each rank its own (``seed + rank``), values and indices all-gathered.
        error_feedback, timeout, telemetry, **kwargs: as :class:`TopKStrategy`.
    """

    hook_name = "randomk"

    def __init__(self, ratio: float = 0.01, seed: int = 0, shared_indices: bool = True, error_feedback: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(hook_kwargs=dict(ratio=ratio, seed=seed, shared_indices=shared_indices,
                                          error_feedback=error_feedback), **kwargs)


class _SignSGDMixin(_CommHookStrategyMixin):
    """DDP + EF-SignSGD: each param's scaled sign (1 bit per element, one fp32 scale) with error feedback.

    Args:
        majority_vote: signSGD's vote sign(sum of the ranks' signs) instead (the paper has no error feedback:
            pass ``error_feedback=False`` for it).
        error_feedback, timeout, telemetry, **kwargs: as :class:`TopKStrategy`.
    """

    hook_name = "sign_sgd"

    def __init__(self, majority_vote: bool = False, error_feedback: bool = True, **kwargs: Any) -> None:
        super().__init__(hook_kwargs=dict(majority_vote=majority_vote, error_feedback=error_feedback), **kwargs)


class _FP16CompressMixin(_CommHookStrategyMixin):
    """DDP + torch's ``fp16_compress_hook`` (each bucket averaged in fp16: half of fp32 DDP's bytes, no error
    feedback), registered on every device (Lightning's ``ddp_comm_hook`` is skipped off CUDA), counted.

    Args:
        timeout, telemetry, **kwargs: as :class:`TopKStrategy`.
    """

    hook_name = "fp16_compress"
    _refuses_grad_scaler = False  # no residuals: a skipped step leaves nothing behind

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(hook_kwargs={}, **kwargs)


class _DecentralizedMixin(_CommHookStrategyMixin):
    """DDP without gradient averaging: each rank steps on its own gradient, then averages its params with its
    neighbours (gossip, point-to-point). The ranks' params differ between steps: checkpoints keep each
    rank's params and optimizer state; validation scores each rank's own model.

    Args:
        neighbors: ``"ring"`` (default), ``"torus"``, ``"torus:RxC"``, ``"exponential"``, a ``Topology``, this
            rank's neighbour list or every rank's lists (checked by all ranks together at setup).
        weights: ``"uniform"`` (1 / (degree + 1), mlbench) or ``"metropolis"``; None: the Topology's own, else uniform.
        consensus_every: log ``comm/consensus_distance`` every this many steps (an allreduce; 0: never).
        by_layer: one exchange per param instead of one flat buffer.
        timeout, telemetry: as :class:`PowerSGDStrategy` (telemetry also adds :class:`ConsensusTelemetry`).
        **kwargs: ``DDPStrategy`` arguments; buffers are not broadcast from rank 0 at every forward (DDP's
            ``forward_sync_buffers``/``broadcast_buffers`` default to False here: no global collective).
    """

    hook_name = "decentralized"
    consensus_callback_class: ClassVar[type]
    _per_rank_params = True
    _refuses_grad_scaler = False  # no residuals; a skipped step on one rank still joins the gossip

    def __init__(self, neighbors: Any = "ring", weights: str | None = None, consensus_every: int = 10,
                 by_layer: bool = False, **kwargs: Any) -> None:
        if "broadcast_buffers" not in kwargs and "forward_sync_buffers" not in kwargs:
            kwargs[_NO_BUFFER_SYNC] = False  # buffers stay each rank's own after the start (as the params do)
        super().__init__(hook_kwargs=dict(neighbors=neighbors, weights=weights, consensus_every=consensus_every,
                                          by_layer=by_layer), **kwargs)
        self.consensus: tuple[int, float] | None = None  # (gossip round, consensus distance), the latest

    def check_world(self, processes_per_node: int, num_nodes: int) -> None:
        from collections.abc import Sequence

        from lightning_optim.comm.topology import Topology, parse_name

        world, spec = processes_per_node * num_nodes, self._hook_kwargs["neighbors"]
        weights = self._hook_kwargs["weights"] or "uniform"
        try:
            if spec is None or isinstance(spec, str):
                parse_name("ring" if spec is None else spec, world, weights)
            elif isinstance(spec, Topology):
                if spec.world_size != world:
                    raise ValueError(f"neighbors: the Topology has {spec.world_size} ranks, the world {world}")
            elif spec and all(isinstance(row, Sequence) and not isinstance(row, str) for row in spec):  # all ranks
                if len(spec) != world:
                    raise ValueError(f"neighbors: one list per rank, {world} ranks, got {len(spec)} lists")
                Topology.from_neighbors(spec, weights)
            else:  # one rank's own list, the same on every rank here
                Topology.from_neighbors([spec] * world, weights)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{type(self).__name__}: {exc} (a world of {world} ranks)") from None
        super().check_world(processes_per_node, num_nodes)

    def _telemetry_callbacks(self) -> list[type]:
        return [*super()._telemetry_callbacks(), self.consensus_callback_class]

    def _step_skips_ddp_allreduce(self) -> bool:
        return True

    def _after_step(self, optimizer: Any) -> None:
        inner = getattr(optimizer, "_optimizer", optimizer)
        params = [p for group in inner.param_groups for p in group["params"]]
        distance = self._hook_state.after_step(params)  # the optimizer's params: each gossiped once per step
        if distance is not None:
            self.consensus = (self._hook_state.steps, distance)


class _ConsensusTelemetryMixin:
    """Logs ``comm/consensus_distance`` (sqrt of the mean squared distance of the ranks' params to their
    mean, after the gossip) on the steps where the decentralized strategy measured it, and only there:
    straight to the trainer's loggers, because a value given to ``LightningModule.log`` in a hook is
    logged again at every later step (Lightning 2.6), which would show a stale distance as current."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: int | None = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        latest = getattr(trainer.strategy, "consensus", None)
        if latest is None or latest[0] == self._seen:
            return
        self._seen = latest[0]
        for logger in trainer.loggers:  # rank zero only (the loggers are)
            logger.log_metrics({"comm/consensus_distance": float(latest[1])}, step=trainer.global_step)
