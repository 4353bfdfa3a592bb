"""Run by torchrun (2 CPU ranks): a plain Accelerate loop with ``enable_diloco``.

    python -m torch.distributed.run --nproc_per_node 2 accelerate_diloco_script.py OUT

For each case of CASES (no compressor; int8 with per-rank residuals; SparseLoCo with per-rank accumulators): a
``full`` run of STEPS optimizer steps (2 accumulated micro-batches each, StepLR, ``clip_grad_norm_``) that calls
``accelerator.save_state`` after
step SAVE_AT (between two synchronisations), then a ``resumed`` run in fresh objects (another initial model)
that ``load_state``s it and trains the remaining steps. Then one refusal under DDP (a foreign comm hook), and the
ends of short runs (SHORT): ``max_steps`` past a sync (``finish`` by itself after the last step), the same with
``handle.finish()`` called after the loop, and a run shorter than ``sync_every`` with ``final_sync=False`` (the
warnings each rank gave). Each rank writes OUT/rank<r>.pt: per step the params, the bytes (comm_stats and the
kernel's socket counters), the loss and the learning rate.
"""

import gc
import sys
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

import accel_plugins
from lightning_optim.comm import comm_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when run as a script
from tests.accel.diloco_data import LR, MAX_NORM, MICRO, SAVE_AT, STEPS, SYNC_EVERY, WEIGHT_DECAY, batch, \
    build_model  # noqa: E402
from tests.wire import wire_bytes_sent  # noqa: E402

CASES = {"plain": {}, "int8": {"compressor": "int8"},
         "sparseloco": {"compressor": "sparseloco", "density": 0.05, "bits": 2, "outer_lr": 1.0, "outer_momentum": 0.9}}


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def train(settings: dict, rank: int, ckpt: Path, resume: bool) -> dict:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    model = build_model(seed=1 if resume else 0)  # the resumed run must take everything from the checkpoint
    initial = flat(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    handle = accel_plugins.enable_diloco(accelerator, model, optimizer, sync_every=SYNC_EVERY, **settings)
    if resume:
        accelerator.load_state(str(ckpt))
    rows = []
    for step in range(SAVE_AT if resume else 0, STEPS):
        lr = optimizer.param_groups[0]["lr"]
        wire, sent = wire_bytes_sent(), comm_stats().bytes_sent
        for micro in range(MICRO):
            x, y = batch(step, micro, rank)
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        after = wire_bytes_sent()
        rows.append({"step": step + 1, "lr": lr, "loss": loss.item(), "params": flat(model),
                     "stats_bytes": comm_stats().bytes_sent - sent,
                     "wire_bytes": None if wire is None or after is None else after - wire})
        if not resume and step + 1 == SAVE_AT:
            accelerator.save_state(str(ckpt))
    result = {"initial": initial, "rows": rows, "summary": handle.summary(), "inner_steps": handle.diloco.inner_steps,
              "steps_inner_optimizer": optimizer.optimizer.inner.state[next(iter(model.parameters()))]["step"]}
    handle.close()
    accelerator.free_memory()
    del model, optimizer, scheduler, handle
    gc.collect()
    return result


SHORT = {"max_steps": dict(sync_every=SYNC_EVERY, max_steps=SAVE_AT), "finish": dict(sync_every=SYNC_EVERY),
         "apart": dict(sync_every=2 * SYNC_EVERY, max_steps=3, final_sync=False)}


def short_run(rank: int, name: str) -> dict:
    """``train``'s loop (fresh objects, no checkpoint) for SHORT[name]'s run length; the params after each step
    and after the run's end, and the warnings this rank gave."""
    kwargs = dict(SHORT[name])
    steps = kwargs.get("max_steps", SAVE_AT)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    model = build_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    rows = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = accel_plugins.enable_diloco(accelerator, model, optimizer, **kwargs)
        for step in range(steps):
            lr = optimizer.param_groups[0]["lr"]
            for micro in range(MICRO):
                x, y = batch(step, micro, rank)
                with accelerator.accumulate(model):
                    accelerator.backward(nn.functional.mse_loss(model(x), y))
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
            rows.append({"step": step + 1, "lr": lr, "params": flat(model)})
        sent = comm_stats().bytes_sent
        finished = handle.finish() if name == "finish" else None
        result = {"rows": rows, "end": flat(model), "finished": finished,
                  "finish_bytes": comm_stats().bytes_sent - sent}
    result["warnings"] = [str(w.message) for w in caught if "enable_diloco" in str(w.message)]
    handle.close()
    accelerator.free_memory()
    del model, optimizer, scheduler, handle
    gc.collect()
    return result


def foreign_hook_refused() -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    accelerator = Accelerator(cpu=True)
    model = build_model(0)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    try:
        accel_plugins.enable_diloco(accelerator, model, optimizer, sync_every=4)
        message = "accepted"
    except ValueError as exc:
        message = str(exc)
    result = {"message": message, "inner": type(optimizer.optimizer).__name__,
              "save_hooks": len(accelerator._save_model_state_pre_hook)}
    accelerator.free_memory()
    del model, optimizer
    gc.collect()
    return result


out = Path(sys.argv[1])
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
results = {"world": accelerator.num_processes}
for name, settings in CASES.items():
    results[name] = {"full": train(settings, rank, out / f"ckpt_{name}", resume=False)}
    results[name]["resumed"] = train(settings, rank, out / f"ckpt_{name}", resume=True)
results["foreign_hook"] = foreign_hook_refused()
results["short"] = {name: short_run(rank, name) for name in SHORT}
torch.save(results, out / f"rank{rank}.pt")
accelerator.wait_for_everyone()
accelerator.end_training()  # destroys the process group: exiting with a live gloo group can abort at teardown
