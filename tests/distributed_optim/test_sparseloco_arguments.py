"""SparseLoCo's arguments, swept (in one process): every argument of the compressor and every DiLoCo argument that
meets it, each bad value refused with a ``TypeError``/``ValueError`` naming the argument and its range before
anything changes (the params, and the adapters' early check ``check_diloco_arguments`` says the same); the outer
step's defaults are those the guide documents; on one rank nothing is compressed and the outer step is plain SGD
on the pseudo-gradient (no momentum: the accumulator takes its place, and it is only filled by an exchange)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from lightning_optim.comm.compressors import SparseLoCo, TopK
from lightning_optim.distributed import DiLoCo
from lightning_optim.distributed.diloco_checks import check_diloco_arguments
from tests.distributed_optim.diloco_workers import DT, SHAPES, init_params, twin_run

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "low_communication.md"
# argument -> bad values (label, value, error, words)
COMPRESSOR_BAD = {
    "density": [("0", 0, ValueError, "density must be in (0, 1], got 0"),
                ("-1", -1.0, ValueError, "density must be in (0, 1]"),
                ("1.5", 1.5, ValueError, "density must be in (0, 1]"),
                ("nan", math.nan, ValueError, "density must be in (0, 1]"),
                ("inf", math.inf, ValueError, "density must be in (0, 1]"),
                ("True", True, TypeError, "density must be a real number"),
                ("str", "0.1", TypeError, "density must be a real number"),
                ("None", None, TypeError, "density must be a real number")],
    "bits": [("0", 0, ValueError, "bits must be in [1, 8], got 0"), ("9", 9, ValueError, "bits must be in [1, 8]"),
             ("-1", -1, ValueError, "bits must be in [1, 8]"), ("2.0", 2.0, TypeError, "bits must be an int in [1, 8]"),
             ("nan", math.nan, TypeError, "bits must be an int"), ("True", True, TypeError, "bits must be an int"),
             ("str", "2", TypeError, "bits must be an int"), ("None", None, TypeError, "bits must be an int")],
    "chunk": [("1", 1, ValueError, "chunk must be in [2, 32768], got 1"),
              ("32769", 32769, ValueError, "chunk must be in [2, 32768]"),
              ("0", 0, ValueError, "chunk must be in [2, 32768]"),
              ("8.0", 8.0, TypeError, "chunk must be an int in [2, 32768]"),
              ("True", True, TypeError, "chunk must be an int"), ("str", "8", TypeError, "chunk must be an int")],
    "decay": [("-0.1", -0.1, ValueError, "decay must be in [0, 1], got -0.1"),
              ("1.5", 1.5, ValueError, "decay must be in [0, 1]"),
              ("nan", math.nan, ValueError, "decay must be finite"),
              ("inf", math.inf, ValueError, "decay must be finite"),
              ("True", True, TypeError, "decay must be a real number"),
              ("str", "0.9", TypeError, "decay must be a real number")],
}
COMPRESSOR_CASES = [(arg, *case) for arg, cases in COMPRESSOR_BAD.items() for case in cases]


@pytest.mark.parametrize("arg,label,value,error,words", COMPRESSOR_CASES,
                         ids=[f"{c[0]}={c[1]}" for c in COMPRESSOR_CASES])
def test_every_compressor_argument_is_refused_by_name(arg, label, value, error, words):
    with pytest.raises(error) as info:
        SparseLoCo(**{arg: value})
    assert str(info.value).startswith(words), str(info.value)


def test_the_range_edges_are_taken():
    for kwargs in (dict(density=1.0), dict(density=1e-9), dict(bits=1), dict(bits=8), dict(chunk=2),
                   dict(chunk=32768), dict(decay=0.0), dict(decay=1.0)):
        SparseLoCo(**kwargs)


# DiLoCo: (label, keywords, error, words); every case also runs through the adapters' early check
DILOCO_BAD = [
    *[(f"density={label}", dict(compressor="sparseloco", density=value), error, words)
      for label, value, error, words in COMPRESSOR_BAD["density"] if value is not None],
    *[(f"bits={label}", dict(compressor="sparseloco", bits=value), error, words)
      for label, value, error, words in COMPRESSOR_BAD["bits"] if value is not None],
    ("density without a compressor", dict(density=0.1), ValueError,
     "density=0.1: only used with compressor='sparseloco'"),
    ("bits with int8", dict(compressor="int8", bits=2), ValueError, "bits=2: only used with compressor='sparseloco'"),
    ("both with topk", dict(compressor="topk", density=0.1, bits=2), ValueError,
     "density=0.1 and bits=2: only used with compressor='sparseloco'"),
    ("density with a TopK instance", dict(compressor=TopK(k=2), density=0.1), ValueError,
     "density=0.1: only used with compressor='sparseloco'"),
    ("bits with a SparseLoCo instance", dict(compressor=SparseLoCo(), bits=3), ValueError,
     "bits=3: the SparseLoCo instance given as compressor has its own"),
    ("nesterov=True", dict(compressor="sparseloco", nesterov=True), ValueError,
     "nesterov=True: SparseLoCo keeps no outer momentum"),
    ("nesterov=True with an instance", dict(compressor=SparseLoCo(), nesterov=True), ValueError,
     "nesterov=True: SparseLoCo keeps no outer momentum"),
    ("nesterov str", dict(compressor="sparseloco", nesterov="no"), TypeError, "nesterov must be True or False"),
    ("decay above 1", dict(compressor="sparseloco", outer_momentum=1.5), ValueError,
     "outer_momentum must be in [0, 1], got 1.5"),
    ("decay negative", dict(compressor="sparseloco", outer_momentum=-0.5), ValueError,
     "outer_momentum must be in [0, 1]"),
    ("decay nan", dict(compressor="sparseloco", outer_momentum=math.nan), ValueError, "outer_momentum must be finite"),
    ("decay str", dict(compressor="sparseloco", outer_momentum="0.9"), TypeError, "outer_momentum must be a real"),
    ("decay not the instance's", dict(compressor=SparseLoCo(decay=0.5), outer_momentum=0.9), ValueError,
     "outer_momentum=0.9 differs from the SparseLoCo instance's decay=0.5"),
    ("outer_lr 0", dict(compressor="sparseloco", outer_lr=0.0), ValueError, "outer_lr must be in (0, inf)"),
    ("compressor unknown with density", dict(compressor="sparse", density=0.1), ValueError,
     "compressor must be None, a Compressor instance or one of"),
]


@pytest.mark.parametrize("kwargs,error,words", [c[1:] for c in DILOCO_BAD], ids=[c[0] for c in DILOCO_BAD])
def test_diloco_refuses_by_name_before_anything_changes(kwargs, error, words):
    params = [torch.nn.Parameter(torch.randn(s, dtype=DT)) for s in SHAPES]
    before = [p.detach().clone() for p in params]
    with pytest.raises(error) as info:
        DiLoCo(torch.optim.SGD(params, lr=0.1), sync_every=4, **kwargs)
    assert str(info.value).startswith(words), str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    with pytest.raises(error) as early:  # what the Lightning, Accelerate and HF adapters check before building
        check_diloco_arguments(4, **kwargs)
    assert str(early.value) == str(info.value)


def test_dense_momentum_keeps_its_range_and_nesterov_rule():
    """Only SparseLoCo's decay may be 1; DiLoCo's outer momentum stays in [0, 1) with its Nesterov rule."""
    with pytest.raises(ValueError, match=r"^outer_momentum must be in \[0, 1\), got 1.0"):
        check_diloco_arguments(4, outer_momentum=1.0)
    with pytest.raises(ValueError, match=r"^nesterov=True needs outer_momentum in \(0, 1\)"):
        check_diloco_arguments(4, outer_momentum=0.0)


def _documented_defaults() -> dict[str, tuple[str, str]]:
    """argument -> (DiLoCo's default, SparseLoCo's default) from the guide's argument table."""
    rows = {}
    for line in GUIDE.read_text().splitlines():
        found = re.match(r"\| `(outer_lr|outer_momentum|nesterov)` \| None: (\S+), `sparseloco`: (\S+) \|", line)
        if found:
            rows[found[1]] = (found[2], found[3])
    assert set(rows) == {"outer_lr", "outer_momentum", "nesterov"}, rows
    return rows


