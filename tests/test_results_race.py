"""The low-communication race's figures (``benchmarks/lowcomm_race.py``) and its results section.

The runs here are made up, with curves whose answers are known in closed form: the loss falls linearly in
time, so the crossing of DDP's final loss, its time and the bytes sent by each validation follow from the
definitions. The real runs need network namespaces and minutes; the section is rendered from a record the race's
own code saves (``results.save``), as the page would read it.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import lowcomm_race  # noqa: E402
import results  # noqa: E402
import results_page  # noqa: E402
from results_sections import SECTIONS  # noqa: E402

from tests.test_results_page import _scaled  # noqa: E402

STEPS, VAL_EVERY, PARAMS = 40, 5, 1_000_000
TARGET = 3.0  # DDP's final loss below: 5 - 0.05 x 40


def _run(label: str, slope: float, seconds: list[list[float]], step_bytes: dict[int, float]) -> dict:
    """A run as ``compressors._collect`` reads one back: loss 5 - slope x steps done; ``seconds[r]``: rank r's step
    times; ``step_bytes``: rank 0's telemetry by metrics.csv step (empty: plain DDP)."""
    curve = [(0, 5.0)] + [(n - 1, 5.0 - slope * n) for n in range(VAL_EVERY, STEPS + 1, VAL_EVERY)]
    payload = int(sum(step_bytes.values()))
    ranks = [{"step_seconds": s, "num_params": PARAMS, "payload_bytes": payload, "steps": STEPS,
              "final_val_loss": curve[-1][1]} for s in seconds]
    return {"label": label, "overrides": [f"strategy={label.lower()}"], "wire_bytes": [payload + 7, payload + 5],
            "ranks": ranks, "val_curve": curve, "step_bytes": step_bytes}


def _runs() -> dict[str, dict]:
    return {
        # 0.2 s and 0.15 s per step: DDP trains for 0.2 x 40 = 8 s
        "DDP": _run("DDP", 0.05, [[0.2] * STEPS, [0.15] * STEPS], {}),
        # slower rank 0.12 s per step; loss 5 - 0.07 n reaches 3.0 at n = 2 / 0.07, between the validations at 25, 30
        "Fast": _run("Fast", 0.07, [[0.1] * STEPS, [0.12] * STEPS], {24: 1e6, 39: 1e6}),
        # each rank slow in one half: the slower rank's sum, not the sum of each step's slower time
        "Halves": _run("Halves", 0.04, [[0.3] * 20 + [0.1] * 20, [0.1] * 20 + [0.3] * 20], {19: 2e6, 39: 2e6}),
    }


def test_the_race_figures_follow_from_the_curves():
    rows = {r["label"]: r for r in lowcomm_race.race_rows(_runs())}
    ddp, fast, halves = rows["DDP"], rows["Fast"], rows["Halves"]
    # DDP: the ring rule, 2 (W - 1) / W x 4 bytes per parameter per step on 2 ranks, marked as computed
    assert ddp["bytes_computed"] and not fast["bytes_computed"]
    assert ddp["sent_mb"] == pytest.approx([4.0 * n for n in ddp["steps_done"]])
    assert ddp["sent_mb_per_rank"] == pytest.approx(4.0 * STEPS)
    assert ddp["time_to_ddp_loss_x"] == pytest.approx(1.0) and ddp["vs_ddp_pct"] == pytest.approx(0.0)
    # the time at a validation: what the slower rank trained so far; the first validation is before training
    assert fast["steps_done"] == [0, *range(VAL_EVERY, STEPS + 1, VAL_EVERY)]
    assert fast["train_s"] == pytest.approx([0.12 * n for n in fast["steps_done"]])
    assert halves["train_s"] == pytest.approx([max(0.3 * min(n, 20) + 0.1 * max(n - 20, 0),
                                                   0.1 * min(n, 20) + 0.3 * max(n - 20, 0))
                                               for n in halves["steps_done"]])
    # bytes by each validation: the telemetry of the steps taken (step 24 is the 25th); the total is comm_stats'
    assert fast["sent_mb"] == pytest.approx([0.0] * 5 + [1.0] * 3 + [2.0])
    assert fast["sent_mb_per_rank"] == pytest.approx(2.0) and fast["fewer_x"] == pytest.approx(80.0)
    # loss linear in time: the interpolated crossing is exact
    assert fast["time_to_ddp_loss_s"] == pytest.approx(0.12 * 2.0 / 0.07)
    assert fast["time_to_ddp_loss_x"] == pytest.approx(0.12 * 2.0 / 0.07 / 8.0)
    assert fast["vs_ddp_pct"] == pytest.approx(((5 - 0.07 * STEPS) / TARGET - 1) * 100)
    assert halves["time_to_ddp_loss_s"] is None and halves["time_to_ddp_loss_x"] is None
    assert fast["wire_mb"] == pytest.approx([2.000007, 2.000005])


