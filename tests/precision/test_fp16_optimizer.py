"""FP16Optimizer (mlbench-core's API) against tests/reference/fp16_reference.py.

* one process, mlbench's usage (``FP16Optimizer(model.half(), 1, average_world=True)`` + our AdamW,
  or a torch optimizer): every step equals torch's optimizer on a flat fp32 copy fed the reference
  gradient (the fp16 model's grads, upcast and unscaled), and the fp16 model holds round16(master);
* 2 real gloo ranks fed different data (ONE run_workers call for every configuration): both ranks end
  identical and equal a single-process reference built from both ranks' gradients, for
  average_world / average_custom (per-rank denoms), divide_before, by_layer, multiplier and a visible
  grad_clip; an inf on one rank only is skipped by both, with the reference loss-scale schedule;
* argument errors, LossScaleUnderflow at min_scale, state_dict round trip, tracker calls.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

import lightning_optim
from lightning_optim.precision import FP16Optimizer, LossScaleUnderflow
from tests.ranks import run_ranks, seeded
from tests.reference.fp16_reference import clip_coefficient, expected_gradient, simulate_scale

STEPS = 4


# ---------------------------------------------------------------------------------------- helpers
class Net(nn.Module):
    """A small MLP plus a frozen param (not in the master) and an unused one (grad always None)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_model(seed: int = 0) -> Net:
    with seeded(seed):
        return Net().half()


def trained(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def flat16(model: nn.Module) -> torch.Tensor:
    """The trained fp16 params, flattened (still fp16)."""
    return torch.cat([p.detach().reshape(-1) for p in trained(model)])


def flat_grad32(model: nn.Module) -> torch.Tensor:
    """float32 of the trained params' fp16 grads, flattened (zeros where a grad is None)."""
    return torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.detach().reshape(-1).float()
                      for p in trained(model)])


def batch(rank: int, step: int, scale: float = 1.0):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(4, 6, generator=gen) * scale
    y = torch.randn(4, 3, generator=gen)
    return x.half(), y


def loss_fn(model: nn.Module, x, y) -> torch.Tensor:
    return ((model(x).float() - y) ** 2).mean()


def forward_backward(fp: FP16Optimizer, rank: int, step: int, data_scale: float = 1.0) -> None:
    fp.zero_grad()
    assert all(p.grad is None or not bool(p.grad.any()) for p in fp.fp16_model.parameters())
    assert fp.fp32_params.grad is None or not bool(fp.fp32_params.grad.any())
    x, y = batch(rank, step, data_scale)
    fp.backward_loss(loss_fn(fp.fp16_model, x, y))


def assert_rounds_to(fp16: torch.Tensor, master: torch.Tensor, tol: float) -> None:
    """``fp16 == round16(master)`` wherever ``master`` is known to within ``tol`` of a value whose
    rounding is unambiguous; elsewhere it is one of the two neighbouring roundings."""
    exact, lo, hi = master.half(), (master - tol).half(), (master + tol).half()
    sure = lo == hi
    assert torch.equal(fp16[sure], exact[sure])
    assert bool(((fp16 == lo) | (fp16 == hi))[~sure].all())


class Tracker:
    def __init__(self) -> None:
        self.events: list[str] = []

    def record_batch_agg(self) -> None:
        self.events.append("agg")

    def record_batch_opt_step(self) -> None:
        self.events.append("opt_step")


