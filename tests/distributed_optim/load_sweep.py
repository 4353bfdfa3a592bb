"""The state-dict load sweep shared by the one-process test and the 2-rank worker (module level, so
``spawn`` can pickle it): every optimizer class of the project built over one small model, a few real steps
so its state exists, then every state key and group hyper-parameter of its own state dict corrupted in turn.
``sweep_loads`` reports each corrupted dict that is not refused with an error naming the key, or that
changes the optimizer or the params.
"""
from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import lightning_optim as lo
from lightning_optim.catalogue import OPTIMIZERS
from lightning_optim.distributed import (
    CentralizedAdam,
    CentralizedSGD,
    CentralizedSparsifiedSGD,
    CustomCentralizedOptimizer,
    DecentralizedSGD,
    DiLoCo,
    GenericCentralizedOptimizer,
    PowerSGD,
)
from tests.optim.specs import SPECS
from tests.ranks import ignore_warnings

Build = Callable[[nn.Module, int], torch.optim.Optimizer]

# a later stage from step 2 on, so the stage-specific states exist after STEPS steps
ONEBIT_KW = {"onebit_adam": dict(freeze_step=1), "onebit_lamb": dict(freeze_step=1),
             "zero_one_adam": dict(var_freeze_step=1, local_step_scaler=1, local_step_clipper=2)}
SPEC_KW = {spec.name: spec.kwargs for spec in SPECS}
STEPS = 3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))  # params (4, 3), (4,), (2, 4), (2,)


def _catalogue_build(name: str) -> Build:
    entry = OPTIMIZERS[name]
    kwargs = ONEBIT_KW.get(name) or SPEC_KW[entry.export]
    return lambda m, world: entry.cls(m.parameters(), **{"lr": 1e-2, **kwargs})


DISTRIBUTED_BUILDS: dict[str, Build] = {
    "generic_centralized": lambda m, w: GenericCentralizedOptimizer(
        w, m, optimizer=lo.SGD(m.parameters(), lr=0.1, momentum=0.9)),
    "centralized_sgd": lambda m, w: CentralizedSGD(w, m, lr=0.1, momentum=0.9, nesterov=True),
    "centralized_adam": lambda m, w: CentralizedAdam(w, m, lr=0.01, amsgrad=True),
    "custom_centralized": lambda m, w: CustomCentralizedOptimizer(
        m, w, lo.Adam(m.parameters(), lr=0.01), average_world=True, grad_clip=1.0),
    "centralized_sparsified_sgd": lambda m, w: CentralizedSparsifiedSGD(
        m.parameters(), lr=0.1, sparse_grad_size=2, random_sparse=True, world_size=w,
        generator=torch.Generator().manual_seed(5)),
    "powersgd": lambda m, w: PowerSGD(m, lr=0.1, momentum=0.9, reuse_query=True, matrix_approximation_rank=2,
                                                world_size=w),
    "decentralized_sgd": lambda m, w: DecentralizedSGD(model=m, lr=0.1, momentum=0.9),
    # synchronises after step 3 of STEPS = 3: its state holds an overlapped exchange still to merge
    "diloco": lambda m, w: DiLoCo(lo.SGD(m.parameters(), lr=0.1, momentum=0.9), sync_every=3, overlap=True,
                                  compressor="int8"),
}
# a torch.optim local optimizer: its load is torch's, so the centralized class checks for it
EXTRA_BUILDS: dict[str, Build] = {
    "generic_centralized[torch.optim.Adam]": lambda m, w: GenericCentralizedOptimizer(
        w, m, optimizer=torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=0.1)),
}
# DiLoCo over a torch.optim optimizer: its inner state is checked for torch's class (a moment of another shape,
# one that only broadcasts, would fail every later step after torch moved its step count)
EXTRA_BUILDS["diloco[torch.optim.AdamW]"] = lambda m, w: DiLoCo(
    torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1), sync_every=2, outer_momentum=0.5)
