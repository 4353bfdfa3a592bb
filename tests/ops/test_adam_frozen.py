"""``adam_frozen``: 1-bit Adam's compression-stage update (momentum final, variance frozen) reads m and v
and writes only the params: the same params, bit for bit, as the full Adam kernel run with
``beta1 = 0, beta2 = 1`` on the same momenta (which rewrites m and v with their own values)."""

from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import KERNEL_BACKENDS, device_of
from tests.ops.conftest import ext  # noqa: F401  (fixture: the built extension)

HYPER = dict(step=-1e-2 / 0.3, sqrt_bc2=0.8, eps=1e-8, keep=1 - 1e-3, neg_decay=-1e-3)


def lists(dtype, device, kahan):
    gen = torch.Generator().manual_seed(3)
    shapes = [(7,), (33, 5), (1024,)]
    params = [torch.randn(s, generator=gen).to(dtype).to(device) for s in shapes]
    m = [torch.randn(s, generator=gen).to(device) for s in shapes]
    v = [torch.rand(s, generator=gen).to(device) for s in shapes]
    comps = [torch.randn(s, generator=gen).mul(1e-3).to(dtype).to(device) for s in shapes] if kahan else []
    return params, m, v, comps


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype,kahan", [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False)])
def test_frozen_update_equals_the_full_kernel_with_beta1_0_beta2_1(backend, dtype, kahan, ext):
    device = device_of(backend)
    p1, m1, v1, c1 = lists(dtype, device, kahan)
    p2, m2, v2, c2 = lists(dtype, device, kahan)
    ext.adam_frozen(params=p1, momenta=m1, exp_avg_sqs=v1, kahan_comps=c1, **HYPER)
    ext.adam(p2, [m.clone() for m in m2], m2, v2, [], c2, [], 1.0, 1.0, 0.0, HYPER["step"], HYPER["sqrt_bc2"],
             HYPER["eps"], 0.0, HYPER["keep"], HYPER["neg_decay"], True)
    if device == "cpu":
        for a, b in zip(p1 + c1 + m1 + v1, p2 + c2 + m2 + v2):
            assert torch.equal(a, b)
    else:  # nvcc fuses multiply-adds differently in the two kernels: the fp32 update differs in its last
        # bits, which a Kahan pair p + c keeps (H100, bf16: 7.5e-9 on a pair of 3.8e-5, the comp 16 of its own
        # ulps off): the pairs must agree to fp32 rounding of the tensor's scale, the rest to an ulp
        for a, b in zip(p1 + m1 + v1, p2 + m2 + v2):
            torch.testing.assert_close(a, b, rtol=torch.finfo(a.dtype).eps, atol=0)
        for a, ca, b, cb in zip(p1, c1, p2, c2):
            scale = b.float().abs().max().item()
            torch.testing.assert_close(a.float() + ca.float(), b.float() + cb.float(), rtol=0,
                                       atol=4 * torch.finfo(torch.float32).eps * scale)
    assert not torch.equal(p1[0], lists(dtype, device, kahan)[0][0])  # the params did move


def test_frozen_update_refuses_missing_or_mismatched_lists(ext):
    params, m, v, _ = lists(torch.float32, "cpu", False)
    before = [p.clone() for p in params]
    with pytest.raises(ValueError, match="momenta: required"):
        ext.adam_frozen(params=params, momenta=[], exp_avg_sqs=v, kahan_comps=[], **HYPER)
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[1\]: 7 elements"):
        ext.adam_frozen(params=params, momenta=m, exp_avg_sqs=[v[0], v[0], v[2]], kahan_comps=[], **HYPER)
    with pytest.raises(TypeError, match=r"momenta\[0\]: must be float32"):
        ext.adam_frozen(params=params, momenta=[t.half() for t in m], exp_avg_sqs=v, kahan_comps=[], **HYPER)
    assert all(torch.equal(a, b) for a, b in zip(params, before))
