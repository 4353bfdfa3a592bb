"""Exchanges on threads of one process: each thread's own byte counter, and scratch buffers no two threads share.

Two ranks as threads each run the compressed all-reduce over gloo while counting into their own counters; the
results must equal the single-process simulation of the exchange, and the process's counter must not move.
"""

from __future__ import annotations

import threading

import torch

from lightning_optim.comm import compressed_allreduce, compressed_bytes, make_error_buffers
from lightning_optim.comm.stats import CommStats, comm_stats, counting_for_this_thread
from tests.ranks import run_ranks
from tests.reference.onebit_allreduce import RefOnebitAllreduce

N = 4099  # not a multiple of 8 * world: padding on every rank


def test_a_thread_counts_into_its_own_counter_only_inside_the_block():
    before = comm_stats().copy()
    seen = {}

    def count():
        with counting_for_this_thread() as own:
            comm_stats().add_control(40)
            seen["own"] = own.bytes_sent
        seen["after"] = comm_stats() is own

    thread = threading.Thread(target=count)
    thread.start()
    thread.join()
    assert seen == {"own": 40, "after": False}
    assert (comm_stats() - before).bytes_sent == 0


def test_a_given_counter_is_used_and_the_previous_one_comes_back():
    outer, inner = CommStats(), CommStats()
    with counting_for_this_thread(outer):
        with counting_for_this_thread(inner):
            comm_stats().add_control(8)
        comm_stats().add_control(16)
    assert (outer.bytes_sent, inner.bytes_sent) == (16, 8)


ROUNDS = 3  # the error feedback and the cached scratch buffers in use


def _exchange(rank: int, world: int, inputs: list[list[torch.Tensor]]):
    worker_error, server_error = make_error_buffers(inputs[0][rank])
    outs = []
    for round_inputs in inputs:
        x = round_inputs[rank].clone()
        compressed_allreduce(x, worker_error, server_error)
        outs.append(x)
    return outs, comm_stats().bytes_sent


def test_ranks_on_threads_match_the_simulation_and_count_their_own_bytes():
    world, gen = 3, torch.Generator().manual_seed(0)
    inputs = [[torch.randn(N, generator=gen) for _ in range(world)] for _ in range(ROUNDS)]
    sim = RefOnebitAllreduce(N, world)
    expected = [sim.step(round_inputs) for round_inputs in inputs]
    process_before = comm_stats().copy()
    results = run_ranks(world, _exchange, inputs)
    for outs, _ in results:
        for got, want in zip(outs, expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert [sent for _, sent in results] == [ROUNDS * compressed_bytes(N, world)] * world
    assert (comm_stats() - process_before).bytes_sent == 0
