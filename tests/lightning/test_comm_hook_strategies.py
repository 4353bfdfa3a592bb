"""The comm-hook strategies (``powersgd``, ``topk``, ``randomk``, ``sign_sgd``, ``decentralized``): real
Trainer runs on 2 gloo ranks (one spawn, ``comm_hook_workers.suite``) on the main job's tiny model, and
every constructor argument refused in one process.

Checked against independent computations: PowerSGD's gradients equal torch's ``powerSGD_hook`` applied
by hand to a plain DDP model (bitwise); bytes per step equal the message sizes worked out here from the
param shapes; the decentralized params equal the W-worker gossip of the ranks' locally stepped params;
a resumed fit equals the uninterrupted one bitwise, each rank with its own hook state. PowerSGD with
several DDP buckets (where torch's hook alone aborts on gloo) runs 14 steps past its start with the ranks'
params identical and equals torch's hook waited for bucket by bucket; by name, a fit that ends before
its start warns once.
"""

from __future__ import annotations

import csv
import math
import os
from types import SimpleNamespace

import pytest
import torch

import lightning_optim
from lightning_optim.comm.ddp_hooks import HOOKS, TopKHookState, make_state, register_comm_hook
from lightning_optim.lightning._hook_checkpoints import HOOK_CHECKPOINT_KEY
from lightning_optim.lightning._rank_checkpoints import rank_file
from tests.distributed import run_workers
from tests.lightning.comm_hook_workers import (BUCKET_STEPS, BY_NAME_STEPS, CASES, POWERSGD, POWERSGD_BUCKETS,
                                              RESUME_EPOCH, suite)
from tests.reference.decentralized import consensus_distance, mix, mixing_matrix, ring_neighbors

WORLD = 2
STEPS = 2 * RESUME_EPOCH


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_workers(WORLD, suite, str(tmp_path_factory.mktemp("comm_hooks")), timeout=400)


def _ring(numel: int, element: int = 4) -> int:
    return 2 * (WORLD - 1) * numel * element // WORLD


def _expected_bytes(case: str, shapes: list[tuple[int, ...]], step: int, powersgd: dict = POWERSGD) -> int:
    """What one optimizer step ``step`` (1-based) sends per rank, from the param shapes (fp32; on 2 ranks the
    ring cost is additive, so the bucket layout does not matter)."""
    numels = [math.prod(s) for s in shapes]
    if case == "powersgd":  # torch's rule: an n x m matrix of rank r travels as P, Q when (n + m) r 2 < n m
        if step <= powersgd["start_powerSGD_iter"]:
            return _ring(sum(numels))
        p = q = plain = 0
        for shape in shapes:
            n, m = shape[0], math.prod(shape) // shape[0]
            r = min(n, m, powersgd["matrix_approximation_rank"])
            if (n + m) * r * 2 < n * m:
                p, q = p + n * r, q + m * r
            else:
                plain += n * m
        return _ring(p) + _ring(q) + _ring(plain)
    if case == "topk":
        return (WORLD - 1) * sum(max(1, int(0.01 * d)) * (4 + 4) for d in numels)
    if case == "fp16_compress":  # every bucket in fp16 through a ring all-reduce
        return _ring(sum(numels), 2)
    if case == "randomk":  # shared positions: the values alone, in one ring all-reduce
        return _ring(sum(max(1, int(0.05 * d)) for d in numels))
    if case == "sign_sgd":
        return (WORLD - 1) * sum(math.ceil(d / 8) + 4 for d in numels)
    gossip = 1 * sum(numels) * 4  # one neighbour on a 2-rank ring
    return gossip + (_ring(sum(numels), 8) + _ring(1, 8) if step % 2 == 0 else 0)  # consensus_every=2


@pytest.mark.parametrize("case", list(CASES))
def test_loss_falls(runs, case):
    for rank in range(WORLD):
        losses = [row["loss"] for row in runs[rank][case]["rows"]]
        assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses


@pytest.mark.parametrize("case", list(CASES))
def test_bytes_per_step_are_the_messages(runs, case):
    for rank in range(WORLD):
        run = runs[rank][case]
        sent = [row["bytes_sent"] for row in run["rows"]]
        want = [_expected_bytes(case, run["shapes"], t) for t in range(1, STEPS + 1)]
        if case in ("topk", "sign_sgd"):  # + the compressors' one-off layout agreement at the first step
            assert sent[1:] == want[1:] and 0 < sent[0] - want[0] <= 200
        elif case == "randomk":  # + the shared-draw agreement every call (a small all-gather)
            control = {s - w for s, w in zip(sent, want)}
            assert len(control) == 1 and 0 < control.pop() <= 200
        else:
            assert sent == want
        assert all(row["fp32_bytes"] == _ring(sum(run["numels"])) for row in run["rows"])


@pytest.mark.parametrize("case", list(CASES))
def test_telemetry_is_logged(runs, case):
    with open(runs[0][case]["metrics_csv"]) as f:
        rows = [r for r in csv.DictReader(f) if r.get("comm/bytes_sent")]
    assert len(rows) == STEPS
    last = rows[-1]
    ratio = float(last["comm/fp32_bytes"]) / float(last["comm/bytes_sent"])
    assert float(last["comm/compression_ratio"]) == pytest.approx(ratio)
    if case in ("topk", "randomk", "sign_sgd", "powersgd"):
        assert ratio > 5  # compressed (PowerSGD after start_powerSGD_iter)
    if case == "fp16_compress":
        assert ratio == pytest.approx(2.0)
    if case == "decentralized":
        distances = [r["comm/consensus_distance"] for r in csv.DictReader(open(runs[0][case]["metrics_csv"]))
                     if r.get("comm/consensus_distance")]
        assert len(distances) == STEPS // 2


@pytest.mark.parametrize("case", ["powersgd", "fp16_compress"])
def test_the_strategy_equals_torchs_hook_applied_by_hand(runs, case):
    for rank in range(WORLD):
        run = runs[rank][case]
        assert len(run["replay"]) == STEPS
        for step, by_hand in zip(run["replay"], run["by_hand"]):
            for strategy_grad, torch_grad in zip(step["grads"], by_hand):
                assert torch.equal(strategy_grad, torch_grad)


def test_powersgd_with_several_buckets_runs_well_past_its_start_on_gloo(runs):
    """PowerSGDStrategy(start_powerSGD_iter=10) with DDP buckets of 10 kB: torch's hook alone aborts the process
    a few steps after the start (gloo::EnforceNotMet, the ranks' collectives out of order)."""
    gloo = [runs[r]["powersgd_on_gloo"] for r in range(WORLD)]
    for rank, run in enumerate(g["buckets"] for g in gloo):
        assert run["buckets"] >= 3 and run["iter"] == BUCKET_STEPS
        losses = [row["loss"] for row in run["rows"]]
        assert len(losses) == BUCKET_STEPS and all(math.isfinite(v) for v in losses)
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses
        sent = [row["bytes_sent"] for row in run["rows"]]
        assert sent == [_expected_bytes("powersgd", run["shapes"], t, POWERSGD_BUCKETS)
                        for t in range(1, BUCKET_STEPS + 1)]
        assert sent[-1] * 5 < sent[0]  # compressed after the start
        assert gloo[rank]["buckets_warnings"] == []  # the fit goes past start_powerSGD_iter
    assert torch.equal(gloo[0]["buckets"]["params"], gloo[1]["buckets"]["params"])  # the ranks agree