def test_the_documented_defaults_are_what_diloco_uses():
    documented = _documented_defaults()
    for compressor, column in ((None, 0), ("int8", 0), ("sparseloco", 1), (SparseLoCo(), 1)):
        opt = DiLoCo(torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1), sync_every=2,
                     compressor=compressor)
        used = {"outer_lr": opt.outer_lr, "outer_momentum": opt.outer_momentum, "nesterov": opt.nesterov}
        assert {k: str(v) for k, v in used.items()} == {k: v[column] for k, v in documented.items()}, compressor
    assert DiLoCo(torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1), sync_every=2,
                  compressor=SparseLoCo(decay=0.5)).outer_momentum == 0.5  # an instance's own decay


def test_one_rank_sends_nothing_and_takes_plain_sgd_on_the_pseudo_gradient():
    """W = 1: nothing is compressed (no accumulator is filled); every H steps the global copy takes
    torch.optim.SGD's step without momentum, lr = outer_lr, on the gradient theta_g - theta."""
    params = [p.requires_grad_() for p in init_params()]
    twin = [p.requires_grad_() for p in init_params()]
    opt = DiLoCo(torch.optim.SGD(params, lr=0.05, momentum=0.9), sync_every=3, outer_lr=0.6,
                 compressor="sparseloco", density=0.2)
    assert opt.outer_momenta == [] and "density=0.2, bits=2" in repr(opt)
    inner = torch.optim.SGD(twin, lr=0.05, momentum=0.9)
    global_params = [p.detach().clone() for p in twin]
    outer = torch.optim.SGD(global_params, lr=0.6)
    twin_run(opt, params, inner, twin, outer, global_params)
    assert all(torch.equal(a, b) for a, b in zip(params, twin))
    assert all(e is None for e in opt.residuals)
