"""The engine tests' model and their single-process reference trainer.

TinyLM has everything the engine must handle: a tied embedding/head, a frozen parameter, a buffer
and a parameter that never gets a gradient. The reference is torch.optim.AdamW on the full batch
(every rank's micro-batch concatenated), in fp32, or for bf16 the usual mixed-precision loop (bf16
model, fp32 master weights stepped by AdamW, copied back to bf16).

A parameter that gets no gradient is not stepped, by the engine as by torch.optim.AdamW (a .grad
of None is skipped: no weight decay, no moment update, its step count stays behind).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, D_MODEL, SEQ, HEADS = 64, 32, 16, 2


class TinyBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # No qkv bias: the key bias has an exactly-zero true gradient (softmax ignores a constant
        # shift), so its computed gradient is rounding noise that Adam amplifies to +-lr per step;
        # two correct summation orders then disagree at O(lr), which says nothing about the engine.
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, c // HEADS).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
        self.frozen_gain = nn.Parameter(torch.rand(D_MODEL) + 0.5, requires_grad=False)
        self.unused = nn.Parameter(torch.randn(24))
        self.register_buffer("pos_ids", torch.arange(SEQ))
        self.blocks = nn.ModuleList(TinyBlock(D_MODEL) for _ in range(2))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[self.pos_ids[: idx.shape[1]]]
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x) * self.frozen_gain)
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def batch(step: int, rows: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """The full (global) batch of `step`: rows x SEQ tokens and next-token targets."""
    g = torch.Generator().manual_seed(seed + step)
    data = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def reference_run(steps: int, rows: int, dtype: torch.dtype, *, lr: float = 1e-2, wd: float = 0.01,
                  clip: float = 0.0, device: str = "cpu",
                  groups: tuple[Callable[[str], int], list[dict]] | None = None,
                  schedule: Callable[[torch.optim.Optimizer], Any] | None = None,
                  norms: list[float] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final fp32 weights of the single-process reference (see the module docstring).
    `groups`, if given: (parameter name -> group index, each group's AdamW overrides);
    `schedule`, if given, makes an LR scheduler of the optimizer, stepped after every step;
    `norms`, if given, receives each step's total gradient norm when clipping."""
    model = make_model().to(device, dtype)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    if groups is None:
        opt = torch.optim.AdamW(masters, lr=lr, weight_decay=wd)
    else:
        which, hyper = groups
        opt = torch.optim.AdamW([{"params": [m for (n, _), m in zip(named, masters) if which(n) == i], **h}
                                 for i, h in enumerate(hyper)], lr=lr, weight_decay=wd)
    scheduler = schedule(opt) if schedule is not None else None
    losses = []
    for step in range(steps):
        x, y = batch(step, rows)
        loss = model(x.to(device), y.to(device))
        loss.backward()
        losses.append(float(loss))
        for p, m in zip(params, masters):
            m.grad = p.grad.float() if p.grad is not None else None
            p.grad = None
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(masters, clip)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    final = {n: m.detach().cpu() for (n, _), m in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], masters)}
    return losses, final
