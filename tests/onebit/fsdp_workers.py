"""What each of 4 gloo ranks runs in the FSDP2 (HSDP, 2 replicas x 2 shards) tests of ``onebit_fsdp``
(module level, so the rank pool can pickle it), and the model/batches the parent replays in the reference.

Mesh ``[[0, 1], [2, 3]]``: ranks 2w and 2w+1 hold replica w (shards 0 and 1), ranks s and 2+s hold the two
replicas of shard s. Every rank gets its own batch (seeded by step and rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_optim import OnebitAdam, OnebitLamb, ZeroOneAdam
from lightning_optim.comm import comm_stats, reset_comm_stats
from lightning_optim.onebit import load_rank_state, onebit_fsdp, rank_state
from lightning_optim.onebit.auto_freeze import AutoFreezeDecision
from tests.distributed import error_text
from tests.ranks import counting_calls, record_warnings, seeded

REPLICAS, SHARDS = 2, 2
COMMON = dict(lr=0.01, weight_decay=0.1)
CONFIGS = {  # optimizer, its arguments, steps, checkpoint after this step (mid-compression)
    "adam": (OnebitAdam, dict(freeze_step=3), 9, 6),
    # freeze_step="auto" under onebit_fsdp: the variance norm is summed over the whole world (every shard)
    "adam_auto": (OnebitAdam, dict(freeze_step="auto", auto_freeze_window=2, auto_freeze_tolerance=0.2), 11, 6),
    "zoadam": (ZeroOneAdam, dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4),
               14, 10),
}


class Block(nn.Module):
    """A param of its own registered before a child's: FSDP's flat order (children first) differs from
    ``parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.8, 1.2, 64))
        self.lin = nn.Linear(127, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain


class Net(nn.Module):
    """Three layers (uneven row counts: FSDP pads their shards) and a param of the root's own."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 127), Block(), nn.Linear(64, 5)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.scale


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 32, generator=gen), torch.randn(8, 5, generator=gen)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


def initial_params() -> dict[str, torch.Tensor]:
    with seeded(0):
        return {n: p.detach().clone() for n, p in Net().named_parameters()}


def plain_grads(params: dict[str, torch.Tensor], step: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s whole gradient at ``params`` (an unsharded copy of the model), in param order."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in params.items()}
    x, y = batch(step, rank)
    loss = loss_fn(torch.func.functional_call(Net(), leaves, (x,)), y)
    return [g.detach() for g in torch.autograd.grad(loss, list(leaves.values()))]


def sharded_model(mesh) -> Net:
    with seeded(0):
        model = Net()
    for layer in (model.a, model.b, model.c):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _build(name: str, mesh):
    model = sharded_model(mesh)
    cls, kwargs, _, _ = CONFIGS[name]
    optimizer = cls(model.parameters(), **COMMON, **kwargs)
    return model, optimizer, onebit_fsdp(model, optimizer)


def _full(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _train(model, optimizer, steps, rank, replicate_ranks, record):
    """Steps ``steps`` (1-based numbers); per step: this rank's whole gradient, the params after it, and what
    crossed the replicas: HSDP all-reduce hook calls, elements all-reduced over the replicate group, comm_stats."""
    hook_calls, reduced = [0], [0]
    for m in (model.a, model.b, model.c, model):
        m.set_all_reduce_hook(lambda out: hook_calls.__setitem__(0, hook_calls[0] + 1))

    def count(_name, args, kwargs) -> None:
        group = kwargs.get("group", args[2] if len(args) > 2 else None)
        if group is not None and sorted(dist.get_process_group_ranks(group)) == replicate_ranks:
            reduced[0] += args[0].numel()

    with counting_calls(dist, ["all_reduce"], count):
        for step in steps:
            if record is not None:
                record["grads"].append(plain_grads(_full(model), step, rank))
            hook_calls[0] = reduced[0] = 0
            stats = comm_stats()
            before = stats.bytes_sent, stats.fp32_equivalent_bytes, stats.compressed_calls, stats.control_calls
            needs = optimizer.needs_averaged_grads
            x, y = batch(step, rank)
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            after = stats.bytes_sent, stats.fp32_equivalent_bytes, stats.compressed_calls, stats.control_calls
            if record is not None:
                record["params"].append(_full(model))
                record["needs"].append(needs)
                record["hook_calls"].append(hook_calls[0])
                record["replicate_all_reduced"].append(reduced[0])
                record["stats"].append(tuple(a - b for a, b in zip(after, before)))


def _save(model, optimizer, path: str, rank: int) -> None:
    dcp.save({"model": model.state_dict(), "optim": rank_state(optimizer, model)}, checkpoint_id=path)


def _load(model, optimizer, path: str, rank: int) -> None:
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    load_rank_state(optimizer, model, path, "optim")


def train_suite(rank: int, world: int, name: str, ckpt_dir: str) -> dict:
    """The run the parent compares with the reference, a checkpoint mid-compression resumed in fresh objects,
    and ``remove()`` giving HSDP its own all-reduce back."""
    mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
    replicate_ranks = sorted(dist.get_process_group_ranks(mesh.get_group(0)))
    reset_comm_stats()
    _, _, steps, at = CONFIGS[name]
    model, optimizer, handle = _build(name, mesh)
    out = {k: [] for k in ("grads", "params", "needs", "hook_calls", "replicate_all_reduced", "stats")}
    with record_warnings() as caught:
        _train(model, optimizer, range(1, at + 1), rank, replicate_ranks, out)
        path = f"{ckpt_dir}/{name}"
        _save(model, optimizer, path, rank)
        out["synced_at_save"] = optimizer.params_synchronized  # DCP keeps one copy of a replicated shard
        out["checkpoint"] = path
        _train(model, optimizer, range(at + 1, steps + 1), rank, replicate_ranks, out)
        onebit = optimizer.state_dict()["onebit"]
        out["onebit"] = (onebit["world_size"], onebit["rank"], onebit["worker_error"].numel())
        out["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
        out["local_numels"] = [p.to_local().numel() for p in model.parameters()]
        out["group_is_replicate"] = optimizer.process_group is mesh.get_group(0)

        model2, optimizer2, _ = _build(name, mesh)
        _load(model2, optimizer2, path, rank)
        resumed = {k: [] for k in out if isinstance(out[k], list)}
        _train(model2, optimizer2, range(at + 1, steps + 1), rank, replicate_ranks, resumed)
        out["resumed_params"] = resumed["params"]
    ours = ("Onebit", "ZeroOne", "onebit", "1-bit", "compress")
    decided = [w for w in caught if w.category is AutoFreezeDecision]  # freeze_step="auto" says its step, once
    out["warnings"] = [str(w.message) for w in caught if any(k in str(w.message) for k in ours) and w not in decided]
    out["decisions"] = [str(w.message) for w in decided]

    # remove(): HSDP's own all-reduce again, the compression stage's partial reductions dropped
    handle.remove()
    full = _full(model)
    x, y = batch(100, rank)
    loss_fn(model(x), y).backward()
    out["after_remove_grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    out["after_remove_params"] = full
    out["restored"] = (optimizer.process_group, optimizer.average_grads)
    return out


def refusal_suite(rank: int, world: int) -> dict:
    """Every refusal, on every rank (``error_text``: the message, or "no error")."""
    mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
    out = {}
    plain = Net()
    out["no_fsdp"] = error_text(lambda: onebit_fsdp(plain, OnebitAdam(plain.parameters(), freeze_step=2)))
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    one_d = Net()
    for layer in (one_d.a, one_d.b, one_d.c, one_d):
        fully_shard(layer, mesh=flat)
    out["one_d"] = error_text(lambda: onebit_fsdp(one_d, OnebitAdam(one_d.parameters(), freeze_step=2)))
    model = sharded_model(mesh)
    out["not_onebit"] = error_text(lambda: onebit_fsdp(model, torch.optim.Adam(model.parameters())))
    out["lamb"] = error_text(lambda: onebit_fsdp(model, OnebitLamb(model.parameters(), freeze_step=2)))
    out["wrong_group"] = error_text(lambda: onebit_fsdp(model, OnebitAdam(model.parameters(), freeze_step=2,
                                                                         process_group=mesh.get_group(1))))
    stepped = OnebitAdam(model.parameters(), freeze_step=2, process_group=mesh.get_group(0))
    x, y = batch(1, rank)
    loss_fn(model(x), y).backward()
    stepped.step()
    stepped.zero_grad()
    out["after_step"] = error_text(lambda: onebit_fsdp(model, stepped))
    root_plain = Net()
    fully_shard(root_plain.a, mesh=mesh)
    out["root_not_sharded"] = error_text(lambda: onebit_fsdp(root_plain, OnebitAdam(root_plain.parameters())))
    fresh = OnebitAdam(model.parameters(), freeze_step=2)
    handle = onebit_fsdp(model, fresh)
    out["twice"] = error_text(lambda: onebit_fsdp(model, OnebitAdam(model.parameters(), freeze_step=2)))
    handle.remove()
    out["again_after_remove"] = error_text(lambda: onebit_fsdp(model, OnebitAdam(model.parameters())).remove())
    return out
