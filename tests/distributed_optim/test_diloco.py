"""DiLoCo on real gloo ranks against the single-process W-worker reference (``tests/reference/diloco.py``):
DiLoCo, Streaming DiLoCo's fragments and overlap, Nesterov or not, every compressor (each against a reference
of the same compressor math); bytes on the wire; nothing sent between syncs (every torch.distributed call
counted); a mid-round checkpoint resumed bitwise in fresh objects; refusals on every rank; a dead rank named.

One 3-rank run serves most tests (``spawned``); all tensors are float64. Ranks and reference differ only in
the summation order of gloo's all-reduce (and, for 1-bit, of its fp32 server average), so the params agree to
1e-10 (1e-4 for the fp32 1-bit path) after 10 inner steps and 3+ synchronisations; a wrong sign, schedule or
mixing moves them by ~1e-2.
"""
from __future__ import annotations

import math

import pytest
import torch

import lightning_optim as lo
from lightning_optim.comm.stats import ring_allreduce_bytes
from lightning_optim.distributed import DiLoCo
from lightning_optim.distributed.diloco_schedule import fragment_bounds, syncing_fragment
from tests.distributed import run_workers
from tests.distributed_optim import diloco_workers as dw
from tests.distributed_optim.diloco_workers import (
    CONFIGS,
    DT,
    SHAPES,
    STEPS,
    fill_grads,
    init_params,
    make_inner,
    twin_run,
)
from tests.ranks import run_ranks
from tests.reference.compressors import RefCompressedWorkers
from tests.reference.diloco import RefDiLoCo, fragments_of
from tests.reference.onebit_allreduce import RefOnebitAllreduce
from tests.reference.powersgd import RefPowerSGD
from tests.reference.quantize import RefQuantizedWorkers

RUNS = sorted(CONFIGS)
TOL = {"onebit": 1e-4}  # fp32 inside; the others 1e-10
QUANTIZER_ROW = 8  # int64s per rank in a quantizer's first-call agreement: an error code + 7 fields


@pytest.fixture(scope="module")
def spawned():
    return run_ranks(3, dw.suite, timeout=150)


def _world(name: str) -> int:
    return CONFIGS[name].get("world", 3)


def _onebit_reducer(world: int, shapes):
    ref = RefOnebitAllreduce(sum(math.prod(s) for s in shapes), world, segments=[math.prod(s) for s in shapes])

    def reduce(per_worker):
        out = ref.step([torch.cat([d.reshape(-1).float() for d in deltas]) for deltas in per_worker])
        return [piece.view(s).to(DT) for piece, s in zip(out.split([math.prod(s) for s in shapes]), shapes)]
    return reduce


def _reducers(name: str, world: int):
    kind = CONFIGS[name].get("compressor")
    if kind is None:
        return None
    groups = fragments_of([math.prod(s) for s in SHAPES], CONFIGS[name]["kw"].get("fragments", 1))
    out = []
    for indices in groups:
        shapes = [SHAPES[i] for i in indices]
        out.append({
            "int8": lambda: RefQuantizedWorkers(8, world, shapes, chunk=4).step,
            "int4": lambda: RefQuantizedWorkers(4, world, shapes, chunk=5, rounding="stochastic", seed=3).step,
            "onebit": lambda: _onebit_reducer(world, shapes),
            "topk": lambda: RefCompressedWorkers("topk", world, shapes, k=3).step,
            "sign": lambda: RefCompressedWorkers("sign", world, shapes).step,
            "powersgd": lambda: RefPowerSGD([torch.zeros(s, dtype=DT) for s in shapes], world, lr=0.0,
                                            rank=1).aggregate,
        }[kind]())
    return out


def _reference(name: str) -> list[list[list[torch.Tensor]]]:
    """history[step][worker] = that worker's params after the step."""
    cfg, world = CONFIGS[name], _world(name)
    kw = dict(cfg["kw"])
    mixing = kw.pop("mixing", 0.5)
    ref = RefDiLoCo(init_params(), world, lambda ps: make_inner(cfg["inner"], ps), **kw, mixing=mixing,
                    reducers=_reducers(name, world))
    history = []
    for _ in range(STEPS):
        ref.step(fill_grads)
        history.append([[p.detach().clone() for p in params] for params in ref.workers])
    return history


