"""Compressors with error feedback: the error-feedback identity, exchanges on 2 and 3 real gloo ranks
against a W-worker simulation (``tests/reference``), the bytes counted, cross-rank refusals, resume and
bad arguments.

Exactness: the all-gather compressors (top-k, own random-k/blockwise, sign, majority vote) add every
rank's message in rank order with the same float64 operations as the reference, so their results are
compared bitwise. Where gloo sums (shared random-k/blockwise values, PowerSGD's P and Q) its order of
summation over 3 ranks is its own, and PowerSGD's matrix products sum in another order than the
reference's: those are compared to 1e-12 (float64 round-off is ~1e-16 per operation, a few hundred
operations deep).
"""
from __future__ import annotations

import io
import math

import pytest
import torch

from lightning_optim.comm.compressors import (
    Blockwise,
    ErrorFeedback,
    PowerSGDCompressor,
    RandomK,
    ScaledSign,
    TopK,
    gather_sparse,
    orthogonalize_,
)
from lightning_optim.comm.compressors.sparse import SparsePayload
from tests.ranks import run_ranks
from tests.distributed_optim.compressor_workers import CONFIGS, DT, SHAPES, STEPS, rank_inputs, suite
from tests.reference.compressors import RefCompressedWorkers
from tests.reference.powersgd import RefPowerSGD, gram_schmidt

KIND = {TopK: "topk", RandomK: "randomk", Blockwise: "blockwise"}
SUMMED_BY_GLOO = {"randomk_shared", "block_shared", "powersgd_r1", "powersgd_r4_reuse"}


@pytest.fixture(scope="module")
def spawned():
    return run_ranks(3, suite, timeout=180)


def _reference(name: str, world: int):
    cls, kwargs, average = CONFIGS[name]
    if cls is PowerSGDCompressor:
        ref = RefPowerSGD([torch.zeros(s, dtype=DT) for s in SHAPES], world, lr=0.0, rank=kwargs["rank"],
                          reuse_query=kwargs.get("reuse_query", False), seed=kwargs.get("seed", 0), average=average)
        outs = [ref.aggregate([rank_inputs(t, r) for r in range(world)]) for t in range(1, STEPS + 1)]
        return outs, ref.memory
    kind = "majority" if kwargs.get("majority_vote") else ("sign" if cls is ScaledSign else KIND[cls])
    ref = RefCompressedWorkers(kind, world, SHAPES, k=kwargs.get("k"), ratio=kwargs.get("ratio"),
                               seed=kwargs.get("seed", 0), shared_indices=kwargs.get("shared_indices", True))
    outs = [ref.step([rank_inputs(t, r) for r in range(world)], average=average) for t in range(1, STEPS + 1)]
    return outs, ref.residuals


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(a, b), (a - b).abs().max()
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_exchange_equals_the_w_worker_simulation(spawned, name, world):
    results = [spawned[r]["two" if world == 2 else "three"][name] for r in range(world)]
    outs, residuals = _reference(name, world)
    exact = name not in SUMMED_BY_GLOO
    for r, res in enumerate(results):
        for t in range(STEPS):
            for got, want in zip(res["outs"][t], outs[t]):
                _same(got, want, exact)
            for got, other in zip(res["outs"][t], results[0]["outs"][t]):
                assert torch.equal(got, other), "every rank must hold the same aggregate"
        for got, want in zip(res["residuals"], residuals[r]):
            _same(got, want, exact)


def _ring(n: int, world: int, size: int) -> int:
    return 2 * (world - 1) * n * size // world


