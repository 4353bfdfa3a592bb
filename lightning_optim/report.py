"""Run outputs of the main job: loss-curve PNG, summary.json and the printed summary table."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on servers/CI; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402


def read_metric(csv_path: Path, name: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric from a Lightning ``CSVLogger`` metrics.csv."""
    points = []
    with open(csv_path, newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get(name):
                points.append((int(row["step"]), float(row[name])))
    return points


def plot_losses(csv_path: Path, png_path: Path) -> None:
    """Plot train and validation loss against the optimizer step."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, style in (("train_loss", "-"), ("val_loss", "o-")):
        points = read_metric(csv_path, name)
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, style, label=name)
    ax.axhline(math.log(256), color="grey", linestyle=":", label="ln 256 (uniform bytes)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title("lightning-optim: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Write ``summary`` as indented JSON."""
    path.write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")


def format_table(summary: dict[str, Any]) -> str:
    """A short human-readable table of the headline numbers."""
    rows = [
        ("output dir", summary["output_dir"]),
        ("parameters", f"{summary['num_params']:,}"),
        ("steps", f"{summary['steps']:,}"),
        ("val loss", f"{summary['initial_val_loss']:.3f} -> {summary['final_val_loss']:.3f}"),
        ("train loss (last step)", "n/a (no training step)" if summary["final_train_loss"] is None
         else f"{summary['final_train_loss']:.3f}"),
        ("train tokens/s", f"{summary['train_tokens_per_sec']:,.0f}"),
        ("wall time", f"{summary['wall_time_s']:.1f} s"),
    ]
    comm = summary.get("comm")
    if comm and comm.get("bytes_sent"):
        ratio = comm["compression_ratio"]
        relation = f"{ratio:.1f}x less" if ratio >= 1 else f"{1 / ratio:.1f}x more"  # gossip can send more
        rows.append((
            "bytes sent per rank",
            f"{comm['bytes_sent'] / 1e6:,.1f} MB vs {comm['fp32_bytes'] / 1e6:,.1f} MB for fp32 DDP "
            f"({relation}; {comm['steps_without_ddp_allreduce']} of {comm['steps']} steps without DDP's allreduce)",
        ))
    width = max(len(label) for label, _ in rows)
    lines = ["lightning-optim run summary"] + [f"  {label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)
