"""What each gloo rank runs in the 1-bit optimizer tests (module level, so ``spawn`` can pickle it),
and the deterministic setup the parent process replays in the W-worker references.

Every worker function returns plain data (tensors, lists, strings); the tests compare.
"""

from __future__ import annotations

import functools
import io

import torch
import torch.distributed as dist

from lightning_optim.onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
from tests.ranks import record_warnings, seeded

SHAPES = [(5, 3), (4,), (2, 2, 2), (9,)]
LRS = [0.01, 0.01, 0.02, 0.01]  # per param, as the groups below set them
MASK = torch.tensor([[[1.0, 0.0], [1.0, 1.0]], [[0.0, 1.0], [1.0, 1.0]]])  # for SHAPES[2]
MASKS = [None, None, MASK, None]

CONFIGS = {
    "adam": (OnebitAdam, dict(freeze_step=3), 8),
    "zoadam": (ZeroOneAdam, dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4), 17),
    "lamb": (OnebitLamb, dict(freeze_step=3), 8),
}
COMMON = dict(lr=0.01, weight_decay=0.1)


def init_params(dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]


def rank_grads(step: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s gradients at step ``step`` (1-based); different on every rank."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=gen) * (1 + rank) for s in SHAPES]


def groups(params):
    return [
        {"params": params[:2]},
        {"params": [params[2]], "lr": LRS[2], "exp_avg_mask": MASK},
        {"params": [params[3]]},
    ]


def build(name, params, **extra):
    cls, kwargs, _ = CONFIGS[name]
    return cls(groups(params), **{**COMMON, **kwargs, **extra})


def _set_grads(params, step, rank):
    for p, g in zip(params, rank_grads(step, rank)):
        p.grad = g.to(p.dtype)


def _run(name, rank, world, steps, *, dtype=torch.float32, average_grads=True, start=None, group=None):
    """Run ``steps`` steps; returns the params after each, and the contract flags."""
    if start is None:
        params = init_params(dtype)
        opt = build(name, params, average_grads=average_grads, process_group=group)
        first = 1
    else:
        params, opt, first = start
    history, needs, synced = [], [], []
    for step in range(first, first + steps):
        needs.append(opt.needs_averaged_grads)
        _set_grads(params, step, rank)
        if not average_grads and opt.needs_averaged_grads:  # what DDP's allreduce would do
            for p in params:
                dist.all_reduce(p.grad, group=group)
                p.grad /= world
        opt.step()
        history.append([p.detach().clone() for p in params])
        synced.append(opt.params_synchronized)
    return {"params": history, "needs": needs, "synced": synced, "opt": opt, "live": params}


def _save(opt, params) -> bytes:
    buf = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "params": [p.detach() for p in params]}, buf)
    return buf.getvalue()


def _restore(name, blob: bytes, **extra):
    ckpt = torch.load(io.BytesIO(blob), weights_only=False)
    params = [p.clone().requires_grad_() for p in ckpt["params"]]
    opt = build(name, params, **extra)
    opt.load_state_dict(ckpt["optimizer"])
    return params, opt


def _strip(result):
    return {k: v for k, v in result.items() if k not in ("opt", "live")}


def two_rank_suite(rank, world, group=None):
    """Everything checked on two ranks; ``group``: the two ranks' process group."""
    run = functools.partial(_run, group=group)
    out = {}
    # 1. each optimizer across its stages (compared with the references by the parent)
    for name, (_, _, steps) in CONFIGS.items():
        out[name] = _strip(run(name, rank, world, steps))
    # 2. the caller averages (DDP with a switchable allreduce) instead of the optimizer
    for name in ("adam", "zoadam"):
        out[f"{name}_caller_avg"] = _strip(run(name, rank, world, CONFIGS[name][2], average_grads=False))
    # 3. bf16 params: fp32 states, Kahan buffers, params equal on every rank when synchronised
    for name in ("adam", "zoadam", "lamb"):
        res = run(name, rank, world, CONFIGS[name][2], dtype=torch.bfloat16)
        state = res["opt"].state[res["live"][0]]
        out[f"{name}_bf16"] = {
            **_strip(res),
            "dtypes": {k: v.dtype for k, v in state.items()},
            "param_dtype": res["live"][0].dtype,
        }
    # 4. checkpoint per rank mid-run, restore into fresh objects, continue: bitwise equal
    for name, at in (("adam", 5), ("zoadam", 9), ("lamb", 5)):
        total = CONFIGS[name][2]
        first = run(name, rank, world, at)
        blob = _save(first["opt"], first["live"])
        cont = run(name, rank, world, total - at, start=(first["live"], first["opt"], at + 1))
        params, opt = _restore(name, blob, process_group=group)
        resumed = run(name, rank, world, total - at, start=(params, opt, at + 1))
        out[f"{name}_resume"] = {
            "continued": cont["params"],
            "resumed": resumed["params"],
            "blob": blob,
            "synced_at_save": first["synced"][-1],
        }
    # 5. gradient accumulation: k micro-batch backward passes of loss / k
    out["accumulation"] = _accumulate(rank, k=3, steps=6, group=group)
    # 6. params whose shapes differ across ranks: ValueError on every rank, before any update
    shapes = [(3,), (2, 2)] if rank == 0 else [(3,), (4,)]
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    opt = OnebitAdam(params, freeze_step=1, process_group=group)
    for p in params:
        p.grad = torch.ones_like(p)
    try:
        opt.step()
        out["mismatch"] = None
    except ValueError as err:
        out["mismatch"] = str(err)
    out["mismatch_untouched"] = all(bool((p == 0).all()) for p in params)
    return out


