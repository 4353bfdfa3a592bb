"""What each gloo rank runs in the DiLoCo tests (module level, so ``spawn`` can pickle it), and the deterministic
setup (params, data, inner optimizers, compressors) the parent replays in the W-worker reference."""
from __future__ import annotations

import contextlib
import io
import os
import time

import torch
import torch.distributed as dist

import lightning_optim as lo
from lightning_optim.comm import CommunicationError, comm_stats, set_collective_timeout
from lightning_optim.comm.compressors import Int4Quantizer, Int8Quantizer, PowerSGDCompressor, TopK
from lightning_optim.distributed import DiLoCo
from lightning_optim.distributed.diloco_schedule import syncing_fragment
from tests.distributed import error_text
from tests.ranks import counting_calls, record_warnings

SHAPES = [(6, 5), (6,), (3, 6), (3,)]
DT = torch.float64
STEPS = 10
# name -> inner optimizer, DiLoCo keywords, compressor (a name for build_compressor), ranks (3: all; 2: a pair
# subgroup), step after which the checkpoint is taken (mid-round; with overlap, an exchange still to merge)
CONFIGS = {
    "plain": dict(inner="sgd", kw=dict(sync_every=3), split=7),
    "adamw_no_nesterov": dict(inner="adamw", kw=dict(sync_every=3, outer_lr=0.9, outer_momentum=0.5, nesterov=False),
                              split=7),
    "averaging_on_a_pair": dict(inner="sgd", kw=dict(sync_every=2, outer_lr=1.0, outer_momentum=0.0, nesterov=False),
                                world=2, split=5),
    "fragments": dict(inner="sgd", kw=dict(sync_every=4, fragments=2), split=7),
    "overlap": dict(inner="sgd", kw=dict(sync_every=3, overlap=True, mixing=0.25), split=6),
    "streaming": dict(inner="adamw", kw=dict(sync_every=3, fragments=3, overlap=True), split=6),
    "int8": dict(inner="sgd", kw=dict(sync_every=4, fragments=2), compressor="int8", split=7),
    "int4_stochastic_overlap": dict(inner="sgd", kw=dict(sync_every=3, overlap=True), compressor="int4", split=6),
    "onebit": dict(inner="sgd", kw=dict(sync_every=3), compressor="onebit", split=7),
    "topk": dict(inner="sgd", kw=dict(sync_every=3), compressor="topk", split=7),
    "powersgd": dict(inner="sgd", kw=dict(sync_every=3), compressor="powersgd", split=7),
    "sign": dict(inner="sgd", kw=dict(sync_every=3), compressor="sign", split=7),
}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all_single",
               "all_to_all", "broadcast", "reduce", "reduce_scatter_tensor", "gather", "scatter", "barrier", "send",
               "recv", "isend", "irecv", "batch_isend_irecv")


def init_params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=DT) * 0.5 for s in SHAPES]


