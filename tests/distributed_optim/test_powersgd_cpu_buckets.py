"""torch's powerSGD_hook synchronises CUDA on CPU buckets when CUDA exists; ours lets CPU buckets through
(seen failing on an H100 host before: ``Expected a cuda device, but got: cpu`` on every PowerSGD step)."""

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import lightning_optim.comm.ddp_hooks.powersgd  # noqa: F401  (installs the view)


def test_the_hooks_view_of_torch_skips_cpu_synchronize_and_only_that(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    view = torch_powersgd.torch
    view.cuda.synchronize(torch.device("cpu"))
    view.cuda.synchronize("cpu")
    assert calls == []
    view.cuda.synchronize("cuda:0")
    view.cuda.synchronize()
    assert calls == ["cuda:0", None]
    assert view.float32 is torch.float32 and view.linalg is torch.linalg and view.cuda.is_available is torch.cuda.is_available
    assert torch.cuda.synchronize is not view.cuda.synchronize  # nobody else sees the change


def test_torch_itself_still_refuses_a_cpu_device():
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda.synchronize needs a CUDA build with a device")
    with pytest.raises(ValueError):
        torch.cuda.synchronize(torch.device("cpu"))