def micro_batches(step: int, rank: int, k: int) -> list[list[torch.Tensor]]:
    """Coefficients c of the micro-batch losses sum_j (p_j * c_j).sum() (gradient: c)."""
    gen = torch.Generator().manual_seed(7000 * step + 10 * rank)
    return [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(k)]


def _accumulate(rank, k, steps, group=None):
    params = init_params()
    opt = OnebitAdam(params, lr=0.01, freeze_step=3, process_group=group)
    history = []
    for step in range(1, steps + 1):
        for coeffs in micro_batches(step, rank, k):
            loss = sum((p * c).sum() for p, c in zip(params, coeffs)) / k
            loss.backward()
        opt.step()
        opt.zero_grad()
        history.append([p.detach().clone() for p in params])
    return history


def resume_other_world(rank, world, blobs, steps):
    """Load a checkpoint saved on another world size, continue ``steps`` steps."""
    blob = blobs[min(rank, len(blobs) - 1)]
    saved = torch.load(io.BytesIO(blob), weights_only=False)["optimizer"]
    with record_warnings() as caught:
        params, opt = _restore("zoadam", blob)
        start = opt.global_step + 1
        restored = opt.state_dict()
        carried = restored["onebit"]["schedule"] == saved["onebit"]["schedule"] and all(
            torch.equal(restored["state"][i][key], value)
            for i, state in saved["state"].items()
            for key, value in state.items()
        )
        res = _run("zoadam", rank, world, steps, start=(params, opt, start))
    messages = [str(w.message) for w in caught if "error buffers" in str(w.message)]
    return {**_strip(res), "warnings": messages, "start": start, "carried": carried}


def three_rank_suite(rank, world, blobs):
    out = {"zoadam": _strip(_run("zoadam", rank, world, CONFIGS["zoadam"][2]))}
    out["resume"] = resume_other_world(rank, world, blobs, 6)
    return out


def _tiny_model():
    with seeded(0):
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def ddp_contract(rank, world, steps=14):
    """ZeroOneAdam(average_grads=False) under DDP whose allreduce follows needs_averaged_grads,
    against the same optimizer averaging by itself on an unwrapped model."""
    from torch.nn.parallel import DistributedDataParallel

    from lightning_optim.comm import register_switchable_allreduce

    kwargs = dict(lr=0.01, var_freeze_step=5, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
    plain = _tiny_model()
    ddp = DistributedDataParallel(_tiny_model())
    switch = register_switchable_allreduce(ddp)
    opt_plain = ZeroOneAdam(plain.parameters(), average_grads=True, **kwargs)
    opt_ddp = ZeroOneAdam(ddp.parameters(), average_grads=False, **kwargs)
    gen = torch.Generator().manual_seed(100 + rank)
    diffs, synced_equal = [], []
    for _ in range(steps):
        x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)
        switch.enabled = opt_ddp.needs_averaged_grads  # what the Lightning strategy does
        for model, opt in ((plain, opt_plain), (ddp, opt_ddp)):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        diffs.append(max((a - b).abs().max().item() for a, b in zip(plain.parameters(), ddp.parameters())))
        if opt_ddp.params_synchronized:
            flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            synced_equal.append(all(torch.equal(g, flat) for g in gathered))
    return {"diffs": diffs, "synced_equal": synced_equal, "reduced": switch.buckets_reduced, "skipped": switch.buckets_skipped}


def suite(rank, world):
    """One spawn of 3 ranks for everything: ranks 0 and 1 run the 2-rank checks on their own
    process group (spawning costs more than all the checks), then all 3 run the 3-rank checks
    and resume the 2-rank checkpoints."""
    assert world == 3
    pair = dist.new_group([0, 1])
    two = two_rank_suite(rank, 2, pair) if rank < 2 else None
    blobs = [None] * world
    dist.all_gather_object(blobs, two["zoadam_resume"]["blob"] if two else None)
    return {"two": two, "three": three_rank_suite(rank, world, blobs[:2]), "ddp": ddp_contract(rank, world)}
