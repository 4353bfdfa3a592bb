"""What each gloo rank runs in the DDP comm hook tests (module level, so ``spawn`` can pickle it): real
``DistributedDataParallel`` models with the hooks of ``lightning_optim.comm.ddp_hooks``, and the inputs
the parent replays in the W-worker references."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from lightning_optim.comm import set_collective_timeout
from lightning_optim.comm.ddp_hooks import PowerSGDHookState, make_state, register_comm_hook
from lightning_optim.comm.gossip import TopologyError
from lightning_optim.comm.stats import CommStats, ring_allreduce_bytes
from tests.ranks import seeded

DT = torch.float64
STEPS = 4
RESUMED = 2  # steps after the state_dict round trip
LR = 0.05
PATH = [[1], [0, 2], [1]]  # a 3-rank path: not complete, irregular (Metropolis weights keep the mean)

# name -> (hook, hook kwargs, DDP kwargs)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "topk": ("topk", dict(ratio=0.25), {}),
    "topk_small_buckets": ("topk", dict(ratio=0.25), dict(bucket_cap_mb=1e-4)),
    "randomk_shared": ("randomk", dict(ratio=0.3, seed=3), {}),
    "randomk_own": ("randomk", dict(ratio=0.3, seed=3, shared_indices=False), {}),
    "signsgd": ("sign_sgd", {}, {}),
    "signsgd_small_buckets": ("sign_sgd", {}, dict(bucket_cap_mb=1e-4)),
    "majority": ("sign_sgd", dict(majority_vote=True, error_feedback=False), {}),
}
POWERSGD = dict(matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=1.0, random_seed=5)
# two buckets of two params after DDP's rebuild, compressed from the third step on, rank 2
POWERSGD_BUCKETS = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=1.0, random_seed=3,
                        orthogonalization_epsilon=1e-12)
BUCKET_STEPS = 8


def make_model() -> nn.Module:
    with seeded(0):
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s data at ``step`` (1-based), different on every rank."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=gen, dtype=DT), torch.randn(5, 3, generator=gen, dtype=DT)


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return ((model(x) - y) ** 2).mean()


def local_grads(model: nn.Module, step: int, rank: int) -> list[torch.Tensor]:
    """This rank's own gradient, without DDP (an independent copy of the module)."""
    plain = copy.deepcopy(getattr(model, "module", model))
    return [g.detach().clone() for g in torch.autograd.grad(loss_of(plain, step, rank), list(plain.parameters()))]


def backward(ddp: nn.Module, step: int, rank: int) -> list[torch.Tensor]:
    ddp.zero_grad(set_to_none=True)
    loss_of(ddp, step, rank).backward()
    return [p.grad.detach().clone() for p in ddp.module.parameters()]


def _compression_case(name: str, rank: int) -> dict[str, Any]:
    hook, kwargs, ddp_kwargs = CASES[name]
    stats = CommStats()
    ddp = nn.parallel.DistributedDataParallel(make_model(), **ddp_kwargs)
    state = register_comm_hook(ddp, hook, stats=stats, **kwargs)
    out: dict[str, Any] = {"local": [], "hooked": [], "bytes": []}
    for step in range(1, STEPS + 1):
        out["local"].append(local_grads(ddp, step, rank))
        before = stats.bytes_sent
        out["hooked"].append(backward(ddp, step, rank))
        out["bytes"].append(stats.bytes_sent - before)
    saved = state.state_dict()
    out["state"] = saved
    out["buckets"] = state.buckets_compressed
    # resume: a fresh DDP (its first iteration has DDP's initial bucket layout) with the saved state
    again = nn.parallel.DistributedDataParallel(make_model(), **ddp_kwargs)
    resumed = register_comm_hook(again, make_state(hook, stats=CommStats(), **kwargs))
    resumed.load_state_dict(saved)
    out["continued"] = [backward(ddp, step, rank) for step in range(STEPS + 1, STEPS + RESUMED + 1)]
    out["resumed"] = [backward(again, step, rank) for step in range(STEPS + 1, STEPS + RESUMED + 1)]
    return out