# a catalogue class whose state dict also carries its generator's state; freeze_step="auto" chosen at step 2
# (the cap) and still undecided after STEPS steps: the schedule holds freeze_at and the variance norms
VARIANT_BUILDS: dict[str, Build] = {
    "sparsified_sgd[generator]": lambda m, w: lo.SparsifiedSGD(
        m.parameters(), lr=0.1, sparse_grad_size=2, mode="random", generator=torch.Generator().manual_seed(3)),
    **{f"{name}[auto{', chosen' if cap else ''}]": (
        lambda m, w, cls=cls, cap=cap: cls(m.parameters(), lr=1e-2, freeze_step="auto", auto_freeze_window=1,
                                           auto_freeze_tolerance=1e-9, auto_freeze_max=cap))
       for name, cls in (("onebit_adam", lo.OnebitAdam), ("onebit_lamb", lo.OnebitLamb)) for cap in (2, None)},
}
BUILDS: dict[str, Build] = {**{n: _catalogue_build(n) for n in OPTIMIZERS}, **VARIANT_BUILDS, **DISTRIBUTED_BUILDS,
                            **EXTRA_BUILDS}
# what needs a second rank for all of its state (PowerSGD's error memory, the 1-bit error buffers)
TWO_RANK = ("powersgd", "onebit_adam", "zero_one_adam", "onebit_lamb")
# group keys a load keeps from the live optimizer on purpose (DeepSpeed's rule for the 1-bit masks)
NOT_LOADED = {"exp_avg_mask"}


def steps(opt: torch.optim.Optimizer, m: nn.Module, n: int, rank: int = 0) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(n):
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def trained(name: str, world: int = 1, rank: int = 0) -> tuple[torch.optim.Optimizer, nn.Module]:
    m = model()
    with ignore_warnings():  # the 1-bit optimizers' "nothing manages DDP" notice
        opt = BUILDS[name](m, world)
        steps(opt, m, STEPS, rank)
    return opt, m


def snapshot(opt: torch.optim.Optimizer, m: nn.Module) -> tuple[bytes, list[torch.Tensor]]:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return buf.getvalue(), [p.detach().clone() for p in m.parameters()]


def unchanged(before: tuple[bytes, list[torch.Tensor]], opt: torch.optim.Optimizer, m: nn.Module) -> bool:
    after = snapshot(opt, m)
    return before[0] == after[0] and all(torch.equal(a, b) for a, b in zip(before[1], after[1]))


# ---------------------------------------------------------------- corruptions
def _tensor_variants(value: torch.Tensor) -> dict[str, Any]:
    variants = {"int64": value.to(torch.int64), "bool": value.to(torch.bool), "complex": value.to(torch.complex64),
                "wrong shape": torch.zeros(7)}
    if value.dim() >= 1 and value.numel() > 1:  # a shape that only broadcasts to the param's
        variants["0-d"] = value.reshape(-1)[0].clone()
    return variants


COUNTER_VARIANTS = {"str": "x", "negative": -1, "fraction": 1.5, "bool tensor": torch.tensor(True),
                    "complex tensor": torch.tensor(1 + 1j)}
GROUP_VARIANTS = {"str": "x", "nan": math.nan, "negative": -1.0}


def _edited(sd: dict, path: tuple, value: Any) -> dict:
    out = copy.deepcopy(sd)
    target = out
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return out


def corruptions(sd: dict[str, Any]) -> Iterator[tuple[str, str, dict]]:
    """``(label, the word the error must name, corrupted copy)`` for every state key (the first param
    holding it), counter and group hyper-parameter of ``sd``, and its extra entries (compressors, 1-bit)."""
    seen = set()
    for pid, entry in sd["state"].items():
        for key, value in entry.items():
            if key in seen:
                continue
            seen.add(key)
            is_counter = key == "step" or (isinstance(value, int) and not isinstance(value, bool))
            variants = COUNTER_VARIANTS if is_counter else _tensor_variants(value) if isinstance(value, torch.Tensor) \
                else {}
            for what, bad in variants.items():
                yield f"state {key} {what}", key, _edited(sd, ("state", pid, key), bad)
    for gi, group in enumerate(sd["param_groups"]):
        for key in group:
            if key not in ("params", *NOT_LOADED):
                for what, bad in GROUP_VARIANTS.items():
                    yield f"group {gi} {key} {what}", key, _edited(sd, ("param_groups", gi, key), bad)
    yield from _extra_corruptions(sd)


