"""Centralized optimizers: the bad-input sweep (one process and 2 gloo ranks), one process without
a group (the local optimizer alone), the optimizer face (schedulers after a reload), and sanity
checks of the W-worker reference itself."""

from __future__ import annotations

import pytest
import torch

import lightning_optim as lo
from lightning_optim.distributed.centralized import (
    CentralizedAdam,
    CentralizedSGD,
    CustomCentralizedOptimizer,
    GenericCentralizedOptimizer,
)
from tests.ranks import run_ranks
from tests.distributed_optim import centralized_bad_inputs as bad
from tests.distributed_optim import centralized_workers as cw
from tests.reference.centralized import RefCentralized, RefSGD, TorchLocal


def _check_sweep(results, world):
    labels = [row[0] for row in results[0]]
    assert len(labels) == len(set(labels)), "case labels must be unique"
    for rank, rows in enumerate(results):
        for label, raised, message, expected, word, untouched in rows:
            where = f"rank {rank}/{world}: {label}"
            assert raised is not None, f"{where}: nothing raised"
            assert issubclass(raised, expected), f"{where}: {raised.__name__}: {message}"
            assert word in message, f"{where}: {message!r} does not name {word!r}"
            assert untouched, f"{where}: the model changed before the refusal"


def test_bad_inputs_one_process():
    _check_sweep([bad.sweep(0, 1)], 1)


def test_bad_inputs_on_every_rank_without_a_hang():
    """Every case on 2 ranks, including mistakes made on one rank only; a hang would hit the
    30 s collective bound (CommunicationError, a wrong type) long before the run's timeout."""
    results = run_ranks(2, bad.sweep, timeout=150)
    _check_sweep(results, 2)
    one_rank = {label for label, *_ in bad.one_rank_cases(2)}
    assert one_rank <= {row[0] for row in results[1]}


# ------------------------------------------------------------------------------- one process
def _run(opt, model, steps=4, **step_kw):
    for step in range(1, steps + 1):
        for p, g in zip(model.weights, cw.rank_grads("sgd", step, 0)):
            p.grad = g.clone()
        opt.step(**step_kw)
    return [p.detach().clone() for p in model.weights]


@pytest.mark.parametrize("by_layer", [False, True])
def test_one_process_is_the_local_optimizer_alone(by_layer):
    pairs = [
        (lambda m: CentralizedSGD(None, m, by_layer=by_layer, **cw.SGD_KW),
         lambda m: lo.SGD(m.parameters(), **cw.SGD_KW)),
        (lambda m: CentralizedAdam(1, m, by_layer=by_layer, **cw.ADAM_KW),
         lambda m: lo.Adam(m.parameters(), **cw.ADAM_KW)),
        (lambda m: GenericCentralizedOptimizer(1, m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)),
         lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
        (lambda m: CustomCentralizedOptimizer(m, None, torch.optim.Adam(m.parameters(), lr=0.01), by_layer=by_layer),
         lambda m: torch.optim.Adam(m.parameters(), lr=0.01)),
    ]
    for centralized, local in pairs:
        a, b = cw.ParamModel(), cw.ParamModel()
        for x, y in zip(_run(centralized(a), a), _run(local(b), b)):
            assert torch.equal(x, y)


def test_one_process_custom_denom_and_clip():
    """average_custom divides by denom with one rank too (mlbench skips it there), then grad_clip clips."""
    a, b = cw.ParamModel(), cw.ParamModel()
    opt = CustomCentralizedOptimizer(a, 1, torch.optim.SGD(a.parameters(), lr=0.1), average_custom=True, grad_clip=0.3)
    got = _run(opt, a, denom=torch.tensor(4.0))
    local = torch.optim.SGD(b.parameters(), lr=0.1)
    for step in range(1, 5):
        for p, g in zip(b.weights, cw.rank_grads("sgd", step, 0)):
            p.grad = g / 4.0
        torch.nn.utils.clip_grad_norm_(b.parameters(), 0.3)
        local.step()
    for x, y in zip(got, b.weights):
        assert torch.equal(x, y)


def test_is_an_optimizer_for_schedulers_also_after_a_reload():
    model = cw.ParamModel()
    opt = CentralizedSGD(None, model, **cw.SGD_KW)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert isinstance(opt, torch.optim.Optimizer)
    _run(opt, model, steps=1)
    sched.step()
    saved = opt.state_dict()
    opt.load_state_dict(saved)  # the local optimizer's groups are new lists now
    sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == cw.SGD_KW["lr"] * 0.25
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    _run(opt, model, steps=2)
    assert calls == [1, 1]
    opt.zero_grad()
    assert all(p.grad is None for p in model.weights)


# ------------------------------------------------------------------------------- the reference itself
@pytest.mark.parametrize("kw", [dict(lr=0.1), cw.SGD_KW, dict(lr=0.05, momentum=0.8, nesterov=True)])
def test_reference_sgd_is_torch_sgd(kw):
    start = cw.initial_params(0)
    ref = [p.clone() for p in start]
    ps = [p.clone().requires_grad_() for p in start]
    r, t = RefSGD(ref, **kw), torch.optim.SGD(ps, **kw)
    for step in range(1, 5):
        grads = cw.rank_grads("sgd", step, 0)
        r.step(grads)
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        t.step()
    for x, y in zip(ref, ps):
        torch.testing.assert_close(x, y.detach(), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("divide_before", [False, True])
def test_reference_identical_workers_are_one_worker(divide_before):
    """W workers with the same gradients, averaged, step like one worker; summed, like W times the gradient."""
    start = cw.initial_params(0)
    for average, scale in (("world", 1.0), ("sum", 3.0)):
        ref = RefCentralized(start, 3, lambda ps: RefSGD(ps, **cw.SGD_KW), average=average, divide_before=divide_before)
        one = [p.clone() for p in start]
        alone = RefSGD(one, **cw.SGD_KW)
        for step in range(1, 5):
            grads = cw.rank_grads("sgd", step, 0)
            ref.step([grads] * 3)
            alone.step([g * scale for g in grads])
        for worker in ref.workers:
            for x, y in zip(worker, one):
                torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-14)


def test_reference_weight_averaging_of_linear_steps_is_gradient_averaging():
    """Plain SGD is linear in the gradient: averaging the weights after the step equals stepping with
    the averaged gradient (from equal starts)."""
    start = cw.initial_params(0)
    by_weights = RefCentralized(start, 2, lambda ps: TorchLocal(ps, torch.optim.SGD, lr=0.1), agg_grad=False)
    by_grads = RefCentralized(start, 2, lambda ps: RefSGD(ps, lr=0.1))
    for step in range(1, 4):
        grads = [cw.rank_grads("sgd", step, r) for r in range(2)]
        by_weights.step(grads)
        by_grads.step(grads)
    for x, y in zip(by_weights.workers[1], by_grads.workers[0]):
        torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-14)
