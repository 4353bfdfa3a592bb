"""Results page section of the DiLoCo recipe sweep (``benchmarks/diloco_sweep.py``): one table."""

from __future__ import annotations

from results_format import f, pct, reading, table, x


def sweep_body(rec: dict) -> list[str]:
    d = rec["data"]
    rows = [[line["label"], len(line["seeds"]), f(line["final_val_loss"], 4),
             pct(line["gap_pct"], 2, sign=True), " / ".join(pct(g, 2, sign=True) for g in line["gap_pct_each"]),
             "-" if line["fewer_bytes_x"] is None else x(line["fewer_bytes_x"], 0), f"`{' '.join(line['overrides'])}`"]
            for line in d["lines"]]
    best = next(line for line in d["lines"] if not line["label"].startswith("fp32 DDP"))
    return [f"The main job (`lightning_optim.train`) on 2 ranks over loopback, the `{d['model']}` model, "
            f"{d['steps']} steps at equal tokens (every configuration sees the same batches as the fp32 DDP run of its "
            "seed); only the overrides change. Final validation loss, its gap to fp32 DDP's of the same seed (mean over "
            "the seeds run, then each), and the payload bytes per rank against DDP's fp32 ring all-reduce. Sorted by "
            f"the gap. The command reads back the runs already in its folder: these were made between "
            f"{d['runs_made'][0]} and {d['runs_made'][1]}, on the machine above.", "",
            *table(["configuration", "seeds", "final val loss", "vs DDP", "each seed", "fewer bytes than DDP",
                    "overrides"], rows, "lrrrrrl"),
            *reading(f"The closest to DDP is {best['label']} ({pct(best['gap_pct'], 2, sign=True)}). A gap under a "
                     "few percent between two lines of one seed is within the seed-to-seed spread (compare the lines "
                     "run on two seeds).")]