def _extra_corruptions(sd: dict[str, Any]) -> Iterator[tuple[str, str, dict]]:
    if "generator_state" in sd:
        yield "generator_state of another size", "generator_state", _edited(sd, ("generator_state",),
                                                                            torch.zeros(3, dtype=torch.uint8))
    if "powersgd" in sd:
        yield "powersgd generator int64", "generator", _edited(sd, ("powersgd", "generator"), torch.zeros(3))
        for key, q in sd["powersgd"]["queries"].items():
            variants = {**_tensor_variants(q), "1-D": q.reshape(-1)}
            variants.pop("wrong shape")  # a 2-D warm start of another shape is redrawn, by design
            for what, bad in variants.items():
                yield f"powersgd query {key} {what}", "queries", _edited(sd, ("powersgd", "queries", key), bad)
    if "diloco" in sd:
        yield from _diloco_corruptions(sd)
    if "onebit" in sd:
        onebit = sd["onebit"]
        for key in ("worker_error", "server_error"):
            value = onebit[key] if onebit[key] is not None else torch.zeros(8)
            variants = {**_tensor_variants(value), "2-D": value.reshape(1, -1)}
            variants.pop("wrong shape")  # sizes that no longer fit restart at zero with a warning, by design
            for what, bad in variants.items():
                yield f"onebit {key} {what}", key, _edited(sd, ("onebit", key), bad)
        step = onebit["schedule"]["step"]
        for key, value in onebit["schedule"].items():
            path = ("onebit", "schedule", key)
            if isinstance(value, int) or value is None:  # counters; freeze_at (None until chosen)
                variants = {"str": "x", "negative": -3, "fraction": 1.5, "nan": math.nan, "inf": math.inf}
                if key == "freeze_at":
                    variants["zero"], variants["beyond the step"] = 0, step + 1
                for what, bad in variants.items():
                    yield f"onebit schedule {key} {what}", key, _edited(sd, path, bad)
            elif isinstance(value, list):  # the variance norms; ZeroOneAdam's per-group sums and products
                variants = {"str": "x", "[nan]": [math.nan], "[inf]": [math.inf], "['x']": ["x"], "[True]": [True],
                            "too long": [1.0] * (step + len(sd["param_groups"]) + 1)}
                if key == "variance_norms":
                    variants["[-1]"] = [-1.0]
                for what, bad in variants.items():
                    yield f"onebit schedule {key} {what}", key, _edited(sd, path, bad)


def _diloco_corruptions(sd: dict[str, Any]) -> Iterator[tuple[str, str, dict]]:
    section = sd["diloco"]
    for key in ("global_params", "outer_momentum"):
        for what, bad in _tensor_variants(section[key][0]).items():
            yield f"diloco {key} {what}", key, _edited(sd, ("diloco", key, 0), bad)
        yield f"diloco {key} short", key, _edited(sd, ("diloco", key), section[key][:1])
    for what, bad in {"str": "x", "negative": -1, "fraction": 1.5, "bool": True}.items():
        yield f"diloco step {what}", "step", _edited(sd, ("diloco", "step"), bad)
    if section["pending"] is not None:
        for what, bad in _tensor_variants(section["pending"]["deltas"][0]).items():
            yield f"diloco pending delta {what}", "pending", _edited(sd, ("diloco", "pending", "deltas", 0), bad)
        yield "diloco pending fragment", "pending", _edited(sd, ("diloco", "pending", "fragment"), 5)
    yield "diloco compressor generator", "compressors", _edited(sd, ("diloco", "compressors", 0, "generator"),
                                                                torch.zeros(3))
    yield "diloco settings", "settings", _edited(sd, ("diloco", "settings", "sync_every"), 4)
    for key in ("world_size", "rank"):
        for what, bad in {"str": "x", "negative": -1, "nan": math.nan, "fraction": 0.5, "bool": True}.items():
            yield f"diloco {key} {what}", key, _edited(sd, ("diloco", key), bad)
    yield "diloco rank beyond world_size", "rank", _edited(sd, ("diloco", "rank"), section["world_size"])


