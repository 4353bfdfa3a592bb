"""1-bit kernels against lightning_optim.comm.packing and comm.pieces' torch fallback: the table
unpacking of ``unpack_signs``, and the per-piece passes of the compressed allreduce (norms, sign
packing with error feedback, the server's mean, unpacking)."""

from __future__ import annotations

import pytest
import torch

from lightning_optim.comm.packing import pack_signs, sign_table, unpack_into, unpack_signs
from tests.ops.conftest import KERNEL_BACKENDS, device_of

SIZES = [1, 7, 8, 9, 65, 32768, 32769, 65537, 1_000_003]


def values(n: int, device: str) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[::7] = 0.0
    x[3::11] = -0.0
    if n > 5:
        x[5] = float("nan")
    return x.to(device)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("n", [8, 64, 32768, 1_000_000])
def test_unpack_table_matches_unpack_into(n, backend, ext):
    device = device_of(backend)
    packed = torch.randint(0, 256, (n // 8,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        table = (sign_table(dtype) * 1.5).to(device)
        want = torch.empty(n, dtype=dtype)
        unpack_into(packed.cpu(), want, table.cpu())
        got = torch.empty(n, dtype=dtype, device=device)
        ext.onebit_unpack_table(packed, table, got)
        assert torch.equal(got.cpu(), want)


# ------------------------------------------------------------------ pieces (per-segment scales)
def _segment_plan(world: int):
    from lightning_optim.comm.plan import CompressionPlan

    # tiny, empty, odd and work-item-straddling segments
    return CompressionPlan(70_000 + 13 + 5 + 1, world, [13, 0, 70_000, 5, 1])


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("world", [2, 3])
def test_piece_kernels_match_torch_fallback(world, backend, ext, monkeypatch):
    """The four passes of comm/pieces.py: compiled kernels against the torch index operations."""
    from lightning_optim.comm import pieces as passes

    device = torch.device(device_of(backend))
    plan = _segment_plan(world)
    g = torch.Generator().manual_seed(world)
    x = (torch.randn(plan.numel, generator=g) * 3).to(device)
    err0 = (torch.randn(plan.padded, generator=g) * 0.1).to(device)
    err0[plan.worker.table[0, -1] + 1:] = 0  # the padding never holds error
    rows = torch.randint(0, 256, (world, plan.chunk // 8), dtype=torch.uint8, generator=g).to(device)

    def run(backend_name: str):
        monkeypatch.setenv("LIGHTNING_OPTIM_BACKEND", backend_name)
        wk = plan.worker.on(device)
        err, packed = err0.clone(), torch.zeros(plan.padded // 8, dtype=torch.uint8, device=device)
        sums = passes.sumsq(x, err, wk)
        scales = wk.scales(sums)
        passes.compress(x, err, packed, scales, wk, add_err=True)
        out = torch.zeros(plan.numel, device=device)
        passes.unpack(packed, scales, out, wk)
        server = plan.server[1].on(device)
        serr = (torch.randn(plan.chunk, generator=torch.Generator().manual_seed(5)) * 0.1).to(device)
        wscales = torch.rand(world, server.count, generator=torch.Generator().manual_seed(6)).to(device)
        ssums = passes.server_mean(rows, wscales, serr, server)
        return sums, scales, err, packed, out, ssums, serr

    kernel, torch_path = run(backend), run("torch")
    names = ["sums", "scales", "err", "packed", "out", "server sums", "server err"]
    for name, a, b in zip(names, kernel, torch_path):
        if name in ("sums", "server sums"):
            # fp32 sums of squares in another order (the SIMD lane count depends on the CPU)
            rel = ((a.cpu().double() - b.cpu().double()).abs() / b.cpu().double().abs().clamp_min(1e-30)).max().item()
            assert rel < 1e-5, (name, rel)
        elif name == "scales":
            torch.testing.assert_close(a.cpu(), b.cpu(), rtol=2e-7, atol=0, msg=name)
        else:  # given equal scales the element-wise results are bitwise equal; the scales may differ by an ulp
            torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-6, atol=1e-6, msg=name)
    # the signs themselves do not depend on the scale
    assert torch.equal(kernel[3].cpu(), torch_path[3].cpu())
