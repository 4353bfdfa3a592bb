"""``flatten_parameters``: params and grads rehomed into one buffer per (device, dtype)
keep training identical, bit for bit, for every optimizer of the family on both backends; the compiled
kernels then get one span per list instead of one tensor per param, and the cached spans are dropped when
a param moves, a state tensor is replaced or the grads are new tensors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_optim
from lightning_optim import ops
from lightning_optim.ops import coalesce
from tests.distributed import torchrun_results
from tests.ops.conftest import ext  # noqa: F401  (fixture: the built extension)
from tests.optim.specs import SPECS

KERNEL_LISTS = {"Adam": "adam", "AdamW": "adam", "FusedAdam": "adam", "CPUAdam": "adam", "SGD": "sgd",
                "FusedSGD": "sgd", "Lion": "lion"}


def model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 2))
    return net.to(dtype)


def batches(steps: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(5, 7, generator=gen).to(dtype) for _ in range(steps)]


def train(net: nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor], between=None) -> None:
    for i, x in enumerate(xs):
        net(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if between is not None:
            between(i, net, opt)


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name}: differs by {(p - q).abs().max()}"


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_flat_training_is_bitwise_the_same(spec, backend, monkeypatch, ext):
    monkeypatch.setenv(ops.ENV_VAR, backend)
    plain, flat = model(), model()
    handle = lightning_optim.flatten_parameters(flat)
    xs = batches(5)
    train(plain, spec.cls(plain.parameters(), **spec.kwargs), xs)
    train(flat, spec.cls(flat.parameters(), **spec.kwargs), xs)
    assert_same(plain, flat)
    # still one buffer for params and one for grads, each param and grad a view of them
    assert len(handle.param_buffers) == len(handle.grad_buffers) == 1
    buffer, grad_buffer = handle.param_buffers[0], handle.grad_buffers[0]
    for p in flat.parameters():
        assert p.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert p.grad is not None and p.grad.untyped_storage().data_ptr() == grad_buffer.untyped_storage().data_ptr()
        assert not p.grad.any()  # zero_grad() zeroed it in place


@pytest.mark.parametrize("name", sorted(KERNEL_LISTS))
def test_the_kernel_gets_one_span_per_list(name, monkeypatch, ext):
    monkeypatch.setenv(ops.ENV_VAR, "cpu")
    spec = next(s for s in SPECS if s.name == name)
    kernel = KERNEL_LISTS[name]
    lengths = []
    real = getattr(ext, kernel)

    def spy(*args, **kwargs):
        lengths.append(len(kwargs["params"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(ext, kernel, spy)
    for flatten, expected in ((False, 6), (True, 1)):
        net = model()
        if flatten:
            lightning_optim.flatten_parameters(net)
        lengths.clear()
        train(net, spec.cls(net.parameters(), **spec.kwargs), batches(3))
        assert lengths == [expected] * 3


def rehome_one_param(i, net, opt):
    if i == 1:
        p = net[2].weight
        p.data = p.data.clone()  # this param leaves the flat buffer


def replace_a_state(i, net, opt):
    if i == 1:
        state = opt.state[net[2].weight]
        key = next(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim())
        state[key] = state[key].clone()


def torch_zero_grad(i, net, opt):
    if i == 1:
        net.zero_grad()  # torch's: drops the flat grads, the next backward allocates fresh ones
    if i == 3:
        handle.zero_grad()  # back to the flat views


handle = None


@pytest.mark.parametrize("change", [rehome_one_param, replace_a_state, torch_zero_grad],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion"])
def test_cached_spans_follow_changes(change, name, monkeypatch, ext):
    global handle
    monkeypatch.setenv(ops.ENV_VAR, "cpu")
    spec = next(s for s in SPECS if s.name == name)
    plain, flat = model(), model()
    handle = lightning_optim.flatten_parameters(flat)
    xs = batches(6)
    opts = [spec.cls(net.parameters(), **spec.kwargs) for net in (plain, flat)]
    train(plain, opts[0], xs, change if change is not torch_zero_grad else None)
    train(flat, opts[1], xs, change)
    assert_same(plain, flat)
    states = [[opt.state[p] for p in net.parameters()] for opt, net in zip(opts, (plain, flat))]
    for a, b in zip(*states):  # the states the optimizer shows are the ones it updated
        for key, value in a.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b[key])), key


def test_mixed_dtypes_get_one_buffer_each(ext):
    plain, flat = model(), model()
    for net in (plain, flat):
        net[4].to(torch.bfloat16)
    handle = lightning_optim.flatten_parameters(flat)
    assert sorted(str(b.dtype) for b in handle.param_buffers) == ["torch.bfloat16", "torch.float32"]
    assert "2 buffers" in repr(handle)

    def run(net):
        opt = lightning_optim.AdamW(net.parameters(), lr=1e-2)
        for x in batches(4):
            net[4](net[3](net[2](net[1](net[0](x)))).to(torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    run(plain)
    run(flat)
    assert_same(plain, flat)


def test_checkpoint_moves_between_flat_and_plain(ext):
    spec_kwargs = dict(lr=1e-2, weight_decay=0.1)
    xs = batches(6)
    straight = model()
    train(straight, lightning_optim.AdamW(straight.parameters(), **spec_kwargs), xs)
    first = model()
    lightning_optim.flatten_parameters(first)
    opt = lightning_optim.AdamW(first.parameters(), **spec_kwargs)
    train(first, opt, xs[:3])
    saved = copy.deepcopy((first.state_dict(), opt.state_dict()))
    resumed = model()  # plain this time
    resumed.load_state_dict(saved[0])
    opt = lightning_optim.AdamW(resumed.parameters(), **spec_kwargs)
    opt.load_state_dict(saved[1])
    train(resumed, opt, xs[3:])
    assert_same(straight, resumed)


def test_grads_false_leaves_gradients_alone():
    net = model()
    handle = lightning_optim.flatten_parameters(net, grads=False)
    assert handle.grad_buffers == [] and all(p.grad is None for p in net.parameters())
    net(batches(1)[0]).sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_existing_grads_are_kept_and_values_unchanged():
    net, ref = model(), model()
    for n in (net, ref):
        n(batches(1)[0]).sum().backward()
    lightning_optim.flatten_parameters(net)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad) and p.requires_grad


def test_frozen_params_stay_where_they_are():
    net = model()
    frozen = net[0].weight
    frozen.requires_grad_(False)
    before = frozen.data_ptr()
    handle = lightning_optim.flatten_parameters(net)
    assert frozen.data_ptr() == before and len(handle.params) == 5


@pytest.mark.parametrize("make,match", [
    (lambda: (model(), {"grads": 1}), "grads must be True or False"),
    (lambda: ([torch.zeros(2, requires_grad=True), "w"], {}), "parameter 1 is a str"),
    (lambda: ([torch.zeros(2, requires_grad=True) * 2], {}), "parameter 0 is not a leaf"),
    (lambda: (shared_storage(), {}), "parameters 0 and 1 share storage"),
    (lambda: (flattened(), {}), "parameter 0 is already flattened"),
])
def test_bad_input_is_refused_before_anything_moves(make, match):
    module, kwargs = make()
    params = list(module.parameters()) if isinstance(module, nn.Module) else list(module)
    before = [p.data_ptr() if isinstance(p, torch.Tensor) else None for p in params]
    with pytest.raises((ValueError, TypeError), match=match):
        lightning_optim.flatten_parameters(module, **kwargs)
    assert before == [p.data_ptr() if isinstance(p, torch.Tensor) else None for p in params]


def shared_storage():
    base = torch.zeros(6)
    return [nn.Parameter(base[:3]), nn.Parameter(base[3:])]


def flattened():
    net = model()
    lightning_optim.flatten_parameters(net)
    return net


def test_coalesce_merges_runs_and_leaves_gaps():
    buffer = torch.arange(10.0)
    a, b, c = buffer[0:2], buffer[2:5], buffer[6:8]  # a, b adjacent; a gap before c
    assert coalesce.adjacent_runs([[a, b, c]]) == [(0, 2), (2, 3)]
    assert torch.equal(coalesce.span([a, b]), buffer[0:5])
    other = torch.arange(8.0)
    # a run must hold in every list
    assert coalesce.adjacent_runs([[a, b, c], [other[0:2], other[3:6], other[6:8]]]) == [(0, 1), (1, 2), (2, 3)]
    cache = {}
    lists = {"params": [a, b, c], "grads": [a.clone(), b.clone(), c.clone()]}
    assert coalesce.coalesced(cache, lists) is lists  # nothing adjacent in the grads: given back, one miss
    assert cache["misses"] == 1


def test_ddp_with_bucket_view_grads_under_torchrun(tmp_path: Path):
    root = Path(__file__).resolve().parents[2]
    results = torchrun_results(root / "tests/optim/flat_params_ddp.py", tmp_path, cwd=root)
    for rank, res in enumerate(results):
        assert res["flat"]["storages"] == 1 and res["plain"]["storages"] > 1
        for a, b in zip(res["plain"]["params"], res["flat"]["params"]):
            assert torch.equal(a, b), f"rank {rank}"
    for a, b in zip(results[0]["flat"]["params"], results[1]["flat"]["params"]):
        assert torch.equal(a, b)