@pytest.mark.parametrize("name", RUNS)
def test_ranks_match_the_w_worker_reference(spawned, name):
    world = _world(name)
    want = _reference(name)
    runs = [spawned[r]["runs"][name] for r in range(world)]
    for t in range(STEPS):
        for r in range(world):
            for got, expected in zip(runs[r]["history"][t], want[t][r]):
                torch.testing.assert_close(got, expected, rtol=0, atol=TOL.get(name, 1e-10),
                                           msg=f"{name} step {t + 1}")
        if runs[0]["syncs"][t] is not None and not CONFIGS[name]["kw"].get("overlap"):
            lo_, hi = runs[0]["bounds"][runs[0]["syncs"][t]]  # every rank took the same global params
            for r in range(1, world):
                same = zip(runs[r]["history"][t][lo_:hi], runs[0]["history"][t][lo_:hi])
                assert all(torch.equal(a, b) for a, b in same)
    # the ranks trained apart between syncs (else the test could not tell averaging from nothing)
    assert (runs[0]["history"][0][0] - runs[1]["history"][0][0]).abs().max() > 1e-4


@pytest.mark.parametrize("name", RUNS)
def test_nothing_is_sent_between_syncs(spawned, name):
    for r in range(_world(name)):
        run = spawned[r]["runs"][name]
        for t, (fragment, seen) in enumerate(zip(run["syncs"], run["per_step"]), start=1):
            if fragment is None:
                assert seen["calls"] == 0 and seen["bytes_sent"] == 0, (name, t, seen)
            else:
                assert seen["calls"] >= 1 and seen["bytes_sent"] > 0, (name, t, seen)


@pytest.mark.parametrize("name", [n for n in RUNS if CONFIGS[n].get("compressor") in (None, "int8", "int4", "onebit")])
def test_bytes_counted_are_the_wire_formats(spawned, name):
    world = _world(name)
    run = spawned[0]["runs"][name]
    seen_fragments = set()
    for fragment, seen in zip(run["syncs"], run["per_step"]):
        if fragment is None:
            continue
        lo_, hi = run["bounds"][fragment]
        elements = sum(math.prod(s) for s in SHAPES[lo_:hi])
        if CONFIGS[name].get("compressor") is None:  # one fp64 all-reduce of the fragment's pseudo-gradients
            assert seen["bytes_sent"] == ring_allreduce_bytes(elements, world, 8) and seen["calls"] == 1
            continue
        expected = run["predicted"][fragment]
        if CONFIGS[name]["compressor"] in ("int8", "int4") and fragment not in seen_fragments:
            expected += (world - 1) * 8 * QUANTIZER_ROW  # the quantizer's first-call layout agreement
        seen_fragments.add(fragment)
        assert seen["bytes_sent"] == expected, (name, fragment, seen)
        assert seen["fp32_equivalent_bytes"] == ring_allreduce_bytes(elements, world, 4)
    if name == "int4_stochastic_overlap":  # the formula of the docs: codes (2 per byte) + an fp32 scale per chunk
        per_tensor = [math.ceil(math.prod(s) / 2) + 4 * math.ceil(math.prod(s) / 5) for s in SHAPES]
        assert run["predicted"][0] == (world - 1) * sum(per_tensor)


def test_error_feedback_is_per_rank(spawned):
    residuals = [spawned[r]["runs"]["int8"]["residuals"] for r in range(3)]
    assert all(e is not None for e in residuals[0])
    assert (residuals[0][0] - residuals[1][0]).abs().max() > 0


@pytest.mark.parametrize("name", RUNS)
def test_a_mid_round_checkpoint_resumes_bitwise(spawned, name):
    split = CONFIGS[name]["split"]
    for r in range(_world(name)):
        run = spawned[r]["runs"][name]
        assert run["pending_saved"] == bool(CONFIGS[name]["kw"].get("overlap"))  # an exchange still to merge
        for got, want in zip(run["resumed"], run["history"][split:]):
            assert all(torch.equal(a, b) for a, b in zip(got, want)), name


def test_refusals_reach_every_rank(spawned):
    assert spawned[2]["refused_on_one"] == "ValueError: sync_every must be in [1, inf), got 0"
    for r in (0, 1):
        assert "refused on rank 2 (sync_every)" in spawned[r]["refused_on_one"]
    for r in range(3):
        assert "sync_every (rank 0: 3, rank 1: 4, rank 2: 3)" in spawned[r]["differs"]
        assert "compressor (rank 0: 'none', rank 1: 'int8', rank 2: 'int8')" in spawned[r]["compressor_differs"]


