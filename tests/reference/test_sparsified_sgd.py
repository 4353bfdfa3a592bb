"""Sanity tests of the SparsifiedSGD reference: plain SGD at full k, error feedback, index draws,
estimated weights."""

from __future__ import annotations

import pytest
import torch

from . import RefSparsifiedSGD
from ._harness import DT, SHAPES, assert_all_close, clone_all, make_grads, make_params, run_ref


# ------------------------------------------------------------------------------- SparsifiedSGD
def test_sparsified_full_k_is_plain_sgd():
    p0, gs = make_params(), make_grads()
    lr, wd = 0.05, 0.01
    got = run_ref(RefSparsifiedSGD, p0, gs, lr=lr, weight_decay=wd, sparse_grad_size=10**6)
    want = clone_all(p0)
    for grads in gs:
        want = [p - (lr * g + wd * p) for p, g in zip(want, grads)]
    assert_all_close(got, want)


@pytest.mark.parametrize("mode", ["random", "blockwise", "topk"])
def test_sparsified_error_feedback_conserves_mass(mode):
    p0, gs = make_params(), make_grads()
    lr = 0.05
    ps = clone_all(p0)
    ref = RefSparsifiedSGD(ps, lr=lr, sparse_grad_size=2, mode=mode,
                           generator=torch.Generator().manual_seed(3))
    for grads in gs:
        before = clone_all(ps)
        ref.step(grads)
        for b, q, idx in zip(before, ps, ref.last_indices):
            changed = (b != q).view(-1).nonzero().view(-1)
            assert set(changed.tolist()) <= set(idx.tolist())
            assert len(set(idx.tolist())) == 2
    total = [sum(g[i] for g in gs) for i in range(len(SHAPES))]
    for p, q, mem, tot in zip(p0, ps, ref.memory, total):
        # applied updates + what is still in memory == lr * sum of grads
        torch.testing.assert_close((p - q) + mem, lr * tot, rtol=1e-12, atol=1e-13)


def test_sparsified_index_draws_follow_the_documented_contract():
    p0, gs = make_params(), make_grads(3)
    k = 2
    ps = clone_all(p0)
    ref = RefSparsifiedSGD(ps, lr=0.1, sparse_grad_size=k, random_sparse=True,
                           generator=torch.Generator().manual_seed(7))
    ps_b = clone_all(p0)
    ref_b = RefSparsifiedSGD(ps_b, lr=0.1, sparse_grad_size=k, random_sparse=False,
                             generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(7)
    gen_b = torch.Generator().manual_seed(7)
    for grads in gs:
        ref.step(grads)
        ref_b.step(grads)
        for p, idx, idx_b in zip(p0, ref.last_indices, ref_b.last_indices):
            n = p.numel()
            assert torch.equal(idx, torch.randperm(n, generator=gen)[:k])
            b = int(torch.randint(0, n // k, (1,), generator=gen_b))
            assert torch.equal(idx_b, torch.arange(b * k, b * k + k))


def test_sparsified_topk_and_index_fn():
    p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0], dtype=DT)
    g = torch.tensor([1.0, -5.0, 2.0, 4.0, -0.5], dtype=DT)
    ref = RefSparsifiedSGD([p], lr=1.0, sparse_grad_size=2, mode="topk")
    ref.step([g])
    torch.testing.assert_close(p, torch.tensor([0.0, 5.0, 0.0, -4.0, 0.0], dtype=DT))
    torch.testing.assert_close(ref.memory[0], torch.tensor([1.0, 0.0, 2.0, 0.0, -0.5], dtype=DT))
    q = torch.zeros(5, dtype=DT)
    ref2 = RefSparsifiedSGD([q], lr=1.0, sparse_grad_size=2, index_fn=lambda i, mem, k: torch.tensor([0, 4]))
    ref2.step([g])
    torch.testing.assert_close(q, torch.tensor([-1.0, 0.0, 0.0, 0.0, 0.5], dtype=DT))


def test_sparsified_estimated_weights():
    p0 = make_params()
    ps = clone_all(p0)
    ref = RefSparsifiedSGD(ps, lr=0.1, sparse_grad_size=3)
    assert_all_close(ref.get_estimated_weights(), p0)  # params untouched at construction
    ref.step(make_grads(1)[0])
    ref.update_estimated_weights(0)  # rho(t=0) == 1
    assert_all_close(ref.get_estimated_weights(), ps)
    before = clone_all(ref.get_estimated_weights())
    ref.step(make_grads(1, seed=5)[0])
    ref.update_estimated_weights(4, 3)
    for p, e0, e in zip(ps, before, ref.get_estimated_weights()):
        tau, t = p.numel() / 3, 4
        rho = 6 * (t + tau) ** 2 / ((1 + t) * (6 * tau**2 + t + 6 * tau * t + 2 * t**2))
        torch.testing.assert_close(e, (1 - rho) * e0 + rho * p)
