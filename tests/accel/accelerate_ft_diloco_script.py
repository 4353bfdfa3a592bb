"""One replica group of a fault-tolerant ``enable_diloco`` run, launched as users launch one:

    python accelerate_ft_diloco_script.py --replica r0 --lighthouse HOST:PORT --out OUT [--save-at 6 --ckpt DIR]
    python accelerate_ft_diloco_script.py --replica r0 --lighthouse HOST:PORT --out OUT2 --resume DIR

A plain Accelerate loop (``Accelerator(cpu=True)``, one process) over ``enable_diloco(..., manager=manager,
max_steps=...)`` with a ``replica_manager``: the model and data of ``diloco_data.py`` (replica ``rN`` draws the
batches rank N draws there), MICRO accumulated micro-batches per optimizer step, StepLR, ``clip_grad_norm_``.
``--start-dir D --start-with N``: wait for N replicas to reach this point before joining (so that they form the
first quorum together). ``--save-at K --ckpt DIR``: ``accelerator.save_state(DIR)`` after step K; ``--resume
DIR``: a fresh model (another seed) and ``accelerator.load_state(DIR)`` before the loop, which goes on from the
step it holds. One JSON line per optimizer step in OUT.jsonl (step, the manager's committed step, its
participants, rounds discarded: the test watches them to kill a replica mid-run); OUT.pt at the end: per step
the params, loss and learning rate, and the handle's summary.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

import accel_plugins
from lightning_optim import fault_tolerance

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when run as a script
from tests.accel.diloco_data import LR, MAX_NORM, MICRO, SYNC_EVERY, WEIGHT_DECAY, batch, build_model


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--out", required=True, help="OUT: writes OUT.jsonl as it goes, OUT.pt at the end")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--start-dir", default=None, help="wait until --start-with replicas have marked this folder")
    parser.add_argument("--start-with", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    index = int(args.replica.lstrip("r"))
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    model = build_model(seed=1 if args.resume else 0)  # resumed: everything must come from the checkpoint
    initial = flat(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if args.start_with:  # the replicas join together, as a scheduler starting them all at once has them
        start_dir = Path(args.start_dir)
        (start_dir / args.replica).touch()
        deadline = time.monotonic() + 60
        while len(list(start_dir.iterdir())) < args.start_with:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{args.start_with} replicas did not reach {start_dir} within 60 s")
            time.sleep(0.02)
    manager = fault_tolerance.replica_manager(replica_id=args.replica, lighthouse=args.lighthouse, host="localhost",
                                              timeout_s=args.timeout)
    handle = accel_plugins.enable_diloco(accelerator, model, optimizer, sync_every=SYNC_EVERY, manager=manager,
                                         max_steps=args.steps)
    if args.resume:
        accelerator.load_state(args.resume)
    start = handle.diloco.inner_steps
    rows = []
    with open(f"{args.out}.jsonl", "a") as events:
        for step in range(start, args.steps):
            lr = optimizer.param_groups[0]["lr"]
            for micro in range(MICRO):
                x, y = batch(step, micro, index)
                with accelerator.accumulate(model):
                    loss = nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
            rows.append({"step": step + 1, "lr": lr, "loss": loss.item(), "params": flat(model),
                         "committed": manager.current_step()})
            events.write(json.dumps({"step": step + 1, "committed": manager.current_step(),
                                     "participants": manager.num_participants(),
                                     "discarded": handle.diloco.replicas.rounds_discarded}) + "\n")
            events.flush()
            if args.save_at == step + 1:
                accelerator.save_state(args.ckpt)
            time.sleep(args.step_sleep)
    torch.save({"initial": initial, "start": start, "rows": rows, "summary": handle.summary(),
                "inner_steps": handle.diloco.inner_steps, "committed": manager.current_step()}, f"{args.out}.pt")
    handle.close()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
