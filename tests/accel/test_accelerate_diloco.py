"""accel_plugins.enable_diloco under one real ``torchrun --nproc_per_node 2`` Accelerate run (gloo, CPU), past
three synchronisations (sync_every=4, 12 optimizer steps of 2 accumulated micro-batches): the params equal the
single-process DiLoCo reference (tests/reference/diloco.py), are equal on both ranks right after each sync and
differ between; the kernel's socket counters see nothing between syncs (DDP's gradient all-reduce is gone) and
at each sync what comm_stats counts; a save_state/load_state between two syncs resumes bitwise (also with int8
residuals and SparseLoCo's accumulators, per rank). ``compressor="sparseloco"`` also follows the reference, with
SparseLoCo's aggregate (tests/reference/sparseloco.py), and sends its wire format at each sync. A run that ends
between syncs ends with one more (``max_steps``, or ``handle.finish()`` after the loop) and one model on both ranks,
as the reference's final sync; ``final_sync=False`` and a run shorter than ``sync_every`` are named on rank 0.
Argument refusals run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from lightning_optim.comm.stats import ring_allreduce_bytes
from tests.accel.diloco_data import LR, MAX_NORM, MICRO, SAVE_AT, STEPS, SYNC_EVERY, WEIGHT_DECAY, batch, \
    build_model  # noqa: E402
from tests.distributed import torchrun_results  # noqa: E402
from tests.reference.diloco import RefDiLoCo  # noqa: E402
from tests.reference.sparseloco import RefSparseLoCoWorkers, message_bytes  # noqa: E402
from tests.wire import assert_quiet_between_syncs  # noqa: E402

SCRIPT = Path(__file__).with_name("accelerate_diloco_script.py")
REPO = Path(__file__).resolve().parents[2]
SYNCS = [s for s in range(1, STEPS + 1) if s % SYNC_EVERY == 0]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    results = torchrun_results(SCRIPT, tmp_path_factory.mktemp("diloco"), cwd=REPO)
    assert [r["world"] for r in results] == [2, 2]
    return results


SPARSELOCO = dict(density=0.05, bits=2, chunk=4096, decay=0.9, outer_lr=1.0)  # the script's sparseloco case


def _reference(rows: list[dict], initial: torch.Tensor, steps: int = STEPS, finish: bool = False,
               sparseloco: bool = False) -> list[torch.Tensor]:
    """Two simulated workers with the ranks' data, learning rates, accumulation and clipping; params per step
    (and, with ``finish``, after the final sync). ``sparseloco``: the outer step without momentum on SparseLoCo's
    aggregate."""
    module = build_model(0)
    names = [n for n, _ in module.named_parameters()]
    shapes = [p.shape for p in module.parameters()]
    init = [t.view(s) for t, s in zip(initial.split([s.numel() for s in shapes]), shapes)]
    outer = {}
    if sparseloco:
        c = SPARSELOCO
        outer = dict(outer_lr=c["outer_lr"], outer_momentum=0.0, nesterov=False, reducers=[RefSparseLoCoWorkers(
            2, shapes, density=c["density"], bits=c["bits"], chunk=c["chunk"], decay=c["decay"],
            dtype=torch.float32).step])
    ref = RefDiLoCo(init, 2, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY), sync_every=SYNC_EVERY,
                    **outer)

    def grads(w: int, t: int, params: list[torch.Tensor]) -> None:
        ref.inners[w].param_groups[0]["lr"] = rows[t - 1]["lr"]  # the scheduler's value at that step
        for micro in range(MICRO):  # accelerator.backward divides the loss by the accumulation steps
            x, y = batch(t - 1, micro, w)
            out = torch.func.functional_call(module, dict(zip(names, params)), (x,))
            (nn.functional.mse_loss(out, y) / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)

    per_step = []
    for _ in range(steps):
        ref.step(grads)
        per_step.append([torch.cat([p.detach().reshape(-1) for p in worker]) for worker in ref.workers])
    if finish:
        ref.finish()
        per_step.append([torch.cat([p.detach().reshape(-1) for p in worker]) for worker in ref.workers])
    return per_step


@pytest.mark.parametrize("case", ["plain", "sparseloco"])
def test_params_follow_the_diloco_reference_and_agree_right_after_each_sync(ranks, case):
    full = [r[case]["full"] for r in ranks]
    assert torch.equal(full[0]["initial"], full[1]["initial"])
    expected = _reference(full[0]["rows"], full[0]["initial"], sparseloco=case == "sparseloco")
    for step in range(1, STEPS + 1):
        mine = [f["rows"][step - 1]["params"] for f in full]
        for rank in range(2):
            torch.testing.assert_close(mine[rank], expected[step - 1][rank], rtol=0, atol=1e-6)
        assert torch.equal(mine[0], mine[1]) == (step in SYNCS), step
    for f in full:
        assert f["inner_steps"] == STEPS == int(f["steps_inner_optimizer"])  # one inner step per accumulation
        assert f["summary"]["buckets_local"] == STEPS  # every backward went through the "local" hook


@pytest.mark.parametrize("case", ["plain", "int8", "sparseloco"])
def test_nothing_on_the_wire_between_syncs_and_comm_stats_at_syncs(ranks, case):
    for result in ranks:
        rows = result[case]["full"]["rows"]
        if any(r["wire_bytes"] is None for r in rows):
            pytest.skip("no `ss` to read the sockets' byte counters")
        assert_quiet_between_syncs(rows, SYNCS)
        for r in rows:
            if r["step"] in SYNCS:
                assert r["stats_bytes"] > 0
                # gloo's own framing adds ~0.6 KB a sync here (seen: 576 bytes on both the fp32 and the int8 path)
                assert r["stats_bytes"] <= r["wire_bytes"] <= 1.03 * r["stats_bytes"] + 1024, r
            else:
                assert r["stats_bytes"] == 0, r


def test_sparseloco_sends_its_wire_format_at_each_sync(ranks):
    """Each sync is SparseLoCo's all-gather of the whole model (the reference's count), the first one with the
    compressor's layout agreement (8 int64s to the other rank); the summary names the settings."""
    numels = [p.numel() for p in build_model(0).parameters()]
    wire = sum(message_bytes(n, density=SPARSELOCO["density"], bits=SPARSELOCO["bits"], chunk=SPARSELOCO["chunk"])
               for n in numels)
    for result in ranks:
        rows = result["sparseloco"]["full"]["rows"]
        assert [r["stats_bytes"] for r in rows if r["step"] in SYNCS] == [wire + 8 * 8] + [wire] * (len(SYNCS) - 1)
        summary = result["sparseloco"]["full"]["summary"]
        assert (summary["compressor"], summary["density"], summary["bits"]) == ("sparseloco", 0.05, 2)


