"""Run by torchrun (2 CPU ranks): Accelerate loops with enable_master_weights / enable_gradient_release,
each beside a reference written with torch DDP and the framework-free core by hand, in the same process.

    python -m torch.distributed.run --nproc_per_node 2 precision_script.py OUT mode=masters [save_at=K] [load=DIR start=K]
    python -m torch.distributed.run --nproc_per_node 2 precision_script.py OUT mode=release
    python -m torch.distributed.run --nproc_per_node 2 precision_script.py OUT mode=onebit

masters: an fp16 MLP, lightning_optim.AdamW, gradient_accumulation_steps=2, clip_grad_norm_, a StepLR,
an inf loss on rank 1 only at step OVERFLOW_AT. The reference: a second copy under torch's own DDP
(no_sync for the first micro-batch), MasterWeights + DynamicLossScaler stepped by hand.
release: an fp32 MLP stepped by gradient release beside a plain copy under the same accelerator.
onebit: fp16 params + master weights + OnebitAdam with enable_onebit, beside the same run in fp32.
Each rank writes OUT/rank<r>.pt.

One launch runs several phases (tests/accel/phases.py), each the arguments above, separated by ``then``:

    ... precision_script.py OUT/full mode=masters save_at=5 then OUT/resumed mode=masters load=OUT/full/ckpt start=5 \
        then OUT/release mode=release then OUT/onebit mode=onebit

Each phase builds its own Accelerator (after ``phases.start_phase`` reset Accelerate's singletons, comm_stats'
counter and the compression caches), models, optimizers and handles. Why a resumed phase stands for its own launch:
params, master weights, optimizer, scheduler, loss scale and random states come from the checkpoint on disk
alone, as a user's resumed run takes them.
"""

import contextlib
import copy
import gc
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

import accel_plugins
import lightning_optim as lo
from lightning_optim.comm import comm_stats
from lightning_optim.precision import DynamicLossScaler, MasterWeights

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when run as a script
from tests.accel.phases import end_launch, split_phases, start_phase  # noqa: E402

STEPS, OVERFLOW_AT, MICRO = 8, 3, 2


@dataclass(frozen=True)
class Phase:
    """One run's arguments and its accelerator."""

    out: Path
    mode: str
    save_at: int | None
    load: str | None
    start: int
    accelerator: Accelerator

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world(self) -> int:
        return self.accelerator.num_processes