def test_a_dead_rank_is_named_within_the_bound():
    bound = 3.0
    # fresh ranks: one dies on purpose; the survivors' group is unusable afterwards
    out = run_workers(3, dw.dies_before_an_exchange, bound, timeout=60, pg_timeout=bound, missing_ok=True)
    assert out[2] is None
    for rank in (0, 1):
        kind, elapsed, message, failed = out[rank]
        assert kind == "CommunicationError", out[rank]
        assert failed == [2] and "rank 2 failed" in message and "fragment 0 after inner step 3" in message, message
        # the survivors that saw the death at once wait for those that only time out: the roll call ends at the bound
        assert bound - 1 < elapsed < bound + 1.5, elapsed


# ---------------------------------------------------------------- one process
def test_one_rank_is_torch_sgd_on_the_pseudo_gradient():
    """W = 1: every H steps the global copy takes torch.optim.SGD's Nesterov step with grad theta_g - theta."""
    params = [p.requires_grad_() for p in init_params()]
    twin = [p.requires_grad_() for p in init_params()]
    opt = DiLoCo(torch.optim.SGD(params, lr=0.05, momentum=0.9), sync_every=3, outer_lr=0.6, outer_momentum=0.8)
    inner = torch.optim.SGD(twin, lr=0.05, momentum=0.9)
    global_params = [p.detach().clone() for p in twin]
    outer = torch.optim.SGD(global_params, lr=0.6, momentum=0.8, nesterov=True)
    twin_run(opt, params, inner, twin, outer, global_params)
    assert all(torch.equal(a, b) for a, b in zip(params, twin))


@pytest.mark.parametrize("numels,fragments", [([30, 6, 18, 3], 2), ([30, 6, 18, 3], 3), ([1, 1, 1, 50], 2),
                                              ([5, 5, 5, 5, 5, 5], 4), ([7], 1), ([3, 100, 3], 3)])
def test_fragments_are_contiguous_and_balanced_as_documented(numels, fragments):
    bounds = fragment_bounds(numels, fragments)
    assert [list(range(a, b)) for a, b in bounds] == fragments_of(numels, fragments)


