"""SparseLoCo on real gloo ranks (2 and 3, threads; ``sparseloco_workers.py``) against a reference written from the
paper's equations and the wire format (``tests/reference/sparseloco.py``), plugged into the W-worker DiLoCo reference
(``tests/reference/diloco.py``, its outer step without momentum: the accumulator takes its place).

The compressor alone (5 calls, fp32 and fp64, 1, 2 and 8 bits, chunks shorter than the tensors, decay 0, 0.95 and 1,
mean and sum): bitwise the reference's aggregates and accumulators, and the bytes counted are ``bytes_sent()``, which
is the wire format's count. DiLoCo with ``compressor="sparseloco"`` and with SparseLoCo instances (1 to 4 bits, one
chunk per tensor and chunks shorter than a tensor, fragments, overlap, 4 to 6 synchronisations in 12 steps): the
params of every rank after every step within 1e-10 of the reference's (they differ from it only in the outer step's
rounding; a wrong selection, level or sign moves them by ~1e-2), nothing sent between synchronisations, the bytes at
each synchronisation ``bytes_sent()`` (plus the first call's layout agreement), a checkpoint mid-run (between syncs,
and with an overlapped exchange to merge) resumed bitwise in fresh objects, ``finish()`` as the reference's final
synchronisation; the construction agreement covers density and bits.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed_optim import sparseloco_workers as sw
from tests.distributed_optim.diloco_workers import DT, SHAPES, fill_grads, init_params, make_inner
from tests.ranks import run_ranks
from tests.reference.diloco import RefDiLoCo, fragments_of
from tests.reference.sparseloco import RefSparseLoCoWorkers, compress, message_bytes

AGREEMENT_ROW = 8  # int64s per rank in the compressor's first-call layout agreement: an error code + 7 fields


@pytest.fixture(scope="module")
def spawned():
    return run_ranks(3, sw.suite, timeout=150)


# ---------------------------------------------------------------- the compressor alone
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(sw.REDUCE))
def test_reduce_is_the_references_aggregate_bitwise(spawned, name, world):
    kwargs, dtype, average = sw.REDUCE[name]
    ref = RefSparseLoCoWorkers(world, sw.REDUCE_SHAPES, dtype=dtype, **kwargs)
    for call in range(1, sw.REDUCE_CALLS + 1):
        want = ref.step([sw.reduce_inputs(call, r, dtype) for r in range(world)])
        if not average:
            want = [w * world for w in want]  # the reference averages; the sum is W times its mean, exactly for W=2
        for r in range(world):
            got = spawned[r]["reduce"][world][name]["outs"][call - 1]
            for a, b in zip(got, want):
                if average or world == 2:
                    assert torch.equal(a, b), (name, world, call)
                else:
                    torch.testing.assert_close(a, b, rtol=1e-15, atol=0)
    for r in range(world):
        for a, b in zip(spawned[r]["reduce"][world][name]["residuals"], ref.accumulators[r]):
            assert torch.equal(a, b), (name, world, r)
        assert any(e.abs().sum() > 0 for e in ref.accumulators[r])  # something was held back


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(sw.REDUCE))
def test_reduce_bytes_are_the_wire_format(spawned, name, world):
    kwargs, _, _ = sw.REDUCE[name]
    wire = (world - 1) * sum(message_bytes(math.prod(s), density=kwargs["density"], bits=kwargs["bits"],
                                           chunk=kwargs["chunk"]) for s in sw.REDUCE_SHAPES)
    for r in range(world):
        run = spawned[r]["reduce"][world][name]
        assert run["predicted"] == wire
        assert [s["stats"] for s in run["sent"]] == [wire] * sw.REDUCE_CALLS
        # the first call also agrees on the layout (into comm_stats()); the later ones send nothing else
        assert [s["agreement"] for s in run["sent"]] == [(world - 1) * 8 * AGREEMENT_ROW] + [0] * (sw.REDUCE_CALLS - 1)


# ---------------------------------------------------------------- DiLoCo with SparseLoCo
def _reference(name: str, steps: int) -> tuple[RefDiLoCo, list[list[list[torch.Tensor]]]]:
    cfg, world = sw.CONFIGS[name], sw.CONFIGS[name]["world"]
    kw, ckw = cfg["kw"], sw.compressor_kwargs(name)
    groups = fragments_of([math.prod(s) for s in SHAPES], kw.get("fragments", 1))
    reducers = [RefSparseLoCoWorkers(world, [SHAPES[i] for i in g], **ckw).step for g in groups]
    ref = RefDiLoCo(init_params(), world, lambda ps: make_inner(cfg.get("inner", "sgd"), ps),
                    sync_every=kw["sync_every"], outer_lr=kw["outer_lr"], outer_momentum=0.0, nesterov=False,
                    fragments=kw.get("fragments", 1), overlap=kw.get("overlap", False), mixing=kw.get("mixing", 0.5),
                    reducers=reducers)
    history = []
    for _ in range(steps):
        ref.step(fill_grads)
        history.append([[p.detach().clone() for p in params] for params in ref.workers])
    return ref, history


@pytest.mark.parametrize("name", list(sw.CONFIGS))
def test_ranks_match_the_w_worker_reference(spawned, name):
    world = sw.CONFIGS[name]["world"]
    _, want = _reference(name, sw.STEPS)
    runs = [spawned[r]["runs"][name] for r in range(world)]
    assert sum(f is not None for f in runs[0]["syncs"]) >= 4
    for t in range(sw.STEPS):
        for r in range(world):
            for got, expected in zip(runs[r]["history"][t], want[t][r]):
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-10, msg=f"{name} step {t + 1}")
    assert (runs[0]["history"][0][0] - runs[1]["history"][0][0]).abs().max() > 1e-4  # the ranks train apart
    for r in range(world):  # no outer momentum buffer; the accumulators are the residuals
        assert runs[r]["outer_momenta"] == 0 and all(e is not None and e.abs().sum() > 0 for e in runs[r]["residuals"])


@pytest.mark.parametrize("name", list(sw.CONFIGS))
def test_bytes_are_bytes_sent_and_nothing_between_syncs(spawned, name):
    world = sw.CONFIGS[name]["world"]
    ckw = sw.compressor_kwargs(name)
    for r in range(world):
        run, seen_fragments = spawned[r]["runs"][name], set()
        for fragment, seen in zip(run["syncs"], run["per_step"]):
            if fragment is None:
                assert seen["calls"] == 0 and seen["bytes_sent"] == 0, seen
                continue
            lo, hi = run["bounds"][fragment]
            wire = (world - 1) * sum(message_bytes(math.prod(s), density=ckw["density"], bits=ckw["bits"],
                                                   chunk=ckw["chunk"]) for s in SHAPES[lo:hi])
            assert run["predicted"][fragment] == wire
            first = fragment not in seen_fragments
            seen_fragments.add(fragment)
            assert seen["bytes_sent"] == wire + (world - 1) * 8 * AGREEMENT_ROW * first, (fragment, seen)
            assert seen["fp32_equivalent_bytes"] == 2 * (world - 1) * 4 * sum(math.prod(s) for s in SHAPES[lo:hi]) \
                // world


@pytest.mark.parametrize("name", list(sw.CONFIGS))
def test_a_checkpoint_mid_run_resumes_bitwise(spawned, name):
    cfg = sw.CONFIGS[name]
    for r in range(cfg["world"]):
        run = spawned[r]["runs"][name]
        assert run["saved_pending"] == cfg["kw"].get("overlap", False)  # an overlapped exchange still to merge
        assert all(run["saved_residuals"])  # the accumulators travel in the checkpoint
        for got, want in zip(run["resumed"], run["history"][cfg["split"]:]):
            assert all(torch.equal(a, b) for a, b in zip(got, want)), name


@pytest.mark.parametrize("name", [n for n, c in sw.CONFIGS.items() if c["finish"] is not None])
def test_finish_is_the_references_final_synchronisation(spawned, name):
    cfg = sw.CONFIGS[name]
    ref, _ = _reference(name, cfg["finish"])
    synced = ref.finish()
    assert synced  # the run ended with fragments apart
    for r in range(cfg["world"]):
        got = spawned[r]["runs"][name]["finished"]
        assert got["synced"] is True
        for a, b in zip(got["params"], ref.workers[r]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)
        assert all(torch.equal(a, b) for a, b in zip(got["params"], spawned[0]["runs"][name]["finished"]["params"]))


def test_the_construction_agreement_covers_density_and_bits(spawned):
    for r in range(3):
        assert "density (rank 0: 0.25, rank 1: 0.5, rank 2: 0.25)" in spawned[r]["density_differs"]
        assert "bits (rank 0: 2, rank 1: 3, rank 2: 4)" in spawned[r]["bits_differs"]
    assert spawned[2]["refused_on_one"] == "ValueError: bits must be in [1, 8], got 9"
    for r in (0, 1):
        assert "refused on rank 2 (bits)" in spawned[r]["refused_on_one"]


# ---------------------------------------------------------------- one process
def test_error_feedback_identity_with_decay_one():
    """decay = 1: what was sent plus the accumulator is what was given, exactly (integer inputs, halves as
    levels: every float64 operation exact)."""
    from lightning_optim.comm.compressors import SparseLoCo

    compressor = SparseLoCo(density=0.25, bits=3, chunk=8, decay=1.0)
    gen = torch.Generator().manual_seed(0)
    accumulators = [torch.zeros(s, dtype=DT) for s in SHAPES]
    sent = [torch.zeros(s, dtype=DT) for s in SHAPES]
    given = [torch.zeros(s, dtype=DT) for s in SHAPES]
    for _ in range(20):
        tensors = [torch.randint(-64, 65, s, generator=gen).to(DT) / 2 for s in SHAPES]
        out = compressor.reduce(tensors, accumulators)  # one process: out = C(e)
        sent = [a + b for a, b in zip(sent, out)]
        given = [a + b for a, b in zip(given, tensors)]
    for s, e, g in zip(sent, accumulators, given):
        torch.testing.assert_close(s + e, g, rtol=0, atol=1e-9 * g.abs().max().item())
        assert e.abs().sum() > 0


@pytest.mark.parametrize("numel,chunk,density,bits", [(30, 8, 0.25, 2), (7, 4096, 1 / 64, 2), (33, 5, 0.5, 1),
                                                      (100, 7, 0.3, 3), (16, 16, 1.0, 8), (9, 2, 0.5, 4)])
def test_one_message_decodes_to_the_references_compression(numel, chunk, density, bits):
    from lightning_optim.comm.compressors import SparseLoCo

    compressor = SparseLoCo(density=density, bits=bits, chunk=chunk)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel), dtype=DT)
    payload = compressor.compress(x)
    assert torch.equal(compressor.decompress(payload), compress(x, density=density, bits=bits, chunk=chunk))
    kept = payload.positions.numel()
    assert payload.positions.dtype == torch.int16 and payload.packed.numel() == math.ceil(kept * bits / 8)
