"""One training process of ``benchmarks/fault_tolerance.py``: a torchft replica group, or one rank of a torchrun job.

Both train the main job's ByteGPT on the main job's data and AdamW settings (``conf/``: the model option given,
``data/stdlib``, ``optimizer/adamw``, the warmup-cosine schedule, gradient clipping) under DiLoCo with the main
job's outer settings (``strategy/diloco``), for ``--steps`` inner steps, and append one JSON line per event to
``--events``: ``start`` (the pid), ``joined`` (after the join, heal or resume: ``t``, ``s``, ``healed``,
``resumed``), one per inner step (``t``: inner steps taken, ``s``: the torchft manager's committed step,
``healed``), ``done`` (the final model's loss on the main job's validation windows).
Every process saves a checkpoint of its own every ``--checkpoint-every`` steps (the same cost in every variant).

* ``--mode replica``: one replica group of a fault-tolerant run, ``DiLoCo(..., manager=replica_manager(...))``;
  launched with the others (``--start-dir``), it waits until all are up before it joins; relaunched (without it),
  it is healed from a peer in DiLoCo's constructor and goes on from the peers' step.
* ``--mode rank``: one rank of a plain DiLoCo job over a gloo process group, launched by ``torchrun``; at start
  it resumes from the newest checkpoint every rank holds (``torchrun --max-restarts`` restarts the whole job
  when one rank dies). torchrun (torch 2.13) hands every restart the same store, where the default ``env://``
  initialisation finds the previous attempt's gloo addresses and fails (connection refused) or hangs: each
  attempt's process group takes its keys under a prefix of its own.

Batch ``i`` of a replica or rank is drawn from ``(seed, replica, i)`` alone, so a resumed job replays the batches of
the steps it lost and a healed replica goes on with the batches of the step it was healed to.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_optim.conf_dir import conf_dir  # noqa: E402


def main_job_settings(model: str) -> dict:
    """The main job's model, data, optimizer, schedule, clipping and DiLoCo settings, read from its ``conf/``."""
    import yaml

    def load(part: str) -> dict:
        text = (conf_dir() / part).read_text()
        return yaml.safe_load(text)

    train, data, opt = load("train.yaml"), load("data/stdlib.yaml"), load("optimizer/adamw.yaml")
    diloco = load("strategy/diloco.yaml")["strategy"]
    return {"model": load(f"model/{model}.yaml"), "model_name": model, "seed": train["seed"],
            "seq_len": data["seq_len"], "batch_size": data["batch_size"], "max_bytes": data["max_bytes"],
            "glob": data["glob"], "val_fraction": data["val_fraction"], "val_windows": data["val_windows"],
            "lr": float(opt["lr"]), "betas": tuple(opt["betas"]), "eps": float(opt["eps"]),
            "weight_decay": float(opt["weight_decay"]), "warmup_steps": train["scheduler"]["warmup_steps"],
            "min_lr_ratio": train["scheduler"]["min_lr_ratio"],
            "clip": load("trainer/default.yaml")["gradient_clip_val"],
            "outer_lr": diloco["outer_lr"], "outer_momentum": diloco["outer_momentum"], "nesterov": diloco["nesterov"]}


class Job:
    """The model, its data and a checkpoint folder; ``batch(i)`` is batch ``i`` of this replica/rank."""

    def __init__(self, cfg: dict, index: int) -> None:
        from lightning_optim.data import RandomWindows, load_corpus
        from lightning_optim.model import ByteGPT

        self.cfg, self.index = cfg, index
        train, val = load_corpus(None, cfg["glob"], cfg["max_bytes"], cfg["val_fraction"])
        self.train = torch.frombuffer(bytearray(train), dtype=torch.uint8)
        val_t = torch.frombuffer(bytearray(val), dtype=torch.uint8)
        self.val = RandomWindows(val_t, cfg["seq_len"], cfg["val_windows"], seed=cfg["seed"] + 1)  # the main job's
        torch.manual_seed(cfg["seed"])  # every replica and rank starts from the same params
        self.model = ByteGPT(max_seq_len=cfg["seq_len"], **cfg["model"])

    def batch(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.cfg["seed"] * 1_000_003 + self.index * 100_003 + i)
        window = self.cfg["seq_len"] + 1
        starts = torch.randint(0, len(self.train) - window + 1, (self.cfg["batch_size"],), generator=g)
        return torch.stack([self.train[s:s + window] for s in starts.tolist()]).long()

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the main job's validation windows (batches of ``batch_size``)."""
        windows = torch.stack([self.val[i] for i in range(len(self.val))])
        losses = [float(self.loss(chunk)) * len(chunk) for chunk in windows.split(self.cfg["batch_size"])]
        return sum(losses) / len(windows)

    def inner_optimizer(self) -> torch.optim.Optimizer:
        import lightning_optim
        from lightning_optim.model import param_groups

        c = self.cfg
        return lightning_optim.AdamW(param_groups(self.model), lr=c["lr"], betas=c["betas"], eps=c["eps"],
                                     weight_decay=c["weight_decay"])