@pytest.mark.parametrize("sync_every,fragments", [(1, 1), (3, 1), (4, 2), (6, 3), (6, 6), (8, 4)])
def test_each_fragment_syncs_every_h_steps_staggered(sync_every, fragments):
    seen = [syncing_fragment(t, sync_every, fragments) for t in range(1, 3 * sync_every + 1)]
    for f in range(fragments):
        steps = [t for t, g in enumerate(seen, start=1) if g == f]
        assert steps == [(f + 1) * sync_every // fragments + k * sync_every for k in range(3)]
    assert sum(g is not None for g in seen) == 3 * fragments  # one fragment at a time


def _model_params():
    return [torch.nn.Parameter(torch.randn(s, dtype=DT)) for s in SHAPES]


BAD = [
    ("inner None", dict(inner=None), TypeError, "inner must be a torch.optim.Optimizer"),
    ("inner module", dict(inner=torch.nn.Linear(2, 2)), TypeError, "inner must be a torch.optim.Optimizer"),
    ("inner communicates", dict(inner="powersgd"), ValueError, "inner: PowerSGD communicates at every step"),
    ("inner DiLoCo", dict(inner="diloco"), TypeError, "inner: a DiLoCo cannot wrap another DiLoCo"),
    ("sync_every 0", dict(sync_every=0), ValueError, "sync_every must be in [1, inf), got 0"),
    ("sync_every float", dict(sync_every=2.0), TypeError, "sync_every must be an int"),
    ("sync_every bool", dict(sync_every=True), TypeError, "sync_every must be an int"),
    ("fragments 0", dict(fragments=0), ValueError, "fragments must be in [1, inf)"),
    ("fragments not dividing", dict(sync_every=4, fragments=3), ValueError, "fragments must divide sync_every=4"),
    ("fragments above H", dict(sync_every=2, fragments=4), ValueError, "fragments must divide sync_every=2"),
    ("fragments above params", dict(sync_every=8, fragments=8), ValueError, "fragments must be in [1, 4]"),
    ("outer_lr 0", dict(outer_lr=0.0), ValueError, "outer_lr must be in (0, inf)"),
    ("outer_lr negative", dict(outer_lr=-0.7), ValueError, "outer_lr must be in (0, inf)"),
    ("outer_lr nan", dict(outer_lr=math.nan), ValueError, "outer_lr must be finite"),
    ("outer_lr str", dict(outer_lr="0.7"), TypeError, "outer_lr must be a real number"),
    ("outer_momentum 1", dict(outer_momentum=1.0), ValueError, "outer_momentum must be in [0, 1)"),
    ("outer_momentum negative", dict(outer_momentum=-0.1), ValueError, "outer_momentum must be in [0, 1)"),
    ("nesterov without momentum", dict(outer_momentum=0.0), ValueError, "nesterov=True needs outer_momentum in (0, 1)"),
    ("nesterov str", dict(nesterov="yes"), TypeError, "nesterov must be True or False"),
    ("overlap int", dict(overlap=1), TypeError, "overlap must be True or False"),
    ("final_sync int", dict(final_sync=1), TypeError, "final_sync must be True or False"),
    ("final_sync str", dict(final_sync="False"), TypeError, "final_sync must be True or False"),
    ("mixing without overlap", dict(mixing=0.5), ValueError, "mixing=0.5 is only used with overlap=True"),
    ("mixing above 1", dict(overlap=True, mixing=1.5), ValueError, "mixing must be in [0, 1]"),
    ("compressor unknown", dict(compressor="int3"), ValueError,
     "compressor must be None, a Compressor instance or one of"),
    ("compressor object", dict(compressor=object()), TypeError, "compressor must be None, a name"),
    ("process_group", dict(process_group=0), TypeError, "process_group must be None"),
    ("complex param", dict(inner="complex"), TypeError, "params: only real floating-point parameters"),
    ("repeated param", dict(inner="repeated"), ValueError, "appears more than once"),
]


def _inner(kind, params):
    if kind == "powersgd":
        return lo.PowerSGD(params, lr=0.1)
    if kind == "diloco":
        return DiLoCo(torch.optim.SGD(params, lr=0.1), sync_every=2)
    if kind == "complex":
        return torch.optim.SGD([*params, torch.zeros(2, dtype=torch.complex64, requires_grad=True)], lr=0.1)
    if kind == "repeated":
        return torch.optim.SGD([*params, params[0]], lr=0.1)
    return kind


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")
@pytest.mark.parametrize("kwargs,error,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments_are_refused_before_anything_changes(kwargs, error, words):
    params = _model_params()
    before = [p.detach().clone() for p in params]
    args = {"inner": torch.optim.SGD(params, lr=0.1), "sync_every": 4, **kwargs}
    if isinstance(args["inner"], str):
        args["inner"] = _inner(args["inner"], params)
    with pytest.raises(error) as info:
        DiLoCo(**args)
    assert words in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(params, before))


def test_a_refused_load_changes_nothing():
    params = _model_params()
    opt = DiLoCo(torch.optim.SGD(params, lr=0.05, momentum=0.9), sync_every=2, overlap=True)
    for t in range(1, 3):
        opt.zero_grad()
        fill_grads(0, t, params)
        opt.step()
    good = opt.state_dict()
    cases = {
        "global_params": {**good["diloco"], "global_params": [g.float() for g in good["diloco"]["global_params"]]},
        "outer_momentum": {**good["diloco"], "outer_momentum": good["diloco"]["outer_momentum"][:2]},
        "step": {**good["diloco"], "step": -1},
        "pending.merge_at": {**good["diloco"], "pending": {**good["diloco"]["pending"], "merge_at": 7}},
        "settings": {**good["diloco"], "settings": {**good["diloco"]["settings"], "sync_every": 3}},
        "rank": {**good["diloco"], "rank": 1, "residuals": [torch.zeros(s, dtype=DT) for s in SHAPES]},
    }
    for key, section in cases.items():
        with pytest.raises(ValueError, match=key.split(".")[0]):
            opt.load_state_dict({**good, "diloco": section})
        after = opt.state_dict()
        assert after["diloco"]["step"] == good["diloco"]["step"]
        assert all(torch.equal(a, b) for a, b in zip(after["diloco"]["global_params"], good["diloco"]["global_params"]))
    with pytest.raises(ValueError, match="lr"):  # the inner part is checked too (torch's own load would take it)
        opt.load_state_dict({**good, "param_groups": [{**good["param_groups"][0], "lr": "x"}]})
    assert opt.param_groups[0]["lr"] == 0.05


def test_bf16_params_keep_an_fp32_global_copy():
    params = [torch.nn.Parameter(torch.randn(4, 3).bfloat16())]
    opt = DiLoCo(torch.optim.SGD(params, lr=0.1), sync_every=1)
    assert opt.global_params[0].dtype == torch.float32 and opt.outer_momenta[0].dtype == torch.float32
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert params[0].dtype == torch.bfloat16 and torch.equal(params[0].float(), opt.global_params[0].bfloat16().float())


def test_construction_broadcasts_only_when_the_ranks_params_differ():
    world = 3
    out = run_ranks(world, dw.construction_bytes)
    reference = dw.init_params()
    for rank in range(world):
        equal, differ = out[rank]["equal"], out[rank]["differ"]
        # the checksum all-reduce only (16 bytes in a ring) besides the agreement on the arguments
        broadcast = (world - 1) * differ["numel"] * differ["global"][0].element_size() if rank == 0 else 0
        assert differ["bytes"] - equal["bytes"] == broadcast, (rank, equal["bytes"], differ["bytes"])
        for g, r in zip(differ["global"], reference):  # rank 0's params everywhere
            assert torch.equal(g, r)


# ---------------------------------------------------------------- the end of a run
@pytest.fixture(scope="module")
def finished():
    return run_ranks(3, dw.finish_suite, timeout=150)


def _reference_finish(name: str, steps: int) -> tuple[RefDiLoCo, list[int]]:
    cfg, world = CONFIGS[name], _world(name)
    kw = dict(cfg["kw"])
    mixing = kw.pop("mixing", 0.5)
    ref = RefDiLoCo(init_params(), world, lambda ps: make_inner(cfg["inner"], ps), **kw, mixing=mixing,
                    reducers=_reducers(name, world))
    for _ in range(steps):
        ref.step(fill_grads)
    return ref, ref.finish()


@pytest.mark.parametrize("name", sorted(dw.FINISH))
def test_finish_is_one_more_synchronisation_of_what_is_apart(finished, name):
    ref, synced = _reference_finish(name, dw.FINISH[name])
    assert synced == ([1] if name == "int8" else list(range(CONFIGS[name]["kw"].get("fragments", 1))))
    for r in range(3):
        got = finished[r][name]
        assert got["synced"] is True and got["again"] is False and got["unchanged"] and got["pending"] is None
        for a, b in zip(got["params"], ref.workers[r]):
            torch.testing.assert_close(a, b, rtol=0, atol=TOL.get(name, 1e-10), msg=name)
        for a, b in zip(got["params"], finished[0][name]["params"]):  # one model on every rank
            assert torch.equal(a, b), name
    if name == "plain":  # the flags (one int64 per fragment), then one fp64 all-reduce of the whole model
        elements = sum(math.prod(s) for s in SHAPES)
        assert finished[0][name]["bytes"] == ring_allreduce_bytes(1, 3, 8) + ring_allreduce_bytes(elements, 3, 8)


def test_a_run_that_ends_at_a_synchronisation_sends_nothing_more(finished):
    for r in range(3):
        assert finished[r]["at_sync"]["synced"] is False and finished[r]["at_sync"]["bytes"] == 0


def test_final_sync_false_sends_nothing_and_warns_on_rank_0(finished):
    for r in range(3):
        kept = finished[r]["kept_apart"]
        assert kept["synced"] is False and kept["bytes"] == 0
    assert not torch.equal(finished[0]["kept_apart"]["params"][0], finished[1]["kept_apart"]["params"][0])
    apart = [w for w in finished[0]["warnings"] if "between two synchronisations" in w]
    assert apart == [("DiLoCo: the run ends after inner step 5, between two synchronisations (sync_every=3): the "
                      "params differ between the ranks, every rank keeps its own (and a save from the main process "
                      "alone keeps rank 0's). Pass final_sync=True to end with one synchronisation, or end the run "
                      "right after a synchronisation")]
    assert finished[1]["warnings"] == finished[2]["warnings"] == []


def test_a_run_without_a_synchronisation_is_named_at_its_start(finished):
    for r in range(3):
        assert finished[r]["no_sync"] == [True, False, False, True]
    no_sync = [w for w in finished[0]["warnings"] if "first synchronisation" in w]
    advice = ("Pass a sync_every the run spans several times (the DiLoCo papers use 100 to 500 inner steps) for "
              "DiLoCo's periodic averaging")
    assert no_sync == [
        ("DiLoCo: sync_every=10, but this run ends at inner step 9 and the first synchronisation would follow step "
         "10: the ranks average their models only once, at its end (final_sync=True). " + advice),
        ("DiLoCo: sync_every=8, fragments=4, but this run ends at inner step 1 and the first synchronisation would "
         "follow step 2: the ranks never average: each trains its own model and ends with it (final_sync=False). "
         + advice)]


def test_a_checkpoint_before_the_end_resumes_bitwise_through_finish(finished):
    for r in range(3):
        assert all(torch.equal(a, b) for a, b in zip(finished[r]["resumed"], finished[r]["streaming"]["params"]))
