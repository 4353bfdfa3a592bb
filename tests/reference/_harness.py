"""What the reference sanity tests share: float64 params and grads from fixed seeds, and runners
that drive a torch.optim optimizer or a reference through the same gradient sequence."""

from __future__ import annotations

import torch

DT = torch.float64
SHAPES = [(5, 3), (7,), (2, 2, 2)]
STEPS = 12


def make_params(seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(s, generator=gen, dtype=DT) for s in SHAPES]


def make_grads(steps=STEPS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen, dtype=DT) for s in SHAPES] for _ in range(steps)]


def clone_all(ts):
    return [t.clone() for t in ts]


def assert_all_close(a, b, rtol=1e-12, atol=1e-13):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


def run_torch(opt_cls, params, grads_seq, lrs=None, **kw):
    ps = [p.clone().requires_grad_(True) for p in params]
    opt = opt_cls(ps, **kw)
    for t, grads in enumerate(grads_seq):
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[t]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


def run_ref(ref_cls, params, grads_seq, lrs=None, **kw):
    ps = clone_all(params)
    ref = ref_cls(ps, **kw)
    for t, grads in enumerate(grads_seq):
        if lrs is not None:
            ref.lr = lrs[t]
        ref.step(clone_all(grads))
    return ps


LRS = [1e-2 * (1 - t / (2 * STEPS)) for t in range(STEPS)]  # a decaying schedule
