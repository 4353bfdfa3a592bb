"""``freeze_step="auto"`` against fixed freeze steps of 5%, 10%, 20% and 40% of the run.

Two workloads, each run once per setting with everything else equal (seed, data, schedule):

* the main job (``python -m lightning_optim.train``: 1-bit Adam on 2 CPU processes, 400 steps by default);
* ``examples/hf_trainer_onebit.py`` under ``torchrun --nproc_per_node 2`` (HF Trainer, 240 steps).

Goal: auto's final validation loss within 1% of the best fixed setting's, at a switch step no later than
2x that setting's. Prints one table per workload and saves the figures (``results.py``).

    python benchmarks/auto_freeze.py                    # both workloads (about 20 minutes on 2 idle cores)
    python benchmarks/auto_freeze.py --only main        # or --only hf
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comm import machine_facts  # noqa: E402
from results import save  # noqa: E402
from convergence import run as main_job_run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARES = (0.05, 0.10, 0.20, 0.40)
HF_LINE = re.compile(r"eval loss (?P<loss>[\d.]+) after (?P<steps>\d+) steps.*?(chose step (?P<chose>\d+))?$")


def main_job(steps: int, setting: str, out: Path, reuse: bool = False) -> tuple[float, int | None]:
    """(final val loss, the step the 1-bit stage started) of one main-job run (``reuse``: a finished one)."""
    result = main_job_run(f"main_{setting}", [f"trainer.max_steps={steps}", f"strategy.freeze_step={setting}"], [],
                          out, resume=reuse)
    summary = result["summary"]
    return summary["final_val_loss"], summary["comm"].get("stage_switch_step")


def hf_example(steps: int, setting: str, out: Path, reuse: bool = False) -> tuple[float, int | None]:
    """(final eval loss, the warmup's last step) of one HF example run (fixed: the setting itself)."""
    log = out / f"hf_{setting}.stdout"
    if not (reuse and log.exists()):
        log.write_text(_run_hf(steps, setting, out))
    found = [m for m in map(HF_LINE.search, log.read_text().splitlines()) if m]
    if not found:
        raise SystemExit(f"hf {setting}: no result line in {log}")
    chose = found[-1].group("chose")
    return float(found[-1].group("loss")), int(chose) if chose else int(setting)


def _run_hf(steps: int, setting: str, out: Path) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               str(REPO / "examples" / "hf_trainer_onebit.py"), "--optim", "onebit_adam",
               "--optim_args", f"freeze_step={setting}", "--max_steps", str(steps),
               "--output_dir", str(out / f"hf_{setting}")]
    result = subprocess.run(command, cwd=out, capture_output=True, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if result.returncode != 0:
        raise SystemExit(f"hf {setting} failed:\n{result.stderr[-4000:]}")
    return result.stdout


def sweep(name: str, runner, steps: int, out: Path, reuse: bool) -> dict:
    rows = {}
    for share in SHARES:
        setting = str(max(1, round(share * steps)))
        rows[f"{share:.0%}"] = dict(zip(("loss", "switch"), runner(steps, setting, out, reuse)), setting=setting)
    rows["auto"] = dict(zip(("loss", "switch"), runner(steps, "auto", out, reuse)), setting="auto")
    fixed = {k: v for k, v in rows.items() if k != "auto"}
    best = min(fixed.values(), key=lambda r: r["loss"])
    auto = rows["auto"]
    gap = (auto["loss"] - best["loss"]) / best["loss"]
    late = auto["switch"] / best["switch"] if auto["switch"] and best["switch"] else float("nan")
    print(f"\n### {name}, {steps} steps\n\n| freeze_step | switch step | final val loss | vs best fixed |\n|---|---:|---:|---:|")
    for key, r in rows.items():
        print(f"| {key} ({r['setting']}) | {r['switch']} | {r['loss']:.4f} | {(r['loss'] - best['loss']) / best['loss']:+.2%} |")
    print(f"\nauto vs the best fixed ({best['setting']}): loss {gap:+.2%} (goal within 1%: "
          f"{'met' if gap <= 0.01 else 'not met'}), switch at {late:.2f}x its step (goal <= 2x: "
          f"{'met' if late <= 2 else 'not met'})")
    return {"rows": rows, "loss_gap": gap, "switch_ratio": late}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("main", "hf"), default=None)
    parser.add_argument("--main-steps", type=int, default=400)
    parser.add_argument("--hf-steps", type=int, default=240)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true", help="take the finished runs found in --out as they are")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="auto_freeze_"))
    out.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    print(f"# freeze_step='auto' benchmark: {facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}, "
          f"load average {facts['loadavg_1_5_15min']}; runs in {out}")
    results = {"machine": facts}
    if args.only in (None, "main"):
        results["main_job"] = sweep("main job (1-bit Adam, 2 processes)", main_job, args.main_steps, out,
                                    args.reuse)
    if args.only in (None, "hf"):
        results["hf_example"] = sweep("examples/hf_trainer_onebit.py (2 ranks)", hf_example, args.hf_steps,
                                      out, args.reuse)
    save("auto_freeze", results, keep=args.only is None)


if __name__ == "__main__":
    main()
