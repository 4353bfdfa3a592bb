"""The DDP comm hooks of ``lightning_optim.comm.ddp_hooks`` on 3 real gloo ranks (one spawn): each against
an independent computation.

* top-k / random-k / sign: the gradients DDP hands back equal the compressors' W-worker simulation
  (``tests/reference/compressors.py``) fed with every rank's own gradient (computed without DDP);
  the error-feedback identity; the bytes; a fresh DDP (DDP's initial bucket layout) with the saved
  state continues exactly like the uninterrupted run.
* PowerSGD: equals torch's ``powerSGD_hook`` applied by hand to a twin DDP model, bitwise; its bytes are
  what the all-reduces it issued carry; resumed into a fresh DDP it is realigned to the new layout. With
  two buckets (where torch's hook alone aborts on gloo), 6 compressed steps: equal to torch's hook
  waited for bucket by bucket (bitwise) and to the W-worker reference ``tests/reference/powersgd_hook.py``.
* decentralized: DDP leaves the gradients local, the params after each step are the W-worker gossip
  simulation (``tests/reference/decentralized.py``), the consensus distance shrinks at the graph's rate.

Exactness: the all-gather compressors add every rank's message in rank order as the reference does
(bitwise); gloo's 3-rank all-reduce sums in an order of its own (shared random-k, PowerSGD after a
change of bucket layout): 1e-12.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import run_workers  # processes: PowerSGD's futures complete on gloo's threads
from tests.distributed_optim.ddp_hook_workers import (BUCKET_STEPS, CASES, LR, PATH, POWERSGD_BUCKETS, RESUMED, STEPS,
                                                      make_model, suite)
from tests.reference.compressors import RefCompressedWorkers
from tests.reference.powersgd_hook import RefPowerSGDHook
from tests.reference.decentralized import consensus_distance, mixing_matrix, second_eigenvalue_modulus

WORLD = 3
NAMES = [name for name, _ in make_model().named_parameters()]
NUMELS = [p.numel() for p in make_model().parameters()]
SUMMED_BY_GLOO = {"randomk_shared"}
FEEDBACK = [name for name in CASES if CASES[name][1].get("error_feedback", True)]


@pytest.fixture(scope="module")
def ranks():
    return run_workers(WORLD, suite, timeout=240)


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool = True) -> None:
    if exact:
        assert torch.equal(a, b), (a - b).abs().max()
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _reference(name: str, ranks) -> RefCompressedWorkers:
    hook, kwargs, _ = CASES[name]
    kind = {"topk": "topk", "randomk": "randomk"}.get(hook, "majority" if kwargs.get("majority_vote") else "sign")
    return RefCompressedWorkers(kind, WORLD, [p.shape for p in make_model().parameters()], ratio=kwargs.get("ratio"),
                                seed=kwargs.get("seed", 0), shared_indices=kwargs.get("shared_indices", True),
                                feedback=kwargs.get("error_feedback", True))


@pytest.mark.parametrize("name", list(CASES))
def test_the_hook_equals_the_w_worker_simulation(ranks, name):
    ref = _reference(name, ranks)
    for t in range(STEPS):
        expected = ref.step([ranks[r][name]["local"][t] for r in range(WORLD)])
        for r in range(WORLD):
            for got, want in zip(ranks[r][name]["hooked"][t], expected):
                _same(got, want, exact=name not in SUMMED_BY_GLOO)
    if CASES[name][1].get("error_feedback", True):  # each rank keeps its own residual of every param
        for r in range(WORLD):
            saved = ranks[r][name]["state"]["residuals"]
            for i, key in enumerate(NAMES):
                _same(saved[key], ref.residuals[r][i], exact=name not in SUMMED_BY_GLOO)
        assert not torch.equal(ranks[0][name]["state"]["residuals"]["0.weight"],
                               ranks[1][name]["state"]["residuals"]["0.weight"])


@pytest.mark.parametrize("name", FEEDBACK)
def test_error_feedback_identity(ranks, name):
    """sum_t aggregate_t + mean_r e_r = mean_r sum_t g_r: nothing dropped is lost, only delayed."""
    for i, key in enumerate(NAMES):
        sent = sum(ranks[0][name]["hooked"][t][i] for t in range(STEPS))
        residual = sum(ranks[r][name]["state"]["residuals"][key] for r in range(WORLD)) / WORLD
        inputs = sum(ranks[r][name]["local"][t][i] for r in range(WORLD) for t in range(STEPS)) / WORLD
        torch.testing.assert_close(sent + residual, inputs, rtol=0, atol=1e-12)


def _payload_bytes(name: str) -> int:
    """What one step puts on the wire per rank (fp64 grads: 8-byte values and scales, int32 indices)."""
    hook, kwargs, _ = CASES[name]
    ks = [max(1, int(kwargs.get("ratio", 0) * d)) for d in NUMELS]
    if hook == "randomk" and kwargs.get("shared_indices", True):  # values only, one ring all-reduce
        return 2 * (WORLD - 1) * sum(ks) * 8 // WORLD
    if hook in ("topk", "randomk"):
        return (WORLD - 1) * sum(k * (8 + 4) for k in ks)
    scale = 0 if kwargs.get("majority_vote") else 8
    return (WORLD - 1) * sum(math.ceil(d / 8) + scale for d in NUMELS)


@pytest.mark.parametrize("name", list(CASES))
def test_bytes_are_the_messages(ranks, name):
    # the agreement's control bytes go to comm_stats(), not to the hook's own counter
    for r in range(WORLD):
        assert ranks[r][name]["bytes"] == [_payload_bytes(name)] * STEPS


@pytest.mark.parametrize("name", list(CASES))
def test_resume_into_a_fresh_ddp_continues_bitwise(ranks, name):
    for r in range(WORLD):
        for got, want in zip(ranks[r][name]["resumed"], ranks[r][name]["continued"]):
            for a, b in zip(got, want):
                _same(a, b)


def test_small_buckets_really_split_the_model(ranks):
    for name in ("topk_small_buckets", "signsgd_small_buckets"):
        assert ranks[0][name]["buckets"] > STEPS  # several buckets per step, same results as one bucket


def test_powersgd_equals_torchs_hook_applied_by_hand(ranks):
    for r in range(WORLD):
        p = ranks[r]["powersgd"]
        for ours, theirs in zip(p["ours"], p["theirs"]):
            for a, b in zip(ours, theirs):
                _same(a, b)


def test_powersgd_with_several_buckets_equals_torchs_hook_and_the_reference(ranks):
    runs = [ranks[r]["powersgd_buckets"] for r in range(WORLD)]
    buckets = runs[0]["buckets"]
    assert len(buckets) >= 2 and sorted(i for b in buckets for i in b) == list(range(len(NUMELS)))
    assert all(run["buckets"] == buckets for run in runs)
    assert all(run["iter"] == BUCKET_STEPS for run in runs)
    ref = RefPowerSGDHook(WORLD, [p.shape for p in make_model().parameters()], **POWERSGD_BUCKETS)
    for t in range(BUCKET_STEPS):
        expected = ref.step([run["local"][t] for run in runs], buckets)
        for run in runs:
            for ours, theirs, want in zip(run["ours"][t], run["theirs"][t], expected):
                _same(ours, theirs)  # torch's own hook, one bucket at a time
                torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-12)
        if t >= POWERSGD_BUCKETS["start_powerSGD_iter"]:  # compressed: not the plain average
            plain = sum(run["local"][t][0] for run in runs) / WORLD
            assert not torch.allclose(runs[0]["ours"][t][0], plain, atol=1e-6)
        for run in runs[1:]:  # every rank gets the same gradients
            for a, b in zip(run["ours"][t], runs[0]["ours"][t]):
                _same(a, b)


def test_powersgd_bytes_are_what_its_all_reduces_carried(ranks):
    full = 2 * (WORLD - 1) * sum(NUMELS) * 8 // WORLD
    for r in range(WORLD):
        p = ranks[r]["powersgd"]
        assert p["bytes"] == p["recorded"]
        assert p["bytes"][:2] == [full, full] and all(b < full for b in p["bytes"][2:])  # start_powerSGD_iter=2


def test_powersgd_resumed_into_another_bucket_layout(ranks):
    for r in range(WORLD):
        p = ranks[r]["powersgd"]
        assert p["realigned"] >= 1 and p["iter"][0] == p["iter"][1] == STEPS + RESUMED
        for got, want in zip(p["resumed"], p["continued"]):  # a misplaced error would differ by O(grad)
            for a, b in zip(got, want):
                _same(a, b, exact=False)


def test_decentralized_leaves_gradients_local_and_gossips_the_params(ranks):
    m = mixing_matrix(PATH, "metropolis")
    for t in range(STEPS):
        half, before = [], [ranks[r]["decentralized"]["mixed"][t - 1] if t else ranks[r]["decentralized"]["start"]
                            for r in range(WORLD)]
        for r in range(WORLD):
            d = ranks[r]["decentralized"]
            for g, local in zip(d["grads"][t], d["local"][t]):
                _same(g, local)  # DDP did not average
            half.append([x.add(g, alpha=-LR) for x, g in zip(before[r], d["local"][t])])  # SGD, torch's op
            for got, want in zip(d["half"][t], half[r]):
                _same(got, want)
        xs = [[sum(float(m[i, j]) * half[j][k] for j in range(WORLD)) for k in range(len(NAMES))]
              for i in range(WORLD)]
        for r in range(WORLD):
            for got, want in zip(ranks[r]["decentralized"]["mixed"][t], xs[r]):
                _same(got, want, exact=False)
            assert ranks[r]["decentralized"]["distance"][t] == pytest.approx(consensus_distance(xs), rel=1e-10)


def test_decentralized_consensus_shrinks_at_the_graph_rate(ranks):
    rate = second_eigenvalue_modulus(mixing_matrix(PATH, "metropolis"))
    distances = [ranks[0]["decentralized"]["distance"][-1], *ranks[0]["decentralized"]["gossip_only"]]
    assert all(ranks[r]["decentralized"]["gossip_only"] == ranks[0]["decentralized"]["gossip_only"]
               for r in range(WORLD))
    for before, after in zip(distances, distances[1:]):
        assert 0 < after <= rate * before * (1 + 1e-9)


def test_decentralized_bytes(ranks):
    numel = sum(NUMELS)
    control = 2 * (WORLD - 1) * numel * 8 // WORLD + 2 * (WORLD - 1) * 8 // WORLD  # consensus distance
    for r in range(WORLD):
        d = ranks[r]["decentralized"]
        assert d["degree"] == len(PATH[r])
        assert d["bytes"] == [len(PATH[r]) * numel * 8 + control] * STEPS


@pytest.mark.parametrize("case,words", [("missing_rank", ["rank 2", "rank 5", "0 .. 2"]),
                                        ("asymmetric", ["not symmetric", "rank 0 lists rank 2"])])
def test_a_bad_topology_raises_the_same_error_on_every_rank(ranks, case, words):
    kinds = {ranks[r][case] for r in range(WORLD)}
    assert len(kinds) == 1
    ((kind, message),) = kinds
    assert kind == "TopologyError" and all(w in message for w in words)


def test_powersgd_arguments_that_differ_across_ranks_raise_on_every_rank(ranks):
    results = {ranks[r]["powersgd_disagree"] for r in range(WORLD)}
    assert len(results) == 1
    ((kind, message),) = results
    assert kind == "ValueError" and "matrix_approximation_rank (rank 0: 1, rank 1: 1, rank 2: 2)" in message


def test_the_old_hook_name_builds_the_new_ones_state_and_its_saved_state_loads():
    """``"signsgd"`` (``lightning_optim.catalogue.STRATEGY_ALIASES``) is ``"sign_sgd"``'s: one FutureWarning; a
    state stamped with the old name loads into the hook under its new one, and into no other hook."""
    from lightning_optim.comm.ddp_hooks import HOOKS, make_state

    assert "signsgd" not in HOOKS
    with pytest.warns(FutureWarning, match="'signsgd' is a deprecated name; use 'sign_sgd'"):
        state = make_state("signsgd", majority_vote=True, error_feedback=False)
    assert type(state) is HOOKS["sign_sgd"][0] and state.hook_name == "sign_sgd" and state.majority_vote
    saved = {**state.state_dict(), "hook": "signsgd"}
    make_state("sign_sgd", majority_vote=True, error_feedback=False).load_state_dict(saved)
    with pytest.raises(ValueError, match="hook 'topk'"):
        make_state("topk", ratio=0.1).load_state_dict(saved)
