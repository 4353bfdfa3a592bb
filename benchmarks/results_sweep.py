"""Results page section of the DiLoCo recipe sweep (``benchmarks/diloco_sweep.py``): one table per sweep file."""

from __future__ import annotations

from results_format import f, pct, reading, table, x


def _sweep_table(d: dict) -> list[str]:
    rows = [[line["label"], len(line["seeds"]), f(line["final_val_loss"], 4),
             pct(line["gap_pct"], 2, sign=True), " / ".join(pct(g, 2, sign=True) for g in line["gap_pct_each"]),
             "-" if line["fewer_bytes_x"] is None else x(line["fewer_bytes_x"], 0), f"`{' '.join(line['overrides'])}`"]
            for line in d["lines"]]
    return [f"**The `{d['model']}` model, {d['steps']} steps** (runs made between {d['runs_made'][0]} and "
            f"{d['runs_made'][1]}):", "",
            *table(["configuration", "seeds", "final val loss", "vs DDP", "each seed", "fewer bytes than DDP",
                    "overrides"], rows, "lrrrrrl")]


def _closest(d: dict) -> str:
    best = next(line for line in d["lines"] if not line["label"].startswith("fp32 DDP"))
    return f"{best['label']} on `{d['model']}` over {d['steps']} steps ({pct(best['gap_pct'], 2, sign=True)})"


def sweep_body(*records: dict) -> list[str]:
    sweeps = [rec["data"] for rec in records]
    lines = ["The main job (`lightning_optim.train`) on 2 ranks over loopback, at equal tokens (every configuration "
             "sees the same batches as the fp32 DDP run of its seed); only the overrides change. Final validation "
             "loss, its gap to fp32 DDP's of the same seed (mean over the seeds run, then each), and the payload bytes "
             "per rank against DDP's fp32 ring all-reduce; sorted by the gap. The command reads back the runs already "
             "in its folder; each table says when they were made, on the machine above.", ""]
    for d in sweeps:
        lines += _sweep_table(d)
    return lines + reading("The closest to DDP: " + "; ".join(_closest(d) for d in sweeps) + ". A gap under a few "
                           "percent between two single-seed lines is within the seed-to-seed spread (compare the "
                           "lines run on two seeds).")
