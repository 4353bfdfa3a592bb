r"""DDP comm hook ``"powersgd"``: torch's own ``powerSGD_hook`` and ``PowerSGDState`` (Vogels et al. 2019),
unchanged, plus what torch leaves out: byte counts, per-rank checkpoints, state that survives DDP's
bucket rebuild, and the same order of collectives on every rank on gloo (torch's hook alone aborts
there with more than one bucket; see "One bucket at a time" below).

What torch's hook does per bucket (``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``):
for the first ``start_powerSGD_iter`` iterations, a plain averaging all-reduce of the bucket; then,
with this rank's error :math:`E` of the bucket, each param's gradient as a matrix :math:`M`
(``shape[0] x rest``), rank :math:`r = \min(n, m, \text{matrix\_approximation\_rank})`, compressed when
:math:`(n + m) r \cdot \text{min\_compression\_rate} < n m`:

.. math::
    M \leftarrow M + E, \quad P = M Q, \quad P \leftarrow \operatorname{orth}(\textstyle\sum_r P), \quad
    Q = M^\top P, \quad Q \leftarrow \tfrac1W \textstyle\sum_r Q, \quad \hat M = P Q^\top, \quad E \leftarrow M - \hat M

(:math:`Q` warm-started from the last iteration with ``warm_start``); the other params are averaged
exactly. Three all-reduces per bucket: the uncompressed params, all P's, all Q's.

Bytes: torch's hook counts nothing, so they are computed here from what it sends: before
``start_powerSGD_iter`` the ring cost of the whole bucket, after it the ring costs of the
concatenated uncompressed params and of the P's and the Q's, whose sizes follow from the param
shapes by torch's own ``_should_compress`` rule, in the bucket's dtype. They are added to
``state.stats`` only when the hook's future completes (a failed bucket adds nothing); the tests
check them against the tensors handed to ``dist.all_reduce``.

Bucket layout: torch keys the error and the P/Q memory by bucket index. DDP rebuilds its buckets
after the first iteration of every process (the params' order inside a bucket changes), so after a
resume torch's state would be added to the wrong elements, silently when the sizes match. Here the
layout (param names) each entry was made for is recorded; when a bucket index comes with another
layout, the entries of the buckets not yet called in this iteration are cut into per-param pieces
and reassembled for the new layout (the params of buckets already in flight start from zero error,
counted in ``resets``). Checkpoints hold the pieces by param name, so they load into any layout.

One bucket at a time on gloo: torch's hook issues its second and third all-reduce (the P's, the Q's)
from inside future callbacks (``.then``). A gloo future completes on one of gloo's worker threads
when the collective has finished, so the P all-reduce of bucket ``i`` is issued either at once on the
autograd thread (the first all-reduce was already done when ``.then`` was attached) or later on a
worker thread, after the autograd thread has issued bucket ``i + 1``'s first all-reduce, and which one
happens is a matter of timing on each rank. gloo pairs the ranks' collectives by their order, so one
rank's P's meet the other's uncompressed params: ``gloo::EnforceNotMet ... op.preamble.length <=
op.nbytes`` aborts the process, or the ranks hang until the timeout (seen in a Lightning fit), or,
where the sizes happen to match, the wrong tensors are summed.
Any model of more than one bucket (DDP's first bucket holds 1 MB) hits it within a few steps of
``start_powerSGD_iter``; NCCL does not, because its futures complete when the work is enqueued and the
callbacks run at once, in order. Here bucket ``i + 1``'s call of torch's hook waits (on a callback,
never blocking a thread) until bucket ``i``'s chain has completed, so every rank issues the same
sequence: uncompressed, P's, Q's of bucket 0, then of bucket 1, ... torch's hook itself is unchanged
and the math is the same; where a bucket's chain is already done when the next one comes (NCCL, one
bucket), torch's hook is called at once, exactly as without this module. The price on gloo: the
buckets' compressions no longer overlap one another (they still overlap the rest of the backward).
A deferred call runs on a gloo worker thread; its fresh queries (the first compressing iteration, or
every one without ``warm_start``) come from torch's ``fork_rng`` of the global CPU generator, which
the autograd thread does not draw from during the backward.

``state_dict()`` (per rank: the error differs per rank) holds ``PowerSGDState.__getstate__()``'s
counters, its RNG as tensors, and the error and Q memory by param name; ``load_state_dict`` restores
them through ``PowerSGDState.__setstate__``, keeping this state's own hyper-parameters (the Q memory
only when ``matrix_approximation_rank`` and ``min_compression_rate`` are the saved ones).
"""
# no ``from __future__ import annotations``: DDP checks the hook's return annotation at runtime
import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim.optim.validation import check_flag, check_int, check_non_negative

