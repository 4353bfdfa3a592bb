"""Fault-tolerant DiLoCo through Accelerate, ``enable_diloco(..., manager=replica_manager(...))``, each replica
group its own launch (``python accelerate_ft_diloco_script.py --replica rN --lighthouse ADDR``, one process)
around a Lighthouse in this process, past three synchronisations (sync_every=4, 12 optimizer steps of 2
accumulated micro-batches, StepLR, clipping):

* two replicas on their own data: identical params right after each sync (apart between), every step's params
  those of the reference DiLoCo on the same two data streams (``tests/reference/diloco.py``, written from the
  paper, nothing of lightning_optim), one committed quorum round per sync;
* ``accelerator.save_state`` after step 6 (between syncs), ``load_state`` by both replicas in new processes (from
  another initial model): the remaining steps bitwise those of the straight run, the manager's step restored;
* a replica SIGKILLed mid-run, after it committed syncs with its peer: the survivor goes on alone, losing at most
  the sync in progress, and finishes the run (``max_steps`` between two syncs: one final round, alone);
* an object that is not a torchft manager, refused by name before anything changes (an Accelerate run of two
  processes: ``test_ft_hf_diloco.py``, with the Trainer's).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")
pytest.importorskip("torchft")

from tests.accel.diloco_data import LR, MAX_NORM, MICRO, SYNC_EVERY, WEIGHT_DECAY, batch, build_model
from tests.accel.ft_replicas import (
    REPLICAS,
    SAVE_AT,
    STEPS,
    WAIT_S,
    check_against_reference,
    kill,
    launch,
    launch_replicas,
    lighthouse,
    run_reference,
    wait_all,
)

SCRIPT = Path(__file__).with_name("accelerate_ft_diloco_script.py")


def _run(house, out: Path, tag: str, extra) -> dict[str, dict]:
    """Both replicas of the script together; their results by replica."""
    launch_replicas(SCRIPT, out, tag, lambda index, r: ["--replica", r, "--lighthouse", house.address(),
                                                        "--out", str(out / f"{tag}_{r}"), *extra(r)])
    return {r: torch.load(out / f"{tag}_{r}.pt", weights_only=False) for r in REPLICAS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The straight run (saving after step SAVE_AT) and the run resumed from that save, two replicas each."""
    out = tmp_path_factory.mktemp("ft_accelerate")
    house = lighthouse(min_replicas=2)
    try:
        full = _run(house, out, "full", lambda r: ["--save-at", str(SAVE_AT), "--ckpt", str(out / r)])
        resumed = _run(house, out, "resumed", lambda r: ["--resume", str(out / r)])
    finally:
        house.shutdown()
    return {"full": full, "resumed": resumed, "out": out}


def _reference(rows: list[dict]) -> list[list[torch.Tensor]]:
    """The loop's two data streams (replica w: rank w's batches of diloco_data), learning rates, accumulation and
    clipping, through the reference DiLoCo."""
    module = build_model(0)
    names = [n for n, _ in module.named_parameters()]
    inners: list[torch.optim.Optimizer] = []  # worker w's inner optimizer: inners[w]

    def make_inner(params):
        inners.append(torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY))
        return inners[-1]

    def grads(w: int, t: int, params: list[torch.Tensor]) -> None:
        inners[w].param_groups[0]["lr"] = rows[t - 1]["lr"]  # the scheduler's value at that step
        for micro in range(MICRO):  # accelerator.backward divides the loss by the accumulation steps
            x, y = batch(t - 1, micro, w)
            out = torch.func.functional_call(module, dict(zip(names, params)), (x,))
            (nn.functional.mse_loss(out, y) / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)

    return run_reference(module, make_inner, grads)


