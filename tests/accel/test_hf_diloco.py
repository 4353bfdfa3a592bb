"""The HF Trainer with ``callbacks=[DiLoCoCallback(...)]`` built from a real command line (``--diloco_sync_every``
through ``HfArgumentParser((TrainingArguments, DiLoCoArguments))``) under ``torchrun --nproc_per_node 2`` (gloo,
CPU), 12 optimizer steps of 2 accumulated micro-batches, sync_every=4: the prepared optimizer steps through
DiLoCo over HF's AdamW; the ranks' params agree right after each sync and differ between; the kernel's socket
counters see nothing between syncs inside the steps (no DDP gradient all-reduce) and comm_stats' bytes at syncs;
``resume_from_checkpoint`` from checkpoint-6 (between syncs; written by ``accel_plugins.hf.Trainer``, resumed by
the stock Trainer after ``register()``) continues bitwise on both ranks; the two runs are phases of one launch
(tests/accel/phases.py). Refusals run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.accel.phases import rank_results, run_phases  # noqa: E402
from tests.wire import assert_quiet_between_syncs  # noqa: E402

SCRIPT = Path(__file__).with_name("hf_diloco_script.py")
REPO = Path(__file__).resolve().parents[2]
STEPS, SYNC_EVERY, SAVE_AT = 12, 4, 6
SYNCS = [s for s in range(1, STEPS + 1) if s % SYNC_EVERY == 0]
COMMON = ["--diloco_sync_every", str(SYNC_EVERY), "--max_steps", str(STEPS), "--save_steps", str(SAVE_AT),
          "--logging_steps", "4", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
          "--learning_rate", "3e-3", "--use_cpu", "--report_to", "none", "--seed", "0",
          # HF's own per-step collectives, not gradients (docs/hf_trainer.md): off, so nothing at all between syncs
          "--average_tokens_across_devices", "False", "--ddp_find_unused_parameters", "False"]


def _phase(out: Path, *extra: str) -> list[str]:
    return ["--output_dir", str(out), *COMMON, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_diloco")
    checkpoint = tmp / "full" / f"checkpoint-{SAVE_AT}"
    run_phases(SCRIPT, [_phase(tmp / "full"),
                        _phase(tmp / "resumed", "--trainer", "stock", "--resume_from_checkpoint", str(checkpoint))],
               cwd=REPO)
    return {"full": rank_results(tmp / "full", "result"), "resumed": rank_results(tmp / "resumed", "result"),
            "checkpoint": checkpoint}


def test_the_trainer_steps_through_diloco_and_the_ranks_agree_right_after_each_sync(runs):
    full = runs["full"]
    for result in full:
        assert (result["trainer"], result["stepping"], result["inner"]) == ("accel_plugins.hf", "DiLoCo", "AdamW")
        assert result["inner_steps"] == STEPS and result["buckets_local"] == STEPS  # one inner step per accumulation
    assert [r["step"] for r in full[0]["rows"]] == list(range(1, STEPS + 1))
    for a, b in zip(full[0]["rows"], full[1]["rows"]):
        assert torch.equal(a["params"], b["params"]) == (a["step"] in SYNCS), a["step"]
    losses = [row["loss"] for row in full[0]["log"] if "loss" in row]
    assert losses[-1] < losses[0]


def test_nothing_on_the_wire_between_syncs_and_comm_stats_at_syncs(runs):
    for result in runs["full"]:
        rows = result["rows"]
        if any(r["wire_bytes"] is None for r in rows):
            pytest.skip("no `ss` to read the sockets' byte counters")
        assert_quiet_between_syncs(rows, SYNCS)
        for r in rows:
            if r["step"] in SYNCS:
                assert r["stats_bytes"] <= r["wire_bytes"] <= 1.03 * r["stats_bytes"] + 1024, r
            else:
                assert r["stats_bytes"] == 0, r


def test_every_rank_writes_its_own_diloco_state_into_the_checkpoint(runs):
    payloads = [torch.load(runs["checkpoint"] / f"diloco_rank{r}.pt", weights_only=True) for r in range(2)]
    assert [(p["world_size"], p["rank"]) for p in payloads] == [(2, 0), (2, 1)]
    assert all(p["optimizer"]["diloco"]["step"] == SAVE_AT for p in payloads)
    # saved between syncs: the ranks' params and inner (Adam) states differ, each rank keeps its own
    assert not all(torch.equal(a, b) for a, b in zip(payloads[0]["model"].values(), payloads[1]["model"].values()))


def test_resume_from_checkpoint_between_syncs_is_bitwise(runs):
    for full, resumed in zip(runs["full"], runs["resumed"]):
        assert resumed["trainer"] == "transformers.trainer" and resumed["stepping"] == "DiLoCo"
        assert [r["step"] for r in resumed["rows"]] == list(range(SAVE_AT + 1, STEPS + 1))
        for a, b in zip(full["rows"][SAVE_AT:], resumed["rows"]):
            assert torch.equal(a["params"], b["params"]), a["step"]
        assert all(torch.equal(a, b) for a, b in zip(full["params"], resumed["params"]))


# ---------------------------------------------------------------------- refusals in this process
BAD = [("sync_every", "0"), ("outer_lr", "0"), ("outer_lr", "-1"), ("outer_momentum", "1"),
       ("fragments", "3"), ("mixing", "0.5"), ("compressor", "int2")]


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v}" for n, v in BAD])
def test_a_bad_command_line_value_is_refused_at_parse_time_by_name(name, value):
    from transformers import HfArgumentParser

    from accel_plugins.hf import DiLoCoArguments

    argv = ["--diloco_sync_every", "4", f"--diloco_{name}", value]  # the last value of an option wins
    with pytest.raises((TypeError, ValueError), match=rf"^diloco_{name}\b"):
        HfArgumentParser(DiLoCoArguments).parse_args_into_dataclasses(argv)


def test_the_callback_checks_its_arguments_and_refuses_to_run_uninstalled():
    from accel_plugins.hf import DiLoCoArguments, DiLoCoCallback

    with pytest.raises(ValueError, match="^sync_every must be in"):
        DiLoCoCallback(sync_every=0)
    with pytest.raises(TypeError, match="^nesterov"):
        DiLoCoCallback(sync_every=4, nesterov="yes")
    assert DiLoCoArguments().callback() is None  # --diloco_sync_every unset: no DiLoCo
    with pytest.raises(RuntimeError, match="accel_plugins.hf.register"):  # a stock Trainer without register()
        DiLoCoCallback(sync_every=4).on_step_begin(None, None, None)
