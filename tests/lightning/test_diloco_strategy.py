"""The DiLoCo strategies in a real Trainer on 2 gloo ranks (``diloco_workers.py``): the fit equals a
one-process simulation of the 2 workers written from the papers (``tests/reference/diloco.py``) fed the
batches each rank saw (with ``compressor="sparseloco"``: SparseLoCo's aggregate, ``tests/reference/sparseloco.py``,
whose wire format each exchange sends); nothing on the wire between synchronisations (the kernel's socket
counters) and at a synchronisation what the strategy counted; a checkpoint between synchronisations resumes
bitwise on every rank; a fit that ends between synchronisations takes one more (the simulation's ``finish``) and ends with one
model on every rank, or with ``final_sync=False`` warns that the ranks end apart; a fit shorter than
``sync_every`` is named at its start; the Hydra options; refusals. A dead rank: ``test_failures.py``."""

from __future__ import annotations

import math

import pytest
import torch

import lightning_optim
from lightning_optim.comm.stats import ring_allreduce_bytes
from lightning_optim.model import LanguageModel, param_groups
from tests.distributed import run_workers
from tests.lightning.comm_hook_workers import _Loss
from tests.lightning.diloco_workers import CASES, RESUME, STEPS, inner_adamw, suite
from tests.lightning.workers import MODEL, SEQ_LEN
from tests.reference.diloco import RefDiLoCo, fragments_of
from tests.reference.sparseloco import RefSparseLoCoWorkers, message_bytes

WORLD = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_workers(WORLD, suite, str(tmp_path_factory.mktemp("diloco_strategy")), timeout=400)


