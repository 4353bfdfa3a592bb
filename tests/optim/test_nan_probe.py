"""Probe: NaN and Inf propagate as in torch's own optimizers, identically on the compiled (cpu) and
torch backends, the foreach and for-loop paths, in fp32 and bf16 (with Kahan summation), for every
optimizer. Where torch has the algorithm (Adam, AdamW, SGD, RAdam) its mask is the reference.

A sign step used to map a NaN momentum to 0 (``torch.sign(nan) = 0``): Lion and SignSGD froze the
coordinate while the param stayed finite, and Lion's kernel (which kept the NaN) disagreed with its
torch path. The one defined exception: LARS clips every gradient element to ``[-grad_clip,
grad_clip]``, so an Inf gradient is clipped like any large value (a NaN still propagates).
"""

from __future__ import annotations

import pytest
import torch

from lightning_optim import ops
from tests.optim.specs import SPECS, Spec

INJECTIONS = ("nan", "inf", "-inf", "nan_state")
TORCH = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD, "RAdam": torch.optim.RAdam}
BACKENDS = ["torch"] + (["cpu"] if ops.backend_for("cpu") == "cpu" else [])


def _nonfinite_after(make, dtype, inject):
    torch.manual_seed(0)
    p = torch.randn(64).to(dtype).requires_grad_(True)
    q = torch.randn(8).to(dtype).requires_grad_(True)
    opt = make([p, q])
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        p.grad = torch.randn(64, generator=gen).to(dtype)
        q.grad = torch.randn(8, generator=gen).to(dtype)
        if step == 2:
            if inject == "nan_state":
                state = opt.state[p]
                key = next(k for k, v in state.items() if torch.is_tensor(v) and v.dim() and k != "kahan_comp")
                state[key][5] = float("nan")
            else:
                p.grad[5] = float(inject)
        opt.step()
    return (~torch.isfinite(p.float())).nonzero().flatten().tolist(), (~torch.isfinite(q.float())).nonzero().flatten().tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_nan_and_inf_propagate_alike_everywhere(spec: Spec, dtype, monkeypatch):
    for inject in INJECTIONS:
        seen = {}
        for backend in BACKENDS:
            monkeypatch.setenv(ops.ENV_VAR, backend)
            for foreach in (True, False):
                seen[(backend, foreach)] = _nonfinite_after(
                    lambda ps: spec.cls(ps, **{**spec.kwargs, "foreach": foreach}), dtype, inject)
        assert len(set(map(str, seen.values()))) == 1, (inject, seen)  # backends and paths agree
        p_bad, _ = next(iter(seen.values()))
        clipped = spec.name == "Lars" and inject in ("inf", "-inf")
        assert (5 in p_bad) != clipped, (inject, p_bad)  # propagated (no silent freeze), or clipped by LARS
        if spec.name in TORCH and inject != "nan_state" and dtype == torch.float32:
            kwargs = {k: v for k, v in spec.kwargs.items() if k != "wd_after_momentum"}
            monkeypatch.setenv(ops.ENV_VAR, "torch")
            reference = _nonfinite_after(lambda ps: TORCH[spec.name](ps, **kwargs), dtype, inject)
            assert reference == seen[("torch", True)], (inject, reference, seen)