def parse_phase(argv: list[str]) -> Phase:
    """``OUT`` then key=value options (torchrun's own parser would take --options as its prefixes)."""
    options = dict(arg.split("=", 1) for arg in argv[1:])
    return Phase(out=Path(argv[0]), mode=options["mode"],
                 save_at=int(options["save_at"]) if "save_at" in options else None,
                 load=options.get("load"), start=int(options.get("start", 0)),
                 accelerator=Accelerator(cpu=True, gradient_accumulation_steps=MICRO))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def batch(phase: Phase, step: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + phase.rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    if phase.mode == "masters" and step == OVERFLOW_AT and phase.rank == 1 and micro == 1:
        x[0, 0] = float("inf")  # this rank only: every rank must skip the step
    return x.to(dtype), y.to(dtype)


def loss_of(phase: Phase, model: nn.Module, step: int, micro: int, dtype: torch.dtype) -> torch.Tensor:
    x, y = batch(phase, step, micro, dtype)
    return nn.functional.mse_loss(model(x).float(), y.float())


def run_masters(phase: Phase) -> dict:
    accelerator = phase.accelerator
    model = mlp().half()
    reference = copy.deepcopy(model)
    optimizer = lo.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    masters = accel_plugins.enable_master_weights(accelerator, model, optimizer)
    if phase.load:
        accelerator.load_state(phase.load)
    rows = []
    for step in range(phase.start, STEPS):
        for micro in range(MICRO):
            with accelerator.accumulate(model):
                loss = loss_of(phase, model, step, micro, torch.float16)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        rows.append({"skipped": optimizer.step_was_skipped, "scale": masters.get_scale(), "norm": float(norm),
                     "lr": optimizer.param_groups[0]["lr"]})
        if phase.save_at is not None and step + 1 == phase.save_at:
            accelerator.save_state(str(phase.out / "ckpt"))
    result = {"params": [p.detach().clone() for p in model.parameters()], "rows": rows,
              "masters": [m.detach().clone() for m in masters.masters.masters]}
    if not phase.load:
        result["reference"] = reference_masters(phase, reference)
    masters.close()
    return result


def reference_masters(phase: Phase, model: nn.Module) -> dict:
    """The same run by hand: torch DDP, MasterWeights, DynamicLossScaler, clipping on the masters."""
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = lo.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    masters, scaler = MasterWeights(model.parameters()), DynamicLossScaler()
    masters.swap_into(optimizer)
    skipped = []
    for step in range(STEPS):
        for micro in range(MICRO):
            # DDP reads no_sync at forward: the whole micro-batch runs inside it
            with ddp.no_sync() if micro < MICRO - 1 else contextlib.nullcontext():
                scaler.scale(loss_of(phase, ddp, step, micro, torch.float16) / MICRO).backward()
        found = masters.grads_to_masters(1.0 / scaler.loss_scale)
        nn.utils.clip_grad_norm_([m for m in masters.masters if m.grad is not None], 0.5)
        overflow = scaler.agree(found)
        scaler.update(overflow)
        if overflow:
            masters.zero_master_grads()
        else:
            optimizer.step()
            masters.after_step(optimizer)
            for _ in range(phase.world):  # Accelerate steps the scheduler once per process (split_batches=False)
                scheduler.step()
        optimizer.zero_grad()
        skipped.append(overflow)
    return {"params": [p.detach().clone() for p in model.parameters()], "skipped": skipped}


def run_release(phase: Phase) -> dict:
    accelerator = phase.accelerator
    released, plain = mlp(), mlp()
    plain.load_state_dict(released.state_dict())
    opt_released = lo.AdamW(released.parameters(), lr=1e-2, weight_decay=0.01)
    opt_plain = lo.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    sched_released = torch.optim.lr_scheduler.StepLR(opt_released, step_size=2, gamma=0.5)
    sched_plain = torch.optim.lr_scheduler.StepLR(opt_plain, step_size=2, gamma=0.5)
    released, plain, opt_released, opt_plain, sched_released, sched_plain = accelerator.prepare(
        released, plain, opt_released, opt_plain, sched_released, sched_plain)
    release = accel_plugins.enable_gradient_release(accelerator, released, opt_released)
    for step in range(STEPS):
        for micro in range(MICRO):
            with accelerator.accumulate(released, plain):
                for model in (released, plain):
                    accelerator.backward(loss_of(phase, model, step, micro, torch.float32))
                for optimizer, scheduler in ((opt_released, sched_released), (opt_plain, sched_plain)):
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
    try:
        accelerator.clip_grad_norm_(released.parameters(), 1.0)
        clip_error = None
    except ValueError as exc:
        clip_error = str(exc)
    release.close()
    return {"released": [p.detach().clone() for p in released.parameters()],
            "plain": [p.detach().clone() for p in plain.parameters()], "clip_error": clip_error,
            "lr": opt_released.param_groups[0]["lr"]}


def run_onebit(phase: Phase) -> dict:
    accelerator = phase.accelerator
    model16, model32 = mlp(), mlp()
    model32.load_state_dict(model16.state_dict())
    model16.half()
    runs = {"initial": [p.detach().clone() for p in model32.parameters()]}
    for name, model in (("fp16", model16), ("fp32", model32)):
        optimizer = accel_plugins.to_onebit_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "onebit_adam",
                                                      freeze_step=3)
        model, optimizer = accelerator.prepare(model, optimizer)
        masters = accel_plugins.enable_master_weights(accelerator, model, optimizer) if name == "fp16" else None
        onebit = accel_plugins.enable_onebit(accelerator, model, optimizer)
        dtype = torch.float16 if name == "fp16" else torch.float32
        sent = []
        for step in range(STEPS):
            before = comm_stats().bytes_sent
            for micro in range(MICRO):
                with accelerator.accumulate(model):
                    accelerator.backward(loss_of(phase, model, step, micro, dtype))
                    optimizer.step()
                    optimizer.zero_grad()
            sent.append(comm_stats().bytes_sent - before)
        runs[name] = {"params": [p.detach().float().clone() for p in model.parameters()], "sent": sent,
                      "switch": onebit.switch.enabled, "skipped": masters.skipped_steps if masters else 0,
                      "numel": sum(p.numel() for p in model.parameters())}
        onebit.close()
        if masters is not None:
            masters.close()
        accelerator.free_memory()
    return runs


RUNS = {"masters": run_masters, "release": run_release, "onebit": run_onebit}


def run_phase(argv: list[str]) -> None:
    start_phase()
    phase = parse_phase(argv)
    phase.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    result = RUNS[phase.mode](phase)
    result["world"] = phase.world
    torch.save(result, phase.out / f"rank{phase.rank}.pt")
    phase.accelerator.wait_for_everyone()
    phase.accelerator.free_memory()
    gc.collect()


for arguments in split_phases(sys.argv[1:]):
    run_phase(arguments)
end_launch()  # destroys the process group before exit (see OnebitHandle.close)