def sweep_loads(opt: torch.optim.Optimizer, m: nn.Module) -> tuple[int, list[str]]:
    """Every corruption of ``opt``'s own state dict loaded into ``opt``: (cases, failures)."""
    good = opt.state_dict()
    before = snapshot(opt, m)
    failures, cases = [], 0
    for label, word, corrupted in corruptions(good):
        cases += 1
        try:
            opt.load_state_dict(corrupted)
        except (ValueError, TypeError) as exc:
            if word not in str(exc):
                failures.append(f"{label}: the error does not name {word!r}: {exc}")
        except Exception as exc:  # noqa: BLE001 - reported
            failures.append(f"{label}: {type(exc).__name__} instead of ValueError/TypeError: {exc}")
        else:
            failures.append(f"{label}: accepted")
        if not unchanged(before, opt, m):
            failures.append(f"{label}: changed the optimizer or the params")
            opt.load_state_dict(copy.deepcopy(good))
            before = snapshot(opt, m)
    return cases, failures


def sweep_on_rank(rank: int, world: int, names: tuple[str, ...]) -> dict[str, tuple[int, list[str]]]:
    """Per class: (cases, failures); afterwards its own dict still loads and it still steps."""
    out = {}
    for name in names:
        opt, m = trained(name, world, rank)
        out[name] = sweep_loads(opt, m)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        steps(opt, m, 1, rank)
    return out


# ---------------------------------------------------------------- steps refused for a state set by hand
HAND_EDITS = {"powersgd": ("momentum_buffer", "memory"), "centralized_sparsified_sgd": ("memory", "estimated_w")}


def refused_steps(rank: int, world: int) -> list[str]:
    """Each state of ``HAND_EDITS`` replaced by hand (int64, complex, another shape) on every rank: the step
    must raise naming it and change nothing (no residual, generator, counter or param moved)."""
    failures = []
    for name, keys in HAND_EDITS.items():
        opt, m = trained(name, world, rank)
        p = next(iter(m.parameters()))
        state = opt.state[p]
        before = snapshot(opt, m)
        for key in keys:
            if key not in state:  # PowerSGD keeps no error memory on one rank
                if world > 1:
                    failures.append(f"{name}: no {key} after {STEPS} steps on {world} ranks")
                continue
            for bad in (state[key].to(torch.int64), state[key].to(torch.complex64), torch.zeros(7)):
                opt.state[p] = {**state, key: bad}
                try:
                    steps(opt, m, 1, rank)
                    failures.append(f"{name}: a step took {key} as {bad.dtype} {tuple(bad.shape)}")
                except ValueError as exc:
                    if key not in str(exc):
                        failures.append(f"{name}: the error does not name {key}: {exc}")
                opt.state[p] = state
                if not unchanged(before, opt, m):
                    failures.append(f"{name}: a refused step with {key} as {bad.dtype} changed the optimizer")
    return failures


def _rank_state_missing(world: int, rank: int) -> list[str]:
    """What the 2-rank sweep is for: the per-rank states exist (else their corruptions prove nothing)."""
    missing = []
    for name in TWO_RANK:
        sd = trained(name, world, rank)[0].state_dict()
        if name == "powersgd" and not all("memory" in entry for entry in sd["state"].values()):
            missing.append("powersgd: no error memory")
        if "onebit" in sd and sd["onebit"]["worker_error"] is None:
            missing.append(f"{name}: no 1-bit error buffers")
    return missing


def two_rank_probe(rank: int, world: int) -> tuple[dict[str, tuple[int, list[str]]], list[str]]:
    """Both probes in one spawned run (the load sweep of ``TWO_RANK``, then the refused steps)."""
    return sweep_on_rank(rank, world, TWO_RANK), _rank_state_missing(world, rank) + refused_steps(rank, world)
