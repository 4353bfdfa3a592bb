"""The communicating-optimizer base and the compressor interface shared by the 1-bit family and mlbench's
compressed optimizers: every one of them is a CommunicatingOptimizer with the same DDP contract, and the
1-bit allreduce is a Compressor (its reduce equals compressed_allreduce driven by hand, on 2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

import lightning_optim as lo
from lightning_optim.comm.compressors import Compressor
from lightning_optim.comm.compressors.onebit import OnebitCompressor
from lightning_optim.distributed import CentralizedSparsifiedSGD, PowerSGD
from lightning_optim.distributed.communicating import CommunicatingOptimizer
from lightning_optim.onebit import OnebitOptimizer
from tests.ranks import run_ranks
from tests.distributed_optim.base_workers import onebit_reduce


def _build(cls):
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    if cls is PowerSGD:
        return cls(params, lr=0.1)
    if cls is CentralizedSparsifiedSGD:
        return cls(params, lr=0.1, sparse_grad_size=2)
    return cls(params, lr=0.1, freeze_step=2) if cls is not lo.ZeroOneAdam else cls(params, lr=0.1, var_freeze_step=2)


@pytest.mark.parametrize("cls", [lo.OnebitAdam, lo.ZeroOneAdam, lo.OnebitLamb, PowerSGD, CentralizedSparsifiedSGD])
def test_every_communicating_optimizer_shares_the_base_and_the_contract(cls):
    opt = _build(cls)
    assert isinstance(opt, CommunicatingOptimizer) and isinstance(opt, torch.optim.Optimizer)
    assert opt.compressor is None or isinstance(opt.compressor, Compressor)
    if issubclass(cls, OnebitOptimizer):  # the 1-bit family: a full-precision warmup step first
        assert opt.needs_averaged_grads and not opt.averages_local_grads
        assert isinstance(opt.compressor, OnebitCompressor)
    else:  # mlbench's: they always average the local gradients themselves
        assert not opt.needs_averaged_grads and opt.averages_local_grads


def test_the_onebit_compressor_equals_compressed_allreduce_by_hand():
    for run in run_ranks(2, onebit_reduce, timeout=120):
        for ours, by_hand in zip(run["ours"], run["by_hand"]):
            assert torch.equal(ours, by_hand)
        assert run["errors_equal"] and run["bytes"] == run["predicted"] and run["bytes"][0] > 0


def test_the_onebit_compressor_refuses_what_it_cannot_do_and_round_trips():
    compressor = OnebitCompressor()
    x = [torch.randn(5)]
    with pytest.raises(ValueError, match="residuals: the 1-bit compressor keeps its own"):
        compressor.reduce(x, [torch.zeros(5)])
    with pytest.raises(ValueError, match="average: the 1-bit allreduce averages"):
        compressor.reduce(x, average=False)
    assert torch.equal(compressor.reduce(x)[0], x[0])  # one process: nothing to average
    assert compressor.bytes_sent([5], 1) == 0
    compressor.worker_error, compressor.server_error, compressor.origin = torch.ones(8), torch.ones(4), (2, 1)
    other = OnebitCompressor()
    other.load_state_dict(compressor.state_dict())
    assert torch.equal(other.worker_error, compressor.worker_error) and other.origin == (2, 1)
    assert not other.belongs_here()  # made by rank 1 of 2; this is one process
    with pytest.raises(TypeError, match="state: worker_error and server_error must be tensors"):
        other.load_state_dict({"worker_error": [1.0], "server_error": [1.0], "world_size": 2, "rank": 0})