# ---------------------------------------------------------------------------------------- one process
def test_mlbench_usage_with_our_adamw_follows_torch_on_a_flat_copy():
    model = make_model()
    frozen_before = model.frozen.detach().clone()
    fp = FP16Optimizer(model, 1, average_world=True)
    # the master: one flat fp32 parameter holding the trained params only (frozen one excluded)
    assert fp.fp32_params.dtype == torch.float32 and fp.fp32_params.dim() == 1
    assert fp.fp32_params.numel() == 6 * 8 + 8 + 8 * 3 + 3 + 4
    assert torch.equal(fp.fp32_params.detach(), flat16(model).float())
    opt = lightning_optim.AdamW([fp.fp32_params], lr=1e-2, weight_decay=0.01)
    fp.set_optimizer(opt)
    ref = fp.fp32_params.detach().clone().requires_grad_(True)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01)
    for step in range(STEPS):
        forward_backward(fp, 0, step)
        scale = fp.loss_scaler.loss_scale
        g = flat_grad32(model)
        if step == 0:  # backward_loss really multiplied the loss by S
            clone = make_model()
            x, y = batch(0, 0)
            loss_fn(clone, x, y).backward()
            torch.testing.assert_close(g / scale, flat_grad32(clone), rtol=1e-2, atol=1e-3)
        expected = expected_gradient([g], scale=scale, average_world=True)
        assert expected is not None
        assert fp.step() is True
        # the gradient the optimizer saw: the fp16 grads upcast and unscaled, bit for bit
        assert torch.equal(fp.fp32_params.grad, expected)
        ref.grad = expected.clone()
        ref_opt.step()
        torch.testing.assert_close(fp.fp32_params.detach(), ref.detach(), rtol=0, atol=1e-6)
        assert torch.equal(flat16(model), fp.fp32_params.detach().half())
        assert_rounds_to(flat16(model), ref.detach(), tol=1e-6)
    assert torch.equal(model.frozen, frozen_before)
    assert model.unused.grad is None  # never used: a zero gradient, moved by weight decay only (checked above)


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
], ids=["torch.AdamW", "torch.SGD"])
def test_wrapped_torch_optimizer_is_bitwise_the_reference(make_opt):
    model = make_model()
    fp = FP16Optimizer(model, 1, average_world=True, init_scale=256, grad_clip=0.5)
    fp.set_optimizer(make_opt([fp.fp32_params]))
    ref = fp.fp32_params.detach().clone().requires_grad_(True)
    ref_opt = make_opt([ref])
    clipped = 0
    for step in range(STEPS):
        forward_backward(fp, 0, step, data_scale=3.0)
        g = flat_grad32(model)
        unclipped = expected_gradient([g], scale=fp.loss_scaler.loss_scale, average_world=True)
        clipped += clip_coefficient(unclipped, 0.5) < 0.9
        expected = expected_gradient([g], scale=fp.loss_scaler.loss_scale, average_world=True, grad_clip=0.5)
        assert fp.step() is True
        torch.testing.assert_close(fp.fp32_params.grad, expected, rtol=1e-6, atol=1e-9)
        # feed the reference optimizer the exact gradient the wrapper produced: the optimizer part is bitwise
        ref.grad = fp.fp32_params.grad.clone()
        ref_opt.step()
        assert torch.equal(fp.fp32_params.detach(), ref.detach())
        assert torch.equal(flat16(model), ref.detach().half())
    assert clipped >= 2  # the clip did act


def test_multiplier_divides_the_gradient_too():
    model = make_model()
    fp = FP16Optimizer(model, 1, average_world=True)
    fp.set_optimizer(torch.optim.SGD([fp.fp32_params], lr=0.1))
    forward_backward(fp, 0, 0)
    expected = expected_gradient([flat_grad32(model)], scale=1024, average_world=True, multiplier=3.0)
    assert fp.step(multiplier=3.0) is True
    assert torch.equal(fp.fp32_params.grad, expected)


