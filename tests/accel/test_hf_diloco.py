"""The HF Trainer with ``callbacks=[DiLoCoCallback(...)]`` built from a real command line (``--diloco_sync_every``
through ``HfArgumentParser((TrainingArguments, DiLoCoArguments))``) under ``torchrun --nproc_per_node 2`` (gloo,
CPU), 12 optimizer steps of 2 accumulated micro-batches, sync_every=4: the prepared optimizer steps through
DiLoCo over HF's AdamW; the ranks' params agree right after each sync and differ between; the kernel's socket
counters see nothing between syncs inside the steps (no DDP gradient all-reduce) and comm_stats' bytes at syncs;
``resume_from_checkpoint`` from checkpoint-6 (between syncs; written by ``accel_plugins.hf.Trainer``, resumed by
the stock Trainer after ``register()``) continues bitwise on both ranks; resumed from a copy of it without rank 1's
``diloco_rank1.pt``, rank 1 continues DiLoCo's schedule from rank 0's saved state with a warning (no restart at
inner step 0) while rank 0 resumes its own; ``--diloco_compressor sparseloco --diloco_density 0.05 --diloco_bits 2``
trains through SparseLoCo, each sync its wire format (tests/reference/sparseloco.py) with nothing between; the runs
are phases of one launch (tests/accel/phases.py). Refusals run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.accel.phases import rank_results, run_phases  # noqa: E402
from tests.reference.sparseloco import message_bytes  # noqa: E402
from tests.wire import assert_quiet_between_syncs  # noqa: E402

SCRIPT = Path(__file__).with_name("hf_diloco_script.py")
REPO = Path(__file__).resolve().parents[2]
STEPS, SYNC_EVERY, SAVE_AT = 12, 4, 6
SYNCS = [s for s in range(1, STEPS + 1) if s % SYNC_EVERY == 0]
SHORT = SYNC_EVERY + 2  # a run past a sync that ends between two
SPARSELOCO = ("--diloco_compressor", "sparseloco", "--diloco_density", "0.05", "--diloco_bits", "2",
              "--diloco_outer_lr", "1.0", "--diloco_outer_momentum", "0.9")
COMMON = ["--diloco_sync_every", str(SYNC_EVERY), "--max_steps", str(STEPS), "--save_steps", str(SAVE_AT),
          "--logging_steps", "4", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
          "--learning_rate", "3e-3", "--use_cpu", "--report_to", "none", "--seed", "0",
          # HF's per-step collectives, not gradients (docs/guides/hf_trainer.md): off, so nothing at all between syncs
          "--average_tokens_across_devices", "False", "--ddp_find_unused_parameters", "False"]


def _phase(out: Path, *extra: str) -> list[str]:
    return ["--output_dir", str(out), *COMMON, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_diloco")
    checkpoint = tmp / "full" / f"checkpoint-{SAVE_AT}"
    resume = ("--resume_from_checkpoint", str(checkpoint))
    done = run_phases(SCRIPT, [_phase(tmp / "full"), _phase(tmp / "resumed", "--trainer", "stock", *resume),
                               _phase(tmp / "partial", *resume, "--drop_rank_state", "1"),
                               _phase(tmp / "ends_apart", "--max_steps", str(SHORT)),
                               _phase(tmp / "kept_apart", "--max_steps", "3", "--diloco_sync_every", "8",
                                      "--diloco_final_sync", "False"),
                               _phase(tmp / "sparseloco", *SPARSELOCO)], cwd=REPO)
    return {"full": rank_results(tmp / "full", "result"), "resumed": rank_results(tmp / "resumed", "result"),
            "partial": rank_results(tmp / "partial", "result"), "checkpoint": checkpoint, "stderr": done.stderr,
            "ends_apart": rank_results(tmp / "ends_apart", "result"),
            "kept_apart": rank_results(tmp / "kept_apart", "result"),
            "sparseloco": rank_results(tmp / "sparseloco", "result")}


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


def test_a_rank_without_its_file_resumes_from_rank_0s_saved_state_with_a_warning(runs):
    partial, full = runs["partial"], runs["full"]
    for result in partial:  # DiLoCo's schedule carried on: syncs after steps 8 and 12, not 4 steps after resuming
        assert result["inner_steps"] == STEPS
        assert [r["step"] for r in result["rows"]] == list(range(SAVE_AT + 1, STEPS + 1))
    for a, b in zip(partial[0]["rows"], partial[1]["rows"]):
        assert torch.equal(a["params"], b["params"]) == (a["step"] in SYNCS), a["step"]
    # rank 0 read its own file: its local steps up to the next sync are the uninterrupted run's, bitwise
    assert torch.equal(partial[0]["rows"][0]["params"], full[0]["rows"][SAVE_AT]["params"])
    missing = [line for line in runs["stderr"].splitlines() if "diloco_rank1.pt is missing" in line]
    assert missing and all("resumes DiLoCo (inner step 6) from the optimizer state saved by rank 0" in m
                           for m in missing), runs["stderr"][-3000:]
    assert "diloco_rank0.pt is missing" not in runs["stderr"]


def test_a_run_that_ends_between_syncs_ends_with_one_more(runs):
    """``max_steps`` 6, sync_every 4: apart after steps 5 and 6, one model on both ranks after train()."""
    ends = runs["ends_apart"]
    for a, b in zip(ends[0]["rows"], ends[1]["rows"]):
        assert torch.equal(a["params"], b["params"]) == (a["step"] == SYNC_EVERY), a["step"]
    assert all(torch.equal(a, b) for a, b in zip(ends[0]["params"], ends[1]["params"]))
    assert not all(torch.equal(a, b) for a, b in zip(ends[0]["params"], ends[0]["rows"][-1]["params"].split(
        [p.numel() for p in ends[0]["params"]])))  # the final sync moved the params


def test_final_sync_false_and_a_run_shorter_than_sync_every_are_named_once(runs):
    kept = runs["kept_apart"]
    assert not all(torch.equal(a, b) for a, b in zip(kept[0]["params"], kept[1]["params"]))
    for words in (("DiLoCoCallback: sync_every=8, but this run ends at inner step 3 and the first synchronisation "
                   "would follow step 8: the ranks never average"),
                  ("DiLoCoCallback: the run ends after inner step 3, between two synchronisations (sync_every=8): the "
                   "params differ between the ranks")):
        assert runs["stderr"].count(words) == 1, words  # rank 0 only
    assert "DiLoCoCallback: sync_every=4, but" not in runs["stderr"]  # the other runs reach their syncs


def test_sparseloco_from_the_command_line_sends_its_wire_format_at_syncs_only(runs):
    """12 steps, sync_every 4: the ranks agree right after each sync and differ between; each sync is SparseLoCo's
    all-gather of the model (the reference's count; the first with its layout agreement, 8 int64s), nothing is sent
    between syncs, the socket counters see what was counted; the loss falls."""
    results = runs["sparseloco"]
    for result in results:
        assert (result["compressor"], result["density"], result["bits"], result["outer_momenta"]) == (
            "sparseloco", 0.05, 2, 0)
        assert result["inner_steps"] == STEPS
    for a, b in zip(results[0]["rows"], results[1]["rows"]):
        assert torch.equal(a["params"], b["params"]) == (a["step"] in SYNCS), a["step"]
    wire = sum(message_bytes(p.numel(), density=0.05, bits=2, chunk=4096) for p in results[0]["params"])
    for result in results:
        rows = result["rows"]
        assert [r["stats_bytes"] for r in rows if r["step"] in SYNCS] == [wire + 8 * 8] + [wire] * (len(SYNCS) - 1)
        assert all(r["stats_bytes"] == 0 for r in rows if r["step"] not in SYNCS)
        if all(r["wire_bytes"] is not None for r in rows):
            assert_quiet_between_syncs(rows, SYNCS)
            for r in rows:
                if r["step"] in SYNCS:
                    assert r["stats_bytes"] <= r["wire_bytes"] <= 1.03 * r["stats_bytes"] + 1024, r
    losses = [row["loss"] for row in results[0]["log"] if "loss" in row]
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------------- refusals in this process
BAD = [("sync_every", "0"), ("outer_lr", "0"), ("outer_lr", "-1"), ("outer_momentum", "1"),
       ("fragments", "3"), ("mixing", "0.5"), ("compressor", "int2"), ("density", "0.1"), ("bits", "2")]
SPARSELOCO_BAD = [("density", "0"), ("density", "1.5"), ("bits", "0"), ("bits", "9"), ("nesterov", "True"),
                  ("outer_momentum", "1.5")]


@pytest.mark.parametrize("name, value", SPARSELOCO_BAD, ids=[f"{n}={v}" for n, v in SPARSELOCO_BAD])
def test_a_bad_sparseloco_value_is_refused_at_parse_time_by_name(name, value):
    from transformers import HfArgumentParser

    from accel_plugins.hf import DiLoCoArguments

    argv = ["--diloco_sync_every", "4", "--diloco_compressor", "sparseloco", f"--diloco_{name}", value]
    with pytest.raises((TypeError, ValueError), match=rf"^diloco_{name}\b"):
        HfArgumentParser(DiLoCoArguments).parse_args_into_dataclasses(argv)


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
    with pytest.raises(TypeError, match=r"^final_sync must be True or False"):
        DiLoCoCallback(sync_every=4, final_sync="yes")
    assert DiLoCoArguments().callback() is None  # --diloco_sync_every unset: no DiLoCo
    with pytest.raises(RuntimeError, match="accel_plugins.hf.register"):  # a stock Trainer without register()
        DiLoCoCallback(sync_every=4).on_step_begin(None, None, None)


OTHER_OPTIONS = [("outer_lr", "-1"), ("outer_lr", "0.5"), ("outer_momentum", "0.5"), ("nesterov", "False"),
                 ("fragments", "2"), ("overlap", "True"), ("mixing", "0.3"), ("compressor", "int8"),
                 ("density", "0.1"), ("bits", "2"),
                 ("final_sync", "False"), ("replica_id", "a"), ("lighthouse", "h:1"), ("min_replica_size", "2")]


def test_the_sweep_covers_every_diloco_option():
    from dataclasses import fields

    from accel_plugins.hf import DiLoCoArguments

    assert {f"diloco_{name}" for name, _ in OTHER_OPTIONS} == {f.name for f in fields(DiLoCoArguments)} - {
        "diloco_sync_every"}


@pytest.mark.parametrize("name, value", OTHER_OPTIONS, ids=[f"{n}={v}" for n, v in OTHER_OPTIONS])
def test_a_diloco_option_without_sync_every_is_refused_not_ignored(name, value):
    from transformers import HfArgumentParser

    from accel_plugins.hf import DiLoCoArguments

    with pytest.raises(ValueError, match=rf"^diloco_sync_every: unset \(no DiLoCo\), but --diloco_{name} "):
        HfArgumentParser(DiLoCoArguments).parse_args_into_dataclasses([f"--diloco_{name}", value])
