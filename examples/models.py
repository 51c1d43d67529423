"""Small GPT-style models for the examples, `zero-offload estimate --model` and the tests.

Plain PyTorch: pre-norm blocks, causal self-attention, tied input/output embedding.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    """One transformer block: the natural stage-3 unit."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, c // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only language model with a tied head; forward returns the mean cross-entropy loss."""

    def __init__(self, vocab: int = 8192, d_model: int = 512, n_layer: int = 8, n_head: int = 8,
                 seq: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_init(module: nn.Module) -> None:
    """GPT-2's embedding scale, N(0, 0.02): nn.Embedding's own N(0, 1) makes the tied head's
    logits huge (a first loss of ~40 instead of ln(vocab)). Use as `model.apply(gpt_init)`, or as
    `initialize(..., init_fn=gpt_init)` for a model built on the meta device."""
    if isinstance(module, nn.Embedding):
        with torch.no_grad():
            module.weight.normal_(0.0, 0.02)


def gpt_small() -> GPT:
    """The peer benchmark's model: 8 layers, d=512, seq 128, vocab 8192 (29.5M parameters)."""
    return GPT(vocab=8192, d_model=512, n_layer=8, n_head=8, seq=128)


def gpt_tiny() -> GPT:
    """A model small enough for tests: 2 layers, d=64."""
    return GPT(vocab=256, d_model=64, n_layer=2, n_head=4, seq=32)