def _expected_bytes(name: str, world: int) -> int:
    """Bytes per call from the wire formats in docs/guides/low_communication.md (float64 inputs)."""
    cls, kwargs, _ = CONFIGS[name]
    numels = [math.prod(s) for s in SHAPES]
    if cls is PowerSGDCompressor:
        ranks = [min(s[0], math.prod(s[1:]), kwargs["rank"]) for s in SHAPES if len(s) > 1]
        mats = [s for s in SHAPES if len(s) > 1]
        p = sum(s[0] * r for s, r in zip(mats, ranks))
        q = sum(math.prod(s[1:]) * r for s, r in zip(mats, ranks))
        vec = sum(math.prod(s) for s in SHAPES if len(s) <= 1)
        return _ring(p, world, 8) + _ring(q, world, 8) + _ring(vec, world, 8)
    if cls is ScaledSign:
        scale = 0 if kwargs.get("majority_vote") else 8
        return (world - 1) * sum((n + 7) // 8 + scale for n in numels)
    ks = [kwargs["k"] if "k" in kwargs else max(1, int(kwargs["ratio"] * n)) for n in numels]
    if kwargs.get("shared_indices", True) and cls is not TopK:
        return _ring(sum(ks), world, 8)
    where = 8 if cls is Blockwise else None
    return (world - 1) * sum(k * 8 + (where or 4 * k) for k in ks)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bytes_counted_are_the_payload_sent(spawned, name, world):
    stats = spawned[0]["two" if world == 2 else "three"][name]
    expected = STEPS * _expected_bytes(name, world)
    assert stats["stats"]["bytes_sent"] == expected == stats["predicted"]
    total = sum(math.prod(s) for s in SHAPES)
    assert stats["stats"]["fp32_equivalent_bytes"] == STEPS * _ring(total, world, 4)
    assert stats["stats"]["control_calls"] == 0  # the agreement goes to comm_stats(), not to this counter


def test_disagreement_raises_on_every_rank_without_hanging(spawned):
    for r in range(3):
        assert "k (rank 0: 2, rank 1: 3, rank 2: 4)" in spawned[r]["k_differs"]
        assert "seed (rank 0: 0, rank 1: 1, rank 2: 2)" in spawned[r]["seed_differs"]
        assert "rank (rank 0: 1, rank 1: 2, rank 2: 3)" in spawned[r]["rank_differs"]
        assert "tensors (rank 0: 2, rank 1: 1, rank 2: 1)" in spawned[r]["layout_differs"]
        assert torch.equal(spawned[r]["after"], torch.full((3,), 2.0, dtype=DT))
    assert spawned[1]["k_too_big_on_one"] == "ValueError: k=8 exceeds tensors[1]'s 7 elements: k must be in [1, numel]"
    for r in (0, 2):
        assert "refused on rank 1 (k)" in spawned[r]["k_too_big_on_one"]


# ------------------------------------------------------------------------------ one process
def _make(name):
    cls, kwargs, _ = CONFIGS[name]
    return cls(**kwargs)


def _inputs(name, step):
    gen = torch.Generator().manual_seed(step)
    if CONFIGS[name][0] in (TopK, RandomK, Blockwise):  # integers: every sum below is exact in float64
        return [torch.randint(-9, 10, s, generator=gen).to(DT) for s in SHAPES]
    return [torch.randn(s, generator=gen, dtype=DT) for s in SHAPES]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_error_feedback_identity(name):
    """sum of what was sent + the final residual == sum of the inputs: exactly for the sparsifiers (integer
    inputs, every operation exact), to float64 round-off for sign and PowerSGD (scales and products)."""
    compressor, feedback = _make(name), ErrorFeedback()
    sent = [torch.zeros(s, dtype=DT) for s in SHAPES]
    given = [torch.zeros(s, dtype=DT) for s in SHAPES]
    for step in range(30):
        tensors = _inputs(name, step)
        out = compressor.reduce(tensors, feedback.residuals(range(3), tensors))  # one process: out = C(g + e)
        sent = [a + b for a, b in zip(sent, out)]
        given = [a + b for a, b in zip(given, tensors)]
    for s, e, g in zip(sent, [feedback.residual(i, t) for i, t in enumerate(given)], given):
        if CONFIGS[name][0] in (TopK, RandomK, Blockwise):
            assert torch.equal(s + e, g)
        else:
            torch.testing.assert_close(s + e, g, rtol=0, atol=1e-11 * g.abs().max().item())
        assert e.abs().sum() > 0 or CONFIGS[name][0] is PowerSGDCompressor  # something was held back


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_is_bitwise(name):
    def run(compressor, feedback, steps):
        return [compressor.reduce(t, feedback.residuals(range(3), t)) for t in (_inputs(name, s) for s in steps)]

    whole = run(_make(name), ErrorFeedback(), range(4))
    first, fb = _make(name), ErrorFeedback()
    run(first, fb, range(2))
    buf = io.BytesIO()
    torch.save({"c": first.state_dict(), "fb": fb.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    second, fb2 = _make(name), ErrorFeedback()
    second.load_state_dict(saved["c"])
    fb2.load_state_dict(saved["fb"])
    rest = run(second, fb2, range(2, 4))
    for a, b in zip(whole[2:], rest):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_orthogonalize_is_the_references_gram_schmidt():
    m = torch.randn(9, 4, dtype=DT, generator=torch.Generator().manual_seed(0))
    got = orthogonalize_(m.clone())
    torch.testing.assert_close(got, gram_schmidt(m), rtol=0, atol=1e-14)
    torch.testing.assert_close(got.t() @ got, torch.eye(4, dtype=DT), rtol=0, atol=1e-12)
    zero = orthogonalize_(torch.zeros(5, 2))
    assert torch.equal(zero, torch.zeros(5, 2))  # eps keeps a zero column zero, not NaN


def test_gather_sparse_one_process_is_the_dense_message():
    p = SparsePayload(torch.tensor([1.0, -2.0]), torch.tensor([4, 0]), 0, 6)
    b = SparsePayload(torch.tensor([3.0, 5.0]), None, 2, 6)
    assert gather_sparse([p, b])[0].tolist() == [-2.0, 0, 0, 0, 1.0, 0]
    assert gather_sparse([p, b])[1].tolist() == [0, 0, 3.0, 5.0, 0, 0]


# name, factory, error type, words
BAD_ARGS = [
    ("no k nor ratio", lambda: TopK(), ValueError, "give exactly one of k"),
    ("both", lambda: TopK(k=2, ratio=0.5), ValueError, "give exactly one of k"),
    ("k zero", lambda: TopK(k=0), ValueError, "k must be in [1, inf)"),
    ("k float", lambda: RandomK(k=2.5), TypeError, "k must be an int"),
    ("k bool", lambda: Blockwise(k=True), TypeError, "k must be an int"),
    ("ratio zero", lambda: TopK(ratio=0.0), ValueError, "ratio must be in (0, 1]"),
    ("ratio big", lambda: RandomK(ratio=1.5), ValueError, "ratio must be in (0, 1]"),
    ("ratio nan", lambda: RandomK(ratio=float("nan")), ValueError, "ratio must be in (0, 1]"),
    ("ratio str", lambda: Blockwise(ratio="0.1"), TypeError, "ratio must be a real number"),
    ("seed negative", lambda: RandomK(k=1, seed=-1), ValueError, "seed must be in [0, inf)"),
    ("seed float", lambda: Blockwise(k=1, seed=1.5), TypeError, "seed must be an int"),
    ("shared str", lambda: RandomK(k=1, shared_indices="yes"), TypeError, "shared_indices must be True or False"),
    ("majority int", lambda: ScaledSign(majority_vote=1), TypeError, "majority_vote must be True or False"),
    ("rank zero", lambda: PowerSGDCompressor(rank=0), ValueError, "rank must be in [1, inf)"),
    ("rank float", lambda: PowerSGDCompressor(rank=1.0), TypeError, "rank must be an int"),
    ("reuse str", lambda: PowerSGDCompressor(reuse_query="no"), TypeError, "reuse_query must be True or False"),
    ("powersgd seed", lambda: PowerSGDCompressor(seed=-2), ValueError, "seed must be in [0, inf)"),
    ("feedback dtype", lambda: ErrorFeedback(dtype=torch.int32), TypeError, "dtype must be None or a floating"),
]


@pytest.mark.parametrize("factory,error,words", [b[1:] for b in BAD_ARGS], ids=[b[0] for b in BAD_ARGS])
def test_bad_constructor_arguments(factory, error, words):
    with pytest.raises(error, match=None) as info:
        factory()
    assert words in str(info.value)


ALL = [TopK(k=2), RandomK(k=2), Blockwise(k=2), ScaledSign(), ScaledSign(majority_vote=True), PowerSGDCompressor(2)]
BAD_CALLS = [
    ("tensors tensor", lambda c: c.reduce(torch.ones(3)), TypeError, "tensors must be a non-empty list"),
    ("tensors empty", lambda c: c.reduce([]), TypeError, "tensors must be a non-empty list"),
    ("tensors int", lambda c: c.reduce([torch.ones(3, dtype=torch.int64)]), TypeError, "tensors[0] must be a dense floating"),
    ("residual shape", lambda c: c.reduce([torch.ones(4)], [torch.zeros(5)]), ValueError, "residuals[0] must be contiguous, shaped"),
    ("residual count", lambda c: c.reduce([torch.ones(4)], []), TypeError, "residuals must be None or a list of 1"),
    ("residual int", lambda c: c.reduce([torch.ones(4)], [torch.zeros(4, dtype=torch.int32)]), TypeError, "residuals[0] must be a floating"),
    ("group", lambda c: c.reduce([torch.ones(4)], group="world"), TypeError, "group must be None"),
    ("average", lambda c: c.reduce([torch.ones(4)], average=1), TypeError, "average must be True or False"),
    ("load junk", lambda c: c.load_state_dict([1]), TypeError, "state must be a mapping"),
]


@pytest.mark.parametrize("compressor", ALL, ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("call,error,words", [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS])
def test_bad_calls_change_nothing(compressor, call, error, words):
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in compressor.state_dict().items()}
    with pytest.raises(error) as info:
        call(compressor)
    assert words in str(info.value)
    after = compressor.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k]


def test_k_beyond_a_tensor_is_refused_before_any_residual_moves():
    e = [torch.ones(9), torch.ones(3)]
    with pytest.raises(ValueError, match=r"k=4 exceeds tensors\[1\]'s 3 elements"):
        TopK(k=4).reduce([torch.ones(9), torch.ones(3)], e)
    assert all(torch.equal(x, torch.ones_like(x)) for x in e)
    with pytest.raises(ValueError, match="keys must name each"):
        PowerSGDCompressor().reduce([torch.ones(2, 2)], keys=[0, 1])
    with pytest.raises(ValueError, match="'generator'"):
        RandomK(k=1).load_state_dict({"generator": "x"})
    with pytest.raises(ValueError, match="'queries'"):
        PowerSGDCompressor().load_state_dict({"generator": torch.Generator().get_state(), "queries": {0: torch.ones(3)}})
    with pytest.raises(ValueError, match="residuals"):
        ErrorFeedback().load_state_dict({"residuals": {0: "x"}})