def test_tracker_called_once_each_per_step_including_a_skipped_one():
    model = make_model()
    fp = FP16Optimizer(model, 1, average_world=True)
    fp.set_optimizer(torch.optim.SGD([fp.fp32_params], lr=0.1))
    tracker = Tracker()
    forward_backward(fp, 0, 0)
    assert fp.step(tracker=tracker) is True
    assert tracker.events == ["agg", "opt_step"]
    forward_backward(fp, 0, 1)
    model.fc1.weight.grad[0, 0] = float("inf")
    assert fp.step(tracker=tracker) is False
    assert tracker.events == ["agg", "opt_step"] * 2
    forward_backward(fp, 0, 2)
    fp.step()  # no tracker: nothing recorded
    assert tracker.events == ["agg", "opt_step"] * 2
    forward_backward(fp, 0, 3)
    with pytest.raises(TypeError, match="tracker"):
        fp.step(tracker=object())


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="use_horovod"):
        FP16Optimizer(make_model(), 1, use_horovod=True, average_world=True)
    with pytest.raises(ValueError, match="average_world and average_custom"):
        FP16Optimizer(make_model(), 1, average_world=True, average_custom=True)
    with pytest.raises((ValueError, TypeError), match="world_size"):
        FP16Optimizer(make_model(), 0, average_world=True)
    with pytest.raises((ValueError, TypeError), match="grad_clip"):
        FP16Optimizer(make_model(), 1, grad_clip=-1.0)
    with pytest.raises(ValueError, match="use_cuda"):
        FP16Optimizer(make_model(), 1, use_cuda=True)
    with pytest.raises(ValueError, match="world_size: 2 given, but"):  # no group of 2 ranks to average over
        FP16Optimizer(make_model(), 2, average_world=True)

    fp = FP16Optimizer(make_model(), 1, average_world=True)
    forward_backward(fp, 0, 0)
    with pytest.raises(RuntimeError, match="set_optimizer"):
        fp.step()
    other = nn.Parameter(fp.fp32_params.detach().clone())
    with pytest.raises(ValueError, match="fp32_params"):
        fp.set_optimizer(torch.optim.SGD([other], lr=0.1))
    with pytest.raises(TypeError, match="optimizer"):
        fp.set_optimizer("sgd")

    custom = FP16Optimizer(make_model(), 1, average_custom=True)
    custom.set_optimizer(torch.optim.SGD([custom.fp32_params], lr=0.1))
    before = custom.fp32_params.detach().clone()
    forward_backward(custom, 0, 0)
    with pytest.raises(ValueError, match="denom"):
        custom.step()
    with pytest.raises(ValueError, match="denom"):
        custom.step(denom=0.0)
    assert torch.equal(custom.fp32_params.detach(), before)
    fp.set_optimizer(torch.optim.SGD([fp.fp32_params], lr=0.1))
    with pytest.raises(ValueError, match="denom"):  # a denom without average_custom
        fp.step(denom=2.0)
    with pytest.raises((ValueError, TypeError), match="multiplier"):
        fp.step(multiplier=0.0)


def test_always_inf_gradients_end_in_loss_scale_underflow_at_min_scale():
    model = make_model()
    fp = FP16Optimizer(model, 1, average_world=True, init_scale=1024, scale_factor=2, min_scale=1.0)
    opt = torch.optim.AdamW([fp.fp32_params], lr=1e-2)
    fp.set_optimizer(opt)
    start_master, start16 = fp.fp32_params.detach().clone(), flat16(model).clone()
    sim = simulate_scale([True] * 30, init_scale=1024, scale_factor=2, min_scale=1.0)
    assert sim.underflow_at == 10  # 1024 -> 1 in ten back-offs, the eleventh would go to 0.5
    for step in range(sim.underflow_at):
        fp.zero_grad()
        x, y = batch(0, step)
        fp.backward_loss(loss_fn(model, x, y) * math.inf)
        assert not bool(torch.isfinite(flat_grad32(model)).all())
        assert fp.loss_scaler.loss_scale == sim.used[step]
        assert fp.step() is False
    assert fp.loss_scaler.loss_scale == sim.final == 1.0
    fp.zero_grad()
    x, y = batch(0, 99)
    fp.backward_loss(loss_fn(model, x, y) * math.inf)
    with pytest.raises(LossScaleUnderflow, match="min_scale"):
        fp.step()
    assert fp.loss_scaler.loss_scale == 1.0
    assert torch.equal(fp.fp32_params.detach(), start_master) and torch.equal(flat16(model), start16)
    assert opt.state_dict()["state"] == {}  # never stepped


def _run(fp: FP16Optimizer, steps: range, inf_at: set[int]) -> list[tuple]:
    out = []
    for step in steps:
        forward_backward(fp, 0, step)
        if step in inf_at:
            fp.fp16_model.fc2.weight.grad[1, 2] = float("inf")
        updated = fp.step()
        out.append((updated, fp.loss_scaler.loss_scale, fp.fp32_params.detach().clone(), flat16(fp.fp16_model)))
    return out


