"""A small decoder-only (GPT-style) byte language model for the demo job.

`ByteGPT` is the plain ``nn.Module`` (this module: torch only); `LanguageModel` (``language_model.py``)
is the LightningModule that trains it and builds the optimizer from a Hydra partial, so any optimizer
config can be swapped in.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 256  # bytes


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention using torch's fused SDPA kernel."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_head != 0:
            raise ValueError(f"model.d_model={d_model} must be divisible by model.n_head={n_head}")
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, seq, width) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_head: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model),
            nn.GELU(),
            nn.Linear(mlp_ratio * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class ByteGPT(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LayerNorm, head tied to the embedding."""

    def __init__(
        self,
        max_seq_len: int,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 128,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        vocab_size: int = VOCAB_SIZE,
    ) -> None:
        super().__init__()
        _check_sizes(max_seq_len=max_seq_len, n_layer=n_layer, n_head=n_head, d_model=d_model, mlp_ratio=mlp_ratio,
                     vocab_size=vocab_size)
        if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):  # 1.0 would zero every activation
            raise ValueError(f"model.dropout={dropout!r} must be a number in [0, 1)")
        self.max_seq_len = max_seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, mlp_ratio, dropout) for _ in range(n_layer))
        self.ln_out = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.apply(_init_weights)
        # GPT-2 style: shrink residual-branch outputs so depth does not blow up the residual stream.
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map (batch, seq) byte ids to (batch, seq, vocab) logits."""
        seq = tokens.shape[1]
        if seq > self.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.max_seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_out(x))


def _check_sizes(**sizes: int) -> None:
    """Each size an int >= 1: n_layer=0 would silently train no transformer block at all."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model.{name}={value!r} must be an int >= 1")


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Split parameters into a decayed group (matrices) and a no-decay group.

    Biases, LayerNorm weights and embeddings get ``weight_decay=0``. The decayed group carries no
    ``weight_decay`` key, so the optimizer's own setting (from its config) applies to it.
    """
    decay, no_decay = [], []
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for param in dict(model.named_parameters()).values():  # dict(): tied weights appear once
        if not param.requires_grad:
            continue
        if param.ndim < 2 or id(param) in embeddings:
            no_decay.append(param)
        else:
            decay.append(param)
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
