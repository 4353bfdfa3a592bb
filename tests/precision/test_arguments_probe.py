"""Probe: every argument of every public callable of ``lightning_optim.precision`` refuses wrong types
(TypeError) and ranges (ValueError) with a message naming it, before anything changes (the objects
compared bitwise before and after); numpy scalars work like the Python numbers they hold; the table
(tests/precision/probe_specs.py) covers every public argument."""

from __future__ import annotations

import pytest

import lightning_optim.precision as precision
from tests.precision.probe_specs import (
    INF,
    KINDS,
    NUMPY_KINDS,
    TARGETS,
    Target,
    check_bad_values_refused,
    check_numpy_twin_alike,
    public_arguments,
    snapshot,
    with_value,
)

ARGS = [(t, name) for t in TARGETS for name in t.args]
# the state arguments have their own probe (tests/precision/test_state_dict_probe.py)
STATE_PROBED = {("DynamicLossScaler.load_state_dict", "state"), ("DynamicLossScaler.check_state_dict", "state"),
                ("MasterWeights.load_state_dict", "state"), ("MasterWeights.check_state_dict", "state"),
                ("FP16Optimizer.load_state_dict", "state")}
SPECIAL = {"positive_or_inf": [INF], "optional_positive_or_inf": [None, INF], "optional_positive": [None],
           "optional_unit_open": [None]}


def test_the_table_covers_every_public_argument():
    public = public_arguments(precision)
    swept = {(t.name.split("[")[0], name) for t, name in ARGS}
    assert public - swept - STATE_PROBED == set()
    assert swept - public == set()  # no stale row


@pytest.mark.parametrize("target,name", ARGS, ids=[f"{t}:{n}" for t, n in ARGS])
def test_a_bad_value_is_refused_by_name_and_changes_nothing(target: Target, name: str):
    check_bad_values_refused(target, name, KINDS, snapshot)


NUMERIC = [(t, n) for t, n in ARGS if t.args[n] in NUMPY_KINDS]


@pytest.mark.parametrize("target,name", NUMERIC, ids=[f"{t}:{n}" for t, n in NUMERIC])
def test_numpy_scalars_work_like_python_numbers(target: Target, name: str):
    check_numpy_twin_alike(target, name, snapshot)


SPECIALS = [(t, n, v) for t, n in ARGS for v in SPECIAL.get(t.args[n], [])]


@pytest.mark.parametrize("target,name,value", SPECIALS, ids=[f"{t}:{n}={v}" for t, n, v in SPECIALS])
def test_the_documented_special_values_are_accepted(target: Target, name: str, value):
    ctx = target.make()
    target.call(ctx, **with_value(target, ctx, name, value))  # None / inf: "no cap", "no clipping", "default"
