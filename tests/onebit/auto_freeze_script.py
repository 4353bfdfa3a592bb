"""A plain script, no logging configured: OnebitAdam with ``freeze_step="auto"`` capped at step 3, five steps.
``tests/onebit/test_auto_freeze.py`` runs it and reads the decision off its stderr."""

import torch

from lightning_optim import OnebitAdam

param = torch.nn.Parameter(torch.ones(4))
optimizer = OnebitAdam([param], lr=1e-2, freeze_step="auto", auto_freeze_max=3)
for _ in range(5):
    param.grad = torch.ones(4)
    optimizer.step()
print(f"freeze_step {optimizer.freeze_step}")
