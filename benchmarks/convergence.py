"""Final validation loss of each 1-bit optimizer vs its full-precision counterpart at equal steps.

Each run is the main job (``python -m lightning_optim.train``, 2 CPU processes, same seed, data
and schedule) with one strategy/optimizer pair:

=====================  ==========================================  ================================
1-bit run              baseline                                     goal (relative final val loss)
=====================  ==========================================  ================================
OnebitAdam             AdamW + DDP (``strategy=ddp``)               within 2%
ZeroOneAdam            AdamW + DDP                                  within 3%
OnebitLamb             FusedLamb + DDP                              within 2%
=====================  ==========================================  ================================

    python benchmarks/convergence.py                       # the main job's defaults (400 steps)
    python benchmarks/convergence.py trainer.max_steps=200 # extra overrides go to every run

Prints a table and saves the figures (``benchmarks/results.py``; ``results_page.py`` draws the curves).
Run directories go under ``--out`` (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comm import machine_facts  # noqa: E402  (benchmarks/comm.py)
from results import save  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUNS = {  # name -> overrides
    "AdamW + DDP": ["strategy=ddp", "trainer.devices=2", "optimizer=adamw"],
    "OnebitAdam": ["strategy=onebit_adam", "optimizer=adamw"],
    "ZeroOneAdam": ["strategy=zero_one_adam", "optimizer=adamw"],
    "FusedLamb + DDP": ["strategy=ddp", "trainer.devices=2", "optimizer=fused_lamb"],
    "OnebitLamb": ["strategy=onebit_lamb", "optimizer=fused_lamb"],
}
PAIRS = [("OnebitAdam", "AdamW + DDP", 0.02), ("ZeroOneAdam", "AdamW + DDP", 0.03), ("OnebitLamb", "FusedLamb + DDP", 0.02)]


def run_dir_of(name: str, out: Path) -> Path:
    """A run's directory: the name with only letters, digits, '-' and '_' (Hydra's override grammar)."""
    return out / re.sub(r"[^A-Za-z0-9_-]+", "_", name.replace("+", "_").replace(" ", ""))


def run(name: str, overrides: list[str], extra: list[str], out: Path, resume: bool = False) -> dict:
    """One main-job run into ``run_dir_of(name, out)``; with ``resume``, a finished one there is reused."""
    run_dir = run_dir_of(name, out)
    start = time.perf_counter()
    if not (resume and (run_dir / "summary.json").exists()):
        command = [sys.executable, "-m", "lightning_optim.train", *overrides, *extra, f"hydra.run.dir={run_dir}"]
        result = subprocess.run(command, cwd=out, capture_output=True, text=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if result.returncode != 0:
            raise SystemExit(f"{name} failed:\n{result.stderr[-4000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    with open(run_dir / "metrics.csv", newline="") as handle:
        curve = [(int(r["step"]), float(r["val_loss"])) for r in csv.DictReader(handle) if r.get("val_loss")]
    summary.pop("config", None)
    return {"summary": summary, "val_curve": curve, "wall_s": summary.get("wall_time_s", time.perf_counter() - start)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="where the run directories go")
    parser.add_argument("--only", nargs="*", default=None, help="run names to run (default: all)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="convergence-"))
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, overrides in RUNS.items():
        if args.only and name not in args.only:
            continue
        results[name] = run(name, overrides, args.overrides, out)
        s = results[name]["summary"]
        comm = s.get("comm") or {}
        print(f"{name:16s} val {s['initial_val_loss']:.3f} -> {s['final_val_loss']:.4f}  train {s['final_train_loss']:.3f}"
              f"  wall {results[name]['wall_s']:.0f}s  bytes/rank {comm.get('bytes_sent', 0) / 1e6:.1f} MB"
              f" (fp32 DDP {comm.get('fp32_bytes', 0) / 1e6:.1f} MB)", flush=True)
    facts = machine_facts()
    print(f"machine: {facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}, python {facts['python']}; "
          f"load average at the end: {facts['loadavg_1_5_15min']}; overrides: {args.overrides or 'none'}")
    table = []
    for onebit, base, goal in PAIRS:
        if onebit in results and base in results:
            a, b = results[onebit]["summary"]["final_val_loss"], results[base]["summary"]["final_val_loss"]
            gap = a / b - 1
            table.append({"onebit": onebit, "baseline": base, "onebit_val": a, "baseline_val": b, "gap": gap,
                          "goal": goal, "met": abs(gap) <= goal or gap < 0})
            print(f"{onebit:12s} {a:.4f} vs {base:16s} {b:.4f}: {gap:+.2%} (goal within {goal:.0%}: "
                  f"{'met' if table[-1]['met'] else 'NOT met'})")
    save("convergence", {"table": table, "overrides": args.overrides, "machine": facts,
                         "runs": {k: {"overrides": RUNS[k], "summary": v["summary"], "wall_s": v["wall_s"],
                                      "val_curve": v["val_curve"]} for k, v in results.items()}},
         keep=not args.only)


if __name__ == "__main__":
    main()
