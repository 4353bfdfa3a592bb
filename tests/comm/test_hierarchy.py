"""Hierarchical averaging on 4 real gloo ranks as 2 nodes of 2, against the single-process simulation
(``tests/reference/hierarchical_allreduce.py``): every rank's result, every rank's error buffers, the bytes
inside and across nodes; other node sizes; refusals on every rank."""
from __future__ import annotations

import pytest
import torch

from lightning_optim.comm import compressed_bytes
from lightning_optim.comm.stats import ring_allreduce_bytes
from tests.comm.hierarchy_workers import CALLS, LENGTHS, SEGMENTS, compressor_suite, optimizer_suite
from tests.comm.workers import make_inputs, segment_scales
from tests.distributed import run_workers
from tests.onebit.workers import COMMON, CONFIGS, LRS, MASKS, init_params, rank_grads
from tests.reference.hierarchical_allreduce import RefHierarchicalAllreduce, cut
from tests.reference.onebit_adam import RefOnebitAdam
from tests.reference.onebit_lamb import RefOnebitLamb
from tests.reference.zero_one_adam import RefZeroOneAdam

WORLD, NODES, PER_NODE = 4, 2, 2
TOL = dict(rtol=1e-4, atol=5e-5)  # fp32 norms summed in another order, carried on by error feedback


@pytest.fixture(scope="module")
def ranks():
    return run_workers(WORLD, compressor_suite, timeout=240)


def _replay(ref, inputs, got_by_rank):
    for call in range(CALLS):
        expected = ref.step(inputs[call])
        for r in range(WORLD):
            assert torch.equal(got_by_rank[r]["outs"][call], got_by_rank[0]["outs"][call]), (call, r)
        torch.testing.assert_close(got_by_rank[0]["outs"][call], expected, **TOL)
    for r in range(WORLD):
        torch.testing.assert_close(got_by_rank[r]["worker_error"], ref.worker_error(r), **TOL)
        torch.testing.assert_close(got_by_rank[r]["server_error"], ref.server_error(r), **TOL)


@pytest.mark.parametrize("numel", LENGTHS)
def test_two_nodes_of_two_match_the_simulation(ranks, numel):
    inputs = [[x.float() for x in row] for row in make_inputs(WORLD, numel, torch.float32)[:CALLS]]
    _replay(RefHierarchicalAllreduce(numel, NODES, PER_NODE), inputs, [r[numel] for r in ranks])


def test_segments_cut_at_the_shard_edges_keep_their_own_scales(ranks):
    numel = sum(SEGMENTS)
    scales = segment_scales(SEGMENTS)
    inputs = [[x * scales for x in row] for row in make_inputs(WORLD, numel, torch.float32)[:CALLS]]
    _replay(RefHierarchicalAllreduce(numel, NODES, PER_NODE, SEGMENTS), inputs, [r["segmented"] for r in ranks])
    # hierarchical=True takes the node size from LOCAL_WORLD_SIZE: the same exchange
    for r in range(WORLD):
        for call in range(CALLS):
            assert torch.equal(ranks[r]["from_env"][call], ranks[r]["segmented"]["outs"][call])


@pytest.mark.parametrize("numel", LENGTHS)
def test_bytes_inside_and_across_nodes(ranks, numel):
    shard = -(-numel // PER_NODE)
    for r in range(WORLD):
        stats = ranks[r][numel]["stats"]
        # reduce-scatter and all-gather inside the node: (L - 1) shards of fp32 each, per call
        assert stats["intra_node_bytes"] == CALLS * 2 * (PER_NODE - 1) * shard * 4
        pieces = cut([numel], (r % PER_NODE) * shard, min(numel, (r % PER_NODE + 1) * shard), shard)
        across = compressed_bytes(shard, NODES, pieces)
        assert stats["inter_node_bytes"] == CALLS * across
        assert stats["fp32_equivalent_bytes"] == CALLS * ring_allreduce_bytes(numel, WORLD)
        assert stats["compressed_calls"] == CALLS
    if numel >= 4000:  # the slow link carries ~32x less than a hierarchical fp32 exchange would
        fp32_across = ring_allreduce_bytes(shard, NODES)
        assert fp32_across / across > 25


def test_one_node_is_the_exact_mean_and_nodes_of_one_the_flat_allreduce(ranks):
    inputs = make_inputs(WORLD, 1001, torch.float32)[:3]
    for call in range(3):
        mean = torch.stack([inputs[call][r] for r in range(WORLD)]).mean(0)
        for r in range(WORLD):
            torch.testing.assert_close(ranks[r]["one_node"]["outs"][call], mean, rtol=1e-6, atol=1e-7)
            a, b = ranks[r]["nodes_of_one"][call]
            assert torch.equal(a, b)
            torch.testing.assert_close(ranks[r]["average"][call], mean, rtol=1e-6, atol=1e-7)
    for r in range(WORLD):
        stats = ranks[r]["one_node"]["stats"]
        assert stats["inter_node_bytes"] == 0 and stats["intra_node_bytes"] > 0 and stats["compressed_calls"] == 0
        assert ranks[r]["one_node"]["errors"] is None  # nothing compressed, no residue
        # said once, by rank 0, when the groups are made
        assert ranks[r]["one_node"]["warnings"] == ([
            "hierarchical: the 4 ranks are one node of 4; every exchange is the exact fp32 mean inside it and nothing "
            "is compressed (hierarchical=False for the flat 1-bit exchange)"] if r == 0 else [])


def test_bad_node_sizes_are_refused_on_every_rank(ranks):
    assert {r["three"] for r in ranks} == {
        "hierarchical: 3 ranks per node do not divide the 4 ranks of the group; give a node size that divides the "
        "world, or hierarchical=False"}
    uneven = {r["uneven"] for r in ranks}
    assert len(uneven) == 1 and "different node sizes (by rank: [2, 2, 1, 1])" in uneven.pop()
    for r in range(WORLD):  # the group still works afterwards
        torch.testing.assert_close(ranks[r]["after"], torch.full((10,), 1.5))


REFS = {"adam": RefOnebitAdam, "zoadam": RefZeroOneAdam, "lamb": RefOnebitLamb}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_optimizers_match_the_reference_with_hierarchical_exchange(name):
    got = run_workers(WORLD, optimizer_suite, name, timeout=240)
    _, kwargs, steps = CONFIGS[name]
    ref = REFS[name](init_params(), WORLD, **COMMON, **kwargs, lrs=LRS, masks=MASKS)
    ref.w.hierarchical(PER_NODE)
    for step in range(1, steps + 1):
        ref.step([rank_grads(step, r) for r in range(WORLD)])
        for r in range(WORLD):
            for p, q in zip(got[r]["params"][step - 1], ref.params[r]):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=f"{name} step {step} rank {r}")
    for r in range(WORLD):
        onebit = got[r]["onebit_state"]
        assert (onebit["world_size"], onebit["rank"], onebit["per_node"]) == (WORLD, r, PER_NODE)
        if name != "zoadam":
            torch.testing.assert_close(got[r]["errors"][0], ref.w.allreduce.worker_error(r), **TOL)