def _syncs(case: str) -> dict[int, int]:
    """Step -> the fragment whose exchange starts after it."""
    kw = CASES[case][1]
    h, f = kw["sync_every"], kw.get("fragments", 4 if CASES[case][0].startswith("Streaming") else 1)
    return {t: k for t in range(1, STEPS + 1) for k in range(f) if t % h == ((k + 1) * h // f) % h}


def _optimizer_order(lm: LanguageModel) -> tuple[list[dict], list[int]]:
    """The main job's param groups of ``lm`` and, per position in the inner optimizer, the model position."""
    groups = param_groups(lm.net)
    index = {id(p): i for i, p in enumerate(lm.parameters())}
    return groups, [index[id(p)] for g in groups for p in g["params"]]


def _simulate(runs, case: str) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """The reference's flat params (model order) of each worker after each step, and after its final
    synchronisation. The reference holds the params in the inner optimizer's order (the main job's decayed group,
    then the no-decay one), as DiLoCo cuts its fragments in that order."""
    kw = dict(CASES[case][1])
    streaming = CASES[case][0].startswith("Streaming")
    fragments, overlap = kw.pop("fragments", 4 if streaming else 1), streaming
    loss = _Loss(LanguageModel(MODEL, SEQ_LEN, optimizer=inner_adamw, scheduler=None))
    groups, order = _optimizer_order(loss.lm)
    sizes = [len(g["params"]) for g in groups]
    names = [f"lm.{n}" for n, _ in loss.lm.named_parameters()]

    def make_inner(params):
        it = iter(params)
        return inner_adamw([{**{k: v for k, v in g.items() if k != "params"}, "params": [next(it) for _ in range(n)]}
                            for g, n in zip(groups, sizes)])

    def model_order(params):
        by_model = [None] * len(params)
        for pos, i in enumerate(order):
            by_model[i] = params[pos]
        return by_model

    init = runs[0][case]["init"]
    outer = {}
    if kw.get("compressor") == "sparseloco":  # no outer momentum: the accumulators, decayed by outer_momentum
        shapes = [init[i].shape for i in order]
        outer = dict(outer_lr=kw["outer_lr"], outer_momentum=0.0, nesterov=False, reducers=[RefSparseLoCoWorkers(
            WORLD, shapes, density=kw["density"], bits=kw["bits"], chunk=4096, decay=kw["outer_momentum"],
            dtype=torch.float32).step])
    ref = RefDiLoCo([init[i] for i in order], WORLD, make_inner, sync_every=kw["sync_every"], fragments=fragments,
                    overlap=overlap, **outer)

    def grad_fn(w, t, params):
        batch = runs[w][case]["rows"][t - 1]["batch"]
        torch.func.functional_call(loss, dict(zip(names, model_order(params))), (batch,)).backward()

    out = []
    for _ in range(STEPS):
        ref.step(grad_fn)
        out.append([torch.cat([p.detach().reshape(-1) for p in model_order(params)]) for params in ref.workers])
    ref.finish()
    return out, [torch.cat([p.detach().reshape(-1) for p in model_order(params)]) for params in ref.workers]


@pytest.mark.parametrize("case", ["diloco", "streaming", "diloco_sparseloco"])
def test_the_fit_equals_the_two_worker_simulation(runs, case):
    simulated, _ = _simulate(runs, case)
    for rank in range(WORLD):
        for t, row in enumerate(runs[rank][case]["rows"]):
            # fp32 rounding orders differ (the outer step's formula, Adam's division): ulps, which Adam's
            # normalisation can blow up on near-zero gradients for a few steps
            torch.testing.assert_close(row["params"], simulated[t][rank], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank}, step {t + 1}: {m}")


@pytest.mark.parametrize("case", ["diloco", "streaming"])
def test_a_fit_that_ends_between_synchronisations_ends_with_the_final_one(runs, case):
    assert STEPS not in _syncs(case) or CASES[case][0].startswith("Streaming")  # apart after the last step
    _, finished = _simulate(runs, case)
    for rank in range(WORLD):
        run = runs[rank][case]
        assert not torch.equal(run["rows"][-1]["params"], runs[1 - rank][case]["rows"][-1]["params"])
        assert torch.equal(run["params"], runs[0][case]["params"])  # one model on every rank after the fit
        torch.testing.assert_close(run["params"], finished[rank], rtol=1e-5, atol=1e-5)
        assert run["summary"]["final_sync"] is True
    if case == "diloco":  # one flag, then the ring all-reduce of the whole model: counted in the fit's totals
        summary = runs[0][case]["summary"]
        assert summary["final_sync_bytes"] == ring_allreduce_bytes(1, WORLD, 8) + ring_allreduce_bytes(
            sum(runs[0][case]["numels"]), WORLD)
        steps_sent = sum(r["bytes_sent"] for r in runs[0][case]["rows"])
        assert summary["bytes_sent"] == steps_sent + summary["final_sync_bytes"]


def test_a_fit_shorter_than_sync_every_is_named_and_final_sync_decides_how_it_ends(runs):
    start = ("DiLoCoStrategy: sync_every=100, but this run ends at inner step 3 and the first synchronisation would "
             "follow step 100: ")
    synced, apart = runs[0]["short"][True], runs[0]["short"][False]
    assert synced["warnings"] == [start + "the ranks average their models only once, at its end (final_sync=True). "
                                  "Pass a sync_every the run spans several times (the DiLoCo papers use 100 to 500 "
                                  "inner steps) for DiLoCo's periodic averaging"]
    assert len(apart["warnings"]) == 2 and apart["warnings"][0].startswith(start + "the ranks never average")
    assert apart["warnings"][1].startswith("DiLoCoStrategy: the run ends after inner step 3, between two "
                                           "synchronisations (sync_every=100): the params differ between the ranks")
    assert runs[1]["short"][True]["warnings"] == runs[1]["short"][False]["warnings"] == []  # rank 0 warns
    assert torch.equal(runs[0]["short"][True]["params"], runs[1]["short"][True]["params"])
    assert not torch.equal(runs[0]["short"][False]["params"], runs[1]["short"][False]["params"])
    assert apart["summary"]["final_sync_bytes"] == 0 and synced["summary"]["final_sync_bytes"] > 0


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_agree_after_a_synchronisation_and_differ_between(runs, case):
    syncs, overlap = _syncs(case), CASES[case][0].startswith("Streaming")
    assert runs[0][case]["optimizer"] == "DiLoCo"
    for t in range(1, STEPS + 1):
        a, b = runs[0][case]["rows"][t - 1]["params"], runs[1][case]["rows"][t - 1]["params"]
        if t in syncs and not overlap and CASES[case][1].get("fragments", 1) == 1:
            assert torch.equal(a, b), f"step {t}"
        elif t not in syncs and (t - 1) not in syncs:
            assert not torch.equal(a, b), f"step {t}"


def _exchange_bytes(run, case: str, fragment: int) -> int:
    _, order = _optimizer_order(LanguageModel(MODEL, SEQ_LEN, optimizer=inner_adamw, scheduler=None))
    numels = [run["numels"][i] for i in order]  # DiLoCo cuts the fragments in the optimizer's order
    kw = CASES[case][1]
    count = kw.get("fragments", 4 if CASES[case][0].startswith("Streaming") else 1)
    elements = sum(numels[i] for i in fragments_of(numels, count)[fragment])
    return ring_allreduce_bytes(elements, WORLD)


# What else the wire carries, none of it a gradient all-reduce (71 KB here): Lightning 2.6 broadcasts a
# one-element SIGTERM flag from rank 0 before every step (104 B from rank 0, 48 from rank 1, seen with `ss`);
# DDP, once, at the second forward, broadcasts its rebuilt buckets' order.
LIGHTNING_PER_STEP = 128
DDP_BUCKET_REBUILD = (2, 512)  # (step, at most this many bytes more)
CHECKPOINTED = RESUME + 1  # the window of the step after the checkpoint holds its path's broadcast


@pytest.mark.parametrize("case", list(CASES))
def test_nothing_on_the_wire_between_synchronisations(runs, case):
    syncs, overlap = _syncs(case), CASES[case][0].startswith("Streaming")
    for rank in range(WORLD):
        run = runs[rank][case]
        rows = {t: row for t, row in enumerate(run["rows"], start=1)}
        for t, row in rows.items():
            assert row["ddp_allreduce"] is False and row["fp32_bytes"] == ring_allreduce_bytes(sum(run["numels"]), WORLD)
            in_flight = overlap and (t - 1) in syncs  # an overlapped exchange's bytes leave during the next step
            if t in syncs:
                assert row["bytes_sent"] > 0
                wire = row["wire"] + (rows[t + 1]["wire"] if overlap and t + 1 in rows else 0)
                # the kernel saw what was counted, give or take TCP framing (a few hundred bytes per message)
                # (an overlapped exchange after the last step is still in flight when the fit returns)
                if CHECKPOINTED not in (t, t + 1 if overlap else t) and not (overlap and t == STEPS):
                    assert row["bytes_sent"] <= wire <= row["bytes_sent"] + 2000 + 2 * LIGHTNING_PER_STEP, (
                        t, wire, row["bytes_sent"])
            elif t == CHECKPOINTED or in_flight:  # the checkpoint broadcasts its path; an exchange in flight
                assert row["bytes_sent"] == 0
            else:
                extra = LIGHTNING_PER_STEP + (DDP_BUCKET_REBUILD[1] if t == DDP_BUCKET_REBUILD[0] else 0)
                assert row["bytes_sent"] == 0 and row["wire"] <= extra, (t, row["wire"], row["bytes_sent"])


@pytest.mark.parametrize("case", ["diloco", "streaming"])
def test_an_exchange_is_the_ring_all_reduce_of_its_fragment(runs, case):
    syncs = _syncs(case)
    for rank in range(WORLD):
        run = runs[rank][case]
        for t, f in syncs.items():
            assert run["rows"][t - 1]["bytes_sent"] == _exchange_bytes(run, case, f), t


def test_sparseloco_exchanges_are_its_wire_format(runs):
    """Each exchange is SparseLoCo's all-gather (the reference's count of positions, codes and levels), the first
    one with the compressor's layout agreement (one row of 8 int64s to the other rank)."""
    kw = CASES["diloco_sparseloco"][1]
    for rank in range(WORLD):
        run = runs[rank]["diloco_sparseloco"]
        wire = (WORLD - 1) * sum(message_bytes(n, density=kw["density"], bits=kw["bits"], chunk=4096)
                                 for n in run["numels"])
        sent = [run["rows"][t - 1]["bytes_sent"] for t in sorted(_syncs("diloco_sparseloco"))]
        assert sent == [wire + (WORLD - 1) * 8 * 8] + [wire] * (len(sent) - 1), (sent, wire)
        plain = ring_allreduce_bytes(sum(run["numels"]), WORLD)
        assert plain / wire > 20  # 5% of each chunk at 2 bits + int16 positions, against fp32 values


def test_int8_outer_gradients_cost_about_a_quarter(runs):
    plain, int8 = runs[0]["diloco"]["rows"], runs[0]["diloco_int8"]["rows"]
    sync = min(_syncs("diloco_int8"))
    ratio = plain[sync - 1]["bytes_sent"] / int8[sync - 1]["bytes_sent"]
    assert 3.5 < ratio <= 4.0, ratio


@pytest.mark.parametrize("case", list(CASES))
def test_the_loss_falls(runs, case):
    for rank in range(WORLD):
        losses = [row["loss"] for row in runs[rank][case]["rows"]]
        assert all(math.isfinite(v) for v in losses)
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_between_synchronisations_resumes_bitwise_on_every_rank(runs, case):
    assert RESUME not in _syncs(case) or CASES[case][0].startswith("Streaming")
    for rank in range(WORLD):
        full, again = runs[rank][case], runs[rank][case]["resumed"]
        assert [r["loss"] for r in again["rows"]] == [r["loss"] for r in full["rows"][RESUME:]]
        for a, b in zip(again["rows"], full["rows"][RESUME:]):
            assert torch.equal(a["params"], b["params"]), f"rank {rank}, step {a['step']}"
        assert torch.equal(again["params"], full["params"])


def test_a_communicating_optimizer_is_refused_on_every_rank(runs):
    messages = {runs[r]["refused"]["onebit_optimizer"] for r in range(WORLD)}
    assert len(messages) == 1
    (message,) = messages
    assert "DiLoCoStrategy" in message and "OnebitAdam communicates by itself" in message, message


# ---------------------------------------------------------------- one process
@pytest.mark.parametrize("cls", ["DiLoCoStrategy", "StreamingDiLoCoStrategy"])
@pytest.mark.parametrize("arg,value", [
    ("sync_every", 0), ("sync_every", 2.5), ("sync_every", "50"), ("outer_lr", 0), ("outer_lr", -1.0),
    ("outer_lr", float("nan")), ("outer_momentum", 1.0), ("outer_momentum", -0.1), ("nesterov", "yes"),
    ("fragments", 0), ("fragments", 3), ("overlap", 1), ("mixing", 1.5), ("compressor", "int2"), ("compressor", 8),
    ("final_sync", 1), ("final_sync", "true"), ("timeout", 0), ("telemetry", "yes"),
])
def test_every_argument_is_refused_with_its_name(cls, arg, value):
    with pytest.raises((TypeError, ValueError)) as info:
        getattr(lightning_optim, cls)(sync_every=100, **{arg: value}) if arg != "sync_every" else \
            getattr(lightning_optim, cls)(**{arg: value})
    assert cls in str(info.value) and arg in str(info.value)


def test_mixing_needs_overlap_and_streaming_defaults_to_it():
    with pytest.raises(ValueError, match="mixing=0.3 is only used with overlap=True"):
        lightning_optim.DiLoCoStrategy(mixing=0.3)
    streaming = lightning_optim.StreamingDiLoCoStrategy(sync_every=8, mixing=0.3)
    assert streaming._diloco_kwargs["fragments"] == 4 and streaming._diloco_kwargs["overlap"] is True


def test_fp16_loss_scaling_is_refused():
    from types import SimpleNamespace

    strategy = lightning_optim.DiLoCoStrategy()
    strategy._precision_plugin = SimpleNamespace(scaler=object())
    with pytest.raises(ValueError, match="16-mixed.*same number of steps"):
        strategy.setup(SimpleNamespace(state=SimpleNamespace(fn="fit"), callbacks=[]))
