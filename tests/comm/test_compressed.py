"""compressed_allreduce on real gloo ranks against the single-process simulation.

One spawn of 4 ranks (``comm_spawn`` in conftest.py, shared with test_hooks.py) runs W = 2, 3, 4
(sub-groups for 2 and 3), every length/dtype for CALLS successive calls with changing inputs; the
parent replays the same inputs through ``tests/reference/onebit_allreduce.py``.
"""
from __future__ import annotations

import pytest
import torch

from lightning_optim.comm import (
    CommStats,
    compressed_allreduce,
    compressed_bytes,
    error_buffer_sizes,
    make_error_buffers,
)
from lightning_optim.comm.stats import ring_allreduce_bytes
from tests.comm.workers import CALLS, DTYPES, LENGTHS, SEGMENTS, make_inputs, segment_scales
from tests.reference.onebit_allreduce import RefOnebitAllreduce

@pytest.mark.parametrize("world", [2, 3, 4])
def test_matches_simulation_on_every_rank(comm_spawn, world):
    per_rank = [comm_spawn[r][world] for r in range(world)]
    for numel in LENGTHS[world]:
        for dtype in DTYPES:
            key = (numel, str(dtype))
            inputs = make_inputs(world, numel, dtype)
            ref = RefOnebitAllreduce(numel, world)
            plain = RefOnebitAllreduce(numel, world, error_feedback=False)
            sum_out = torch.zeros(numel)
            sum_avg = torch.zeros(numel)
            sum_plain = torch.zeros(numel)
            for call in range(CALLS):
                xs = [x.float() for x in inputs[call]]
                expected = ref.step(xs)
                got = per_rank[0][key]["outs"][call]
                for r in range(1, world):  # bit-identical on every rank
                    assert torch.equal(per_rank[r][key]["outs"][call], got), (key, call, r)
                if dtype == torch.float32:
                    # the scales are fp32 norms summed in another order (SIMD lanes vs torch; the
                    # lane count depends on the CPU) and error feedback carries the difference on:
                    # up to ~1e-5 after a few calls, far below any algorithmic error (~ the scale)
                    torch.testing.assert_close(got, expected, rtol=1e-4, atol=5e-5)
                else:
                    torch.testing.assert_close(got, expected.to(dtype), rtol=1e-2, atol=1e-6)
                sum_out += got.float()
                sum_avg += torch.stack(xs).mean(0)
                sum_plain += plain.step(xs)
            # error buffers match the simulation's, per rank
            for r in range(world):
                torch.testing.assert_close(per_rank[r][key]["worker_error"], ref.worker_error[r],
                                           rtol=1e-4, atol=5e-5)
                torch.testing.assert_close(per_rank[r][key]["server_error"], ref.server_error[r],
                                           rtol=1e-4, atol=5e-5)
            # error feedback: sum(out) - sum(avg) = -(mean worker error + server error), bounded
            drift = (sum_out - sum_avg).norm().item()
            drift_plain = (sum_plain - sum_avg).norm().item()
            if numel >= 16:  # a handful of elements: even plain sign compression is near lossless
                assert drift < 0.5 * drift_plain, (key, drift, drift_plain)
            if dtype == torch.float32:
                residual = torch.stack([p[key]["worker_error"] for p in per_rank]).mean(0)[:numel]
                residual += torch.cat([p[key]["server_error"] for p in per_rank])[:numel]
                torch.testing.assert_close(sum_out - sum_avg, -residual, rtol=1e-4, atol=1e-4)
            # byte counting rule, last call
            stats = per_rank[0][key]["stats"]
            assert stats["bytes_sent"] == compressed_bytes(numel, world)
            assert stats["fp32_equivalent_bytes"] == ring_allreduce_bytes(numel, world)
    for r in range(world):
        view, expect = per_rank[r]["transposed"]
        assert torch.equal(view, expect)
        assert "different sizes" in per_rank[r]["mismatch"]
        assert "100" in per_rank[r]["mismatch"] and "101" in per_rank[r]["mismatch"]
        torch.testing.assert_close(per_rank[r]["after_mismatch"],
                                   torch.full((10,), (world - 1) / 2))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_per_segment_scales_match_simulation(comm_spawn, world):
    segments = SEGMENTS[world]
    numel = sum(segments)
    inputs = make_inputs(world, numel, torch.float32)
    ref = RefOnebitAllreduce(numel, world, segments=segments)
    shared = RefOnebitAllreduce(numel, world)  # one scale for everything
    got_err, shared_err = torch.zeros(numel), torch.zeros(numel)
    small = segment_scales(segments) < 0.05
    for call in range(CALLS):
        xs = [x * segment_scales(segments) for x in inputs[call]]
        expected = ref.step(xs)
        got = comm_spawn[0][world]["segmented"]["outs"][call]
        for r in range(1, world):
            assert torch.equal(comm_spawn[r][world]["segmented"]["outs"][call], got), (call, r)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        truth = torch.stack(xs).mean(0)
        got_err += (got - truth).abs()
        shared_err += (shared.step(xs) - truth).abs()
    for r in range(world):
        # residuals of values up to ~30: fp32 rounding of the scales shows at ~1e-5 absolute
        torch.testing.assert_close(comm_spawn[r][world]["segmented"]["worker_error"], ref.worker_error[r],
                                   rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(comm_spawn[r][world]["segmented"]["server_error"], ref.server_error[r],
                                   rtol=1e-5, atol=1e-4)
    # what per-segment scales are for: small-magnitude segments are not drowned by the big ones
    assert got_err[small].mean() < 0.01 * shared_err[small].mean()


def test_segment_validation():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="add up to"):
        error_buffer_sizes(10, 2, [3, 3])
    with pytest.raises(ValueError, match=r"segments\[1\]"):
        make_error_buffers(x, None, [12, -2])
    with pytest.raises(ValueError, match="add up to"):
        compressed_allreduce(x, *make_error_buffers(x), segments=[9])
    # zero-length segments carry nothing; each segment starts on a multiple of 8
    assert error_buffer_sizes(10, 2, [3, 0, 7]) == (16, 8)
    assert error_buffer_sizes(10, 2, [3, 7]) == error_buffer_sizes(10, 2, [3, 0, 7])
    assert error_buffer_sizes(17, 2, [9, 8]) == (32, 16)
    assert error_buffer_sizes(10, 2, torch.tensor([3, 7])) == (16, 8)  # integer tensors and numpy ints too
    with pytest.raises(ValueError, match=r"segments\[0\]"):
        error_buffer_sizes(10, 2, [3.0, 7])


