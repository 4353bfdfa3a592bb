"""Run by torchrun (2 ranks): gradient release prepared BEFORE the process group exists (as before
``Accelerator()``), then DDP. Each rank writes one line, the outcome of the first backward, to
``rank<r>.txt`` in the working directory (files, not stdout: torchrun's children share one pipe)."""

import torch
import torch.distributed as dist
from torch import nn

import lightning_optim as lo

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
opt = lo.AdamW(model.parameters(), lr=1e-2)
lo.prepare_for_gradient_release(model, opt)  # one process so far: accepted
dist.init_process_group("gloo")
rank = dist.get_rank()
ddp = nn.parallel.DistributedDataParallel(model)
before = [p.detach().clone() for p in model.parameters()]
try:
    ddp(torch.randn(16, 4) + rank).pow(2).mean().backward()
    outcome = "no error"
except RuntimeError as exc:
    outcome = str(exc).splitlines()[0]
unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
line = f"rank {rank}: unchanged={unchanged} state={len(opt.state_dict()['state'])} outcome={outcome}"
with open(f"rank{rank}.txt", "w") as out:
    out.write(line + "\n")
dist.destroy_process_group()
