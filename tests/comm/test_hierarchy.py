"""Hierarchical averaging on 4 real gloo ranks as 2 nodes of 2, against the single-process simulation
(``tests/reference/hierarchical_allreduce.py``): every rank's result, every rank's error buffers, the bytes
inside and across nodes (also against the kernel's socket counters: gloo's reduce-scatter sends a whole
all-reduce's bytes); other node sizes; refusals on every rank."""
from __future__ import annotations

import pytest
import torch

from lightning_optim.comm import compressed_bytes
from lightning_optim.comm.stats import reduce_scatter_bytes, ring_allreduce_bytes
from tests.comm.hierarchy_workers import (
    CALLS,
    LENGTHS,
    SEGMENTS,
    WIRE_NUMEL,
    compressor_suite,
    optimizer_suite,
    wire_suite,
)
from tests.comm.workers import make_inputs, segment_scales
from tests.distributed import run_workers
from tests.onebit.workers import COMMON, CONFIGS, LRS, MASKS, init_params, rank_grads
from tests.ranks import run_ranks
from tests.reference.hierarchical_allreduce import RefHierarchicalAllreduce, cut
from tests.reference.onebit_adam import RefOnebitAdam
from tests.reference.onebit_lamb import RefOnebitLamb
from tests.reference.zero_one_adam import RefZeroOneAdam

WORLD, NODES, PER_NODE = 4, 2, 2
TOL = dict(rtol=1e-4, atol=5e-5)  # fp32 norms summed in another order, carried on by error feedback


@pytest.fixture(scope="module")
def ranks():
    return run_workers(WORLD, compressor_suite, timeout=240)  # per-rank LOCAL_WORLD_SIZE: processes


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
        # inside the node, per call: gloo's reduce-scatter all-reduces the L padded shards (2 (L - 1) shards
        # sent), the all-gather sends (L - 1) shards
        assert stats["intra_node_bytes"] == CALLS * 3 * (PER_NODE - 1) * shard * 4
        assert stats["intra_node_bytes"] == CALLS * (reduce_scatter_bytes(PER_NODE * shard, PER_NODE, 4, "gloo")
                                                     + (PER_NODE - 1) * shard * 4)
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
            "is compressed, and it sends 1.5x the bytes of DDP's flat fp32 all-reduce (gloo's reduce-scatter sends a "
            "whole all-reduce's bytes, and the all-gather follows it) (hierarchical=False for the flat 1-bit "
            "exchange)"] if r == 0 else [])
        # what the warning says: 1.5x a flat fp32 ring all-reduce of the same vector, counted
        assert stats["bytes_sent"] == 3 * int(1.5 * ring_allreduce_bytes(1001 + 3, WORLD))  # 1001 padded to 4 x 251


def test_counted_bytes_are_the_bytes_on_the_wire():
    """Each rank's CommStats against what its gloo sockets sent (the kernel's counters), per call: gloo frames
    its messages in a few hundred bytes; a reduce-scatter counted at the ring's size would be 400 KB short."""
    got = run_workers(WORLD, wire_suite, timeout=240)
    if any(row[1] is None for r in got for row in r.values()):
        pytest.skip("no `ss` to read the sockets' byte counters")
    shard = -(-WIRE_NUMEL // PER_NODE)
    for r in range(WORLD):
        for name in ("hier_fp32", "hier_1bit", "one_node_fp32"):
            counted, wire = got[r][name]
            assert counted <= wire <= counted * 1.01 + 4096, (r, name, counted, wire)
        counted, wire = got[r]["hier_fp32"]
        # inside the node 3 (L - 1) shards of fp32, across (the fp32 ring over K = 2 nodes) one shard
        assert counted == 3 * (PER_NODE - 1) * shard * 4 + ring_allreduce_bytes(shard, NODES)
        # one node of 4: 1.5x the flat all-reduce, on the wire too
        flat_wire = got[r]["flat_all_reduce"][1]
        assert 1.45 < got[r]["one_node_fp32"][1] / flat_wire < 1.55, (got[r]["one_node_fp32"][1], flat_wire)


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
    got = run_ranks(WORLD, optimizer_suite, name, timeout=240)
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


@pytest.mark.parametrize("per_node", [2, 3, 4, 8])
def test_the_counting_rule_per_backend(per_node):
    """NCCL's reduce-scatter is a ring ((L-1)/L of the input); gloo's an all-reduce of all of it. One node
    (reduce-scatter + all-gather) against a flat ring all-reduce: 1.5x on gloo, 1.0x on NCCL (the warning's)."""
    from lightning_optim.comm.hierarchy import one_node_ratio

    n = per_node * 1000
    assert reduce_scatter_bytes(n, per_node, 4, "nccl") == (per_node - 1) * 1000 * 4
    assert reduce_scatter_bytes(n, per_node, 4, "gloo") == ring_allreduce_bytes(n, per_node)
    assert reduce_scatter_bytes(n, 1, 4, "gloo") == 0
    assert one_node_ratio(per_node, "gloo") == 1.5 and one_node_ratio(per_node, "nccl") == 1.0
