"""Run by torchrun (2 CPU ranks): a plain Accelerate loop with enable_onebit.

    python -m torch.distributed.run --nproc_per_node 2 accelerate_script.py OUT [save_at=K] [load=DIR start=K]

Trains a small MLP for STEPS steps on per-rank data with OnebitAdam (converted from torch AdamW
before ``prepare``), ``accelerator.accumulate`` and ``clip_grad_norm_``; after step ``save_at`` it
calls ``accelerator.save_state(OUT/ckpt)``; with ``load`` it first loads a state and trains the
remaining steps. Each rank writes OUT/rank<r>.pt: params, per-step bytes and switch states.

One launch runs several phases (tests/accel/phases.py), each the arguments above, separated by ``then``:

    ... accelerate_script.py OUT/full save_at=6 then OUT/resumed load=OUT/full/ckpt start=6

Why a resumed phase stands for its own launch: it builds a new Accelerator (after ``phases.start_phase`` reset
Accelerate's singletons, comm_stats' counter and the compression caches), model, optimizer, scheduler and 1-bit
handle, and takes the params, optimizer, scheduler, random states and every rank's 1-bit state from the
checkpoint on disk alone, as a user's resumed run does.
"""

import gc
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

import accel_plugins
from lightning_optim.comm import comm_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when run as a script
from tests.accel.phases import end_launch, split_phases, start_phase  # noqa: E402

STEPS, FREEZE = 10, 4


def run_phase(argv: list[str]) -> None:
    """One run: ``OUT`` then key=value options (torchrun's own parser would take --options as its prefixes)."""
    start_phase()
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    options = dict(arg.split("=", 1) for arg in argv[1:])
    save_at = int(options["save_at"]) if "save_at" in options else None
    load, start = options.get("load"), int(options.get("start", 0))

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
    optimizer = accel_plugins.to_onebit_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
                                                  "onebit_adam", freeze_step=FREEZE)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    handle = accel_plugins.enable_onebit(accelerator, model, optimizer)
    if load:
        accelerator.load_state(load)

    rows = []
    for step in range(start, STEPS):
        before = comm_stats().bytes_sent
        for micro in range(2):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    local = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()  # before the clip
                    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        rows.append({"step": step, "bytes": comm_stats().bytes_sent - before, "ddp_allreduce": handle.switch.enabled,
                     "loss": loss.item(), "local_norm": float(local), "clip_norm": float(norm),
                     "clipped_norm": float(clipped)})
        if save_at is not None and step + 1 == save_at:
            accelerator.save_state(str(out / "ckpt"))

    torch.save({"params": [p.detach().clone() for p in model.parameters()], "rows": rows,
                "numel": sum(p.numel() for p in model.parameters()), "summary": handle.summary(),
                "world": accelerator.num_processes}, out / f"rank{rank}.pt")
    accelerator.wait_for_everyone()
    handle.close()  # free the DDP model and the optimizer while the process group exists (OnebitHandle.close)
    accelerator.free_memory()
    del model, optimizer, handle, scheduler
    gc.collect()


for phase in split_phases(sys.argv[1:]):
    run_phase(phase)
end_launch()  # destroys the process group: exiting with a live gloo group can abort at teardown
