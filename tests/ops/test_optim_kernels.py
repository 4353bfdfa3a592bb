"""Every optimizer on every kernel backend agrees with the torch fallback (the foreach math):
fp32 within ~1e-6 relative, 16-bit params (fp32 state, Kahan) within a few ulps; states too;
accumulation steps included; any layout (many small tensors, a few big ones, odd sizes)."""

from __future__ import annotations

import pytest
import torch

from lightning_optim import ops
from tests.ops.conftest import KERNEL_BACKENDS, device_of
from tests.optim.specs import SPECS

SHAPES = [(7, 5), (13,), (65537,), (1,), (3, 4, 2)]
STEPS = 6
ACCUMULATE_AT = 2  # this step only accumulates into the states


def run(spec, backend, dtype, extra, monkeypatch, shapes=SHAPES, steps=STEPS, device="cpu"):
    monkeypatch.setenv(ops.ENV_VAR, backend)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_()
              for s in shapes]
    opt = spec.cls(params, **{**spec.kwargs, **extra})
    grads = torch.Generator().manual_seed(1)
    for i in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads, dtype=torch.float64).to(device=device, dtype=dtype)
        if spec.accumulates:
            opt.optimizer_accumulation = i == ACCUMULATE_AT
        opt.step()
    return params, opt


