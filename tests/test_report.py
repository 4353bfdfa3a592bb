"""The run's report: the summary's bytes line compares with fp32 DDP sensibly at every ratio, and loss.png
draws the losses, the bytes on the wire (cumulative) and the 1-bit stage switch."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_optim.report import (compare_bytes, format_bytes, format_table, plot_losses, plot_series,
                                    stage_switch_step)

BASE = {"output_dir": "out", "num_params": 10, "steps": 4, "initial_val_loss": 5.0, "final_val_loss": 4.0,
        "final_train_loss": 4.1, "train_tokens_per_sec": 100.0, "wall_time_s": 1.0}


# A sweep over fp32 / sent ratios below, at and above 1: "1.0x more" or "1.0x less" never appears.
@pytest.mark.parametrize("sent,fp32,words", [
    (1e6, 32e6, "32.0x less"), (1e6, 1.06e6, "1.1x less"), (1e6, 1.04e6, "about the same"),
    (4e6, 4e6, "the same"), (298792, 298752, "about the same"),  # fp32 DDP steps plus a few bytes of agreement
    (1e6, 0.96e6, "about the same"), (1e6, 0.94e6, "1.1x more"), (10e6, 8e6, "1.2x more"), (1e6, 0.0, "more"),
])
def test_the_bytes_line_compares_with_fp32_ddp(sent, fp32, words):
    assert compare_bytes(sent, fp32) == words
    comm = {"bytes_sent": sent, "fp32_bytes": fp32, "compression_ratio": fp32 / sent, "steps": 4,
            "steps_without_ddp_allreduce": 4}
    text = format_table({**BASE, "comm": comm})
    assert f"{format_bytes(sent)} vs {format_bytes(fp32)} for DDP's fp32 allreduce ({words}; 4 of 4 steps" in text
    assert "1.0x" not in text and "from step" not in text
    assert "from step 2)" in format_table({**BASE, "comm": {**comm, "stage_switch_step": 2}})


def test_byte_counts_read_in_their_unit():
    assert [format_bytes(n) for n in (0, 999, 482_300, 368_700_000, 1_348_000_000)] == [
        "0 bytes", "999 bytes", "482.3 kB", "368.7 MB", "1.3 GB"]


def test_no_bytes_line_without_communication():
    assert "bytes sent" not in format_table(BASE)


def test_stage_switch_is_the_first_step_without_ddp_allreduce_after_one_with_it():
    trace = [(0, 1, 1, True), (1, 2, 2, True), (2, 3, 3, False), (3, 4, 4, True), (4, 5, 5, False)]
    assert stage_switch_step(trace) == 2  # the first switch
    assert stage_switch_step([(0, 1, 1, True), (1, 2, 2, True)]) is None  # plain DDP steps / freeze_step not reached
    assert stage_switch_step([(5, 1, 1, False), (6, 2, 2, False)]) is None  # compressed from the start: no switch seen
    assert stage_switch_step([]) is None


def _metrics_csv(path: Path) -> Path:
    """A CSVLogger file as the job writes it: validation rows, train rows every other step (log_every_n_steps=2)."""
    rows = ["epoch,step,train_loss,val_loss", "0,0,,5.5", "0,1,5.0,", "0,3,4.0,", "0,3,,4.2", "0,5,3.0,", "0,5,,3.5"]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_loss_png_series_mark_the_switch_and_sum_the_bytes(tmp_path: Path):
    csv_path = _metrics_csv(tmp_path / "metrics.csv")
    # the job's byte trace: every optimizer step (not only the logged ones), cumulative; 1-bit from step 3
    trace = [(0, 100, 100, True), (1, 200, 200, True), (2, 300, 300, True), (3, 310, 400, False),
             (4, 320, 500, False), (5, 330, 600, False)]
    series = plot_losses(csv_path, tmp_path / "loss.png", trace)
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert series == plot_series(csv_path, trace)
    assert series["train_loss"] == [(1, 5.0), (3, 4.0), (5, 3.0)]
    assert series["val_loss"] == [(0, 5.5), (3, 4.2), (5, 3.5)]
    assert series["bytes_sent"] == [(0, 100), (1, 200), (2, 300), (3, 310), (4, 320), (5, 330)]
    assert series["fp32_bytes"][-1] == (5, 600)
    assert series["switch_step"] == 3

    plain = plot_losses(csv_path, tmp_path / "plain.png")  # a strategy that counts no bytes: losses only
    assert plain["bytes_sent"] == [] and plain["switch_step"] is None
    assert (tmp_path / "plain.png").stat().st_size > 0
