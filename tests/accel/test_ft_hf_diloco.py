"""Fault-tolerant DiLoCo under the HF Trainer, from the command line: ``--diloco_replica_id rN --diloco_lighthouse
ADDR`` (``DiLoCoArguments`` -> ``DiLoCoCallback(fault_tolerant=True)``, which builds the replica manager when
training starts; the second replica passes one its script built, ``DiLoCoCallback(manager=...)``), each replica
group its own launch (``python hf_ft_diloco_script.py ...``, one process) around a Lighthouse in this process,
past three synchronisations (sync_every=4, 12 optimizer steps of a tiny GPT-2 built from its config):

* two replicas on their own shards: identical params right after each sync (apart between), every step's params
  those of the reference DiLoCo on the same two data streams (``tests/reference/diloco.py``; the Trainer's step
  written out: the model's loss, clipping to norm 1, AdamW at a constant learning rate);
* ``resume_from_checkpoint`` from checkpoint-6 (between syncs) by both replicas in new processes (from another
  initial model): the remaining steps bitwise those of the straight run, the manager's step restored;
* refusals: the callback's and the command line's replica arguments, by name, before anything is built; an
  Accelerate run and a Trainer of two processes (one process per replica group), by name, before a manager is
  used or built (run_workers' gloo group).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchft")

from lightning_optim import fault_tolerance
from tests.accel.ft_replicas import (
    REPLICAS,
    SAVE_AT,
    STEPS,
    SYNC_EVERY,
    SYNCS,
    check_against_reference,
    launch_replicas,
    lighthouse,
    run_reference,
)

SCRIPT = Path(__file__).with_name("hf_ft_diloco_script.py")
BATCH, LR = 4, 3e-3
# Adam's epsilon: 1e-8 would turn the last-bit differences of two correct float orders (the outer step's fused
# multiply-add, the reference's plain one) into visible ones through the near-zero gradients of attention at init
EPS = 1e-6
COMMON = ["--diloco_sync_every", str(SYNC_EVERY), "--max_steps", str(STEPS), "--save_steps", str(SAVE_AT),
          "--use_cpu", "--report_to", "none", "--optim", "adamw_torch", "--lr_scheduler_type", "constant",
          "--learning_rate", str(LR), "--adam_epsilon", str(EPS), "--per_device_train_batch_size", str(BATCH),
          "--logging_steps", "4",
          "--disable_tqdm", "True"]


def _run(house, out: Path, tag: str, extra) -> dict[str, dict]:
    """Both replicas' Trainers together, replica N on shard N; r0's callback builds its manager
    (``--diloco_replica_id``), r1's is given the one its script built (``manager=``). Their results by replica."""
    launch_replicas(SCRIPT, out, tag, lambda index, r: [
        "--output_dir", str(out / f"{tag}_{r}"), "--data_shard", str(index), "--diloco_replica_id", r,
        "--diloco_lighthouse", house.address(), "--own_manager", str(r == "r1"), *COMMON, *extra(r)])
    return {r: torch.load(out / f"{tag}_{r}" / "result.pt", weights_only=False) for r in REPLICAS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The straight run (checkpoint-6 on the way) and the run resumed from it, two replicas each."""
    out = tmp_path_factory.mktemp("ft_hf")
    house = lighthouse(min_replicas=2)
    try:
        full = _run(house, out, "full", lambda r: [])
        resumed = _run(house, out, "resumed", lambda r: [
            "--resume_from_checkpoint", str(out / f"full_{r}" / f"checkpoint-{SAVE_AT}"), "--model_seed", "1"])
    finally:
        house.shutdown()
    return {"full": full, "resumed": resumed, "out": out}


def _reference() -> list[list[torch.Tensor]]:
    """The Trainer's run written out: replica w's shard read in order, BATCH windows a step, the model's own
    loss, gradients clipped to norm 1 (max_grad_norm's default), AdamW (no decay) at a constant learning rate."""
    from tests.accel.hf_ft_diloco_script import tiny_gpt2, window

    module = tiny_gpt2(0)
    names = [n for n, _ in module.named_parameters()]

    def grads(w: int, t: int, params: list[torch.Tensor]) -> None:
        items = [window(w, (t - 1) * BATCH + k) for k in range(BATCH)]
        inputs = {key: torch.stack([item[key] for item in items]) for key in ("input_ids", "labels")}
        torch.func.functional_call(module, dict(zip(names, params)), (), inputs).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)

    return run_reference(module, lambda ps: torch.optim.AdamW(ps, lr=LR, eps=EPS, weight_decay=0.0), grads)


def test_replicas_average_as_the_reference_does(runs):
    full = runs["full"]
    for r in REPLICAS:
        result = full[r]
        assert (result["stepping"], result["inner"], result["processes"]) == ("DiLoCo", "AdamW", 1)
        assert result["manager"] == "torchft.manager.Manager"
        assert result["built_by_callback"] == (r == "r0")  # from --diloco_replica_id; r1: DiLoCoCallback(manager=)
        assert result["inner_steps"] == STEPS and result["discarded"] == 0
        assert result["committed"] == 1 + len(SYNCS)  # the join, then one committed round per sync
        assert [row["step"] for row in result["rows"]] == list(range(1, STEPS + 1))
    check_against_reference([[row["params"] for row in full[r]["rows"]] for r in REPLICAS], _reference())


def test_resume_from_checkpoint_is_bitwise(runs):
    full, resumed = runs["full"], runs["resumed"]
    for r in REPLICAS:
        assert (runs["out"] / f"full_{r}" / f"checkpoint-{SAVE_AT}" / "diloco_rank0.pt").exists()
        after = resumed[r]["rows"]
        assert [row["step"] for row in after] == list(range(SAVE_AT + 1, STEPS + 1))
        for a, b in zip(full[r]["rows"][SAVE_AT:], after):
            assert torch.equal(a["params"], b["params"]), a["step"]
        assert torch.equal(full[r]["params"], resumed[r]["params"]) and resumed[r]["committed"] == full[r]["committed"]
    # saved between two syncs: each replica resumed its own params
    assert not torch.equal(full["r0"]["rows"][SAVE_AT - 1]["params"], full["r1"]["rows"][SAVE_AT - 1]["params"])


# ---------------------------------------------------------------------- refusals
def test_a_run_of_two_processes_is_refused_by_name_before_a_manager_is_used_or_built(tmp_path):
    from tests.accel.ft_refusal_workers import both_refused
    from tests.distributed import run_workers

    house = lighthouse(min_replicas=1)
    try:
        results = run_workers(2, both_refused, house.address(), str(tmp_path), timeout=120)
    finally:
        house.shutdown()
    for accelerate, trainer in results:
        assert accelerate["message"].startswith("manager: with a torchft manager enable_diloco runs one process per "
                                                "replica group"), accelerate["message"]
        assert "2 process(es)" in accelerate["message"] and accelerate["processes"] == 2
        assert accelerate["unchanged"] and accelerate["hooks"] == 0 and accelerate["comm_hooks"] == 0
        assert accelerate["committed"] == 0  # no quorum was asked
        assert trainer["message"].startswith("fault_tolerant: with a torchft manager DiLoCoCallback runs one process "
                                             "per replica group"), trainer["message"]
        assert trainer["processes"] == 2
        assert trainer["manager"] is None and trainer["diloco"] is None and trainer["stepping"] == "AdamW"


CALLBACK_REFUSALS = [
    ({"fault_tolerant": "yes"}, TypeError, "fault_tolerant must be True or False"),
    ({"manager": object()}, TypeError, "manager must be a torchft.Manager"),
    ({"replica_id": "a"}, ValueError, "replica_id: only used with fault_tolerant=True"),
    ({"lighthouse": "h:1"}, ValueError, "lighthouse: only used with fault_tolerant=True"),
    ({"min_replica_size": 2}, ValueError, "min_replica_size: only used with fault_tolerant=True"),
    ({"fault_tolerant": True}, ValueError, "replica_id: fault_tolerant=True needs this replica group's name"),
    ({"fault_tolerant": True, "replica_id": ""}, ValueError, "replica_id: fault_tolerant=True needs"),
    ({"fault_tolerant": True, "replica_id": "a"}, ValueError,
     "lighthouse: give the Lighthouse's address or set TORCHFT_LIGHTHOUSE"),
    ({"fault_tolerant": True, "replica_id": "a", "lighthouse": ""}, ValueError, "lighthouse: the Lighthouse's address"),
    ({"fault_tolerant": True, "replica_id": "a", "lighthouse": "h:1", "min_replica_size": 0}, ValueError,
     r"min_replica_size must be in \[1, inf\)"),
    ({"fault_tolerant": True, "replica_id": "a", "lighthouse": "h:1", "min_replica_size": 1.5}, TypeError,
     "min_replica_size must be an int"),
]


def _case_id(kwargs: dict) -> str:
    """A test id that is the same in every pytest process (no object addresses): xdist compares them."""
    return ",".join(f"{k}={v!r}" if type(v).__name__ != "object" else f"{k}=object()" for k, v in kwargs.items())


@pytest.mark.parametrize("kwargs, error, message", CALLBACK_REFUSALS,
                         ids=[_case_id(k) for k, _, _ in CALLBACK_REFUSALS])
def test_the_callback_refuses_bad_replica_arguments_by_name(monkeypatch, kwargs, error, message):
    from accel_plugins.hf import DiLoCoCallback

    monkeypatch.delenv(fault_tolerance.LIGHTHOUSE_ENV, raising=False)
    with pytest.raises(error, match=f"^{message}"):
        DiLoCoCallback(sync_every=4, **kwargs)


def test_the_callback_takes_the_lighthouse_from_the_environment_and_builds_nothing_before_training(monkeypatch):
    from accel_plugins.hf import DiLoCoCallback

    monkeypatch.setenv(fault_tolerance.LIGHTHOUSE_ENV, "localhost:1")  # never reached: nothing connects yet
    callback = DiLoCoCallback(sync_every=4, fault_tolerant=True, replica_id="a")
    assert callback.replica_options == {"replica_id": "a", "lighthouse": None, "min_replica_size": 1}
    assert callback.manager is None and callback.diloco is None


def test_the_command_line_refuses_replica_options_by_name(monkeypatch):
    from accel_plugins.hf import DiLoCoArguments

    monkeypatch.delenv(fault_tolerance.LIGHTHOUSE_ENV, raising=False)
    with pytest.raises(ValueError, match=r"^diloco_replica_id: unset .* --diloco_lighthouse h:1 given"):
        DiLoCoArguments(diloco_sync_every=4, diloco_lighthouse="h:1")
    with pytest.raises(ValueError, match=r"^diloco_sync_every: unset .*--diloco_replica_id a"):
        DiLoCoArguments(diloco_replica_id="a")
    with pytest.raises(ValueError, match=r"^diloco_min_replica_size must be in \[1, inf\)"):
        DiLoCoArguments(diloco_sync_every=4, diloco_replica_id="a", diloco_lighthouse="h:1", diloco_min_replica_size=0)
    with pytest.raises(ValueError, match=r"^diloco_lighthouse: give the Lighthouse's address"):
        DiLoCoArguments(diloco_sync_every=4, diloco_replica_id="a")
    callback = DiLoCoArguments(diloco_sync_every=4, diloco_replica_id="a", diloco_lighthouse="h:1",
                               diloco_min_replica_size=2).callback()
    assert callback.replica_options == {"replica_id": "a", "lighthouse": "h:1", "min_replica_size": 2}
    assert DiLoCoArguments(diloco_sync_every=4).callback().replica_options is None
