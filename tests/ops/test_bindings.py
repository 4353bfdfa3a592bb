"""The compiled bindings take named arguments (a swapped pair of scalars cannot pass silently), and
the removed single-buffer 1-bit kernels are gone."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_optim.ops.fused import OPTIMIZER_KERNELS, RAW_KERNELS

BINDINGS = ["adam", "sgd", "lion", "adan", "lamb_moments", "lamb_apply", "lars_norms", "lars", "stable_moments",
            "stable_apply", "grads_of", "data_ptrs", "same_items", *RAW_KERNELS]


def _arg_names(fn) -> list[str]:
    first = fn.__doc__.splitlines()[0]  # pybind11: "name(arg0: type, ...) -> ret"
    return re.findall(r"(\w+): ", first[first.index("(") :])


@pytest.mark.parametrize("name", BINDINGS)
def test_every_binding_names_its_arguments(ext, name):
    names = _arg_names(getattr(ext, name))
    assert names and not any(re.fullmatch(r"arg\d+", n) for n in names), names
    with pytest.raises(TypeError, match="incompatible function arguments"):
        getattr(ext, name)(**{n: None for n in names[:-1]}, not_an_argument=1.0)


def test_the_optimizer_wrappers_cover_every_optimizer_binding():
    assert set(OPTIMIZER_KERNELS) == {"adam", "sgd", "lion", "adan", "lamb", "lars", "stableadamw"}


def test_single_buffer_kernels_are_removed(ext):
    for gone in ("onebit_compress", "onebit_pack", "onebit_unpack"):
        assert not hasattr(ext, gone)
    assert torch.is_tensor(torch.zeros(1))  # (the shipped path uses the per-piece kernels above)
