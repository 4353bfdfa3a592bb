"""benchmarks/scale_formulas.py: its byte formulas are the project's own counters, and its limits hold."""
from __future__ import annotations

import importlib.util
import math
import random
import sys
from pathlib import Path

import pytest

from lightning_optim.comm.compressed import compressed_bytes
from lightning_optim.comm.compressors.powersgd import PowerSGDCompressor
from lightning_optim.comm.stats import ring_allreduce_bytes
from lightning_optim.model import ByteGPT

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "scale_formulas.py"
_spec = importlib.util.spec_from_file_location("scale_formulas", _PATH)
sf = importlib.util.module_from_spec(_spec)
sys.modules["scale_formulas"] = sf
_spec.loader.exec_module(sf)

WORLDS = [2, 3, 4, 5, 8, 16, 64, 100]
TINY = sf.gpt_shapes(4, 128, 256, 128)


def _segment_lists() -> list[list[int]]:
    rng = random.Random(0)
    return [
        [1_000_003],
        [math.prod(s) for s in TINY],
        [rng.randint(1, 5000) for _ in range(37)],
        [7, 1, 8, 9, 3, 64, 65, 1000],
    ]


@pytest.mark.parametrize("world", WORLDS)
def test_onebit_bytes_match_compressed_bytes(world: int) -> None:
    for segments in _segment_lists():
        assert sf.onebit_bytes(segments, world) == compressed_bytes(sum(segments), world, segments), segments
    assert sf.onebit_bytes([12345], world) == compressed_bytes(12345, world)  # segments=None: one segment


@pytest.mark.parametrize("world", [1, *WORLDS])
def test_ring_and_powersgd_bytes_match_the_counters(world: int) -> None:
    for numel in (1, 999, 4_000_001):
        assert sf.ring_allreduce_bytes(numel, world) == ring_allreduce_bytes(numel, world)
    for rank in (1, 4):
        p, q, vec = sf.powersgd_elements(TINY, rank)
        modelled = sum(sf.ring_allreduce_bytes(n, world) for n in (p, q, vec))
        assert modelled == PowerSGDCompressor(rank=rank).bytes_sent(list(TINY), world)


def test_flat_collectives_send_the_counted_bytes() -> None:
    link = sf.gbit(1, 0.0)
    segments = [math.prod(s) for s in TINY]
    for world in WORLDS:
        flat = sf.Topology(world, link)
        assert sf.allreduce(sum(segments), flat).inter_bytes == ring_allreduce_bytes(sum(segments), world)
        assert sf.onebit_allreduce(segments, flat).inter_bytes == compressed_bytes(sum(segments), world, segments)


def test_gpt_shapes_are_the_main_job_model() -> None:
    model = ByteGPT(128, n_layer=4, n_head=4, d_model=128, mlp_ratio=4)
    assert TINY == tuple(tuple(p.shape) for p in model.parameters())


def test_shards_cover_the_segments() -> None:
    segments = [math.prod(s) for s in TINY]
    shards = sf.shard_segments(segments, 8)
    assert sum(map(sum, shards)) == sum(segments)
    assert max(map(sum, shards)) - min(map(sum, shards)) <= 1


def test_limits_follow_from_the_formulas() -> None:
    # bytes: fp32 ring / 1-bit -> 32 from below as the tensor grows (1 bit per element + fixed scales)
    for world in (2, 16, 256):
        ratios = [ring_allreduce_bytes(n, world) / sf.onebit_bytes([n], world) for n in (10**5, 10**7, 10**9)]
        assert ratios == sorted(ratios) and ratios[-1] < 32 and ratios[-1] > 31.9
    # with latency, 1-bit's 3 (W-1) messages against the ring's 2 (W-1): the fp32 ring wins at some W,
    # and from then on (the break-even is the first such W)
    model = sf.ModelShape("tiny", TINY)
    link = sf.gbit(10, 20e-6)
    w = sf.comm_break_even_world(model, link)
    assert w is not None

    def onebit_minus_ring(world: int) -> float:
        flat = sf.Topology(world, link)
        return sf.onebit_allreduce(model.segments, flat).seconds - sf.allreduce(model.numel, flat).seconds

    assert onebit_minus_ring(w - 1) < 0 <= onebit_minus_ring(w) and onebit_minus_ring(4 * w) > 0
    # a faster link inside the node never makes the fp32 allreduce slower
    fast = sf.Link(5e-6, 100e9)
    for world in (8, 64, 1024):
        flat, hier = sf.Topology(world, link), sf.Topology(world, link, fast)
        assert sf.allreduce(model.numel, hier).seconds < sf.allreduce(model.numel, flat).seconds