def test_powersgd_with_several_buckets_equals_torchs_hook_one_bucket_at_a_time(runs):
    for rank in range(WORLD):
        run = runs[rank]["powersgd_on_gloo"]["buckets"]
        assert len(run["replay"]) == len(run["by_hand"]) == BUCKET_STEPS
        for step, by_hand in zip(run["replay"], run["by_hand"]):
            for strategy_grad, torch_grad in zip(step["grads"], by_hand):
                assert torch.equal(strategy_grad, torch_grad)


def test_powersgd_by_name_warns_once_when_the_fit_ends_before_its_start(runs):
    """strategy="powersgd" has start_powerSGD_iter=1000: a shorter fit is plain DDP, said once (rank 0)."""
    first, other = (runs[r]["powersgd_on_gloo"] for r in range(WORLD))
    (message,) = first["by_name_warnings"]
    assert "start_powerSGD_iter=1000" in message and f"ends at iteration {BY_NAME_STEPS}" in message
    assert other["by_name_warnings"] == []
    for run in (first["by_name"], other["by_name"]):
        assert run["iter"] == BY_NAME_STEPS
        assert [row["bytes_sent"] for row in run["rows"]] == [_ring(sum(run["numels"]))] * BY_NAME_STEPS


def test_decentralized_params_are_the_gossip_of_the_local_steps(runs):
    m = mixing_matrix(ring_neighbors(WORLD))
    for t in range(STEPS):
        half = [[runs[r]["decentralized"]["half"][t]] for r in range(WORLD)]
        assert not torch.equal(half[0][0], half[1][0])  # each rank stepped on its own gradient
        mixed = mix(half, m)
        for r in range(WORLD):
            torch.testing.assert_close(runs[r]["decentralized"]["mixed"][t].double(), mixed[r][0], rtol=0, atol=1e-7)
        assert consensus_distance(mixed) < consensus_distance(half)


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise_on_every_rank(runs, case):
    for rank in range(WORLD):
        full, again = runs[rank][case], runs[rank][case]["resumed"]
        assert [r["loss"] for r in again["rows"]] == [r["loss"] for r in full["rows"][RESUME_EPOCH:]]
        assert torch.equal(again["params"], full["params"]), f"rank {rank} diverged after resuming"


@pytest.mark.parametrize("case", ["topk", "powersgd", "decentralized"])
def test_each_rank_keeps_its_own_hook_state(runs, case):
    ckpt = runs[0][case]["ckpt"]
    assert os.path.isfile(rank_file(ckpt, 1)) and not os.path.exists(rank_file(ckpt, 0))
    main = torch.load(ckpt, map_location="cpu", weights_only=True)
    side = torch.load(rank_file(ckpt, 1), map_location="cpu", weights_only=True)  # plain tensors and numbers
    mine, theirs = main[HOOK_CHECKPOINT_KEY]["state"], side["state"]
    assert (mine["rank"], theirs["rank"], mine["hook"]) == (0, 1, case)
    if case == "topk":
        assert not torch.equal(mine["residuals"]["net.tok_emb.weight"], theirs["residuals"]["net.tok_emb.weight"])
    if case == "powersgd":
        assert mine["torch_state"]["iter"] == RESUME_EPOCH and mine["q"]
        assert not torch.equal(mine["error"]["net.tok_emb.weight"], theirs["error"]["net.tok_emb.weight"])
    assert (side["state_dict"] is not None) is (case == "decentralized")  # its params are per rank


@pytest.mark.parametrize("case,words", [
    ("onebit_optimizer", ["TopKStrategy", "OnebitAdam communicates by itself"]),
    ("gradient_release", ["TopKStrategy", "GradientRelease", "one per model"]),
    ("missing_rank", ["TopologyError", "rank 1 name rank 2", "0 .. 1"]),
])
def test_refusals_that_need_the_world_raise_on_every_rank(runs, case, words):
    messages = {runs[rank]["refused"][case] for rank in range(WORLD)}
    assert len(messages) == 1
    (message,) = messages
    assert all(w in message for w in words), message


