"""``onebit_fsdp`` on 4 real gloo ranks, FSDP2 on a 2 x 2 (replicate, shard) mesh, against the W=2 worker
references run shard by shard (``tests/reference/sharded_onebit.py``): worker w's gradient is the mean of
the gradients of replica w's two ranks (computed by the ranks with an unsharded copy of the model at the
gathered params), and every rank's gathered params after each step must be worker w's. Also: no HSDP
all-reduce in the compression stage and ~1/32 of its bytes across the replicas, a checkpoint (DCP for the
model, each rank's optimizer state dict) resumed mid-compression bitwise, ``remove()``, the refusals."""

from __future__ import annotations

import pytest
import torch

from lightning_optim.comm import compressed_bytes
from lightning_optim.comm.stats import ring_allreduce_bytes
from lightning_optim.onebit.fsdp_grads import missing_fsdp2_api
from tests.onebit.fsdp_workers import (
    COMMON,
    CONFIGS,
    REPLICAS,
    SHARDS,
    initial_params,
    plain_grads,
    refusal_suite,
    train_suite,
)
from tests.ranks import run_ranks
from tests.reference.auto_freeze import auto_freeze_step
from tests.reference.onebit_adam import RefOnebitAdam
from tests.reference.sharded_onebit import ShardedReference, shard_rows
from tests.reference.zero_one_adam import RefZeroOneAdam

# torch 2.11 (the GPU image) lacks FSDP2 methods that onebit_fsdp needs, and onebit_fsdp refuses there by
# name; these tests run where torch has them (CI's 2.13).
pytestmark = pytest.mark.skipif(bool(missing_fsdp2_api()),
                                reason=f"torch {torch.__version__} lacks FSDP2's {missing_fsdp2_api()}")

WORLD = REPLICAS * SHARDS
TOL = 1e-5  # fp32 round-off of equivalent formulas; a flipped 1-bit sign moves a param by ~lr
REFS = {"adam": RefOnebitAdam, "adam_auto": RefOnebitAdam, "zoadam": RefZeroOneAdam}
FSDP_MODULES = 4  # a, b, c and the root (its own param): one HSDP all-reduce each per full-precision backward


