"""The DiLoCo recipe sweep: final validation loss against DDP at equal tokens, on the main job, 2 ranks.

Every configuration runs the main job (``lightning_optim.train`` on a config composed by Hydra, as
``python -m lightning_optim.train <overrides>`` would) on 2 gloo ranks over loopback with the same model,
data, seed, inner optimizer (AdamW and its schedule) and step budget as the fp32 DDP run of the same seed; only
the strategy's overrides change. The loss does not depend on the link, so the sweep needs no shaped network.

    python benchmarks/diloco_sweep.py --grid all --save              # every configuration, seed 1234
    python benchmarks/diloco_sweep.py --grid seeds --seeds 7 --save    # the closest ones on a second seed
    python benchmarks/diloco_sweep.py --grid longer --steps 1000 --save   # the recipe over 1000 steps
    python benchmarks/diloco_sweep.py --grid small --model small --save   # and on the small model
    python benchmarks/diloco_sweep.py --config 'H=5: strategy=diloco strategy.sync_every=5'   # one more

Per configuration and seed: the final validation loss, its gap to DDP's (same seed), the payload bytes per rank
(``comm_stats()``) and how many times fewer than DDP's ring all-reduce. Runs already in ``--out`` (a
``rank0.json`` there) are read back, not run again, so a sweep can grow in steps. ``--save`` writes
``benchmarks/results/diloco_sweep_<model>.json`` (``_<steps>`` added for other lengths than 300) with every row in
the folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from comm import _free_port, machine_facts  # noqa: E402
from compressors import _collect, _launch  # noqa: E402
from results import save  # noqa: E402

DDP = ["strategy=ddp", "trainer.devices=2"]


def _diloco(h: int, lr: float | None = None, momentum: float | None = None, nesterov: bool | None = None,
            *extra: str, strategy: str = "diloco") -> list[str]:
    out = [f"strategy={strategy}", f"strategy.sync_every={h}"]
    if lr is not None:
        out.append(f"strategy.outer_lr={lr}")
    if momentum is not None:
        out.append(f"strategy.outer_momentum={momentum}")
    if nesterov is not None:
        out.append(f"strategy.nesterov={str(nesterov).lower()}")
    return out + list(extra)


def _named(label: str, *overrides: str) -> tuple[str, list[str]]:
    return label, list(overrides)


def grids() -> dict[str, dict[str, list[str]]]:
    """Named groups of configurations (label -> the main job's strategy overrides); ``all`` is every one the results
    page shows for seed 1234, ``seeds`` those also run with ``--seeds 7``."""
    def dense(h, lr, mom, *extra, strategy="diloco", fragments=None):
        name = "Streaming DiLoCo" if strategy != "diloco" else "DiLoCo"
        shape = f"H={h}" + (f" F={fragments}" if fragments else "")
        tail = f"mom={mom} nesterov" if mom else "mom=0"
        label = f"{name} {shape} lr={lr} {tail}"
        more = [f"strategy.fragments={fragments}"] if fragments else []
        for e in extra:
            key, value = e.split("=", 1)
            label += {"strategy.compressor": f" {value}", "optimizer.lr": f" inner lr={value}",
                      "scheduler.warmup_steps": f" warmup={value}"}[key]
        if "strategy.compressor" in " ".join(extra) and mom:
            label = label.replace(" nesterov", "")
        return label, _diloco(h, lr, mom, bool(mom), *more, *extra, strategy=strategy)

    def sparse(h, lr, density, decay=None):
        label = f"SparseLoCo H={h} lr={lr} density={density}" + (f" decay={decay}" if decay else "")
        extra = [] if density == "1/64" else [f"strategy.density={density}"]
        return label, _diloco(h, lr, decay, None, "strategy.compressor=sparseloco", *extra)

    runs = [dense(h, lr, 0.9) for h, lr in ((10, 0.2), (10, 0.3), (10, 0.5), (10, 0.7), (50, 0.7))]
    runs += [dense(10, 0.5, 0.7), dense(10, 0.6, 0.5), dense(10, 0.8, 0.5), dense(10, 1.0, 0.5), dense(10, 0.9, 0.3),
             dense(25, 0.8, 0.5), dense(50, 0.8, 0.5)]
    runs += [dense(h, lr, 0) for h, lr in ((10, 1.0), (10, 1.3), (10, 1.6), (10, 2.0), (25, 1.0))]
    runs += [dense(10, 0.8, 0.5, "strategy.compressor=int4"), dense(25, 0.8, 0.5, "strategy.compressor=int4"),
             dense(40, 0.8, 0.5, "strategy.compressor=int4", strategy="streaming_diloco", fragments=4)]
    runs += [dense(10, 0.8, 0.5, f"optimizer.lr={lr}") for lr in ("2e-3", "4.5e-3", "6e-3")]
    runs += [dense(25, 0.8, 0.5, "strategy.compressor=int4", "optimizer.lr=4.5e-3"),
             dense(10, 0.8, 0.5, "scheduler.warmup_steps=60"),
             _named("fp32 DDP inner lr=4.5e-3", *DDP, "optimizer.lr=4.5e-3"),
             _named("fp32 DDP warmup=60", *DDP, "scheduler.warmup_steps=60")]
    runs += [sparse(10, 1.0, "1/64"), sparse(10, 1.0, "1/64", 0.8), sparse(10, 1.0, 0.03), sparse(10, 1.0, 0.06),
             sparse(10, 1.5, 0.06), sparse(10, 2.0, 0.06), sparse(10, 2.0, 0.03), sparse(10, 3.0, 0.03),
             sparse(25, 1.0, 0.08), sparse(25, 2.0, 0.08)]
    seeds = [dense(10, 0.8, 0.5), dense(10, 0.8, 0.5, "strategy.compressor=int4")]
    longer = [dense(10, 0.8, 0.5), dense(25, 0.8, 0.5, "strategy.compressor=int4"), dense(10, 0.7, 0.9),
              sparse(10, 2.0, 0.03)]
    return {"all": dict(runs), "seeds": dict(seeds), "longer": dict(longer), "small": dict([dense(10, 0.8, 0.5), dense(10, 0.7, 0.9), dense(10, 1.0, 0)])}


def _parse_config(text: str) -> tuple[str, list[str]]:
    label, _, overrides = text.partition(":")
    if not overrides.strip():
        raise SystemExit(f"--config {text!r}: expected 'label: override override ...'")
    return label.strip(), overrides.split()


def _folder(out: Path, label: str, seed: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "=.-" else "_" for c in label)
    return out / f"{safe}__seed{seed}"


def run_one(args, label: str, overrides: list[str], seed: int) -> dict:
    folder = _folder(Path(args.out), label, seed)
    if not (folder / "rank0.json").exists():
        start = time.perf_counter()
        _launch(args, label, [*overrides, f"seed={seed}"], "127.0.0.1", (None, None),
                ({"GLOO_SOCKET_IFNAME": "lo"},) * 2, folder, _free_port())
        print(f"# {label} seed {seed}: {time.perf_counter() - start:.0f} s", flush=True)
    result = _collect(folder)
    finished = datetime.fromtimestamp((folder / "rank0.json").stat().st_mtime, timezone.utc)
    return {"label": label, "seed": seed, "overrides": overrides, "finished": finished.strftime("%Y-%m-%d %H:%M UTC"),
            "final_val_loss": result["ranks"][0]["final_val_loss"],
            "payload_bytes": max(r["payload_bytes"] for r in result["ranks"]),
            "num_params": result["ranks"][0]["num_params"], "steps": result["ranks"][0]["steps"],
            "val_curve": result["val_curve"]}


def table(rows: list[dict]) -> list[dict]:
    """One line per label: the mean final loss over seeds and its gap to DDP's mean over the same seeds."""
    ddp = {r["seed"]: r["final_val_loss"] for r in rows if r["label"] == "fp32 DDP"}
    labels = list(dict.fromkeys(r["label"] for r in rows))
    lines = []
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        seeds = [r["seed"] for r in mine if r["seed"] in ddp]
        losses = [r["final_val_loss"] for r in mine if r["seed"] in ddp]
        if not losses:
            continue
        gaps = [(r["final_val_loss"] / ddp[r["seed"]] - 1) * 100 for r in mine if r["seed"] in ddp]
        ddp_bytes = 4 * mine[0]["num_params"] * mine[0]["steps"]  # the fp32 ring all-reduce on 2 ranks, per rank
        payload = mine[0]["payload_bytes"] if not label.startswith("fp32 DDP") else ddp_bytes
        lines.append({"label": label, "seeds": seeds, "final_val_loss": statistics.mean(losses),
                      "gap_pct": statistics.mean(gaps), "gap_pct_each": gaps,
                      "fewer_bytes_x": ddp_bytes / payload if payload else None, "overrides": mine[0]["overrides"]})
    lines.sort(key=lambda line: line["gap_pct"])
    print("| configuration | seeds | final val loss | vs DDP | fewer bytes than DDP |")
    print("|---|---|---|---|---|")
    for line in lines:
        fewer = "-" if line["fewer_bytes_x"] is None else f"{line['fewer_bytes_x']:.0f}x"
        each = " ".join(f"{g:+.2f}" for g in line["gap_pct_each"])
        print(f"| {line['label']} | {len(line['seeds'])} | {line['final_val_loss']:.4f} | "
              f"{line['gap_pct']:+.2f}% ({each}) | {fewer} |")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", default="1234", help="comma-separated seeds")
    p.add_argument("--grid", default="", help=f"a named group: {', '.join(grids())}")
    p.add_argument("--config", action="append", default=[], help="'label: override override ...' (repeatable)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="", help="the runs' folder (default /tmp/diloco_sweep_<model>_<steps>)")
    p.add_argument("--save", action="store_true", help="write benchmarks/results/diloco_sweep_<model>[_<steps>].json")
    args = p.parse_args(argv)
    args.out = args.out or f"/tmp/diloco_sweep_{args.model}_{args.steps}"
    configs = {"fp32 DDP": DDP}
    if args.grid:
        configs.update(grids()[args.grid])
    configs.update(_parse_config(text) for text in args.config)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = [run_one(args, label, overrides, seed) for seed in seeds for label, overrides in configs.items()]
    known = {(r["label"], r["seed"]) for r in rows}
    for folder in sorted(Path(args.out).glob("*__seed*")):  # earlier runs of this folder join the table
        if (folder / "rank0.json").exists():
            meta = json.loads((folder / "run.json").read_text())
            seed = int(folder.name.rsplit("__seed", 1)[1])
            if (meta["label"], seed) not in known:
                overrides = [o for o in meta["overrides"] if not o.startswith("seed=")]
                rows.append(run_one(args, meta["label"], overrides, seed))
    lines = table(rows)
    if args.save:
        finished = sorted(r["finished"] for r in rows)
        name = f"diloco_sweep_{args.model}" + ("" if args.steps == 300 else f"_{args.steps}")
        save(name, {"model": args.model, "steps": args.steps, "machine": machine_facts(),
                                            "runs_made": [finished[0], finished[-1]], "lines": lines, "runs": rows})


if __name__ == "__main__":
    main()
