"""Probe: every optimizer class of the project (the catalogue's and mlbench's distributed family) refuses a
corrupted state dict of its own — any state tensor as int64 / bool / complex / another shape, a counter as a
string / negative / fraction, any group hyper-parameter as a string / NaN / negative, the compressor and 1-bit
entries alike — with an error naming the key, and is bitwise unchanged afterwards (state dict and params).
The classes whose whole state needs a second rank (PowerSGD's error memory, the 1-bit error buffers) run the
same sweep on 2 gloo ranks, in one spawned run. A step refused for a state set by hand changes nothing.
"""
from __future__ import annotations

from lightning_optim.catalogue import DISTRIBUTED, OPTIMIZERS
from tests.ranks import run_ranks
from tests.distributed_optim.load_sweep import BUILDS, refused_steps, sweep_on_rank, two_rank_probe


def _report(results: dict[str, tuple[int, list[str]]], where: str) -> list[str]:
    return [f"{where} {name}: {failure}" for name, (_, failures) in results.items() for failure in failures]


def test_the_sweep_covers_every_class_of_the_catalogue():
    assert set(OPTIMIZERS) | set(DISTRIBUTED) <= set(BUILDS)


def test_every_class_refuses_every_corrupted_key_in_one_process():
    results = sweep_on_rank(0, 1, tuple(BUILDS))
    assert all(cases >= 30 for cases, _ in results.values()), {n: c for n, (c, _) in results.items()}
    failures = _report(results, "1 process:")
    assert not failures, "\n".join(failures)


def test_every_rank_state_is_checked_on_two_ranks():
    per_rank = run_ranks(2, two_rank_probe, timeout=150)
    failures = [f for rank, (results, _) in enumerate(per_rank) for f in _report(results, f"rank {rank}/2:")]
    failures += [f"rank {rank}/2: {f}" for rank, (_, refused) in enumerate(per_rank) for f in refused]
    assert not failures, "\n".join(failures)  # (including: the per-rank states existed to be corrupted)


def test_a_step_refused_for_a_state_set_by_hand_changes_nothing():
    assert not refused_steps(0, 1)
