"""Measurement primitives shared by ``benchmarks/memory.py`` and ``benchmarks/memory_first_step.py``.

Memory is the resident set size on CPU (``/proc/self/statm`` now, ``ru_maxrss`` for the peak, reset
through ``/proc/self/clear_refs``) or ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` on
CUDA. Children print one ``RESULT {...}`` line that the parent reads back with ``_result``. The
model inputs are random byte ids, batch ``BATCH`` x sequence ``SEQ``; ``SIZES`` are the ByteGPT
shapes (``full``, ``quick``, ``ddp``).
"""
from __future__ import annotations

import json
import os
import resource

import torch
import torch.nn.functional as F

BATCH, SEQ, VOCAB, MB = 2, 64, 256, 2**20
MET = {True: "met", False: "NOT met"}
SIZES = {"full": dict(d_model=768, n_layer=7, n_head=12),  # 49.9M params
         "quick": dict(d_model=512, n_layer=4, n_head=8),  # 12.8M
         "ddp": dict(d_model=384, n_layer=6, n_head=6)}    # 10.7M


def _batch(seed: int, device="cpu"):
    """Random byte ids (BATCH x SEQ + 1) from ``seed``: the inputs and the next-byte targets."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed)).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, inputs, targets):
    """Next-byte cross-entropy of ``model`` (logits upcast to fp32)."""
    return F.cross_entropy(model(inputs).reshape(-1, VOCAB).float(), targets.reshape(-1))


def _now(cuda: bool = False) -> int:
    """Memory held right now: resident set size (CPU) or bytes allocated (CUDA)."""
    if cuda:
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak(cuda: bool = False) -> int:
    """The peak since the process started or the last ``_reset_peak``: ru_maxrss (CPU) or max allocated (CUDA)."""
    return torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak(cuda: bool = False) -> bool:
    """Start a new peak from the memory held now (Linux: writing 5 to clear_refs resets ru_maxrss)."""
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (packed state buffers counted once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _result(stdout: str, what: str) -> dict:
    """The JSON of a child's first ``RESULT {...}`` line; exits naming ``what`` if there is none."""
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"{what} printed no result:\n{stdout[-2000:]}")
