"""The 1-bit strategies with ``hierarchical=True`` in a real Trainer on 4 gloo ranks that Lightning sees as
2 nodes of 2 devices: the node size comes from the trainer, the warmup's DDP average and the compression
stage go through the node hierarchy (bytes inside the node, few across), every rank holds the same model, and
a resume from Lightning's checkpoint continues bitwise."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_workers
from tests.lightning.workers import CASES, HIERARCHICAL_EPOCH, hierarchical

WORLD = 4


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_workers(WORLD, hierarchical, str(tmp_path_factory.mktemp("hierarchical")), timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_nodes_come_from_the_trainer_and_compression_engages(ranks, case):
    for r in range(WORLD):
        result = ranks[r][case]
        assert result["hierarchical"] == 2 and result["made_per_node"] == 2  # True -> devices per node
        rows = result["rows"]
        assert any(row["enabled"] for row in rows) and not rows[-1]["enabled"]  # DDP's allreduce switched off
        for row in rows:
            if row["enabled"]:  # the warmup's DDP average went through the node: part of it stayed inside
                assert 0 < row["inter_node_bytes"] < row["bytes_sent"], (case, r, row)
        # compression steps that exchanged momenta (ZeroOneAdam's local steps exchange none, only an agreed norm)
        exchanged = [row for row in rows if not row["enabled"] and row["inter_node_bytes"] < row["bytes_sent"]]
        assert exchanged and (case == "zero_one_adam" or len(exchanged) == sum(not row["enabled"] for row in rows))
        # across nodes, a compression step sends a small fraction of a flat fp32 ring allreduce's bytes
        assert max(row["inter_node_bytes"] for row in exchanged) * 10 < exchanged[0]["fp32_bytes"]


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_holds_the_same_model(ranks, case):
    for step, params in ranks[0][case]["synced"].items():
        for r in range(1, WORLD):
            assert torch.equal(ranks[r][case]["synced"][step], params), (case, step, r)
    assert len(ranks[0][case]["synced"]) >= HIERARCHICAL_EPOCH  # synchronised often, in both stages


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise_on_every_rank(ranks, case):
    for r in range(WORLD):
        assert torch.equal(ranks[r][case]["resumed"]["params"], ranks[r][case]["params"]), (case, r)
