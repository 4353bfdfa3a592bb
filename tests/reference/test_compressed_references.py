"""Sanity of the compressed W-worker references against plain algebra: keeping everything is plain
averaging, a full-rank PowerSGD is exact, the centralized sparsified SGD at k = numel is SGD on the mean."""
from __future__ import annotations

import torch

from .centralized_sparsified import RefCentralizedSparsifiedSGD
from .compressors import RefCompressedWorkers
from .powersgd import RefPowerSGD, gram_schmidt

DT = torch.float64
SHAPES = [(4, 3), (5,)]


def _grads(world, step):
    gen = torch.Generator().manual_seed(step)
    return [[torch.randn(s, generator=gen, dtype=DT) for s in SHAPES] for _ in range(world)]


def test_keeping_everything_is_averaging():
    for kind in ("topk", "randomk", "blockwise"):
        ref = RefCompressedWorkers(kind, 3, SHAPES, ratio=1.0)
        grads = _grads(3, 0)
        for got, i in zip(ref.step(grads), range(len(SHAPES))):
            torch.testing.assert_close(got, sum(g[i] for g in grads) / 3, rtol=0, atol=1e-15)
        assert all(torch.equal(e, torch.zeros_like(e)) for w in ref.residuals for e in w)


def test_sign_of_a_constant_magnitude_tensor_is_exact():
    x = torch.tensor([2.0, -2.0, 2.0, 2.0], dtype=DT)
    ref = RefCompressedWorkers("sign", 1, [(4,)])
    assert torch.equal(ref.step([[x]])[0], x)
    vote = RefCompressedWorkers("majority", 3, [(2,)]).step([[torch.tensor([1.0, -1.0], dtype=DT)]] * 2
                                                            + [[torch.tensor([-5.0, -1.0], dtype=DT)]])
    assert vote[0].tolist() == [1.0, -1.0]


def test_full_rank_powersgd_is_plain_averaging():
    params = [torch.zeros(s, dtype=DT) for s in SHAPES]
    ref = RefPowerSGD(params, 2, lr=1.0, rank=3)  # r = min(4, 3, 3) = 3: P spans the whole column space
    grads = _grads(2, 1)
    out = ref.aggregate(grads)
    for i in range(len(SHAPES)):
        torch.testing.assert_close(out[i], (grads[0][i] + grads[1][i]) / 2, rtol=0, atol=1e-13)
    q = gram_schmidt(torch.randn(6, 3, dtype=DT, generator=torch.Generator().manual_seed(2)))
    torch.testing.assert_close(q.t() @ q, torch.eye(3, dtype=DT), rtol=0, atol=1e-13)


def test_centralized_sparsified_at_full_k_is_sgd_on_the_mean():
    params = [torch.randn(s, dtype=DT, generator=torch.Generator().manual_seed(3)) for s in SHAPES]
    lr, wd = 0.1, 0.01
    ref = RefCentralizedSparsifiedSGD(params, 2, lr=lr, weight_decay=wd, sparse_grad_size=12, mode="topk")
    want = [p.clone() for p in params]
    for step in range(3):
        grads = _grads(2, step)
        ref.step(grads)
        want = [p - (lr * (grads[0][i] + grads[1][i]) / 2 + wd * p) for i, p in enumerate(want)]
    for got, w in zip(ref.params, want):
        torch.testing.assert_close(got, w, rtol=0, atol=1e-14)