def ulps(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest |a - b| in units of the last place of ``dtype`` at ``b``."""
    mant = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    exp = torch.floor(torch.log2(b.abs().clamp_min(2.0**-14)))
    return ((a - b).abs() / torch.exp2(exp - mant)).max().item()


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().cpu().reshape(-1) for t in tensors])


def _assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor], msg: str, **tol) -> None:
    """``assert_close`` of every pair at once: dtypes and shapes pair by pair, values element by element on
    the concatenation (the same element-wise check as pair by pair, in one call instead of hundreds for
    the many-small layout)."""
    assert [(t.dtype, t.shape) for t in got] == [(t.dtype, t.shape) for t in want], msg
    torch.testing.assert_close(_flat(got), _flat(want), **tol, msg=lambda detail: f"{msg}: {detail}")


def compare(spec, backend, dtype, extra, monkeypatch, **kw):
    got, opt_k = run(spec, backend, dtype, extra, monkeypatch, device=device_of(backend), **kw)
    want, opt_t = run(spec, "torch", dtype, extra, monkeypatch, **kw)
    if dtype == torch.float32:
        _assert_all_close(got, want, f"{spec}: params", rtol=1e-6, atol=1e-7)
    else:
        assert [(p.dtype, p.shape) for p in got] == [(q.dtype, q.shape) for q in want]
        assert ulps(_flat(got), _flat(want), dtype) <= 2, f"{spec}: params differ by more than 2 ulps"
    # states: fp32 math; with 16-bit params an ulp flip of p feeds back through L2/decay terms
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-4)
    pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # key -> (kernel's, torch's), param by param
    for p, q in zip(got, want):
        for key, value in opt_t.state[q].items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "kahan_comp":
                pairs.setdefault(key, []).append((opt_k.state[p][key], value))
    for key, both in pairs.items():
        _assert_all_close([a for a, _ in both], [b for _, b in both], f"{spec} {key}", **tol)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_fp32_matches_torch(spec, backend, use_backend, monkeypatch):
    compare(spec, backend, torch.float32, {}, monkeypatch)


LOW_PRECISION = [
    (torch.bfloat16, dict(fp32_state=True)),                    # Kahan on by default
    (torch.bfloat16, dict(fp32_state=True, kahan_sum=False)),
    (torch.float16, dict(fp32_state=True)),
]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype,extra", LOW_PRECISION, ids=["bf16-kahan", "bf16", "fp16-kahan"])
@pytest.mark.parametrize("spec", [s for s in SPECS if s.name != "CPUAdam"], ids=str)
def test_low_precision_params_match_torch(spec, dtype, extra, backend, use_backend, monkeypatch):
    compare(spec, backend, dtype, {**extra, "lr": spec.kahan_lr}, monkeypatch)


LAYOUTS = {
    "many-small": [(int(n),) for n in torch.randint(1, 300, (300,), generator=torch.Generator().manual_seed(3))],
    "few-big": [(100_003,), (3, 40_000)],
    "odd": [(1,), (7,), (65537,), (32768,), (32769,)],
}
LAYOUT_SPECS = [s for s in SPECS if s.name in ("AdamW", "SGD", "Lamb", "Lion", "Adan", "Lars", "StableAdamW")]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("spec", LAYOUT_SPECS, ids=str)
def test_layouts(spec, layout, backend, use_backend, monkeypatch):
    compare(spec, backend, torch.float32, {}, monkeypatch, shapes=LAYOUTS[layout], steps=3)
    compare(spec, backend, torch.bfloat16, dict(fp32_state=True), monkeypatch, shapes=LAYOUTS[layout], steps=3)


FUSED = {"Adam": "adam", "AdamW": "adam", "FusedAdam": "adam", "CPUAdam": "adam", "SGD": "sgd", "FusedSGD": "sgd",
         "Lamb": "lamb_apply", "FusedLamb": "lamb_apply", "Lars": "lars", "Lion": "lion", "Adan": "adan",
         "StableAdamW": "stable_apply"}


@pytest.mark.parametrize("spec", [s for s in SPECS if s.name in FUSED], ids=str)
def test_kernel_is_used(spec, ext, monkeypatch):
    """The cpu backend really runs the compiled kernel (a spy on the extension function)."""
    calls = []
    real = getattr(ext, FUSED[spec.name])
    monkeypatch.setattr(ext, FUSED[spec.name], lambda *a, **k: calls.append(1) or real(*a, **k))
    run(spec, "cpu", torch.float32, {}, monkeypatch, steps=2)
    assert calls


def test_unsupported_batches_take_the_torch_path(ext, monkeypatch):
    """fp64 params, 16-bit states and non-contiguous params run the foreach math (same results)."""
    monkeypatch.setenv(ops.ENV_VAR, "cpu")
    calls = []
    real = ext.adam
    monkeypatch.setattr(ext, "adam", lambda *a, **k: calls.append(1) or real(*a, **k))
    cases = [
        [torch.randn(5, dtype=torch.float64, requires_grad=True)],
        [torch.randn(5, dtype=torch.bfloat16, requires_grad=True)],  # states in bf16 (fp32_state=False)
        [torch.nn.Parameter(torch.randn(4, 6).t())],                 # non-contiguous
    ]
    for params in cases:
        before = [p.detach().clone() for p in params]
        opt = torch.optim.AdamW(before, lr=1e-2) if False else None
        ref = [p.detach().clone().requires_grad_() for p in params]
        for p, r in zip(params, ref):
            p.grad = torch.ones_like(p)
            r.grad = torch.ones_like(r)
        import lightning_optim.optim as lo

        lo.AdamW(params, lr=1e-2).step()
        monkeypatch.setenv(ops.ENV_VAR, "torch")
        lo.AdamW(ref, lr=1e-2).step()
        monkeypatch.setenv(ops.ENV_VAR, "cpu")
        for p, r in zip(params, ref):
            assert torch.equal(p, r)
        del before, opt
    assert not calls


def test_raw_kernel_refuses_bad_input(ext):
    p = torch.randn(4, 6).t()
    g = torch.randn(6, 4)
    m, v = torch.zeros(6, 4), torch.zeros(6, 4)
    with pytest.raises(ValueError, match="contiguous"):
        ext.adam([p], [g], [m], [v], [], [], [], 0.1, 0.999, 0.001, -1e-3, 1.0, 1e-8, 0.0, 1.0, -0.0, True)
    with pytest.raises(ValueError, match="elements"):
        ext.adam([torch.zeros(3)], [torch.zeros(4)], [torch.zeros(3)], [torch.zeros(3)], [], [], [],
                 0.1, 0.999, 0.001, -1e-3, 1.0, 1e-8, 0.0, 1.0, -0.0, True)
    with pytest.raises(TypeError, match="float32"):
        ext.adam([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3, dtype=torch.bfloat16)], [torch.zeros(3)], [], [],
                 [], 0.1, 0.999, 0.001, -1e-3, 1.0, 1e-8, 0.0, 1.0, -0.0, True)


def test_master_weight_copy(ext):
    """fp32 master params + a rounded bf16/fp16 copy written in the same pass."""
    for dtype in (torch.bfloat16, torch.float16):
        p = torch.randn(1000)
        g = torch.randn(1000)
        m, v = torch.zeros(1000), torch.zeros(1000)
        copy = torch.empty(1000, dtype=dtype)
        ext.adam([p], [g], [m], [v], [], [], [copy], 0.1, 0.999, 0.001, -1e-3 / 0.1, 0.001**0.5, 1e-8, 0.0, 1.0, -0.0,
                 True)
        assert torch.equal(copy, p.to(dtype))