def test_state_dict_round_trip_equals_the_uninterrupted_run_bitwise():
    kw = dict(average_world=True, init_scale=512, scale_window=3, grad_clip=1.0)
    inf_at = {1, 6}
    fp = FP16Optimizer(make_model(), 1, **kw)
    fp.set_optimizer(lightning_optim.AdamW([fp.fp32_params], lr=1e-2))
    first = _run(fp, range(0, 4), inf_at)
    buffer = io.BytesIO()
    torch.save(fp.state_dict(), buffer)
    rest = _run(fp, range(4, 9), inf_at)

    fresh = FP16Optimizer(make_model(seed=7), 1, **kw)  # other weights, default scaler state
    fresh.set_optimizer(lightning_optim.AdamW([fresh.fp32_params], lr=1e-2))
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer, weights_only=False))
    assert torch.equal(fresh.fp32_params.detach(), first[-1][2])
    assert torch.equal(flat16(fresh.fp16_model), first[-1][3])
    assert fresh.loss_scaler.loss_scale == first[-1][1]
    resumed = _run(fresh, range(4, 9), inf_at)

    # the schedule crossed the save: an overflow before it, growth and an overflow after it
    sim = simulate_scale([s in inf_at for s in range(9)], init_scale=512, scale_window=3)
    assert [u for u, *_ in first + rest] == [s not in inf_at for s in range(9)]
    assert [s for _, s, *_ in first + rest] == sim.used[1:] + [sim.final]
    for (u1, s1, m1, h1), (u2, s2, m2, h2) in zip(rest, resumed):
        assert (u1, s1) == (u2, s2)
        assert torch.equal(m1, m2) and torch.equal(h1, h2)


# ---------------------------------------------------------------------------------------- two gloo ranks
CONFIGS = {
    "world": dict(kw=dict(average_world=True)),
    "world/before/by_layer": dict(kw=dict(average_world=True, divide_before=True, by_layer=True)),
    "custom": dict(kw=dict(average_custom=True, by_layer=True), denoms=((3.0, 5.0), (2.0, 9.0))),
    "custom/before": dict(kw=dict(average_custom=True, divide_before=True), denoms=((1.0, 6.0), (4.0, 0.5))),
    "world/clip/multiplier": dict(kw=dict(average_world=True, grad_clip=0.05), multiplier=3.0),
    "custom/before/by_layer/clip": dict(kw=dict(average_custom=True, divide_before=True, by_layer=True,
                                                grad_clip=0.02), denoms=((2.0, 3.0), (7.0, 1.0)),
                                        multiplier=2.0),
}
OVERFLOW = dict(kw=dict(average_world=True, init_scale=1024, scale_window=2), steps=9,
                inf_at={2: 0, 5: 1, 6: 0})  # step -> the only rank whose fp16 grad gets a non-finite value


def _denom(cfg: dict, rank: int, step: int):
    if "denoms" not in cfg:
        return None
    d = cfg["denoms"][rank][step % 2] + step
    return torch.tensor(d) if step % 2 else d  # a tensor (mlbench's token counts) or a float


def _train_rank(rank: int, cfg: dict, steps: int, inf_at: dict[int, int]) -> list[dict]:
    model = make_model()
    fp = FP16Optimizer(model, 2, **cfg["kw"])
    fp.set_optimizer(torch.optim.SGD([fp.fp32_params], lr=0.05, momentum=0.9))
    out = []
    for step in range(steps):
        forward_backward(fp, rank, step)
        if inf_at.get(step) == rank:
            model.fc1.weight.grad[3, 1] = float("inf") if step % 2 else float("nan")
        record = dict(grad=flat_grad32(model), scale=fp.loss_scaler.loss_scale)
        record["updated"] = fp.step(multiplier=cfg.get("multiplier", 1), denom=_denom(cfg, rank, step))
        record.update(master=fp.fp32_params.detach().clone(), half=flat16(model), scale_after=fp.loss_scaler.loss_scale)
        out.append(record)
    return out


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message goes back to the parent
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def two_rank_worker(rank: int, world: int) -> dict:
    out = {name: _train_rank(rank, cfg, STEPS, {}) for name, cfg in CONFIGS.items()}
    out["overflow"] = _train_rank(rank, OVERFLOW, OVERFLOW["steps"], OVERFLOW["inf_at"])
    out["errors"] = {
        "world_size mismatch": _error(lambda: FP16Optimizer(make_model(), 3, average_world=True)),
        "world_size 1 in a group of 2": _error(lambda: FP16Optimizer(make_model(), 1, average_world=True)),
        "no averaging flag": _error(lambda: FP16Optimizer(make_model(), 2)),
    }
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(2, two_rank_worker, timeout=120)


