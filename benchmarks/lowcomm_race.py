"""The low-communication race: five ways to train the main job on 2 ranks over a slow link, at equal tokens.

Every method runs the main job (``lightning_optim.train.run`` on a config composed by Hydra, as
``python -m lightning_optim.train <overrides>`` would) on 2 gloo ranks, each in its own network namespace, the
veth between them shaped with ``tc tbf`` to each of ``--rates`` in turn (one namespace pair per rate, its runs
back to back). Model, data, seed, inner optimizer (AdamW and its schedule) and step budget are the same for every
method; only the strategy's overrides change (``RECIPE`` below):

    DDP (fp32 ring all-reduce every step), 1-bit Adam, DiLoCo, Streaming DiLoCo with int4 outer gradients,
    SparseLoCo (DiLoCo with sparse outer gradients)

Per method and rate, at each validation (every ``--val-every`` steps, and once before training):

* the validation loss;
* the training time so far: the slower rank's sum of its per-step wall times (forward, backward, optimizer
  step and the exchanges inside it; validation is left out);
* the bytes sent per rank so far: the strategies' own per-step telemetry (``comm/bytes_sent`` in rank 0's
  metrics.csv); plain DDP's all-reduce is Lightning's and counts nothing, so its bytes are the ring rule's,
  :math:`2 (W - 1) / W \\cdot 4 \\cdot n_{params}` per step (marked as computed).

and at the end: the veth tx bytes of each rank (TCP/IP framing included), the final validation loss and its gap
to DDP's, the bytes per rank and how many times fewer than DDP, and the time to DDP's final loss: the first
validation at or under DDP's final validation loss at the same rate, the time interpolated linearly between the
two validations that bracket the crossing, as a multiple of DDP's whole training time ("never" if not reached).

    python benchmarks/lowcomm_race.py                                  # tiny model, 300 steps, 100mbit and 1gbit
    python benchmarks/lowcomm_race.py --model small --only DDP,DiLoCo  # a subset (labels as in RECIPE)

Options: --model tiny|small --steps 300 --rates 100mbit,1gbit --only label,label --val-every (steps / 20)
--threads 1 --out DIR. Each run has its folder under ``--out/<rate>/``; a run already complete there is read
back, not run again. Needs root and iproute2 for the namespaces (else a note, exit 0). Writes
``benchmarks/results/lowcomm_race.json`` (``results.save``) when every chosen run completed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from comm import NETNS_ADDRS, NetnsUnavailable, machine_facts, netns_pair  # noqa: E402
from compressors import _collect, _cumulative, _launch, only  # noqa: E402
from results import save  # noqa: E402

WORLD = 2  # ranks; compressors.py's launcher starts two
DDP = "DDP"

# The recipe (benchmarks/diloco_sweep.py): DiLoCo's outer defaults (lr 0.8, Nesterov momentum 0.5; SparseLoCo: lr 2,
# decay 0.95) and the inner optimizer as DDP's. "{freeze_step}" is a quarter of the steps, the full-precision warmup
# compressors.py gives 1-bit Adam.
RECIPE: dict[str, str] = {
    DDP: "strategy=ddp trainer.devices=2",
    "1-bit Adam": "strategy=onebit_adam strategy.freeze_step={freeze_step}",
    "DiLoCo": "strategy=diloco strategy.sync_every=10",
    "DiLoCo int4": "strategy=diloco strategy.sync_every=25 strategy.compressor=int4",
    "Streaming DiLoCo int4": "strategy=streaming_diloco strategy.sync_every=40 strategy.fragments=4 "
                             "strategy.compressor=int4",
    "SparseLoCo": "strategy=diloco strategy.sync_every=10 strategy.compressor=sparseloco strategy.density=0.03",
}


def race_configs(steps: int) -> dict[str, list[str]]:
    """Label -> the main job's strategy overrides (the recipe's, for a run of ``steps`` steps)."""
    freeze = max(1, steps // 4)
    return {label: text.format(freeze_step=freeze).split() for label, text in RECIPE.items()}


def ring_bytes_per_step(num_params: int, world: int = WORLD) -> float:
    """What one rank sends in a ring all-reduce of the fp32 gradients: 2 (W - 1) / W x 4 bytes per parameter."""
    return 2 * (world - 1) / world * 4 * num_params


# ----------------------------------------------------------------------------- one run's curves
def curves(run: dict) -> dict:
    """At each validation of one run (``compressors._collect``'s dict): steps done, loss, training seconds so
    far (the slower rank's sum of per-step times) and MB sent per rank so far."""
    per_step = ring_bytes_per_step(run["ranks"][0]["num_params"])
    sums = [list(itertools.accumulate(rank["step_seconds"])) for rank in run["ranks"]]
    total = len(sums[0])
    done, losses, seconds, sent = [], [], [], []
    for i, (step, loss) in enumerate(run["val_curve"]):
        # the first validation runs before training; metrics.csv's later steps are 0-based (step s: s + 1 done)
        n = 0 if i == 0 else min(step + 1, total)
        done.append(n)
        losses.append(loss)
        seconds.append(max(s[n - 1] for s in sums) if n else 0.0)
        sent.append(_cumulative(run, n - 1, per_step) / 1e6 if n else 0.0)
    return {"steps_done": done, "val_loss": losses, "train_s": seconds, "sent_mb": sent}


def time_to_loss(seconds: list[float], losses: list[float], target: float) -> float | None:
    """When the curve first reaches ``target``: linear in time between the validations on either side of the
    crossing (the first one at or under it and the one before); None if it never does."""
    for i, (t, loss) in enumerate(zip(seconds, losses)):
        if loss <= target:
            if i == 0:
                return t
            t0, loss0 = seconds[i - 1], losses[i - 1]
            return t0 + (loss0 - target) / (loss0 - loss) * (t - t0)
    return None


def race_rows(runs: dict[str, dict]) -> list[dict]:
    """One rate's rows (label -> collected run), each set against DDP's run at the same rate where there is one."""
    made = {label: curves(run) for label, run in runs.items()}
    base = made.get(DDP)
    target = base["val_loss"][-1] if base else None
    ddp_mb = base["sent_mb"][-1] if base else None
    ddp_s = base["train_s"][-1] if base else None
    rows = []
    for label, run in runs.items():
        c = made[label]
        computed = not run["step_bytes"]  # no telemetry: Lightning's own DDP all-reduce, the ring rule's bytes
        sent_mb = c["sent_mb"][-1] if computed else max(rank["payload_bytes"] for rank in run["ranks"]) / 1e6
        reached = None if target is None else time_to_loss(c["train_s"], c["val_loss"], target)
        final = c["val_loss"][-1]
        rows.append({
            "label": label, "overrides": run["overrides"], **c, "bytes_computed": computed,
            "sent_mb_per_rank": sent_mb, "fewer_x": ddp_mb / sent_mb if ddp_mb and sent_mb else None,
            "wire_mb": [b / 1e6 for b in run["wire_bytes"]] if run["wire_bytes"] else None,
            "median_step_ms": max(statistics.median(rank["step_seconds"]) for rank in run["ranks"]) * 1e3,
            "final_val_loss": final, "vs_ddp_pct": (final / target - 1) * 100 if target else None,
            "time_to_ddp_loss_s": reached,
            "time_to_ddp_loss_x": reached / ddp_s if reached is not None and ddp_s else None})
    return rows


def race_data(args, chosen: dict[str, list[str]], rates: dict[str, dict], num_params: int | None) -> dict:
    """What ``lowcomm_race.json`` holds: the settings, the recipe and, per rate, its rows (``race_rows``)."""
    return {"model": args.model, "steps": args.steps, "val_every": args.val_every, "threads": args.threads,
            "world_size": WORLD, "num_params": num_params, "recipe": chosen, "rates": rates,
            "machine": machine_facts()}


def print_table(rate: str, rows: list[dict]) -> None:
    print(f"\n## {rate}\n")
    print("| method | MB/rank | x fewer than DDP | veth tx MB/rank | training s | final val loss | vs DDP "
          "| time to DDP's final loss |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        wire = "-" if not r["wire_mb"] else f"{max(r['wire_mb']):.1f}"
        fewer = "-" if r["fewer_x"] is None else f"{r['fewer_x']:.1f}x"
        vs = "-" if r["vs_ddp_pct"] is None else f"{r['vs_ddp_pct']:+.2f}%"
        reach = ("-" if r["vs_ddp_pct"] is None else "never" if r["time_to_ddp_loss_s"] is None else
                 f"{r['time_to_ddp_loss_x']:.2f}x DDP's ({r['time_to_ddp_loss_s']:.1f} s)")
        print(f"| {r['label']} | {'~' if r['bytes_computed'] else ''}{r['sent_mb_per_rank']:.2f} | {fewer} | {wire} "
              f"| {r['train_s'][-1]:.1f} | {r['final_val_loss']:.4f} | {vs} | {reach} |")
    print("(~: DDP's bytes by the ring rule, not counted; time to DDP's final loss interpolated linearly between "
          "validations; training s: the slower rank's step times, validation left out)")


# ----------------------------------------------------------------------------- runs and their folders
def _folder(out: Path, rate: str, label: str) -> Path:
    return out / rate / "".join(c if c.isalnum() or c in "=.-" else "_" for c in label)


def _settings(args, rate: str, overrides: list[str]) -> dict:
    return {"model": args.model, "steps": args.steps, "val_every": args.val_every, "threads": args.threads,
            "rate": rate, "overrides": overrides}


def _complete(folder: Path, wanted: dict) -> bool:
    """Whether ``folder`` holds a finished run of exactly these settings (an earlier, different one: an error)."""
    marker = folder / "race.json"
    if not marker.exists():
        return False
    found = json.loads(marker.read_text())
    if found != wanted:
        raise SystemExit(f"{folder} holds a run of other settings ({found}, not {wanted}): "
                         "choose another --out or delete that folder")
    return True


def run_rate(args, rate: str, chosen: dict[str, list[str]], out: Path) -> tuple[dict[str, dict], list[str]]:
    """Every chosen method at one rate: runs missing from ``out`` are launched back to back in one namespace pair.
    Returns (label -> collected run, labels that failed)."""
    todo = [label for label, o in chosen.items() if not _complete(_folder(out, rate, label), _settings(args, rate, o))]
    failed = []
    if todo:
        with netns_pair(rate) as (prefixes, envs):  # NetnsUnavailable: the caller's note
            for i, label in enumerate(todo):
                folder = _folder(out, rate, label)
                start = time.perf_counter()
                try:  # a fresh port per run: no TIME_WAIT clash with the one before
                    _launch(args, label, chosen[label], NETNS_ADDRS[0], prefixes, envs, folder, 29531 + i)
                except SystemExit as exc:  # _launch's report of failed ranks, with their stderr
                    print(f"# {rate} {label}: failed\n{exc}", flush=True)
                    failed.append(label)
                    continue
                (folder / "race.json").write_text(json.dumps(_settings(args, rate, chosen[label])))
                print(f"# {rate} {label}: {time.perf_counter() - start:.0f} s", flush=True)
    runs = {label: _collect(_folder(out, rate, label)) for label in chosen if label not in failed}
    return runs, failed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=["tiny", "small"], help="the main job's model option")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rates", default="100mbit,1gbit", help="tc tbf rates, comma-separated")
    p.add_argument("--only", default="", help=f"comma-separated labels of {list(RECIPE)} (default: all)")
    p.add_argument("--val-every", type=int, default=0, help="validate every N steps (default: steps / 20)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--out", default="", help="the runs' folder (default /tmp/lowcomm_race_<model>_<steps>)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps: {args.steps}; must be >= 1")
    if args.val_every < 0 or args.threads < 1:
        p.error(f"--val-every {args.val_every} must be >= 0 (0: steps / 20); --threads {args.threads} must be >= 1")
    args.val_every = args.val_every or max(1, args.steps // 20)
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    if not rates:
        p.error("--rates: give at least one tc rate (e.g. 100mbit)")
    chosen = only(p, race_configs(args.steps), args.only)
    out = Path(args.out or Path(tempfile.gettempdir()) / f"lowcomm_race_{args.model}_{args.steps}")
    results: dict[str, dict] = {}
    failed: list[str] = []
    num_params = None
    for rate in rates:
        try:
            runs, bad = run_rate(args, rate, chosen, out)
        except NetnsUnavailable as exc:
            print(f"network namespaces {exc}: the race needs them; skipped")
            return
        failed += [f"{label} at {rate}" for label in bad]
        num_params = next((run["ranks"][0]["num_params"] for run in runs.values()), num_params)
        rows = race_rows(runs)
        print_table(rate, rows)
        results[rate] = {"where": f"2 network namespaces, veth shaped to {rate} (tc tbf)", "rows": rows}
    if failed:
        raise SystemExit(f"failed: {failed} (their stderr above); nothing saved. The other runs are kept in {out}: "
                         "leave the failed ones out with --only to save the rest")
    save("lowcomm_race", race_data(args, chosen, results, num_params))


if __name__ == "__main__":
    main()