def loss_of(params, rank: int, step: int) -> torch.Tensor:
    """A small tanh MLP on rank- and step-specific data (different ranks pull different ways)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 5, generator=gen, dtype=DT)
    y = torch.randn(8, 3, generator=gen, dtype=DT) + rank
    w1, b1, w2, b2 = params
    out = torch.tanh(x @ w1.t() + b1) @ w2.t() + b2
    return (out - y).square().mean()


def fill_grads(rank: int, step: int, params) -> None:
    loss_of(params, rank, step).backward()


def make_inner(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return lo.AdamW(params, lr=0.02, weight_decay=0.01)  # one of ours


def build_compressor(name: str | None):
    return {None: None, "int8": Int8Quantizer(chunk=4), "int4": Int4Quantizer(chunk=5, rounding="stochastic", seed=3),
            "onebit": "onebit", "topk": TopK(k=3), "powersgd": PowerSGDCompressor(rank=1), "sign": "sign"}[name]


def build(name: str, params, group):
    cfg = CONFIGS[name]
    return DiLoCo(make_inner(cfg["inner"], params), **cfg["kw"], compressor=build_compressor(cfg.get("compressor")),
                  process_group=group)


@contextlib.contextmanager
def counting_collectives():
    """Every torch.distributed collective and point-to-point call this rank makes, counted."""
    counter = {"calls": 0}
    with counting_calls(dist, COLLECTIVES, lambda *_: counter.__setitem__("calls", counter["calls"] + 1)):
        yield counter


def _steps(opt, params, rank, steps, per_step=None, counter=None):
    history = []
    for t in steps:
        calls, stats = (counter or {"calls": 0})["calls"], comm_stats().copy()
        opt.zero_grad()
        fill_grads(rank, t, params)
        opt.step()
        history.append([p.detach().clone() for p in params])
        if per_step is not None:
            per_step.append({"calls": counter["calls"] - calls, **(comm_stats() - stats).as_dict()})
    return history


def _run(name: str, rank: int, group) -> dict:
    cfg = CONFIGS[name]
    params = [p.requires_grad_() for p in init_params()]
    before = comm_stats().copy()
    opt = build(name, params, group)
    construction = (comm_stats() - before).as_dict()
    per_step: list[dict] = []
    with counting_collectives() as counter:
        history = _steps(opt, params, rank, range(1, STEPS + 1), per_step, counter)
    resumed, saved = resumed_run(build, name, group, rank, cfg["split"], STEPS)  # checkpoint mid-round
    syncs = [syncing_fragment(t, opt.sync_every, opt.fragments) for t in range(1, STEPS + 1)]
    numels = [[p.numel() for p in params[lo:hi]] for lo, hi in opt.bounds]
    predicted = [None if c is None else c.bytes_sent(n, opt._origin()[0]) for c, n in zip(opt.compressors, numels)]
    return {"history": history, "resumed": resumed, "per_step": per_step, "construction": construction,
            "syncs": syncs, "bounds": opt.bounds, "predicted": predicted,
            "pending_saved": saved["opt"]["diloco"]["pending"] is not None,
            "residuals": [None if e is None else e.clone() for e in opt.residuals]}


def suite(rank: int, world: int) -> dict:
    set_collective_timeout(30)
    pair = dist.new_group([0, 1])
    out: dict = {"runs": {}}
    for name, cfg in CONFIGS.items():
        if cfg.get("world", 3) == 3:
            out["runs"][name] = _run(name, rank, None)
        elif rank < 2:
            out["runs"][name] = _run(name, rank, pair)
    params = [p.requires_grad_() for p in init_params()]
    inner = torch.optim.SGD(params, lr=0.1)
    out["refused_on_one"] = error_text(lambda: DiLoCo(inner, sync_every=0 if rank == 2 else 3))
    out["differs"] = error_text(lambda: DiLoCo(inner, sync_every=3 + (rank == 1)))
    out["compressor_differs"] = error_text(lambda: DiLoCo(inner, sync_every=3, compressor="int8" if rank else None))
    return out


def dies_before_an_exchange(rank: int, world: int, bound: float, compressor: str | None = None, die_after: int = 2):
    """The last rank exits mid-round after inner step ``die_after``: the others' next exchange (H = 3) must
    raise naming it within ``bound`` (plus the roll call's grace for a blocking first-call agreement)."""
    set_collective_timeout(bound)
    params = [p.requires_grad_() for p in init_params()]
    opt = DiLoCo(torch.optim.SGD(params, lr=0.05), sync_every=3, compressor=compressor)
    for t in range(1, die_after + 1):
        opt.zero_grad()
        fill_grads(rank, t, params)
        opt.step()
    if rank == world - 1:
        os._exit(0)  # dies without a word, mid-round
    time.sleep(0.3)
    for t in range(die_after + 1, 3 * (die_after // 3 + 1)):
        opt.zero_grad()
        fill_grads(rank, t, params)
        opt.step()
    opt.zero_grad()
    fill_grads(rank, 3 * (die_after // 3 + 1), params)
    start = time.monotonic()
    try:
        opt.step()  # the exchange
    except CommunicationError as exc:
        return ("CommunicationError", time.monotonic() - start, str(exc), getattr(exc, "failed_ranks", "unset"))
    return ("no error", time.monotonic() - start, "", None)


def construction_bytes(rank: int, world: int) -> dict:
    """What building DiLoCo sends: params equal on every rank (as under DDP) and params that differ."""
    out = {}
    for case in ("equal", "differ"):
        params = [p.requires_grad_() for p in init_params()]
        if case == "differ":
            with torch.no_grad():
                params[0].add_(rank)
        before = comm_stats().copy()
        opt = DiLoCo(torch.optim.SGD(params, lr=0.1), sync_every=2)
        sent = comm_stats() - before
        out[case] = {"bytes": sent.bytes_sent, "control_calls": sent.control_calls,
                     "global": [g.clone() for g in opt.global_params], "numel": sum(p.numel() for p in params)}
    return out


# config -> inner steps before finish(): each past a synchronisation and between two ("int8": fragment 0 has just
# synchronised after step 6, fragment 1 not; "overlap"/"streaming": an exchange still in flight)
FINISH = {"plain": 8, "overlap": 6, "streaming": 8, "int8": 6}


def _stepped(name: str, rank: int, steps: int, group=None, **kw):
    params = [p.requires_grad_() for p in init_params()]
    cfg = CONFIGS[name]
    opt = DiLoCo(make_inner(cfg["inner"], params), **{**cfg["kw"], **kw},
                 compressor=build_compressor(cfg.get("compressor")), process_group=group)
    _steps(opt, params, rank, range(1, steps + 1))
    return opt, params


def _finished(opt, params) -> dict:
    before = comm_stats().copy()
    synced = opt.finish()
    sent = comm_stats() - before
    after = [p.detach().clone() for p in params]
    again = opt.finish()  # nothing apart any more: the flags only
    return {"synced": synced, "params": after, "bytes": sent.bytes_sent, "again": again,
            "unchanged": all(torch.equal(a, p) for a, p in zip(after, params)), "pending": opt.pending}


def finish_suite(rank: int, world: int) -> dict:
    """``finish()`` past a synchronisation on every rank: the final synchronisation, the end right after a
    synchronisation, ``final_sync=False``, the run-length warning, and a checkpoint before the end resumed."""

    set_collective_timeout(30)
    out: dict = {name: _finished(*_stepped(name, rank, steps)) for name, steps in FINISH.items()}
    out["at_sync"] = _finished(*_stepped("plain", rank, 9))  # 9 = 3 x sync_every: nothing to do, nothing sent
    with record_warnings() as caught:
        opt, params = _stepped("plain", rank, 5, final_sync=False)
        before = comm_stats().copy()
        out["kept_apart"] = {"synced": opt.finish(), "bytes": (comm_stats() - before).bytes_sent,
                             "params": [p.detach().clone() for p in params]}
        short = DiLoCo(make_inner("sgd", params), sync_every=10)
        out["no_sync"] = [short.warn_if_no_sync(9), short.warn_if_no_sync(10), short.warn_if_no_sync(0)]
        streaming = DiLoCo(make_inner("sgd", params), sync_every=8, fragments=4, final_sync=False)
        out["no_sync"].append(streaming.warn_if_no_sync(1))  # one fragment every 2 steps: none before step 2
    out["warnings"] = [str(w.message) for w in caught]
    # a checkpoint before the end (mid-round, an exchange in flight), resumed in fresh objects, then finish()
    opt, params = _stepped("streaming", rank, 5)
    saved = {"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}
    fresh = [p.clone().requires_grad_() for p in saved["params"]]
    again = DiLoCo(make_inner("adamw", fresh), **CONFIGS["streaming"]["kw"])
    again.load_state_dict(saved["opt"])
    _steps(again, fresh, rank, range(6, FINISH["streaming"] + 1))
    again.finish()
    out["resumed"] = [p.detach().clone() for p in fresh]
    return out


def twin_run(opt, params, inner, twin, outer, global_params, steps: int = 7, every: int = 3) -> None:
    """``steps`` steps of ``opt`` (DiLoCo on one rank) on ``params`` beside its hand-made twin: ``inner`` on ``twin``
    and, every ``every`` steps, ``outer`` (a torch.optim.SGD over ``global_params``) on the gradient theta_g - theta,
    then theta <- theta_g. Both sides get the same gradients (``fill_grads``)."""
    for t in range(1, steps + 1):
        for o, ps in ((opt, params), (inner, twin)):
            o.zero_grad()
            fill_grads(0, t, ps)
            o.step()
        if t % every == 0:
            for g, p in zip(global_params, twin):
                g.grad = g - p.detach()
            outer.step()
            with torch.no_grad():
                for g, p in zip(global_params, twin):
                    p.copy_(g)


def resumed_run(build, name: str, group, rank: int, split: int, steps: int) -> tuple[list, dict]:
    """A second run of ``build(name, params, group)`` saved (params and ``state_dict()``, through ``torch.save``)
    after step ``split``, then resumed in fresh objects to step ``steps``: the history of the resumed steps, and
    what was saved."""
    first = [p.requires_grad_() for p in init_params()]
    opt1 = build(name, first, group)
    _steps(opt1, first, rank, range(1, split + 1))
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    second = [p.clone().requires_grad_() for p in saved["params"]]
    opt2 = build(name, second, group)
    opt2.load_state_dict(saved["opt"])
    return _steps(opt2, second, rank, range(split + 1, steps + 1)), saved
