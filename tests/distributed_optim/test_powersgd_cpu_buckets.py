"""torch's powerSGD_hook synchronises CUDA on CPU buckets when CUDA exists; ours lets CPU buckets through
(seen failing on an H100 host before: ``Expected a cuda device, but got: cpu`` on every PowerSGD step), by
running torch's hook from a private instance of its module, leaving torch's module as torch made it."""

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from lightning_optim.comm.ddp_hooks import powersgd


def test_the_hooks_view_of_torch_skips_cpu_synchronize_and_only_that(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    view = powersgd._torch_hook_modules()[1].powerSGD_hook.__globals__["torch"]
    view.cuda.synchronize(torch.device("cpu"))
    view.cuda.synchronize("cpu")
    assert calls == []
    view.cuda.synchronize("cuda:0")
    view.cuda.synchronize()
    assert calls == ["cuda:0", None]
    assert view.float32 is torch.float32 and view.linalg is torch.linalg and view.cuda.is_available is torch.cuda.is_available
    assert torch.cuda.synchronize is not view.cuda.synchronize  # nobody else sees the change


def test_torchs_module_is_untouched_and_its_state_class_is_the_one_we_use():
    assert torch_powersgd.torch is torch
    assert torch_powersgd.powerSGD_hook.__globals__["torch"] is torch
    torchs, private = powersgd._torch_hook_modules()
    assert torchs is torch_powersgd and private is not torch_powersgd
    assert private.powerSGD_hook is not torch_powersgd.powerSGD_hook
    state = powersgd.PowerSGDHookState(start_powerSGD_iter=2)
    assert type(state.torch_state) is torch_powersgd.PowerSGDState  # users' isinstance checks keep holding


def test_torch_itself_still_refuses_a_cpu_device():
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda.synchronize needs a CUDA build with a device")
    with pytest.raises(ValueError):
        torch.cuda.synchronize(torch.device("cpu"))