from ..agreement import agree, fingerprint
from ..stats import CommStats, ring_allreduce_bytes
from ..timeouts import collective_timeout
from ._bucket import HookState, bounded, stats_lock
from ._cpu_buckets_on_cuda_hosts import private_powersgd_module

if TYPE_CHECKING:
    import numpy as np



@functools.cache
def _torch_hook_modules() -> tuple[ModuleType, ModuleType]:
    """torch's ``powerSGD_hook`` module (its ``PowerSGDState``) and the private instance of it whose hook lets CPU
    buckets through on CUDA hosts. Imported on first use: torch's module needs numpy, which the rest of this
    package does without."""
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_module
    except ModuleNotFoundError as missing:
        raise ImportError(f"the 'powersgd' hook runs torch's powerSGD_hook, which needs {missing.name}: "
                          f"pip install {missing.name}", name=missing.name) from missing
    return torch_module, private_powersgd_module()

__all__ = ["PowerSGDHookState", "powersgd_hook"]

_DICTS = ("error_dict", "p_memory_dict", "q_memory_dict")
_KEPT = ("matrix_approximation_rank", "min_compression_rate")  # the Q memory's shapes depend on them
_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch logs a warning on every __getstate__/__setstate__ (the process group is not saved)."""
    logger = logging.getLogger(_torch_hook_modules()[0].__name__)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _rng_tensors(rng: "np.random.RandomState") -> dict[str, Any]:
    import numpy as np

    # numpy's stub types the argument-less call as the dict form; RandomState returns the legacy tuple
    legacy = cast(tuple[str, np.ndarray, int, int, float], rng.get_state())
    _kind, keys, pos, has_gauss, cached = legacy
    return {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached)}


def _rng_from(saved: Mapping[str, Any]) -> "np.random.RandomState":
    import numpy as np

    rng = np.random.RandomState()
    rng.set_state(("MT19937", saved["keys"].numpy().astype(np.uint32), int(saved["pos"]), int(saved["has_gauss"]),
                   float(saved["cached_gaussian"])))
    return rng


class PowerSGDHookState(HookState):
    """torch's ``PowerSGDState`` (``torch_state``) with this module's bookkeeping. Arguments: torch's."""

    hook_name = "powersgd"

    def __init__(self, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2.0, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, random_seed: int = 0,
                 batch_tensors_with_same_shape: bool = False, *, group: Any = None,
                 stats: CommStats | None = None) -> None:
        super().__init__(group, stats)
        check_int("matrix_approximation_rank", matrix_approximation_rank, 1)
        check_int("start_powerSGD_iter", start_powerSGD_iter, 0)
        check_non_negative("min_compression_rate", min_compression_rate)
        check_flag("use_error_feedback", use_error_feedback)
        check_flag("warm_start", warm_start)
        check_non_negative("orthogonalization_epsilon", orthogonalization_epsilon)
        if check_int("random_seed", random_seed, 0) > 2**32 - 1:
            raise ValueError(f"random_seed must be in [0, 2**32 - 1] (numpy's RandomState), got {random_seed}")
        check_flag("batch_tensors_with_same_shape", batch_tensors_with_same_shape)
        if (use_error_feedback or warm_start) and start_powerSGD_iter < 2:
            raise ValueError(f"start_powerSGD_iter must be in [2, inf) with use_error_feedback or warm_start, got "
                             f"{start_powerSGD_iter} (DDP rebuilds its buckets after the first iteration; torch's "
                             "PowerSGDState requires it)")
        self.torch_state = _torch_hook_modules()[0].PowerSGDState(
            process_group=group, matrix_approximation_rank=int(matrix_approximation_rank),
            start_powerSGD_iter=int(start_powerSGD_iter), min_compression_rate=float(min_compression_rate),
            use_error_feedback=use_error_feedback, warm_start=warm_start,
            orthogonalization_epsilon=float(orthogonalization_epsilon), random_seed=int(random_seed),
            batch_tensors_with_same_shape=batch_tensors_with_same_shape)
        self.random_seed = int(random_seed)  # torch keeps only the generator it seeds
        self._layouts: dict[int, tuple[str, ...]] = {}  # bucket index -> the layout its torch entries fit
        self._pieces: dict[str, dict[str, Tensor]] = {"error": {}, "q": {}}  # by param name, not yet placed
        self._called: set[int] = set()  # bucket indices called in the current iteration
        self._iteration_over = True
        self.realigned = 0  # times a bucket index came with another layout than its entries were made for
        self.resets = 0  # params whose error restarted at zero because their bucket changed mid-iteration
        self._tail: torch.futures.Future | None = None  # the last compressing bucket's chain (one at a time)

    def attach(self, ddp_model) -> None:
        """Collective: the ranks check that they share the arguments and the params' shapes (one bounded
        all-gather), so a rank configured differently raises on every rank instead of mismatching the
        all-reduces of torch's hook."""
        super().attach(ddp_model)
        ts = self.torch_state
        values = {"matrix_approximation_rank": ts.matrix_approximation_rank,
                  "start_powerSGD_iter": ts.start_powerSGD_iter,
                  "min_compression_rate (x1e6)": round(ts.min_compression_rate * 1e6),
                  "use_error_feedback": int(ts.use_error_feedback), "warm_start": int(ts.warm_start),
                  "orthogonalization_epsilon": fingerprint([ts.orthogonalization_epsilon]),
                  "random_seed": self.random_seed,
                  "batch_tensors_with_same_shape": int(ts.batch_tensors_with_same_shape),
                  "the params' shapes": fingerprint(self.attached_names().shapes.items())}
        agree("PowerSGDHookState", tuple(values), values, group=self.group)

    # ------------------------------------------------------------------ layouts
    def _offsets(self, layout: tuple[str, ...]) -> Iterator[tuple[str, int, int]]:
        offset, shapes = 0, self.attached_names().shapes
        for name in layout:
            numel = int(torch.Size(shapes[name]).numel())
            yield name, offset, numel
            offset += numel

    def plan(self, layout: tuple[str, ...]) -> tuple[list[tuple[str, int, int, int]], list[str]]:
        """``([(name, n, m, r)] in the order of torch's P/Q memory, [uncompressed names])`` by torch's rule."""
        ts, shapes = self.torch_state, self.attached_names().shapes
        groups: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
        plain: list[str] = []
        for name in layout:
            shape = shapes[name]
            n = shape[0] if shape else 1
            m = int(torch.Size(shape).numel()) // max(n, 1)
            r = min(n, m, ts.matrix_approximation_rank)
            if _torch_hook_modules()[0]._should_compress(n, m, r, ts.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((name, n, m, r))  # torch batches by matrix shape
            else:
                plain.append(name)
        return [entry for group in groups.values() for entry in group], plain

    def _cut(self, index: int, layout: tuple[str, ...], pop: bool) -> dict[str, dict[str, Tensor]]:
        """Bucket ``index``'s error and Q memory as per-param pieces (removed from torch's dicts with ``pop``)."""
        ts = self.torch_state
        error, q = ((d.pop(index, None) if pop else d.get(index)) for d in (ts.error_dict, ts.q_memory_dict))
        if pop:
            ts.p_memory_dict.pop(index, None)
        pieces: dict[str, dict[str, Tensor]] = {"error": {}, "q": {}}
        if error is not None:
            for name, offset, numel in self._offsets(layout):
                pieces["error"][name] = error[offset:offset + numel].clone()
        if q is not None:
            offset = 0
            for name, _, m, r in self.plan(layout)[0]:
                pieces["q"][name] = q[offset:offset + m * r].clone()
                offset += m * r
        return pieces

    def _realign(self, index: int, layout: tuple[str, ...], like: Tensor) -> None:
        ts = self.torch_state
        recorded = self._layouts.get(index)
        if recorded is not None and recorded != layout:
            self.realigned += 1
            quiet = set(self._layouts) - self._called  # no future of theirs is in flight
            for i in sorted(quiet):
                for kind, found in self._cut(i, self._layouts.pop(i), pop=True).items():
                    self._pieces[kind].update(found)
        if any(self._pieces.values()) and index not in ts.error_dict and index not in ts.q_memory_dict:
            self._place(index, layout, like)
        self._layouts[index] = layout
        self._called.add(index)

    def _place(self, index: int, layout: tuple[str, ...], like: Tensor) -> None:
        """Build bucket ``index``'s torch entries for ``layout`` from the pieces."""
        ts, errors, queries = self.torch_state, self._pieces["error"], self._pieces["q"]
        if ts.use_error_feedback and any(name in errors for name in layout):
            error = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
            for name, offset, numel in self._offsets(layout):
                piece = errors.pop(name, None)
                if piece is None:
                    self.resets += 1
                else:
                    error[offset:offset + numel] = piece
            ts.error_dict[index] = error
        compressed = self.plan(layout)[0]
        if ts.warm_start and compressed and all(name in queries for name, *_ in compressed):
            ts.q_memory_dict[index] = torch.cat([queries.pop(name) for name, *_ in compressed]).to(like)
            ts.p_memory_dict[index] = torch.zeros(sum(n * r for _, n, _, r in compressed), dtype=like.dtype,
                                                  device=like.device)  # overwritten by P = M Q before use

    # ------------------------------------------------------------------ bytes
    def _bytes(self, layout: tuple[str, ...], buffer: Tensor, compressing: bool):
        """What this call will send (a function that counts it), from torch's rule."""
        world, size, stats = self.world_size(), buffer.element_size(), self.stats
        if world == 1:
            return None
        if not compressing:
            numel = buffer.numel()
            return lambda: stats.add_full_precision(numel, world, size)
        compressed, plain = self.plan(layout)
        p = sum(n * r for _, n, _, r in compressed)
        q = sum(m * r for _, _, m, r in compressed)
        dense = sum(n * m for _, n, m, _ in compressed)
        shapes = self.attached_names().shapes
        plain_numel = sum(int(torch.Size(shapes[name]).numel()) for name in plain)

        def count() -> None:
            if dense:
                stats.add_compressed(ring_allreduce_bytes(p, world, size) + ring_allreduce_bytes(q, world, size),
                                     dense, world)
            if plain_numel:
                stats.add_full_precision(plain_numel, world, size)
        return count

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: torch's counters and RNG, and the error and Q memory by param name."""
        ts = self.torch_state
        with _quiet():
            slots = ts.__getstate__()
        pieces = {kind: dict(found) for kind, found in self._pieces.items()}
        for index, layout in self._layouts.items():
            for kind, found in self._cut(index, layout, pop=False).items():
                pieces[kind].update(found)
        counters = {k: v for k, v in slots.items() if k not in (*_DICTS, "rng")}
        return {**self._stamp(), "torch_state": counters, "rng": _rng_tensors(ts.rng),
                "error": {k: v.clone() for k, v in pieces["error"].items()},
                "q": {k: v.clone() for k, v in pieces["q"].items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = self._check_stamp(state)
        saved, rng = state.get("torch_state"), state.get("rng")
        error, q = state.get("error"), state.get("q")
        if not isinstance(saved, Mapping) or "iter" not in saved or not isinstance(rng, Mapping) \
                or not isinstance(error, Mapping) or not isinstance(q, Mapping) \
                or not all(isinstance(t, Tensor) for t in (*error.values(), *q.values())):
            raise ValueError("state: expected a PowerSGDHookState.state_dict() (torch_state, rng, error, q)")
        ts = self.torch_state
        with _quiet():
            merged = ts.__getstate__()
            merged.update({k: saved[k] for k in _COUNTERS if k in saved})  # hyper-parameters stay this state's
            merged.update({"rng": _rng_from(rng), **{name: {} for name in _DICTS}})
            if dist.is_available() and dist.is_initialized():
                ts.__setstate__(merged)  # also sets the default group ...
                ts.process_group = self.group  # ... ours replaces it
            else:
                for key, value in merged.items():
                    setattr(ts, key, value)
        keep_q = all(saved.get(k) == getattr(ts, k) for k in _KEPT)
        self._pieces = {"error": {k: v.clone() for k, v in error.items()},
                        "q": {k: v.clone() for k, v in q.items()} if keep_q else {}}
        self._layouts.clear()

    # ------------------------------------------------------------------ one bucket at a time
    def _after_previous(self, start: Callable[[], torch.futures.Future]) -> torch.futures.Future:
        """``start()`` (torch's hook on one bucket) once the previous compressing bucket's chain has completed:
        at once when it has (NCCL, one bucket), else from its completion callback. A failed previous chain
        fails this bucket without a collective (the ranks' sequences would no longer match)."""
        tail = self._tail
        if tail is None or (tail.done() and not _failed(tail)):
            fut = start()
        else:
            fut = torch.futures.Future()

            def go(previous: torch.futures.Future) -> None:
                try:
                    previous.value()
                    inner = start()
                except Exception as exc:  # noqa: BLE001 - surfaced through this bucket's future
                    fut.set_exception(exc)
                    return
                inner.add_done_callback(lambda done: _pass_on(done, fut))

            tail.add_done_callback(go)
        self._tail = fut
        return fut


def _failed(fut: torch.futures.Future) -> bool:
    try:
        fut.value()
    except Exception:  # noqa: BLE001
        return True
    return False


def _pass_on(done: torch.futures.Future, to: torch.futures.Future) -> None:
    try:
        to.set_result(done.value())
    except Exception as exc:  # noqa: BLE001 - surfaced through the bucket's future
        to.set_exception(exc)


def powersgd_hook(state: PowerSGDHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: torch's ``powerSGD_hook`` on ``state.torch_state``, bounded, counted, layout-safe, and
    one compressing bucket at a time (gloo: see the module docstring)."""
    ts = state.torch_state
    layout = state.names_of(bucket)
    if state._iteration_over:
        state._called.clear()
        state._iteration_over = False
        if state._tail is not None and state._tail.done():
            state._tail = None  # a chain still in flight (a timed-out bucket) keeps the next ones behind it
    buffer = bucket.buffer()
    compressing = ts.iter >= ts.start_powerSGD_iter
    if compressing:
        state._realign(bucket.index(), layout, buffer)
    count = state._bytes(layout, buffer, compressing)
    if bucket.is_last():
        state._iteration_over = True

    def counted() -> None:
        if count is not None:
            with stats_lock:
                count()

    if compressing:
        fut = state._after_previous(lambda: _torch_hook_modules()[1].powerSGD_hook(ts, bucket))
    else:  # one all-reduce, issued here on the autograd thread: the same order on every rank
        fut = _torch_hook_modules()[1].powerSGD_hook(ts, bucket)
    return bounded(fut, collective_timeout(), f"PowerSGD bucket {bucket.index()}", on_success=counted)
