"""The int8/int4 quantizers in one process, against the reference written from their equations
(``tests/reference/quantize.py``): codes, scales, both roundings, error feedback, wire bytes, refusals."""
from __future__ import annotations

import math

import pytest
import torch

from lightning_optim.comm.compressors import ErrorFeedback, Int4Quantizer, Int8Quantizer, Quantizer
from tests.reference.quantize import RefQuantizedWorkers

SHAPES = [(7, 3), (5,), (1,), (4, 4)]  # odd sizes: a short last chunk, an int4 byte half used


def _inputs(call: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(call)
    out = [torch.randn(s, generator=gen, dtype=torch.float64) * (1 + i) for i, s in enumerate(SHAPES)]
    out[3][1] = 0.0  # an all-zero chunk (chunk 4: the second row) is sent as zeros
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_equal_to_the_reference_with_error_feedback(bits, rounding):
    quantizer = Quantizer(bits, chunk=4, rounding=rounding, seed=5)
    ref = RefQuantizedWorkers(bits, 1, SHAPES, chunk=4, rounding=rounding, seed=5)
    feedback = ErrorFeedback()
    total_in = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    total_out = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for call in range(4):
        x = _inputs(call)
        residuals = feedback.residuals(range(len(x)), x)
        got = quantizer.reduce(x, residuals)
        want = ref.step([x])
        for g, w, e, r in zip(got, want, residuals, ref.residuals[0]):
            assert torch.equal(g, w) and torch.equal(e, r)
        total_in = [a + b for a, b in zip(total_in, x)]
        total_out = [a + b for a, b in zip(total_out, got)]
    for sent, given, e in zip(total_out, total_in, residuals):  # nothing lost, only delayed
        torch.testing.assert_close(sent + e, given, rtol=0, atol=1e-12)


def test_codes_stay_within_levels_and_nibbles_round_trip():
    for cls, levels in ((Int8Quantizer, 127), (Int4Quantizer, 7)):
        quantizer = cls(chunk=3)
        x = torch.tensor([1.0, -1.0, 0.5, -0.25, 0.0, 3.0, -3.0])
        payload = quantizer.compress(x)
        codes = quantizer.dequantize(payload.codes, torch.ones_like(payload.scales), x.numel())
        assert codes.abs().max() == levels and torch.equal(codes, codes.round())
        assert payload.codes.numel() == quantizer.code_bytes(7) == (7 if levels == 127 else 4)
        assert torch.equal(quantizer.decompress(payload)[[0, 1, 5, 6, 4]], x[[0, 1, 5, 6, 4]])  # extremes exact


def test_stochastic_rounding_is_unbiased():
    quantizer = Int4Quantizer(chunk=8, rounding="stochastic", seed=1)
    x = torch.tensor([7.0, 0.3, -2.6, 1.5, 0.05, -0.05, 3.3, -7.0])  # scale 1: the codes are x rounded
    mean = torch.stack([quantizer.decompress(quantizer.compress(x)) for _ in range(4000)]).mean(0)
    torch.testing.assert_close(mean, x, rtol=0, atol=0.03)


def test_bytes_sent_is_codes_plus_fp32_scales():
    numels = [math.prod(s) for s in SHAPES]
    assert Int8Quantizer(chunk=4).bytes_sent(numels, 3) == 2 * sum(n + 4 * math.ceil(n / 4) for n in numels)
    assert Int4Quantizer(chunk=4).bytes_sent(numels, 3) == 2 * sum(math.ceil(n / 2) + 4 * math.ceil(n / 4)
                                                                for n in numels)
    assert Int8Quantizer().bytes_sent(numels, 1) == 0


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(bits=2), ValueError, "bits must be 8 or 4, got 2"),
    (dict(bits=8.0), TypeError, "bits must be an int"),
    (dict(chunk=0), ValueError, "chunk must be in [1, inf)"),
    (dict(rounding="up"), ValueError, "rounding must be one of 'nearest', 'stochastic'"),
    (dict(seed=-1), ValueError, "seed must be in [0, inf)"),
])
def test_bad_arguments(kwargs, error, words):
    with pytest.raises(error) as info:
        Quantizer(**kwargs)
    assert words in str(info.value)


def test_generator_state_round_trips_and_bad_state_is_refused():
    a = Int8Quantizer(rounding="stochastic", seed=2)
    a.compress(torch.randn(10))
    b = Int8Quantizer(rounding="stochastic", seed=9)
    b.load_state_dict(a.state_dict())
    x = torch.randn(10)
    assert torch.equal(a.compress(x).codes, b.compress(x).codes)
    with pytest.raises(ValueError, match="generator"):
        b.load_state_dict({"generator": torch.zeros(3)})