def _replica(rank: int) -> int:
    return rank // SHARDS


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def run(request, tmp_path_factory):
    name = request.param
    return name, run_ranks(WORLD, train_suite, name, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


def _mean_grads(ranks, steps: int) -> list[list[torch.Tensor]]:
    return [[sum(g) / WORLD for g in zip(*(ranks[r]["grads"][t] for r in range(WORLD)))] for t in range(steps)]


def test_replicas_follow_the_sharded_reference(run):
    name, ranks = run
    _, kwargs, steps, _ = CONFIGS[name]
    decided = [bool(ranks[r]["decisions"]) for r in range(WORLD)]
    if kwargs.get("freeze_step") == "auto":  # the reference takes the step the rule picks on the whole model
        chosen = auto_freeze_step(_mean_grads(ranks, steps), 0.999, kwargs["auto_freeze_window"],
                                  kwargs["auto_freeze_tolerance"], 100000)
        assert chosen is not None and ranks[0]["needs"].index(False) == chosen  # step chosen + 1 compresses
        kwargs = {"freeze_step": chosen}
        # announced by rank 0 of the world that voted, once per run that decided (the resumed one too)
        assert decided == [True] + [False] * (WORLD - 1)
        assert all(f"ends the warmup at step {chosen}:" in m for m in ranks[0]["decisions"])
    else:
        assert decided == [False] * WORLD
    params = list(initial_params().values())
    ref = ShardedReference(lambda p, w: REFS[name](p, w, **COMMON, **kwargs), params, REPLICAS, SHARDS)
    for t in range(steps):
        grads = []
        for w in range(REPLICAS):  # worker w: the mean over replica w's ranks
            members = [ranks[r]["grads"][t] for r in range(WORLD) if _replica(r) == w]
            grads.append([sum(g[j] for g in members) / len(members) for j in range(len(params))])
        ref.step(grads)
        for r in range(WORLD):
            got = list(ranks[r]["params"][t].values())
            for j, (a, b) in enumerate(zip(got, ref.params(_replica(r)))):
                diff = (a - b).abs().max().item()
                assert diff < TOL, f"{name} step {t + 1} rank {r} param {j}: {diff}"
    stages = ranks[0]["needs"]
    assert stages.count(False) >= 5 and stages[0]  # warmup first, then at least 5 steps past it
    for r in range(WORLD):
        assert ranks[r]["needs"] == stages  # the stage agreed on every rank
        assert ranks[r]["warnings"] == []


def test_no_hsdp_all_reduce_in_the_compression_stage(run):
    name, ranks = run
    for r in range(WORLD):
        for t, needs in enumerate(ranks[r]["needs"]):
            calls, reduced = ranks[r]["hook_calls"][t], ranks[r]["replicate_all_reduced"][t]
            if needs:  # HSDP's own full-precision all-reduce of every module's shard
                assert calls == FSDP_MODULES and reduced >= ranks[r]["local_numel"], (name, r, t)
            else:
                assert calls == 0 and reduced == 0, (name, r, t)


def test_bytes_across_replicas_are_about_a_32nd_of_fp32(run):
    name, ranks = run
    for r in range(WORLD):
        numel, segments = ranks[r]["local_numel"], ranks[r]["local_numels"]
        per_call = compressed_bytes(numel, REPLICAS, segments)
        fp32 = ring_allreduce_bytes(numel, REPLICAS)
        assert fp32 / per_call > 28  # ~32 less the scales and the padding of 8 segments
        for t, needs in enumerate(ranks[r]["needs"]):
            sent, fp32_equivalent, calls, control = ranks[r]["stats"][t]
            # HSDP's own all-reduce (warmup; what torch all-reduced over the replicas, counted by the patched
            # dist.all_reduce), the 1-bit exchange and the step's layout agreement: 5 int64 to the other replica
            full = ring_allreduce_bytes(ranks[r]["replicate_all_reduced"][t], REPLICAS)
            # freeze_step="auto": in warmup also the variance norm, one float64 summed over the world
            vote = ring_allreduce_bytes(1, WORLD, 8) if CONFIGS[name][1].get("freeze_step") == "auto" and needs else 0
            assert sent == full + calls * per_call + (control - bool(vote)) * 5 * 8 + vote, (name, r, t)
            assert fp32_equivalent == full + calls * fp32, (name, r, t)
            if name.startswith("adam"):
                assert calls == (0 if needs else 1)
        assert ranks[r]["onebit"][:2] == (REPLICAS, _replica(r))  # its error buffers: its rank in the replicate group
        assert ranks[r]["group_is_replicate"]


def test_checkpoint_resumes_mid_compression_bitwise(run):
    name, ranks = run
    _, _, steps, at = CONFIGS[name]
    assert not ranks[0]["needs"][at]  # the step after the checkpoint compresses
    assert all(r["synced_at_save"] for r in ranks)  # ZeroOneAdam: the replicas' params agree at a synchronisation
    for r in range(WORLD):
        resumed = ranks[r]["resumed_params"]
        assert len(resumed) == steps - at
        for t, params in enumerate(resumed):
            for key, value in params.items():
                assert torch.equal(value, ranks[r]["params"][at + t][key]), (name, r, at + 1 + t, key)


def test_one_file_from_the_checkpoint_as_the_docs_say_loads_into_a_plain_model(run, tmp_path):
    """docs/guides/sharded.md, "One file from a checkpoint", on the folder saved mid-compression by ``dcp.save``."""
    import io

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.onebit.fsdp_workers import Net

    name, ranks = run
    at = CONFIGS[name][3]
    dcp_to_torch_save(ranks[0]["checkpoint"], tmp_path / "model.pt")
    with torch.serialization.safe_globals([io.BytesIO]):
        checkpoint = torch.load(tmp_path / "model.pt", weights_only=True)
    model = Net()
    model.load_state_dict(checkpoint["model"])
    for key, value in model.named_parameters():  # the replicas agreed when it was saved: every rank's params
        for r in range(WORLD):
            assert torch.equal(value, ranks[r]["params"][at - 1][key]), (name, r, key)
    assert sorted(checkpoint["optim"]) == [f"onebit_rank{r}" for r in range(WORLD)]


def test_remove_gives_hsdp_its_all_reduce_back(run):
    name, ranks = run
    for r in range(WORLD):
        assert ranks[r]["restored"] == (None, True)
        # each rank's gradient at its own replica's params (ZeroOneAdam's replicas differ between synchronisations)
        per_rank = [plain_grads(ranks[q]["after_remove_params"], 100, q) for q in range(WORLD)]
        for j, (key, got) in enumerate(ranks[r]["after_remove_grads"].items()):
            mean = sum(g[j] for g in per_rank) / WORLD  # every rank's: no stale partial reduction added
            torch.testing.assert_close(got, mean, rtol=1e-5, atol=1e-7, msg=f"{name} rank {r} {key}")


def test_refusals_name_the_argument():
    ranks = run_ranks(WORLD, refusal_suite, timeout=180)
    for key in ranks[0]:
        if key != "wrong_group":  # that one names each rank's own groups
            assert len({r[key] for r in ranks}) == 1, key  # the same on every rank
    for r in range(WORLD):
        assert ranks[r]["wrong_group"].endswith(f"ranks {[r % SHARDS, r % SHARDS + SHARDS]} (the mesh's replicate "
                                                "dimension); pass process_group=None")
    got = ranks[0]
    assert got["no_fsdp"].startswith("ValueError: model: has no FSDP modules")
    assert got["one_d"].startswith("ValueError: mesh: the params are on a 1-D mesh")
    assert got["not_onebit"].startswith("TypeError: optimizer: onebit_fsdp needs a lightning_optim 1-bit optimizer")
    assert got["lamb"].startswith("ValueError: optimizer: OnebitLamb is not supported")
    assert got["wrong_group"].startswith("ValueError: process_group: holds ranks")
    assert got["after_step"].startswith("ValueError: optimizer: OnebitAdam has already taken 1 step(s)")
    assert got["root_not_sharded"].startswith("ValueError: model: apply fully_shard to the root module too")
    assert got["twice"].startswith("ValueError: model: onebit_fsdp is already installed")
    assert got["again_after_remove"] == "no error"


def test_shard_rows_cut_as_fsdp():
    t = torch.arange(7.0)
    assert [shard_rows(t, s, 2).tolist() for s in range(2)] == [[0, 1, 2, 3], [4, 5, 6]]
    assert shard_rows(torch.ones(1, 3), 1, 2).shape == (0, 3)
