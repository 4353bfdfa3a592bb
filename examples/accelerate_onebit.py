"""1-bit Adam in a plain Hugging Face Accelerate loop, on real text, with no download.

    torchrun --nproc_per_node 2 examples/accelerate_onebit.py            # 2 CPU processes (gloo)
    accelerate launch --num_processes 2 examples/accelerate_onebit.py    # GPUs (NCCL)

(`accelerate launch --cpu --num_processes 2` starts ONE process, accelerate#2741: on CPUs use
torchrun; this script passes cpu=True when no GPU is there.) The model is the main job's byte-level
GPT, the text the Python standard library. DDP's fp32 allreduce runs for the first ``FREEZE``
steps, then 1-bit Adam's compressed allreduce is the only communication; rank 0 prints the loss
and the bytes this rank sent per step.
"""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from accelerate import Accelerator

import accel_plugins
from lightning_optim.comm import comm_stats
from lightning_optim.data import RandomWindows, load_corpus
from lightning_optim.model import ByteGPT

STEPS, FREEZE, SEQ, BATCH = 60, 20, 64, 16

accelerator = Accelerator(cpu=not torch.cuda.is_available())
torch.manual_seed(0)
model = ByteGPT(max_seq_len=SEQ, n_layer=2, n_head=2, d_model=64)
# the conversion happens before prepare: same param groups and hyper-parameters, 1-bit from then on
optimizer = accel_plugins.to_onebit_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1),
                                              "onebit_adam", freeze_step=FREEZE)
train, _ = load_corpus(None, "*.py", max_bytes=500_000, val_fraction=0.1)
windows = RandomWindows(torch.frombuffer(bytearray(train), dtype=torch.uint8), SEQ, 4096, seed=0)
loader = torch.utils.data.DataLoader(windows, batch_size=BATCH, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
onebit = accel_plugins.enable_onebit(accelerator, model, optimizer)  # the one call

step = 0
while step < STEPS:
    for batch in loader:
        sent_before = comm_stats().bytes_sent
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if accelerator.is_main_process and (step % 10 == 0 or step == FREEZE + 1):
            stage = "DDP fp32 allreduce" if onebit.switch and onebit.switch.enabled else "1-bit"
            print(f"step {step:3d}  loss {loss.item():.3f}  sent {(comm_stats().bytes_sent - sent_before) / 1e3:8.1f} kB"
                  f"  ({stage})", flush=True)
        if step >= STEPS:
            break
if accelerator.is_main_process:
    print(onebit.summary())
# free the DDP model and the optimizer while the process group exists (see OnebitHandle.close)
onebit.close()
accelerator.free_memory()
del model, optimizer, onebit
gc.collect()
accelerator.end_training()
