"""Gossip averaging (lightning_optim.comm.gossip) on real gloo ranks, against the W-worker reference
(tests/reference/decentralized.py): topologies, mixing, consensus rate, bytes, bad input, timeouts."""
from __future__ import annotations

import pytest
import torch

from lightning_optim.comm.gossip import Topology
from lightning_optim.comm.stats import ring_allreduce_bytes
from lightning_optim.comm.topology import parse_name
from tests.distributed import run_workers
from tests.distributed_optim import gossip_workers as gw
from tests.ranks import run_ranks
from tests.reference import decentralized as ref

ROUNDS = 10  # the path's distance ratio is within 1e-7 of lambda_2 by then (the check allows 1e-4)
IRREGULAR = [[1, 2, 3], [0, 2], [0, 1], [0]]  # degrees 3, 2, 2, 1
PATH = [[1], [0, 2], [1, 3], [2]]
CASES_4 = [
    ("ring", "name", "ring", None),
    ("torus", "name", "torus:2x2", None),
    ("exponential", "name", "exponential", None),
    ("own_list", "own", IRREGULAR, None),
    ("own_list_metropolis", "own", IRREGULAR, "metropolis"),
    ("full_lists", "full", PATH, None),
    ("path_metropolis", "path_metropolis", None, None),
]
EXPECTED_4 = {
    "ring": (ref.ring_neighbors(4), "uniform"),
    "torus": (ref.torus_neighbors(2, 2), "uniform"),
    "exponential": (ref.exponential_neighbors(4), "uniform"),
    "own_list": (IRREGULAR, "uniform"),
    "own_list_metropolis": (IRREGULAR, "metropolis"),
    "full_lists": (PATH, "uniform"),
    "path_metropolis": (PATH, "metropolis"),
}
CASES_3 = [("ring", "name", "ring", None), ("exponential", "name", "exponential", None),
           ("torus", "name", "torus:1x3", None), ("own_list", "own", [[1], [0, 2], [1]], None)]
EXPECTED_3 = {"ring": (ref.ring_neighbors(3), "uniform"), "exponential": (ref.exponential_neighbors(3), "uniform"),
              "torus": (ref.torus_neighbors(1, 3), "uniform"), "own_list": ([[1], [0, 2], [1]], "uniform")}


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(4, gw.gossip_cases, CASES_4, ROUNDS, timeout=180)


@pytest.fixture(scope="module")
def three_ranks():
    return run_ranks(3, gw.gossip_cases, CASES_3, ROUNDS, timeout=120)


def _simulate(neighbors, weights, world, rounds, dtype=torch.float64):
    m = ref.mixing_matrix(neighbors, weights)
    xs = [gw.tensors(r, dtype) for r in range(world)]
    dists = [ref.consensus_distance(xs)]
    for _ in range(rounds):
        xs = ref.mix(xs, m)
        dists.append(ref.consensus_distance(xs))
    return m, xs, dists


def _check_against_reference(results, expected, world):
    for label, (neighbors, weights) in expected.items():
        m, xs, dists = _simulate(neighbors, weights, world, ROUNDS)
        for rank in range(world):
            got = results[rank][label]
            assert [list(r) for r in got["neighbors"]] == neighbors, label
            torch.testing.assert_close(got["matrix"], m, rtol=0, atol=1e-15)
            for mode in ("flat", "by_layer"):
                # float64, different summation order than the reference: a few ulps per round
                for a, b in zip(got[mode]["xs"], xs[rank]):
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{label} {mode} rank {rank}")
                assert got[mode]["dists"] == pytest.approx(dists, rel=1e-9, abs=1e-13), (label, mode)
            # the mix is element-wise: one flat buffer and one exchange per tensor agree bitwise
            for a, b in zip(got["flat"]["xs"], got["by_layer"]["xs"]):
                assert torch.equal(a, b), label


def test_topologies_match_the_reference_on_4_ranks(four_ranks):
    _check_against_reference(four_ranks, EXPECTED_4, 4)


def test_topologies_match_the_reference_on_3_ranks(three_ranks):
    _check_against_reference(three_ranks, EXPECTED_3, 3)


def test_bytes_per_round_are_degree_times_numel_times_4(four_ranks):
    numel = sum(torch.Size(s).numel() for s in gw.SHAPES)
    for label, (neighbors, _) in EXPECTED_4.items():
        for rank in range(4):
            deg = len(neighbors[rank])
            flat = four_ranks[rank][label]["fp32"]
            assert flat["sent"] == [(deg * numel * 4, ring_allreduce_bytes(numel, 4))], label
            assert flat["per_peer"] == [{j: numel * 4 for j in neighbors[rank]}], label
            layered = four_ranks[rank][label]["fp32_by_layer"]
            assert layered["sent"][0][0] == deg * numel * 4, label
            assert layered["per_peer"] == [{j: numel * 4 for j in neighbors[rank]}], label


