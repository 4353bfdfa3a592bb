"""Final validation loss of the 16-bit precision options vs fp32 on the main job, one process.

=====================  ============================================  =========================
run                    what                                          goal vs ``32-true``
=====================  ============================================  =========================
``32-true``            fp32 params, lightning_optim.AdamW            baseline
``fp16_master``        fp16 model, fp32 masters, loss scaling        within 1%
``bf16_kahan``         bf16 params (norms fp32), Kahan summation     within 1%
``bf16-true``          bf16 params, no Kahan (contrast)              none: shows what Kahan buys
=====================  ============================================  =========================

    python benchmarks/precision_convergence.py                        # 200 steps
    python benchmarks/precision_convergence.py trainer.max_steps=400  # extra overrides go to every run

Same seed, data and schedule for every run (``strategy=auto trainer.devices=1``). Prints a table and
saves the figures with the validation curves (``benchmarks/results.py``). On CPU, fp16
matmuls are slow (no fp16 units): compare the losses here, not the times.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comm import machine_facts  # noqa: E402  (benchmarks/comm.py)
from convergence import run  # noqa: E402  (benchmarks/convergence.py)
from results import save  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ONE = ["strategy=auto", "trainer.devices=1", "optimizer=adamw"]
RUNS = {
    "32-true": [*ONE, "precision=32-true"],
    "fp16_master": [*ONE, "precision=fp16_master"],
    "bf16_kahan": [*ONE, "precision=bf16_kahan"],
    "bf16-true, no Kahan": [*ONE, "precision=32-true", "precision.name=bf16-true", "+optimizer.kahan_sum=false"],
}
GOALS = {"fp16_master": 0.01, "bf16_kahan": 0.01}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="where the run directories go")
    parser.add_argument("--only", nargs="*", default=None, help="run names to run (default: all)")
    parser.add_argument("--resume", action="store_true", help="reuse runs already finished under --out")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    overrides = args.overrides or ["trainer.max_steps=200"]
    out = args.out or Path(tempfile.mkdtemp(prefix="precision-"))
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, run_overrides in RUNS.items():
        if args.only and name not in args.only:
            continue
        results[name] = run(name, run_overrides, overrides, out, resume=args.resume)  # fp16 on a CPU: minutes
        s = results[name]["summary"]
        print(f"{name:22s} val {s['initial_val_loss']:.3f} -> {s['final_val_loss']:.4f}  "
              f"train tokens/s {s['train_tokens_per_sec']:,.0f}  wall {results[name]['wall_s']:.0f}s", flush=True)
    if "32-true" not in results:
        raise SystemExit("the 32-true baseline is needed (run it, or --resume from an --out that has it)")
    base = results["32-true"]["summary"]["final_val_loss"]
    table = []
    for name in RUNS:
        if name not in results:
            continue
        val = results[name]["summary"]["final_val_loss"]
        goal = GOALS.get(name)
        table.append({"run": name, "final_val": val, "gap": val / base - 1, "goal": goal,
                      "met": None if goal is None else abs(val / base - 1) <= goal})
        print(f"{name:22s} {val:.4f} vs 32-true {base:.4f}: {val / base - 1:+.2%}"
              + ("" if goal is None else f" (goal within {goal:.0%}: {'met' if table[-1]['met'] else 'NOT met'})"))
    facts = machine_facts()
    print(f"machine: {facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}; overrides: {overrides}")
    save("precision_convergence", {"table": table, "machine": facts, "overrides": overrides,
                                   "runs": {k: {"overrides": RUNS[k], "summary": v["summary"], "wall_s": v["wall_s"],
                                                "val_curve": v["val_curve"]} for k, v in results.items()}},
         keep=not args.only)


if __name__ == "__main__":
    main()
