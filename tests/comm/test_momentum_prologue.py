"""``compressed_allreduce(..., momentum=(grads, w1))``: 1-bit Adam's local momentum update done in the
worker's first pass (one fused CPU kernel; the torch path lerps, then sums) gives what the reference
gets for ``lerp(m, g, w1)`` compressed on 2 real gloo ranks, on both backends, over several calls."""

from __future__ import annotations

import pytest
import torch

from lightning_optim import ops
from lightning_optim.comm import compressed_allreduce, make_error_buffers
from lightning_optim.comm import pieces as passes
from tests.ops.conftest import ext  # noqa: F401  (fixture: the built extension)
from tests.ranks import run_ranks
from tests.reference.onebit_allreduce import RefOnebitAllreduce

SEGMENTS = [5, 0, 13, 8, 31, 1000]
W1 = 0.1
CALLS = 3


def grads_of(rank: int, call: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * call + rank)
    return [torch.randn(n, generator=gen) * (1 + i) for i, n in enumerate(SEGMENTS) if n]


def start() -> torch.Tensor:
    return torch.randn(sum(SEGMENTS), generator=torch.Generator().manual_seed(7))


def fused_vs_apart(rank: int, world: int) -> dict:
    fused, apart = start(), start()
    buffers = [make_error_buffers(fused, None, SEGMENTS), make_error_buffers(apart, None, SEGMENTS)]
    outs = []
    for call in range(CALLS):
        grads = grads_of(rank, call)
        compressed_allreduce(fused, *buffers[0], segments=SEGMENTS, momentum=(grads, W1))
        passes.lerp_segments_(apart, grads, W1, [n for n in SEGMENTS if n])
        compressed_allreduce(apart, *buffers[1], segments=SEGMENTS)
        outs.append((fused.clone(), apart.clone()))
    return {"outs": outs}


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_fused_momentum_matches_the_reference_on_two_ranks(backend, ext, monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, backend)  # the process's: both rank threads read it
    results = run_ranks(2, fused_vs_apart, timeout=120)
    ref = RefOnebitAllreduce(sum(SEGMENTS), 2, segments=SEGMENTS)
    m = [start(), start()]
    for call in range(CALLS):
        locals_ = []
        for r in range(2):  # the reference's own momentum update: m + w1 (g - m)
            g = torch.cat(grads_of(r, call))
            locals_.append(m[r] + W1 * (g - m[r]))
        expected = ref.step(locals_)
        m = [expected.clone(), expected.clone()]
        for r in range(2):
            fused, apart = results[r]["outs"][call]
            assert torch.equal(fused, results[0]["outs"][call][0])  # every rank holds the same values
            torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fused, apart, rtol=1e-6, atol=1e-6)


def test_one_rank_only_moves_the_momentum():
    x = start()
    grads = grads_of(0, 0)
    compressed_allreduce(x, *make_error_buffers(x), segments=SEGMENTS, momentum=(grads, W1))
    assert torch.equal(x, torch.lerp(start(), torch.cat(grads), W1))


@pytest.mark.parametrize("momentum,match", [
    (lambda g: (g[:-1], W1), "one gradient per non-empty segment"),
    (lambda g: (g[:-1] + [torch.zeros(3)], W1), "gradient 4 must be a tensor of 1000 elements"),
    (lambda g: (g, 1.5), r"in \[0, 1\]"),
    (lambda g: (g, True), r"in \[0, 1\]"),
])
def test_bad_momentum_is_refused_before_anything_changes(momentum, match):
    x = start()
    buffers = make_error_buffers(x, None, SEGMENTS)
    with pytest.raises(ValueError, match=match):
        compressed_allreduce(x, *buffers, segments=SEGMENTS, momentum=momentum(grads_of(0, 0)))
    assert torch.equal(x, start())
    with pytest.raises(ValueError, match="contiguous float32"):
        compressed_allreduce(x.double(), *buffers, segments=SEGMENTS, momentum=(grads_of(0, 0), W1))


def test_the_kernel_refuses_bad_gradients(ext):
    x = start()
    worker = __import__("lightning_optim.comm.plan", fromlist=["plan_for"]).plan_for(x.numel(), 2, SEGMENTS).worker
    err = torch.zeros(worker.total)
    grads = grads_of(0, 0)
    with pytest.raises(ValueError, match=r"grads\[1\]: 12 elements, its piece has 13"):
        ext.onebit_momentum_sumsq(x, [grads[0], torch.zeros(12)] + grads[2:], err, worker.table, worker.total, W1)
    with pytest.raises(TypeError, match=r"grads\[0\]: expected Float"):
        ext.onebit_momentum_sumsq(x, [grads[0].double()] + grads[1:], err, worker.table, worker.total, W1)
    assert torch.equal(x, start())
