"""fp16 model + fp32 master weights + our AdamW tracks the fp32 run of the main job's model
(ByteGPT on real bytes of the standard library) over 100 steps, and beats fp16 params without
masters; the rounded copies our step writes (fused into the compiled Adam pass) equal
``round16(master)``, as a torch optimizer + ``masters_to_model`` gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lightning_optim as lo
from lightning_optim.data import RandomWindows, load_corpus
from lightning_optim.model import ByteGPT
from lightning_optim.precision import DynamicLossScaler, MasterWeights

SEQ = 32


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return ByteGPT(max_seq_len=SEQ, n_layer=2, n_head=2, d_model=64).to(dtype)


def _batches(steps: int) -> list[torch.Tensor]:
    train, _ = load_corpus(None, "*.py", max_bytes=400_000, val_fraction=0.1)
    windows = RandomWindows(torch.frombuffer(bytearray(train), dtype=torch.uint8), SEQ, steps * 8, seed=0)
    return [torch.stack([windows[i * 8 + j] for j in range(8)]) for i in range(steps)]


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _train(mode: str, batches: list[torch.Tensor]) -> tuple[list[float], torch.nn.Module]:
    model = _model({"fp32": torch.float32, "kahan": torch.bfloat16, "bf16": torch.bfloat16}.get(mode, torch.float16))
    losses = []
    if mode == "master":
        masters = MasterWeights(model.parameters())
        opt = lo.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
        masters.swap_into(opt)
        scaler = DynamicLossScaler(init_scale=2.0**12, scale_window=20)
    elif mode in ("kahan", "bf16"):  # bf16 params and bf16 states, with / without Kahan summation
        opt = lo.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, kahan_sum=mode == "kahan")
    else:  # fp32, or fp16 params stepped directly (fp32 states, no Kahan compensation, no masters)
        opt = lo.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, kahan_sum=False, fp32_state=True)
    for batch in batches:
        loss = _loss(model, batch)
        losses.append(loss.item())
        if mode == "master":
            scaler.scale(loss).backward()
            masters.step(opt, scaler)
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        model.zero_grad()
    return losses, model


@torch.no_grad()
def _deviation(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """|model - reference| relative to how far the reference moved from the initial weights (L2).
    At lr 3e-4 Adam's updates are below half an fp16 ulp for weights near 1 (LayerNorm): fp16
    params without masters lose them; fp32 masters keep them."""
    init = _model(torch.float32)
    num = sum((a.float() - b).pow(2).sum() for a, b in zip(model.parameters(), reference.parameters()))
    den = sum((b - c).pow(2).sum() for b, c in zip(reference.parameters(), init.parameters()))
    return float((num / den).sqrt())


@pytest.fixture(scope="module")
def runs():
    batches = _batches(100)
    return {mode: _train(mode, batches) for mode in ("fp32", "master", "fp16", "kahan", "bf16")}


def _versus_fp32(runs, mode: str) -> tuple[float, float]:
    """(weight deviation from the fp32 run, relative to its displacement; mean loss of the last 20 steps
    minus fp32's)."""
    losses, model = runs[mode]
    fp32_losses, fp32_model = runs["fp32"]
    return _deviation(model, fp32_model), (sum(losses[80:]) - sum(fp32_losses[80:])) / 20


def test_master_weights_track_fp32_and_beat_plain_fp16(runs):
    # bounded deviation over 100 steps: the weights within 2% of the fp32 run's displacement, the
    # final losses within 0.2%; fp16 params without masters deviate at least 5x more and end worse
    master_dev, master_gap = _versus_fp32(runs, "master")
    fp16_dev, fp16_gap = _versus_fp32(runs, "fp16")
    fp32_tail = sum(runs["fp32"][0][80:]) / 20
    assert master_dev < 0.02 and fp16_dev > 5 * master_dev, (master_dev, fp16_dev)
    assert abs(master_gap) < 0.002 * fp32_tail and fp16_gap > 5 * abs(master_gap), (master_gap, fp16_gap)


def test_bf16_with_kahan_tracks_fp32_and_beats_bf16_without(runs):
    """bf16 params and states: Kahan summation keeps the updates rounding would drop."""
    kahan_dev, kahan_gap = _versus_fp32(runs, "kahan")
    bf16_dev, bf16_gap = _versus_fp32(runs, "bf16")
    assert kahan_dev < 0.04 and bf16_dev > 4 * kahan_dev, (kahan_dev, bf16_dev)
    assert kahan_gap < 0.4 * bf16_gap, (kahan_gap, bf16_gap)


def _pair(optimizer_cls, fused: bool):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)).half()
    model[1].float()  # an fp32 param is its own master
    masters = MasterWeights(model.parameters())
    opt = optimizer_cls(model.parameters(), lr=1e-2)
    masters.swap_into(opt)
    return model, masters, opt


@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion", "Lamb"])
def test_our_step_writes_the_rounded_copies(name):
    ours = getattr(lo, name)
    model, masters, opt = _pair(ours, True)
    ref_model, ref_masters, ref_opt = _pair(ours, True)
    ref_opt.set_param_copies([])  # the reference rounds with a separate pass
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(8, 16, generator=g)
        for m in (model, ref_model):
            m(x.half()).float().pow(2).mean().backward()
        masters.step(opt)
        ref_masters.step(ref_opt)
        assert ref_opt._param_copies == {}
        for p, m in zip(model.parameters(), masters.masters):
            assert torch.equal(p, m.to(p.dtype))
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b)
    assert all(m.dtype == torch.float32 for m in opt.param_groups[0]["params"])


def test_masters_survive_a_state_dict_round_trip():
    model, masters, opt = _pair(lo.AdamW, True)
    model(torch.ones(2, 16).half()).float().sum().backward()
    masters.step(opt)
    state = masters.state_dict()
    model2, masters2, _ = _pair(lo.AdamW, True)
    masters2.load_state_dict(state)  # the separate masters; fp32 params come with the model's own state
    separate = [(m1, m2) for p, m1, m2 in zip(model.parameters(), masters.masters, masters2.masters) if p.dtype == torch.float16]
    assert len(separate) == 4
    for a, b in separate:
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), model2.parameters()):
        if a.dtype == torch.float16:
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="expected 4 master tensors, got 1"):
        masters2.load_state_dict({"masters": state["masters"][:1]})