# ---------------------------------------------------------------- one process: every argument refused
BAD = {
    "PowerSGDStrategy": [("matrix_approximation_rank", 0), ("matrix_approximation_rank", 1.5),
                         ("start_powerSGD_iter", -1), ("start_powerSGD_iter", 1), ("start_powerSGD_iter", "2"),
                         ("min_compression_rate", -1.0), ("min_compression_rate", float("nan")),
                         ("use_error_feedback", "yes"), ("warm_start", 1), ("orthogonalization_epsilon", -1e-8),
                         ("random_seed", -1), ("random_seed", 2**32), ("batch_tensors_with_same_shape", "no")],
    "TopKStrategy": [("ratio", 0), ("ratio", 1.5), ("ratio", "0.1"), ("ratio", float("nan")), ("ratio", None),
                     ("error_feedback", "true")],
    "RandomKStrategy": [("ratio", -0.1), ("ratio", 2), ("seed", -1), ("seed", 1.0), ("shared_indices", "no"),
                        ("error_feedback", 0)],
    "SignSGDStrategy": [("majority_vote", "false"), ("error_feedback", None)],
    "FP16CompressStrategy": [],
    "DecentralizedStrategy": [("neighbors", "star"), ("neighbors", 3), ("neighbors", [[1], ["a"]]),
                              ("neighbors", [-1]), ("weights", "max"), ("consensus_every", -1),
                              ("consensus_every", 1.5), ("by_layer", "no")],
}
COMMON = [("timeout", 0), ("timeout", -5), ("timeout", "x"), ("telemetry", "yes")]
NOT_OURS = ["ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"]


@pytest.mark.parametrize("cls,arg,value", [(c, a, v) for c, cases in BAD.items() for a, v in cases + COMMON])
def test_every_argument_is_refused_with_its_name(cls, arg, value):
    with pytest.raises((TypeError, ValueError)) as info:
        getattr(lightning_optim, cls)(**{arg: value})
    assert cls in str(info.value) and arg in str(info.value)


@pytest.mark.parametrize("cls", list(BAD))
@pytest.mark.parametrize("arg", NOT_OURS)
def test_the_comm_hook_arguments_belong_to_the_strategy(cls, arg):
    with pytest.raises(TypeError, match=f"{cls}: {arg} is not supported"):
        getattr(lightning_optim, cls)(**{arg: (lambda *a: None) if arg != "model_averaging_period" else 4})


@pytest.mark.parametrize("cls", ["PowerSGDStrategy", "TopKStrategy", "RandomKStrategy", "SignSGDStrategy"])
def test_fp16_loss_scaling_is_refused_by_the_error_feedback_strategies(cls):
    strategy = getattr(lightning_optim, cls)()
    strategy._precision_plugin = SimpleNamespace(scaler=object())  # what precision="16-mixed" installs
    trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), callbacks=[])
    with pytest.raises(ValueError, match="16-mixed.*loss-scaled residuals"):
        strategy.setup(trainer)
    assert trainer.callbacks == []  # refused before anything was added


def test_defaults_build_and_the_hook_names_are_the_catalogues():
    for name, entry in lightning_optim.catalogue.STRATEGIES.items():
        if name in HOOKS:
            strategy = getattr(lightning_optim, entry.export)()
            assert strategy.hook_name == name and entry.optimizer is None
            assert isinstance(make_state(name), HOOKS[name][0])


def test_hook_state_refuses_another_hooks_or_ranks_state():
    state = TopKHookState(ratio=0.1)
    with pytest.raises(ValueError, match="hook 'topk'"):
        state.load_state_dict(make_state("sign_sgd").state_dict())
    with pytest.raises(ValueError, match="each rank loads its own state"):
        state.load_state_dict({**state.state_dict(), "rank": 1})
    with pytest.raises(ValueError, match="hook name must be one of"):
        make_state("topq")
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        register_comm_hook(torch.nn.Linear(2, 2), "topk")