def test_error_feedback_beats_plain_sign_over_many_calls():
    """Simulation-only: without feedback the bias grows ~linearly, with feedback it stays bounded."""
    world, numel, calls = 4, 512, 200
    g = torch.Generator().manual_seed(7)
    mean = torch.randn(numel, generator=g) * 0.3
    ref, plain = RefOnebitAllreduce(numel, world), RefOnebitAllreduce(numel, world, error_feedback=False)
    drift, drift_plain, total = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    history = []
    for _ in range(calls):
        xs = [mean + torch.randn(numel, generator=g) for _ in range(world)]
        avg = torch.stack(xs).mean(0)
        drift += ref.step(xs) - avg
        drift_plain += plain.step(xs) - avg
        total += avg
        history.append(drift.norm().item())
    assert drift.norm() < 0.05 * drift_plain.norm()
    assert max(history[calls // 2:]) < 2 * max(history[: calls // 2])  # not growing


def test_world_size_one_is_exact_identity():
    # no process group: world size 1, the tensor comes back untouched (any dtype)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(37).to(dtype)
        before = x.clone()
        we, se = make_error_buffers(x)
        assert we.numel() == error_buffer_sizes(37, 1)[0] == 40 and se.numel() == 40
        out = compressed_allreduce(x, we, se)
        assert out is x and torch.equal(x, before)
        assert torch.count_nonzero(we) == 0 and torch.count_nonzero(se) == 0


def test_error_buffer_validation():
    x = torch.randn(100)
    we, se = make_error_buffers(x)
    with pytest.raises(ValueError, match="worker_error"):
        compressed_allreduce(x, torch.zeros(99), se)
    with pytest.raises(ValueError, match="worker_error"):
        compressed_allreduce(x, we.double(), se)
    with pytest.raises(ValueError, match="server_error"):
        compressed_allreduce(x, we, torch.zeros(8))
    with pytest.raises(ValueError, match="server_error"):
        compressed_allreduce(x, we, None)
    with pytest.raises(TypeError, match="floating-point"):
        compressed_allreduce(torch.ones(100, dtype=torch.int64), we, se)
    assert error_buffer_sizes(100, 4) == (128, 32)
    assert error_buffer_sizes(5, 3) == (24, 8)
    assert error_buffer_sizes(0, 2) == (0, 0)
    with pytest.raises(ValueError, match="world_size"):
        error_buffer_sizes(10, 0)


def test_byte_counting_rule():
    # n = 1000, W = 2: N = 1008, C = 504 -> 63 packed bytes per chunk
    # all_gather(numel, #segments, crc, dtype as int64) 32 + all_gather(scale) 4 + all_to_all 63
    # + all_gather(63 signs + one 4-byte server scale) 67
    assert compressed_bytes(1000, 2) == 32 + 4 + 63 + 67
    assert ring_allreduce_bytes(1000, 2) == 4000
    # W = 4, n = 1000: N = 1024, C = 256 -> 32 bytes; each part goes to 3 peers
    assert compressed_bytes(1000, 4) == 3 * (32 + 4 + 32 + 36)
    # 3 segments (600, 5, 395) on 2 ranks at positions 0, 600, 608: N = 1008, C = 504; chunk 0 is
    # a piece of segment 0, chunk 1 holds the rest of it and segments 1, 2 -> 3 server-scale slots
    assert compressed_bytes(1000, 2, [600, 5, 395]) == 32 + 12 + 63 + 63 + 12
    assert ring_allreduce_bytes(1000, 4) == 6000
    n = 25_000_000
    assert ring_allreduce_bytes(n, 2) / compressed_bytes(n, 2) >= 30
    assert compressed_bytes(n, 1) == 0 and ring_allreduce_bytes(n, 1) == 0
    s = CommStats()
    s.add_compressed(compressed_bytes(1000, 2), 1000, 2)
    s.add_full_precision(1000, 2, 4)
    assert (s.bytes_sent, s.fp32_equivalent_bytes) == (166 + 4000, 8000)
    delta = s - CommStats(bytes_sent=166, fp32_equivalent_bytes=4000, compressed_calls=1)
    assert delta.as_dict()["full_precision_calls"] == 1 and delta.compression_ratio == 1.0