def _reference_run(records: list[list[dict]], cfg: dict) -> list[torch.Tensor | None]:
    """Single-process replay from both ranks' recorded fp16 grads: the master after each step."""
    ref = make_model()
    master = flat16(ref).float().requires_grad_(True)
    opt = torch.optim.SGD([master], lr=0.05, momentum=0.9)
    kw = cfg["kw"]
    masters = []
    for step in range(len(records[0])):
        denoms = None
        if kw.get("average_custom"):
            denoms = [float(_denom(cfg, r, step)) for r in range(2)]
        expected = expected_gradient(
            [records[r][step]["grad"] for r in range(2)], scale=records[0][step]["scale"],
            average_world=kw.get("average_world", False), average_custom=kw.get("average_custom", False),
            denoms=denoms, divide_before=kw.get("divide_before", False), multiplier=cfg.get("multiplier", 1.0),
            grad_clip=kw.get("grad_clip", math.inf))
        if expected is not None:
            if math.isfinite(kw.get("grad_clip", math.inf)):
                unclipped = expected_gradient(
                    [records[r][step]["grad"] for r in range(2)], scale=records[0][step]["scale"],
                    average_world=kw.get("average_world", False), average_custom=kw.get("average_custom", False),
                    denoms=denoms, divide_before=kw.get("divide_before", False),
                    multiplier=cfg.get("multiplier", 1.0))
                assert clip_coefficient(unclipped, kw["grad_clip"]) < 0.5, "the clip must act on every step"
            master.grad = expected
            opt.step()
        masters.append(master.detach().clone())
    return masters


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_ranks_agree_and_equal_the_reference(two_ranks, name):
    cfg = CONFIGS[name]
    records = [two_ranks[0][name], two_ranks[1][name]]
    assert not torch.equal(records[0][0]["grad"], records[1][0]["grad"])  # the ranks saw different data
    for a, b in zip(*records):
        assert a["updated"] is b["updated"] is True
        assert torch.equal(a["master"], b["master"]) and torch.equal(a["half"], b["half"])
        assert torch.equal(a["half"], a["master"].half())
    clip = math.isfinite(cfg["kw"].get("grad_clip", math.inf))
    for step, want in enumerate(_reference_run(records, cfg)):
        got = records[0][step]["master"]
        if clip:  # the clip coefficient is computed in float64 by the reference, float32 by torch
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got, want), f"step {step}: max diff {(got - want).abs().max().item()}"


def test_two_ranks_modes_really_differ(two_ranks):
    """The configurations are not all the same run (a wrapper ignoring denom or clip would fail above)."""
    finals = {name: two_ranks[0][name][-1]["master"] for name in CONFIGS}
    assert not torch.allclose(finals["world"], finals["custom"], rtol=1e-3, atol=1e-4)
    assert not torch.allclose(finals["world"], finals["world/clip/multiplier"], rtol=1e-3, atol=1e-4)


def test_an_overflow_on_one_rank_is_skipped_by_both(two_ranks):
    records = [two_ranks[0]["overflow"], two_ranks[1]["overflow"]]
    inf_at = OVERFLOW["inf_at"]
    flags = [step in inf_at for step in range(OVERFLOW["steps"])]
    sim = simulate_scale(flags, init_scale=1024, scale_factor=2, scale_window=2)
    assert sim.skipped == sorted(inf_at) and sim.underflow_at is None
    assert len(set(sim.used)) >= 3  # the schedule both grew and backed off
    for rank in range(2):
        for step, rec in enumerate(records[rank]):
            # only one rank's grad holds the non-finite value, yet both skip
            assert bool(torch.isfinite(rec["grad"]).all()) is (inf_at.get(step) != rank)
            assert rec["updated"] is (step not in inf_at), (rank, step)
            assert rec["scale"] == sim.used[step]
            if step in inf_at:
                prev_master = records[rank][step - 1]["master"]
                prev_half = records[rank][step - 1]["half"]
                assert torch.equal(rec["master"], prev_master) and torch.equal(rec["half"], prev_half)
        assert records[rank][-1]["scale_after"] == sim.final
    for a, b in zip(*records):
        assert torch.equal(a["master"], b["master"]) and a["scale_after"] == b["scale_after"]
    for step, want in enumerate(_reference_run(records, OVERFLOW)):
        assert torch.equal(records[0][step]["master"], want), step


def test_group_errors_name_the_argument(two_ranks):
    for rank in range(2):
        errors = two_ranks[rank]["errors"]
        assert errors["world_size mismatch"].startswith("ValueError") and "world_size" in errors["world_size mismatch"]
        assert "3" in errors["world_size mismatch"] and "2" in errors["world_size mismatch"]
        assert errors["world_size 1 in a group of 2"].startswith("ValueError")
        assert errors["no averaging flag"].startswith("ValueError")
        assert "average_world" in errors["no averaging flag"] and "average_custom" in errors["no averaging flag"]
