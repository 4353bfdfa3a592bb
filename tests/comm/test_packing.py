"""Sign packing: round trip, sign(0) = +1, bit order, padding, fast path == portable path."""
from __future__ import annotations

import pytest
import torch

import lightning_optim.comm.packing as packing
from lightning_optim.comm import pack_signs, unpack_signs


def _signs(x: torch.Tensor) -> torch.Tensor:
    return (x >= 0).to(x.dtype) * 2 - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 63, 64, 65, 1000, 4099])
def test_round_trip(numel, dtype):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g).to(dtype)
    x[:: 5] = 0  # zeros must come back as +1
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == (numel + 7) // 8
    back = unpack_signs(packed, numel, dtype)
    assert back.dtype == dtype and back.shape == (numel,)
    assert torch.equal(back, _signs(x))


def test_sign_zero_and_bit_order():
    x = torch.tensor([0.0, -0.0, -1.0, 2.0, -3.0, -4.0, 5.0, -6.0, -7.0, 1e-30])
    packed = pack_signs(x)
    # element 8k+i -> bit i of byte k; +1 where x >= 0 (both zeros); padding bits are +1
    assert packed.tolist() == [0b01001011, 0b11111110]
    assert unpack_signs(packed, 10).tolist() == [1, 1, -1, 1, -1, -1, 1, -1, -1, 1]
    assert pack_signs(torch.zeros(3)).tolist() == [0xFF]
    assert pack_signs(x.view(2, 5)).tolist() == packed.tolist()  # any shape, flattened


def test_fast_path_matches_portable_path(monkeypatch):
    g = torch.Generator().manual_seed(0)
    bits = torch.randn(8 * 777, generator=g) >= 0
    fast = packing.pack_bits_(bits.clone(), torch.empty(777, dtype=torch.uint8))
    monkeypatch.setattr(packing, "_LITTLE_ENDIAN", False)
    portable = packing.pack_bits_(bits.clone(), torch.empty(777, dtype=torch.uint8))
    assert torch.equal(fast, portable)
    # an unaligned view also takes the portable path
    monkeypatch.setattr(packing, "_LITTLE_ENDIAN", True)
    backing = torch.cat([torch.zeros(1, dtype=torch.bool), bits])
    assert torch.equal(packing.pack_bits_(backing[1:], torch.empty(777, dtype=torch.uint8)), fast)


def test_bad_arguments():
    with pytest.raises(ValueError, match="numel"):
        unpack_signs(torch.zeros(2, dtype=torch.uint8), 17)
    with pytest.raises(TypeError, match="uint8"):
        unpack_signs(torch.zeros(2), 8)
    with pytest.raises(ValueError, match="multiple of 8"):
        packing.pack_bits_(torch.ones(9, dtype=torch.bool), torch.empty(1, dtype=torch.uint8))