def test_replicas_average_as_the_reference_does(runs):
    full = runs["full"]
    assert torch.equal(full["r0"]["initial"], full["r1"]["initial"])
    for r in REPLICAS:
        result = full[r]
        assert [row["step"] for row in result["rows"]] == list(range(1, STEPS + 1))
        assert result["inner_steps"] == STEPS
        assert result["summary"]["fault_tolerant"] and result["summary"]["rounds_discarded"] == 0
        assert result["summary"]["buckets_local"] == 0  # one process: no DDP, no hook
        # the join, then one committed round per sync
        assert [row["committed"] for row in result["rows"]] == [1 + t // SYNC_EVERY for t in range(1, STEPS + 1)]
    check_against_reference([[row["params"] for row in full[r]["rows"]] for r in REPLICAS],
                            _reference(full["r0"]["rows"]))


def test_save_state_load_state_resumes_bitwise(runs):
    full, resumed = runs["full"], runs["resumed"]
    for r in REPLICAS:
        assert (runs["out"] / r / "diloco_rank0.pt").exists()
        assert resumed[r]["start"] == SAVE_AT and not torch.equal(resumed[r]["initial"], full[r]["initial"])
        after = resumed[r]["rows"]
        assert [row["step"] for row in after] == list(range(SAVE_AT + 1, STEPS + 1))
        for a, b in zip(full[r]["rows"][SAVE_AT:], after):
            assert torch.equal(a["params"], b["params"]) and a["loss"] == b["loss"] and a["lr"] == b["lr"], a["step"]
            assert a["committed"] == b["committed"]  # the manager's committed step came back with the checkpoint
    # saved between two syncs: each replica resumed its own params
    assert not torch.equal(full["r0"]["rows"][SAVE_AT - 1]["params"], full["r1"]["rows"][SAVE_AT - 1]["params"])


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_a_replica_killed_mid_run_costs_the_survivor_at_most_one_sync(tmp_path):
    steps = 30  # ends between two syncs: max_steps runs finish(), one more round, after step 30
    house = lighthouse(min_replicas=1)  # the survivor goes on alone
    (tmp_path / "start").mkdir()
    procs = {r: (launch(SCRIPT, tmp_path / f"{r}.log", "--replica", r, "--lighthouse", house.address(),
                        "--out", str(tmp_path / r), "--steps", str(steps), "--step-sleep", "0.1", "--timeout", "5",
                        "--start-dir", str(tmp_path / "start"), "--start-with", "2"), tmp_path / f"{r}.log")
             for r in REPLICAS}
    try:
        deadline = time.monotonic() + WAIT_S
        while not any(e["participants"] == 2 and e["committed"] >= 3 for e in _events(tmp_path / "r1.jsonl")):
            assert procs["r1"][0].poll() is None, f"r1 exited before two syncs:\n{(tmp_path / 'r1.log').read_text()}"
            assert time.monotonic() < deadline, f"r1: no two syncs with r0 within {WAIT_S:.0f}s"
            time.sleep(0.05)
        kill(procs["r1"][0])
        at_kill = _events(tmp_path / "r0.jsonl")[-1]
        wait_all({"r0": procs["r0"]})
    finally:
        for proc, _ in procs.values():
            kill(proc)
        house.shutdown()
    assert at_kill["step"] < steps - 2 * SYNC_EVERY  # the survivor had several syncs ahead of it
    events = _events(tmp_path / "r0.jsonl")
    survivor = torch.load(tmp_path / "r0.pt", weights_only=False)
    # every step to the end (from the step it joined at: a replica that joins late is healed into its peer's round)
    assert [e["step"] for e in events] == list(range(survivor["start"] + 1, steps + 1))
    assert survivor["inner_steps"] == steps
    discarded = survivor["summary"]["rounds_discarded"]
    assert discarded - at_kill["discarded"] <= 1  # the kill cost at most the sync in progress
    # the join, one committed round per sync (a healed replica takes its peer's count) and the final one, but the
    # discarded ones
    assert survivor["committed"] == 1 + steps // SYNC_EVERY + 1 - discarded
    after = [e for e in events if e["step"] > at_kill["step"] + SYNC_EVERY]
    assert after and all(e["participants"] == 1 for e in after)  # alone from the next sync on
    assert all(torch.isfinite(row["params"]).all() for row in survivor["rows"])


def test_an_object_that_is_not_a_manager_is_refused_before_anything_changes():
    from accelerate import Accelerator

    import accel_plugins

    accelerator = Accelerator(cpu=True)
    model = nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    inner = optimizer.optimizer
    with pytest.raises(TypeError, match=r"^manager must be a torchft.Manager .*no start_quorum"):
        accel_plugins.enable_diloco(accelerator, model, optimizer, sync_every=4, manager=object())
    assert optimizer.optimizer is inner and "load_state_dict" not in vars(optimizer)
    assert not accelerator._save_model_state_pre_hook and not accelerator._load_model_state_pre_hook