@pytest.mark.parametrize("case", ["plain", "int8", "sparseloco"])
def test_save_state_load_state_between_syncs_resumes_bitwise(ranks, case):
    for result in ranks:
        full, resumed = result[case]["full"]["rows"], result[case]["resumed"]["rows"]
        assert [r["step"] for r in resumed] == list(range(SAVE_AT + 1, STEPS + 1))
        for a, b in zip(full[SAVE_AT:], resumed):
            assert torch.equal(a["params"], b["params"]) and a["loss"] == b["loss"] and a["lr"] == b["lr"]
    # the ranks differed when saved: each resumed its own params and state
    assert not torch.equal(ranks[0][case]["full"]["rows"][SAVE_AT - 1]["params"],
                           ranks[1][case]["full"]["rows"][SAVE_AT - 1]["params"])


def test_a_run_that_ends_between_syncs_ends_with_one_more_sync(ranks):
    initial = ranks[0]["plain"]["full"]["initial"]
    for name in ("max_steps", "finish"):  # 6 steps, sync_every 4: apart after the last step
        runs = [r["short"][name] for r in ranks]
        expected = _reference(runs[0]["rows"], initial, steps=SAVE_AT, finish=True)
        assert torch.equal(runs[0]["end"], runs[1]["end"])
        for rank in range(2):
            torch.testing.assert_close(runs[rank]["end"], expected[-1][rank], rtol=0, atol=1e-6)
            assert runs[rank]["warnings"] == []
    finish = [r["short"]["finish"] for r in ranks]
    assert not torch.equal(finish[0]["rows"][-1]["params"], finish[1]["rows"][-1]["params"])
    assert finish[0]["finished"] is True  # the flag, then the ring all-reduce of the whole model
    assert finish[0]["finish_bytes"] == ring_allreduce_bytes(1, 2, 8) + ring_allreduce_bytes(initial.numel(), 2)
    # max_steps finishes inside the last step, with the same result as finish() after the loop
    assert torch.equal(ranks[0]["short"]["max_steps"]["rows"][-1]["params"], finish[0]["end"])


