"""1-bit sign packing: 8 signs per byte, and the way back.

Convention (shared by every path, fused kernels included):
* the sign of ``x`` is ``+1`` where ``x >= 0`` (so ``sign(0) = sign(-0.0) = +1``) and ``-1``
  elsewhere (NaN counts as negative);
* element ``8*k + i`` lands in bit ``i`` (LSB first) of byte ``k``; a length that is not a multiple
  of 8 is padded with ``+1`` bits.

CPU speed (one thread, 25M fp32 on the project machine): ``x >= 0`` writes one bool per element,
then the bools are gathered 8 at a time with one 64-bit multiply (``bits_as_int64 * 0x0102040810204080``
moves byte ``i``'s low bit to bit ``56 + i``; no two partial products collide, so nothing carries),
a shift and a narrowing copy: ~15 ms, i.e. ~6.5 GB/s of fp32 input. Unpacking is one row gather
from a 256x8 lookup table (``index_select``), ~11 ms, ~9 GB/s of fp32 output. ``torch.where`` on the
bools with scalar operands, or bool->float arithmetic, runs 5-25x slower and is avoided.

``pack_bits_`` / ``unpack_into`` are the allocation-free forms the collectives use; a fused kernel
from ``lightning_optim.ops`` would replace their bodies and nothing else.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor

from lightning_optim import ops

__all__ = ["pack_signs", "unpack_signs", "pack_bits_", "unpack_into", "sign_table", "packed_size"]

# Sum of 2**(56 - 7*i) for i in 0..7: gathers the low bit of byte i of a little-endian uint64
# into bit 56 + i of the product.
_GATHER_BITS = 0x0102040810204080
_LITTLE_ENDIAN = sys.byteorder == "little"
_BIT_WEIGHTS: dict[torch.device, Tensor] = {}
_TABLES: dict[tuple[torch.dtype, torch.device], Tensor] = {}
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def packed_size(numel: int) -> int:
    """Bytes needed to hold ``numel`` signs."""
    return (int(numel) + 7) // 8


def sign_table(dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """The 256x8 table: row ``b`` holds the 8 signs (+1/-1, ``dtype``) encoded by byte ``b``."""
    device = torch.device("cpu") if device is None else torch.device(device)
    key = (dtype, device)
    table = _TABLES.get(key)
    if table is None:
        byte = torch.arange(256, dtype=torch.int64).unsqueeze(1)
        bit = torch.arange(8, dtype=torch.int64).unsqueeze(0)
        ones = ((byte >> bit) & 1).to(torch.float32)  # 1 where the bit is set
        table = (ones * 2 - 1).to(dtype=dtype, device=device).contiguous()
        _TABLES[key] = table
    return table


def pack_bits_(bits: Tensor, out: Tensor) -> Tensor:
    """Pack a bool tensor (length a multiple of 8) into ``out`` (uint8, length/8). Clobbers ``bits``.

    ``bits`` must be contiguous and, on CPU, 8-byte aligned; it is used as int64 scratch.
    """
    if bits.dtype != torch.bool or bits.numel() % 8:
        raise ValueError("pack_bits_: bits must be a bool tensor whose length is a multiple of 8")
    if out.dtype != torch.uint8 or out.numel() != bits.numel() // 8:
        raise ValueError("pack_bits_: out must be a uint8 tensor of length bits.numel() // 8")
    raw = bits.reshape(-1).view(torch.uint8)
    aligned = bits.is_contiguous() and bits.data_ptr() % 8 == 0
    if _LITTLE_ENDIAN and aligned:
        word = raw.view(torch.int64)
        word.mul_(_GATHER_BITS)  # wraps modulo 2**64; only the top byte matters
        word.bitwise_right_shift_(56)
        out.copy_(word)  # int64 -> uint8 keeps the low byte (= packed bits)
        return out
    weights = _BIT_WEIGHTS.get(bits.device)
    if weights is None:
        weights = _BIT_WEIGHTS[bits.device] = (
            torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=bits.device)
        )
    torch.sum(raw.view(-1, 8) * weights, dim=1, dtype=torch.uint8, out=out)
    return out


def pack_signs(x: Tensor, out: Tensor | None = None) -> Tensor:
    """Pack the signs of ``x`` (any shape, any float dtype) into ``ceil(numel/8)`` uint8 bytes."""
    flat = x.reshape(-1)
    n = flat.numel()
    nbytes = packed_size(n)
    bits = torch.ones(nbytes * 8, dtype=torch.bool, device=x.device)  # padding = +1
    torch.ge(flat, 0, out=bits[:n])
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    return pack_bits_(bits, out)


def unpack_into(packed: Tensor, out: Tensor, table: Tensor, index: Tensor | None = None) -> Tensor:
    """Decode ``packed`` (uint8, k bytes) into ``out`` (8k elements, contiguous) as ``table`` rows.

    ``table`` is a 256x8 table (``sign_table(...)`` or a scaled copy, so one pass decodes straight to
    ``scale * sign``); ``index`` is optional int64 scratch of k elements.
    """
    k = packed.numel()
    if out.numel() != 8 * k:
        raise ValueError(f"unpack_into: out has {out.numel()} elements, expected {8 * k}")
    if (out.dtype in _KERNEL_DTYPES and table.dtype == out.dtype and out.is_contiguous() and packed.is_contiguous()
            and table.is_contiguous()):
        kernel = ops.raw_kernel("onebit_unpack_table", out.device)
        if kernel is not None:  # compiled: the same table lookup, vectorised and threaded
            kernel(packed.reshape(-1), table, out.view(-1))
            return out
    if index is None:
        index = packed.reshape(-1).long()
    else:
        index = index[:k]
        index.copy_(packed.reshape(-1))
    torch.index_select(table, 0, index, out=out.view(k, 8))
    return out


def unpack_signs(packed: Tensor, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The first ``numel`` signs held in ``packed`` as a ±1 tensor of ``dtype``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_signs: packed must be uint8, got {packed.dtype}")
    numel = int(numel)
    if numel < 0 or packed_size(numel) > packed.numel():
        raise ValueError(
            f"unpack_signs: numel={numel} needs {packed_size(numel)} bytes, packed has {packed.numel()}"
        )
    nbytes = packed_size(numel)
    out = torch.empty(nbytes * 8, dtype=dtype, device=packed.device)
    unpack_into(packed.reshape(-1)[:nbytes], out, sign_table(dtype, packed.device))
    return out[:numel]