def test_16_bit_tensors_travel_in_16_bits_and_mix_in_fp32(four_ranks):
    numel = sum(torch.Size(s).numel() for s in gw.SHAPES)
    for label, (neighbors, weights) in EXPECTED_4.items():
        start = [gw.tensors(r, torch.bfloat16) for r in range(4)]
        expected = ref.mix(start, ref.mixing_matrix(neighbors, weights))  # float64 from the bf16 values
        for rank in range(4):
            got = four_ranks[rank][label]["bf16"]
            assert got["sent"][0][0] == len(neighbors[rank]) * numel * 2, label
            for a, b in zip(got["xs"], expected[rank]):
                assert a.dtype == torch.bfloat16
                # one rounding to bf16 at the end (fp32 accumulation differs from float64 far below that)
                torch.testing.assert_close(a.double(), b, rtol=2 ** -8, atol=1e-6, msg=label)


def test_consensus_shrinks_by_the_second_eigenvalue(four_ranks):
    # ring of 4, uniform weights: eigenvalues 1, 1/3, 1/3, -1/3 -> every round exactly lambda_2
    lam = ref.second_eigenvalue_modulus(ref.mixing_matrix(ref.ring_neighbors(4)))
    dists = four_ranks[0]["ring"]["flat"]["dists"]
    ratios = [b / a for a, b in zip(dists, dists[1:])]
    assert ratios == pytest.approx([lam] * ROUNDS, rel=1e-6)
    # path with Metropolis weights (irregular): the ratio tends to lambda_2 (the next eigenvalue dies out)
    m = ref.mixing_matrix(PATH, "metropolis")
    lam = ref.second_eigenvalue_modulus(m)
    dists = four_ranks[0]["path_metropolis"]["flat"]["dists"]
    assert dists[-1] / dists[-2] == pytest.approx(lam, rel=1e-4)
    assert all(b < a for a, b in zip(dists, dists[1:]))
    # every rank reports the same distance
    for rank in range(4):
        assert four_ranks[rank]["path_metropolis"]["flat"]["dists"] == dists


def test_weights_decide_what_the_ranks_agree_on(four_ranks):
    start = torch.stack([torch.cat([t.reshape(-1) for t in gw.tensors(r)]) for r in range(4)])
    degrees = torch.tensor([len(n) + 1 for n in IRREGULAR], dtype=torch.float64)
    # Metropolis is doubly stochastic: the plain mean is invariant. mlbench's uniform rows on an irregular
    # graph keep pi X invariant instead, pi ~ deg + 1 (the left eigenvector): a degree-weighted consensus.
    for label, pi in (("own_list_metropolis", torch.full((4,), 0.25, dtype=torch.float64)),
                      ("own_list", degrees / degrees.sum())):
        target = pi @ start
        final = torch.stack([torch.cat([t.reshape(-1) for t in four_ranks[r][label]["flat"]["xs"]]) for r in range(4)])
        torch.testing.assert_close(pi @ final, target, rtol=0, atol=1e-13)  # invariant, every round
        weights = "metropolis" if label.endswith("metropolis") else "uniform"
        lam = ref.second_eigenvalue_modulus(ref.mixing_matrix(IRREGULAR, weights))
        spread = float((start - target).abs().max())
        for rank in range(4):  # and every rank approaches it at the rate lambda_2
            assert float((final[rank] - target).abs().max()) < 4 * lam ** ROUNDS * spread, label
    assert (degrees / degrees.sum() @ start - start.mean(0)).abs().max() > 0.01  # the two targets differ