def test_final_sync_false_and_a_run_shorter_than_sync_every_are_named_on_rank_0(ranks):
    apart = [r["short"]["apart"] for r in ranks]
    assert not torch.equal(apart[0]["end"], apart[1]["end"]) and apart[1]["warnings"] == []
    start, end = apart[0]["warnings"]
    assert start.startswith(f"enable_diloco: sync_every={2 * SYNC_EVERY}, but this run ends at inner step 3 and the "
                            f"first synchronisation would follow step {2 * SYNC_EVERY}: the ranks never average")
    assert end.startswith(f"enable_diloco: the run ends after inner step 3, between two synchronisations (sync_every="
                          f"{2 * SYNC_EVERY}): the params differ between the ranks")


def test_a_foreign_comm_hook_is_refused_before_anything_changes(ranks):
    for result in ranks:
        refused = result["foreign_hook"]
        assert refused["message"].startswith("model: its DDP already has a comm hook"), refused["message"]
        assert refused["inner"] == "AdamW" and refused["save_hooks"] == 0


# ---------------------------------------------------------------------- refusals in this process (one rank)
BAD_ARGUMENTS = [
    ("sync_every", 0, ValueError), ("sync_every", 2.5, TypeError), ("sync_every", True, TypeError),
    ("density", 0.1, ValueError), ("bits", 2, ValueError),  # without compressor="sparseloco"
    ("outer_lr", 0.0, ValueError), ("outer_lr", -1.0, ValueError), ("outer_lr", "0.7", TypeError),
    ("outer_momentum", 1.0, ValueError), ("outer_momentum", -0.1, ValueError),
    ("nesterov", "yes", TypeError), ("fragments", 0, ValueError), ("fragments", 3, ValueError),
    ("overlap", 1, TypeError), ("mixing", 0.5, ValueError), ("compressor", "int2", ValueError),
    ("compressor", 8, TypeError), ("final_sync", 1, TypeError), ("final_sync", "yes", TypeError),
    ("max_steps", 0, ValueError), ("max_steps", 2.5, TypeError),
]


def _prepared():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    return accelerator, model, optimizer


def _unchanged(accelerator, optimizer, inner) -> bool:
    return (optimizer.optimizer is inner and "load_state_dict" not in vars(optimizer)
            and not accelerator._save_model_state_pre_hook and not accelerator._load_model_state_pre_hook)


@pytest.mark.parametrize("name, value, error", BAD_ARGUMENTS, ids=[f"{n}={v!r}" for n, v, _ in BAD_ARGUMENTS])
def test_a_bad_argument_is_refused_by_name_before_anything_changes(name, value, error):
    import accel_plugins

    accelerator, model, optimizer = _prepared()
    inner = optimizer.optimizer
    kwargs = {"sync_every": 4, name: value}
    with pytest.raises(error, match=rf"^{name}\b"):
        accel_plugins.enable_diloco(accelerator, model, optimizer, **kwargs)
    assert _unchanged(accelerator, optimizer, inner)


SPARSELOCO_BAD = [("density", dict(density=0.0), ValueError), ("density", dict(density="x"), TypeError),
                  ("bits", dict(bits=9), ValueError), ("bits", dict(bits=2.0), TypeError),
                  ("nesterov", dict(nesterov=True), ValueError),
                  ("outer_momentum", dict(outer_momentum=1.5), ValueError)]


@pytest.mark.parametrize("name, kwargs, error", SPARSELOCO_BAD, ids=[str(k) for _, k, _ in SPARSELOCO_BAD])
def test_a_bad_sparseloco_argument_is_refused_by_name_before_anything_changes(name, kwargs, error):
    import accel_plugins

    accelerator, model, optimizer = _prepared()
    inner = optimizer.optimizer
    with pytest.raises(error, match=rf"^{name}\b"):
        accel_plugins.enable_diloco(accelerator, model, optimizer, sync_every=4, compressor="sparseloco", **kwargs)
    assert _unchanged(accelerator, optimizer, inner)