def save_checkpoint(folder: Path, t: int, name: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    keep: int = 2) -> None:
    """``<folder>/<t>-<name>.pt`` written whole (a temporary file renamed), the older ones past ``keep`` removed."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{t}-{name}.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "t": t}, tmp)
    tmp.rename(folder / f"{t}-{name}.pt")
    mine = sorted((p for p in folder.glob(f"*-{name}.pt")), key=lambda p: int(p.name.split("-")[0]))
    for old in mine[:-keep]:
        old.unlink(missing_ok=True)


def newest_complete(folder: Path, names: list[str]) -> int | None:
    """The newest step every one of ``names`` holds a checkpoint of."""
    if not folder.exists():
        return None
    steps = [{int(p.name.split("-")[0]) for p in folder.glob(f"*-{name}.pt")} for name in names]
    common = set.intersection(*steps) if steps else set()
    return max(common) if common else None


def train(args: argparse.Namespace) -> None:
    import lightning_optim
    from lightning_optim.model import warmup_cosine

    torch.set_num_threads(1)
    cfg = main_job_settings(args.model)
    rank_mode = args.mode == "rank"
    if rank_mode:
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        name, index = f"rank{rank}", rank
        events_path = Path(args.events) / f"rank{rank}-restart{restart}.jsonl"
    else:
        name, index, restart = args.replica, int(args.replica.lstrip("r")), 0
        events_path = Path(args.events)

    def record(**fields) -> None:  # opened per line: a SIGKILL loses nothing written before it
        with open(events_path, "a") as events:
            events.write(json.dumps({"time": time.time(), **fields}) + "\n")

    record(event="start", pid=os.getpid(), restart=restart)
    job = Job(cfg, index)
    inner = job.inner_optimizer()
    folder = Path(args.checkpoints)
    kw = {"sync_every": args.sync_every, "outer_lr": cfg["outer_lr"], "outer_momentum": cfg["outer_momentum"],
          "nesterov": cfg["nesterov"]}
    resumed = None
    if rank_mode:
        # torchrun keeps one store across restarts: a plain env:// init meets the previous attempt's gloo addresses
        # (connection refused, then a hang), so each attempt's group gets keys of its own
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=timedelta(seconds=300))
        dist.init_process_group("gloo", store=dist.PrefixStore(f"restart{restart}", store), rank=rank,
                                world_size=world)
        resumed = newest_complete(folder, [f"rank{r}" for r in range(world)])
        if resumed is not None:
            state = torch.load(folder / f"{resumed}-{name}.pt", weights_only=False)
            job.model.load_state_dict(state["model"])
        opt = lightning_optim.DiLoCo(inner, **kw)
        if resumed is not None:
            opt.load_state_dict(state["opt"])
        manager = None
    else:
        from lightning_optim import fault_tolerance

        manager = fault_tolerance.replica_manager(replica_id=args.replica, min_replica_size=args.min_replicas,
                                                  lighthouse=args.lighthouse, host="localhost")
        if args.start_dir:  # launched together: every replica's process is up before any joins
            start = Path(args.start_dir)
            (start / args.replica).touch()
            deadline = time.monotonic() + 300
            while len(list(start.iterdir())) < args.start_with:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{args.replica}: {args.start_with} replicas did not start within 300 s")
                time.sleep(0.05)
        opt = lightning_optim.DiLoCo(inner, manager=manager, **kw)  # a rejoining replica is healed here
    healed = bool(opt.replicas and opt.replicas.healed)
    record(event="joined", t=opt.inner_steps, s=manager.current_step() if manager else None, healed=healed,
           resumed=resumed)
    while opt.inner_steps < args.steps:
        t = opt.inner_steps
        # from the configured lr, not the groups' (a resume or a heal loads the lr of the step it came from)
        lr = cfg["lr"] * warmup_cosine(t, cfg["warmup_steps"], args.steps, cfg["min_lr_ratio"])
        for group in inner.param_groups:
            group["lr"] = lr
        loss = job.loss(job.batch(t))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(job.model.parameters(), cfg["clip"])
        opt.step()
        t = opt.inner_steps
        record(t=t, s=manager.current_step() if manager else None, loss=round(float(loss), 4),
               healed=bool(opt.replicas and opt.replicas.healed),
               discarded=opt.replicas.rounds_discarded if opt.replicas else 0)
        if t % args.checkpoint_every == 0:
            save_checkpoint(folder, t, name, job.model, opt)
    opt.finish()
    if not rank_mode or rank == 0:
        record(event="done", t=opt.inner_steps, eval=job.evaluate())
    if manager is not None:
        manager.shutdown(wait=False)
    else:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("replica", "rank"), required=True)
    parser.add_argument("--events", required=True, help="replica: the events file; rank: the events folder")
    parser.add_argument("--checkpoints", required=True, help="the checkpoint folder")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--sync-every", type=int, required=True)
    parser.add_argument("--checkpoint-every", type=int, required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--replica", default=None, help="replica: its id (r0, r1, ...)")
    parser.add_argument("--lighthouse", default=None)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--start-dir", default=None)
    parser.add_argument("--start-with", type=int, default=0)
    train(parser.parse_args())


if __name__ == "__main__":
    main()