class _RecordAllreduce:
    """Wraps ``dist.all_reduce`` to record what each call sends (numel, element size)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self._real = dist.all_reduce

    def __enter__(self) -> "_RecordAllreduce":
        def recording(tensor, *args, **kwargs):
            self.calls.append((tensor.numel(), tensor.element_size()))
            return self._real(tensor, *args, **kwargs)
        dist.all_reduce = recording
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._real


def _powersgd_case(rank: int, world: int) -> dict[str, Any]:
    """Ours vs torch's powerSGD_hook by hand on the same model and data; bytes vs the recorded all-reduces;
    resume into a fresh DDP (another bucket layout) vs the uninterrupted run."""
    stats = CommStats()
    ours = nn.parallel.DistributedDataParallel(make_model())
    state = register_comm_hook(ours, PowerSGDHookState(**POWERSGD, stats=stats))
    theirs = nn.parallel.DistributedDataParallel(make_model())
    theirs.register_comm_hook(torch_powersgd.PowerSGDState(process_group=None, **POWERSGD),
                              torch_powersgd.powerSGD_hook)
    out: dict[str, Any] = {"ours": [], "theirs": [], "bytes": [], "recorded": []}
    for step in range(1, STEPS + 1):
        before = stats.bytes_sent
        with _RecordAllreduce() as record:
            out["ours"].append(backward(ours, step, rank))
        out["bytes"].append(stats.bytes_sent - before)
        out["recorded"].append(sum(ring_allreduce_bytes(n, world, size) for n, size in record.calls))
        out["theirs"].append(backward(theirs, step, rank))
    saved = state.state_dict()
    out["state"] = saved
    again = nn.parallel.DistributedDataParallel(make_model())
    resumed = register_comm_hook(again, PowerSGDHookState(**POWERSGD, stats=CommStats()))
    resumed.load_state_dict(saved)
    out["continued"] = [backward(ours, step, rank) for step in range(STEPS + 1, STEPS + RESUMED + 1)]
    out["resumed"] = [backward(again, step, rank) for step in range(STEPS + 1, STEPS + RESUMED + 1)]
    out["realigned"] = resumed.realigned
    out["iter"] = (state.torch_state.iter, resumed.torch_state.iter)
    return out


def _one_bucket_at_a_time(state, bucket):  # no annotation: DDP checks a string one against the Future type
    """torch's own powerSGD_hook, its whole chain waited for inside the hook (blocking the backward): by hand,
    the order of collectives every rank shares."""
    fut = torch_powersgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def _powersgd_buckets_case(rank: int) -> dict[str, Any]:
    """Several buckets (torch's hook alone aborts on gloo here: its P/Q all-reduces are issued from gloo's
    callback threads, in an order that differs per rank): ours vs torch's hook waited for bucket by bucket
    on a twin DDP, and every rank's own gradient for the W-worker reference."""
    ours = nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=1e-4)
    state = register_comm_hook(ours, PowerSGDHookState(**POWERSGD_BUCKETS, stats=CommStats()))
    theirs = nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=1e-4)
    theirs.register_comm_hook(torch_powersgd.PowerSGDState(process_group=None, **POWERSGD_BUCKETS),
                              _one_bucket_at_a_time)
    out: dict[str, Any] = {"local": [], "ours": [], "theirs": []}
    for step in range(1, BUCKET_STEPS + 1):
        out["local"].append(local_grads(ours, step, rank))
        out["ours"].append(backward(ours, step, rank))
        out["theirs"].append(backward(theirs, step, rank))
    position = state.names.position  # the buckets in DDP's call order, as param positions
    out["buckets"] = [[position[name] for name in state._layouts[i]] for i in sorted(state._layouts)]
    out["iter"] = state.torch_state.iter
    return out


def _decentralized_case(rank: int) -> dict[str, Any]:
    stats = CommStats()
    ddp = nn.parallel.DistributedDataParallel(make_model())
    state = register_comm_hook(ddp, "decentralized", neighbors=PATH, weights="metropolis", consensus_every=1,
                               stats=stats)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    flat = lambda: [p.detach().clone() for p in ddp.module.parameters()]  # noqa: E731
    out: dict[str, Any] = {"start": flat(), "local": [], "grads": [], "half": [], "mixed": [], "bytes": [],
                           "distance": []}
    for step in range(1, STEPS + 1):
        out["local"].append(local_grads(ddp, step, rank))
        out["grads"].append(backward(ddp, step, rank))
        opt.step()
        out["half"].append(flat())
        before = stats.bytes_sent
        out["distance"].append(state.after_step(ddp.module.parameters()))
        out["bytes"].append(stats.bytes_sent - before)
        out["mixed"].append(flat())
    out["gossip_only"] = [state.after_step(ddp.module.parameters()) for _ in range(3)]  # lr 0: pure gossip
    out["final"] = flat()
    out["degree"] = len(state.topology.neighbors[rank])
    return out


def _refusal(neighbors: Any) -> tuple[str, str]:
    ddp = nn.parallel.DistributedDataParallel(make_model())
    try:
        register_comm_hook(ddp, "decentralized", neighbors=neighbors)
    except (TopologyError, TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return "", "no error"


def _powersgd_disagreement(rank: int) -> tuple[str, str]:
    ddp = nn.parallel.DistributedDataParallel(make_model())
    try:  # the last rank was given another rank of approximation
        register_comm_hook(ddp, "powersgd", **{**POWERSGD, "matrix_approximation_rank": 2 if rank == 2 else 1})
    except ValueError as exc:
        return type(exc).__name__, str(exc)
    return "", "no error"


def suite(rank: int, world: int) -> dict[str, Any]:
    """Everything the hook tests check, in one spawn of 3 ranks."""
    set_collective_timeout(60)
    out: dict[str, Any] = {name: _compression_case(name, rank) for name in CASES}
    out["powersgd"] = _powersgd_case(rank, world)
    out["powersgd_buckets"] = _powersgd_buckets_case(rank)
    out["decentralized"] = _decentralized_case(rank)
    out["missing_rank"] = _refusal([[1], [0, 2], [1, 5]])
    out["asymmetric"] = _refusal([[1, 2], [0], [1]])
    out["powersgd_disagree"] = _powersgd_disagreement(rank)
    return out