def test_time_to_loss_brackets_the_crossing():
    seconds, losses = [0.0, 1.0, 3.0, 4.0], [5.0, 4.0, 2.0, 2.5]
    assert lowcomm_race.time_to_loss(seconds, losses, 3.0) == pytest.approx(2.0)  # halfway from 4.0 to 2.0
    assert lowcomm_race.time_to_loss(seconds, losses, 2.0) == pytest.approx(3.0)  # at a validation: its time
    assert lowcomm_race.time_to_loss(seconds, losses, 6.0) == pytest.approx(0.0)
    assert lowcomm_race.time_to_loss(seconds, losses, 1.9) is None


def test_the_recipe_gives_every_method_its_overrides():
    configs = lowcomm_race.race_configs(300)
    assert list(configs) == list(lowcomm_race.RECIPE)
    assert "strategy.freeze_step=75" in configs["1-bit Adam"]
    assert all(o[0].startswith("strategy=") and all("{" not in x for x in o) for o in configs.values())


@pytest.fixture
def record(tmp_path, monkeypatch):
    """lowcomm_race.json as results.save writes it, from two rates' rows; the second rate without DDP."""
    monkeypatch.setenv("LIGHTNING_OPTIM_RESULTS", str(tmp_path))
    runs = _runs()
    rates = {"100mbit": {"where": "namespaces", "rows": lowcomm_race.race_rows(runs)},
             "1gbit": {"where": "namespaces", "rows": lowcomm_race.race_rows({"Fast": runs["Fast"]})}}
    args = argparse.Namespace(model="tiny", steps=STEPS, val_every=VAL_EVERY, threads=1)
    configs = {label: run["overrides"] for label, run in runs.items()}
    results.save("lowcomm_race", lowcomm_race.race_data(args, configs, rates, PARAMS))
    return results_page.load(tmp_path)


def test_the_race_section_shows_its_files_figures(record):
    section = next(s for s in SECTIONS if s.files == ("lowcomm_race",))
    text = section.render(record)
    assert "Not measured yet" not in text and "lowcomm_race.png" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + 3 + 1  # header and marks, then method x rate
    assert any("| Halves |" in line and "| never |" in line for line in table)
    assert "| 1gbit | Fast |" in table[-1] and table[-1].endswith("| - | - |")  # no DDP there: nothing against
    changed = copy.deepcopy(record)
    changed["lowcomm_race"]["data"] = _scaled(changed["lowcomm_race"]["data"], 1.37)
    assert section.render(changed) != text
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    [(name, figure)] = section.plots(record, plt)
    assert name == "lowcomm_race.png" and len(figure.axes) == 3  # one panel per rate, and the bytes
    plt.close(figure)


def test_ddp_loss_at_a_time_is_read_off_its_curve():
    """DDP's loss after a given training time: linear between the validations that bracket it, exact at a validation,
    None past DDP's last one (a method that trained longer than DDP has nothing to compare with)."""
    import results_race

    ddp = {"train_s": [0.0, 10.0, 30.0], "val_loss": [5.0, 3.0, 2.0]}
    assert results_race.ddp_loss_at(ddp, 10.0) == 3.0
    assert results_race.ddp_loss_at(ddp, 20.0) == pytest.approx(2.5)
    assert results_race.ddp_loss_at(ddp, 5.0) == pytest.approx(4.0)
    assert results_race.ddp_loss_at(ddp, 31.0) is None
