"""Run outputs of the main job: loss.png, summary.json and the printed summary table.

loss.png has the train/validation loss against the step and, for a strategy that counts its bytes (the
1-bit and comm-hook strategies), a second panel with the bytes this rank put on the wire (cumulative)
next to what fp32 DDP would have sent; the step where DDP's allreduce gave way to the 1-bit exchange
(the 1-bit strategies' stage switch) is marked on both.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on servers/CI; must precede pyplot
import matplotlib.pyplot as plt

# One point of the job's byte trace: (step, bytes sent so far, fp32 DDP bytes so far, DDP's allreduce ran).
TracePoint = tuple[int, int, int, bool]


def read_metric(csv_path: Path, name: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric from a Lightning ``CSVLogger`` metrics.csv."""
    points = []
    with open(csv_path, newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get(name):
                points.append((int(row["step"]), float(row[name])))
    return points


def stage_switch_step(trace: Sequence[TracePoint]) -> int | None:
    """The first step that ran without DDP's allreduce after one that ran with it (the 1-bit stage
    switch), or None. Steps are metrics.csv's (0-based: the optimizer step just taken)."""
    for (_, _, _, before), (step, _, _, now) in pairwise(trace):
        if before and not now:
            return step
    return None


def plot_series(csv_path: Path, trace: Sequence[TracePoint] = ()) -> dict[str, Any]:
    """What loss.png shows: ``train_loss``/``val_loss`` as (step, value) from metrics.csv, ``bytes_sent`` and
    ``fp32_bytes`` as (step, cumulative bytes of this rank) from the job's byte ``trace`` (every optimizer step,
    whatever ``log_every_n_steps`` keeps in the CSV), and ``switch_step`` (None: no stage switch)."""
    return {
        "train_loss": read_metric(csv_path, "train_loss"),
        "val_loss": read_metric(csv_path, "val_loss"),
        "bytes_sent": [(step, sent) for step, sent, _, _ in trace],
        "fp32_bytes": [(step, fp32) for step, _, fp32, _ in trace],
        "switch_step": stage_switch_step(trace),
    }


def byte_unit(largest: float) -> tuple[str, float]:
    """A unit for a byte count: (name, bytes per unit)."""
    for name, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if largest >= size:
            return name, size
    return "bytes", 1.0


def format_bytes(count: float) -> str:
    name, size = byte_unit(count)
    return f"{count:,.0f} bytes" if size == 1.0 else f"{count / size:,.1f} {name}"


def plot_losses(csv_path: Path, png_path: Path, trace: Sequence[TracePoint] = ()) -> dict[str, Any]:
    """Write loss.png (see :func:`plot_series`); returns the series it drew."""
    series = plot_series(csv_path, trace)
    with_bytes = bool(series["bytes_sent"])
    fig, axes = plt.subplots(2 if with_bytes else 1, 1, sharex=True, squeeze=False,
                             figsize=(7, 7) if with_bytes else (7, 4.5),
                             gridspec_kw={"height_ratios": [3, 2]} if with_bytes else None)
    loss_ax = axes[0][0]
    for name, style in (("train_loss", "-"), ("val_loss", "o-")):
        if series[name]:
            steps, values = zip(*series[name])
            loss_ax.plot(steps, values, style, label=name)
    loss_ax.axhline(math.log(256), color="grey", linestyle=":", label="ln 256 (uniform bytes)")
    loss_ax.set_ylabel("cross-entropy (nats per byte)")
    loss_ax.set_title("lightning-optim: loss" + (" and bytes on the wire" if with_bytes else ""))
    if with_bytes:
        bytes_ax = axes[1][0]
        unit, size = byte_unit(max(v for _, v in series["bytes_sent"] + series["fp32_bytes"]))
        for name, label, style in (("bytes_sent", "sent by this job (per rank)", "-"),
                                   ("fp32_bytes", "fp32 DDP would send", "--")):
            steps, values = zip(*series[name])
            bytes_ax.plot(steps, [v / size for v in values], style, label=label)
        bytes_ax.set_ylabel(f"cumulative {unit} sent")
        bytes_ax.set_ylim(bottom=0)
    switch = series["switch_step"]
    for ax in (row[0] for row in axes):
        if switch is not None:
            ax.axvline(switch, color="tab:red", linestyle="-.", label=f"1-bit from step {switch}")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return series


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Write ``summary`` as indented JSON."""
    path.write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")


def compare_bytes(sent: float, fp32: float) -> str:
    """How ``sent`` compares with what fp32 DDP sends: "32.0x less", "1.2x more", "the same" or, when the
    ratio rounds to 1.0x either way, "about the same"."""
    if sent == fp32:
        return "the same"
    if fp32 == 0:
        return "more"
    if sent == 0:
        return "none sent"
    ratio = fp32 / sent
    factor = ratio if ratio > 1 else 1 / ratio
    if f"{factor:.1f}" == "1.0":
        return "about the same"
    return f"{factor:.1f}x {'less' if ratio > 1 else 'more'}"


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
        baseline = comm.get("baseline", "DDP's fp32 allreduce")
        without = f"{comm['steps_without_ddp_allreduce']} of {comm['steps']} steps without {baseline}"
        if comm.get("stage_switch_step") is not None:
            without += f", from step {comm['stage_switch_step']}"
        rows.append((
            "bytes sent per rank",
            (f"{format_bytes(comm['bytes_sent'])} vs {format_bytes(comm['fp32_bytes'])} for {baseline} "
             f"({compare_bytes(comm['bytes_sent'], comm['fp32_bytes'])}; {without})"),
        ))
    width = max(len(label) for label, _ in rows)
    lines = ["lightning-optim run summary"] + [f"  {label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)
