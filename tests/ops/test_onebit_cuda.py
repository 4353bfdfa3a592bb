"""The CUDA 1-bit kernels (csrc/cuda/onebit_cuda.cu) against the CPU kernels (csrc/cpu/onebit_cpu.cpp) on
the same random inputs: the packed bytes (and every byte the pieces do not own, left as it was), the error
buffers, the unpacked values, the server's mean, the sums; plus the unpack of a compress against the signs
computed by torch. Awkward layouts: empty, 1-element and odd pieces, gaps between pieces, pieces across the
kernels' 8192-position block ranges, x offsets that are not 16-byte aligned, an unaligned packed buffer
(the byte-store path). Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

AWKWARD = [0, 1, 5, 7, 8, 9, 31, 32, 33, 100, 8191, 8192, 8193, 20_005]


def layout(seed: int, count: int, big: bool):
    """A pieces table [3, P] (pos, off, len), the pos-space total and the values' length."""
    g = torch.Generator().manual_seed(seed)
    pos, off, lens = [], [], []
    p = o = 0
    for i in range(count):
        n = AWKWARD[int(torch.randint(0, len(AWKWARD) - (0 if big else 4), (1,), generator=g))]
        p += 8 * int(torch.randint(0, 3, (1,), generator=g))  # a gap of 0-2 bytes nobody owns
        o += int(torch.randint(0, 4, (1,), generator=g))      # x offsets: any element
        pos.append(p), off.append(o), lens.append(n)
        p = (p + n + 7) // 8 * 8
        o += n
    total = p + 8 * int(torch.randint(0, 3, (1,), generator=g))
    return torch.tensor([pos, off, lens], dtype=torch.int64), total, o


def values(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    x[::13] = 0.0
    x[5::17] = -0.0
    return x


def both(t: torch.Tensor):
    return t.clone(), t.clone().cuda()


def same(a: torch.Tensor, b: torch.Tensor, what: str):
    """Bitwise for finite values (NaN payloads differ between CPU and GPU arithmetic)."""
    torch.testing.assert_close(b.cpu(), a, rtol=0, atol=0, equal_nan=True, msg=what)


CASES = [(1, 40, True), (2, 300, False), (3, 3, True), (4, 1, True)]


@pytest.fixture
def cuda_ext(ext):
    if not ext.with_cuda():
        pytest.skip("the extension was built without CUDA")
    return ext


@pytest.mark.parametrize("seed,count,big", CASES)
@pytest.mark.parametrize("mode", ["feedback", "residual", "signs only"])
@pytest.mark.parametrize("packed_shift", [0, 1])
def test_compress_bytes_equal_cpu_kernel(seed, count, big, mode, packed_shift, cuda_ext):
    table, total, n = layout(seed, count, big)
    x = values(n, seed)
    if n > 3:
        x[3] = float("nan")
    scales = torch.rand(table.shape[1], generator=torch.Generator().manual_seed(seed)) + 0.5
    err0 = values(total, seed + 1, 0.1)
    junk = torch.randint(0, 256, (total // 8 + packed_shift,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed + 2))
    results = []
    for dev in ("cpu", "cuda"):
        err = err0.clone().to(dev) if mode != "signs only" else None
        buf = junk.clone().to(dev)
        packed = buf[packed_shift:]  # shift 1: not 4-byte aligned, every byte stored alone
        sums = cuda_ext.onebit_seg_sumsq(x.to(dev), err, table.to(dev), total)
        cuda_ext.onebit_seg_compress(x.to(dev), err, packed, table.to(dev), total, scales.to(dev), mode == "feedback")
        results.append((buf, err, sums))
    (cbuf, cerr, csums), (gbuf, gerr, gsums) = results
    assert torch.equal(gbuf.cpu(), cbuf), "packed bytes (and the bytes outside the pieces) differ"
    if cerr is not None:
        same(cerr, gerr, "err")
    torch.testing.assert_close(gsums.cpu(), csums, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("seed,count,big", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unpack_equals_cpu_kernel_and_round_trips(seed, count, big, dtype, cuda_ext):
    table, total, n = layout(seed, count, big)
    x = values(n, seed)
    scales = torch.rand(table.shape[1], generator=torch.Generator().manual_seed(seed)) + 0.5
    packed = torch.zeros(total // 8, dtype=torch.uint8)
    cuda_ext.onebit_seg_compress(x, None, packed, table, total, scales, False)  # the CPU kernel packs
    start = values(n, seed + 3).to(dtype)  # elements outside the pieces must keep these
    outs = []
    for dev in ("cpu", "cuda"):
        out = start.clone().to(dev)
        cuda_ext.onebit_seg_unpack(packed.to(dev), table.to(dev), total, scales.to(dev), out)
        outs.append(out)
    same(outs[0], outs[1], "unpacked")
    # the round trip: +scale where x >= 0, -scale elsewhere, piece by piece
    want = start.clone()
    for (_, o, ln), s in zip(table.t().tolist(), scales.tolist()):
        seg = x[o:o + ln]
        want[o:o + ln] = torch.where(seg >= 0, torch.tensor(s), torch.tensor(-s)).to(dtype)
    same(want, outs[1], "round trip")


@pytest.mark.parametrize("seed,count,big", CASES[:3])
@pytest.mark.parametrize("world", [1, 2, 5])
def test_server_mean_equals_cpu_kernel(seed, count, big, world, cuda_ext):
    table, total, _ = layout(seed, count, big)
    g = torch.Generator().manual_seed(seed)
    stride = total // 8 + 3  # rows wider than the chunk, as the server's receive buffer may be
    rows = torch.randint(0, 256, (world, stride), dtype=torch.uint8, generator=g)
    scales = torch.rand(world, table.shape[1], generator=g)
    err0 = values(total, seed + 4, 0.1)
    got = []
    for dev in ("cpu", "cuda"):
        err = err0.clone().to(dev)
        sums = cuda_ext.onebit_server_mean(rows.to(dev), scales.to(dev), err, table.to(dev), total)
        got.append((err, sums))
    same(got[0][0], got[1][0], "server err")
    torch.testing.assert_close(got[1][1].cpu(), got[0][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 4093, 65536, 1_000_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shift", [0, 1])
def test_unpack_table_equals_cpu_kernel(n, dtype, shift, cuda_ext):
    from lightning_optim.comm.packing import sign_table

    packed = torch.randint(0, 256, ((n + 7) // 8,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    table = sign_table(dtype) * 1.5
    outs = []
    for dev in ("cpu", "cuda"):
        buf = torch.zeros(n + shift, dtype=dtype, device=dev)
        cuda_ext.onebit_unpack_table(packed.to(dev), table.to(dev), buf[shift:])  # shift 1: the scalar path
        outs.append(buf)
    same(outs[0], outs[1], "table unpack")