def test_optimizers_that_communicate_scalers_and_unprepared_objects_are_refused():
    import accel_plugins
    from lightning_optim import OnebitAdam

    accelerator, model, optimizer = _prepared()
    inner = optimizer.optimizer
    with pytest.raises(TypeError, match="^optimizer: expected the optimizer accelerator.prepare returned"):
        accel_plugins.enable_diloco(accelerator, model, inner, sync_every=4)
    with pytest.raises(TypeError, match="^accelerator: expected an accelerate.Accelerator"):
        accel_plugins.enable_diloco(object(), model, optimizer, sync_every=4)
    with pytest.raises(TypeError, match="^model: expected the torch.nn.Module"):
        accel_plugins.enable_diloco(accelerator, "model", optimizer, sync_every=4)
    accelerator.scaler = torch.amp.GradScaler("cpu")  # what mixed_precision="fp16" sets up
    with pytest.raises(ValueError, match="GradScaler.*desynchronise"):
        accel_plugins.enable_diloco(accelerator, model, optimizer, sync_every=4)
    accelerator.scaler = None
    assert _unchanged(accelerator, optimizer, inner)
    handle = accel_plugins.enable_diloco(accelerator, model, optimizer, sync_every=4)  # one rank: no DDP, works
    with pytest.raises(ValueError, match="^optimizer: it already steps through a DiLoCo"):
        accel_plugins.enable_diloco(accelerator, model, optimizer, sync_every=4)
    handle.close()

    accelerator, model, _ = _prepared()
    onebit = accelerator.prepare(OnebitAdam(model.parameters(), freeze_step=2))
    with pytest.raises(ValueError, match="^optimizer: OnebitAdam communicates at every step"):
        accel_plugins.enable_diloco(accelerator, model, onebit, sync_every=4)


def test_one_process_trains_locally_through_diloco(tmp_path):
    """Without DDP (one process) the prepared optimizer steps DiLoCo; save_state/load_state round-trips."""
    import accel_plugins

    accelerator, model, optimizer = _prepared()
    handle = accel_plugins.enable_diloco(accelerator, model, optimizer, sync_every=2, outer_lr=1.0,
                                         outer_momentum=0.0, nesterov=False)
    for _ in range(3):
        accelerator.backward(model(torch.ones(3, 4)).square().sum())
        optimizer.step()
        optimizer.zero_grad()
    assert handle.diloco.inner_steps == 3 and handle.hook is None and handle.comm_stats().bytes_sent == 0
    accelerator.save_state(str(tmp_path))
    assert (tmp_path / "diloco_rank0.pt").exists()
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state(str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
    assert handle.diloco.inner_steps == 3
    handle.close()


RANK_FILE_CORRUPTIONS = [("world_size", v) for v in ("x", -1, float("nan"), 1.5, True, 0)] + \
    [("rank", v) for v in ("x", -1, float("nan"), True, 1)] + [("optimizer", "x"), ("model", {})]


def test_a_corrupted_rank_file_is_refused_by_key_and_changes_nothing(tmp_path):
    """Every field of ``diloco_rank<r>.pt`` (the optimizer's own fields: tests/distributed_optim/test_load_probe.py)
    mutated in turn: ``accelerator.load_state`` refuses it naming the field; DiLoCo and the params stay as they were."""
    import io

    import accel_plugins

    accelerator, model, optimizer = _prepared()
    handle = accel_plugins.enable_diloco(accelerator, model, optimizer, sync_every=2)
    for _ in range(3):
        accelerator.backward(model(torch.ones(3, 4)).square().sum())
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(str(tmp_path))
    path = tmp_path / "diloco_rank0.pt"
    good = torch.load(path, weights_only=True)

    def snapshot():
        blob = io.BytesIO()
        torch.save(handle.diloco.state_dict(), blob)
        return blob.getvalue(), [p.detach().clone() for p in model.parameters()]

    before = snapshot()
    shaped = {**good["model"], "weight": torch.zeros(3, 4)}
    for key, bad in [*RANK_FILE_CORRUPTIONS, ("model", shaped)]:
        torch.save({**good, key: bad}, path)
        with pytest.raises((TypeError, ValueError), match=key):
            accelerator.load_state(str(tmp_path))
        after = snapshot()
        assert after[0] == before[0] and all(torch.equal(a, b) for a, b in zip(after[1], before[1])), (key, bad)
    handle.close()