def test_a_subgroup_gossips_among_its_own_ranks():
    results = run_ranks(4, gw.subgroup_ring, 5, timeout=120)
    assert results[0] is None
    _, xs, dists = _simulate(ref.ring_neighbors(3), "uniform", 3, 5)
    for rank in range(1, 4):
        for a, b in zip(results[rank]["xs"], xs[rank - 1]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert results[rank]["dists"] == pytest.approx(dists, rel=1e-9)


def test_built_in_topologies_match_the_reference_graphs():
    for world in range(1, 10):
        assert [list(r) for r in Topology.ring(world).neighbors] == ref.ring_neighbors(world)
        assert [list(r) for r in Topology.exponential(world).neighbors] == ref.exponential_neighbors(world)
        for rows in range(1, world + 1):
            if world % rows == 0:
                topo = Topology.torus(rows, world // rows)
                assert [list(r) for r in topo.neighbors] == ref.torus_neighbors(rows, world // rows)
                assert parse_name(f"torus:{rows}x{world // rows}", world) == topo
        for weights in ("uniform", "metropolis"):
            m = Topology.exponential(world, weights).mixing_matrix()
            torch.testing.assert_close(m, ref.mixing_matrix(ref.exponential_neighbors(world), weights), rtol=0,
                                       atol=1e-15)
            torch.testing.assert_close(m.sum(1), torch.ones(world, dtype=torch.float64))
    assert parse_name("torus", 6).neighbors == Topology.torus(2, 3).neighbors
    metro = Topology.from_neighbors(IRREGULAR, "metropolis").mixing_matrix()
    torch.testing.assert_close(metro, metro.T)  # symmetric: doubly stochastic
    lam = ref.second_eigenvalue_modulus(ref.mixing_matrix(ref.ring_neighbors(7)))
    assert Topology.ring(7).consensus_rate() == pytest.approx(lam, rel=1e-12)


@pytest.mark.parametrize("lists, weights, words", [
    ([[1], [2], [0]], "uniform", "not symmetric"),
    ([[1], [0, 3], [1]], "uniform", "not in the group"),
    ([[0, 1], [0]], "uniform", "itself"),
    ([[1, 1], [0]], "uniform", "twice"),
    ([[1], [0], []], "uniform", "not connected"),
    ([[1], [0]], "max", "weights must be one of"),
    ([], "uniform", "at least one rank"),
])
def test_topology_refuses_bad_graphs(lists, weights, words):
    with pytest.raises(ValueError, match=words):
        Topology.from_neighbors(lists, weights)


def test_named_constructors_refuse_bad_sizes():
    for call in (lambda: Topology.ring(0), lambda: Topology.torus(2, 0), lambda: Topology.exponential(True),
                 lambda: parse_name("torus:2x2", 6), lambda: parse_name("star", 4)):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(TypeError, match="sequence"):
        Topology.from_neighbors("0,1")


BAD = [  # (label, kwargs per rank of 3, words in the message every rank raises)
    ("asymmetric", [dict(neighbors=[1]), dict(neighbors=[0, 2]), dict(neighbors=[0, 1])], "not symmetric"),
    ("missing_rank", [dict(neighbors=[1, 3]), dict(neighbors=[0, 2]), dict(neighbors=[1])], "not in the group"),
    ("self_loop", [dict(neighbors=[1]), dict(neighbors=[0, 1, 2]), dict(neighbors=[1])], "itself"),
    ("duplicate", [dict(neighbors=[1, 1]), dict(neighbors=[0, 2]), dict(neighbors=[1])], "twice"),
    ("entry_type", [dict(neighbors=[1.0]), dict(neighbors=[0, 2]), dict(neighbors=[1])], "must be ints"),
    ("lists_differ", [dict(neighbors=[[1], [0, 2], [1]]), dict(neighbors=[[1, 2], [0, 2], [0, 1]]),
                      dict(neighbors=[[1, 2], [0, 2], [0, 1]])], "different topologies"),
    ("disconnected", [dict(neighbors=[1]), dict(neighbors=[0]), dict(neighbors=[])], "not connected"),
    ("full_length", [dict(neighbors=[[1], [0]])] * 3, "one list per rank"),
    ("bad_name", [dict(neighbors="ring")] * 2 + [dict(neighbors="rnig")], "unknown topology name 'rnig'"),
    ("bad_type", [dict(neighbors=3.5)] + [dict(neighbors="ring")] * 2, "got float"),
    ("torus_shape", [dict(neighbors="torus:2x2")] * 3, "torus 2x2 has 4 ranks"),
    ("topology_size", [dict(neighbors="<topology of 2>")] * 3, "the Topology has 2 ranks"),
    ("bad_weights", [dict(weights="max")] * 3, "weights on rank 0"),
    ("weights_differ", [dict(weights="metropolis"), dict(weights="uniform"), dict(weights="uniform")],
     "weights differ"),
    ("wrong_rank", [dict(rank=0)] * 3, "rank=0"),
    ("rank_type", [dict(rank=r) for r in (0, "1", 2)], "rank='1'"),
    ("rank_bool", [dict(rank=r) for r in (False, 1, 2)], "rank=False"),
]


def test_bad_topologies_raise_the_same_error_on_every_rank():
    results = run_ranks(3, gw.bad_topologies, [(label, kwargs) for label, kwargs, _ in BAD], timeout=90)
    for label, _, words in BAD:
        raised = [results[r][label] for r in range(3)]
        assert all(raised), (label, raised)
        assert len(set(raised)) == 1, (label, raised)  # same type and message everywhere
        assert words in raised[0][1], (label, raised[0])


def test_a_silent_neighbour_is_reported_within_the_bound():
    # fresh ranks: the neighbours' exchanges time out on purpose (no later call should meet what is left)
    results = run_workers(3, gw.silent_neighbour, 2.0, timeout=60)
    assert results[2] == "silent"
    for rank in (0, 1):
        kind, elapsed, message = results[rank]
        assert kind == "CommunicationError" and 1.5 < elapsed < 10, results[rank]
        assert "gossip exchange" in message and "bound of 2s" in message
