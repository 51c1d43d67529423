"""The stage-3 tests' model, a small engine-like driver and the single-process AdamW reference.

Model3 has what stage 3 must handle: a tied embedding/LM head (the head reads a parameter owned by
the root unit), a frozen parameter, a buffer, a parameter that never gets a gradient, a block
called twice in one forward, a block run under torch.utils.checkpoint (non-reentrant), and a
`swap` switch that runs the blocks in another order (data-dependent control flow, decided the same
way on every rank).

Blocks have no attention: a key bias has an exactly-zero true gradient whose rounding noise Adam
amplifies, which would make two correct summation orders disagree (see _engine_model.py).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, D, SEQ = 48, 24, 8


class Block3(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(self.ln(x))))


class Model3(nn.Module):
    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        self.n_blocks = n_blocks  # what meta construction rebuilds the root from, for its pos_ids
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(SEQ, D) * 0.02)
        self.frozen_gain = nn.Parameter(torch.rand(D) + 0.5, requires_grad=False)
        self.unused = nn.Parameter(torch.randn(10))
        self.register_buffer("pos_ids", torch.arange(SEQ))
        self.blocks = nn.ModuleList(Block3(D) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        self.swap = False

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[self.pos_ids[: idx.shape[1]]]
        first, *rest = self.blocks
        x = first(first(x))  # a module called twice
        if self.swap:
            rest = rest[::-1]
        for i, blk in enumerate(rest):
            x = checkpoint(blk, x, use_reentrant=False) if i == 0 else blk(x)
        logits = self.head(self.ln_f(x) * self.frozen_gain)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def make_model(seed: int = 0, n_blocks: int = 3) -> Model3:
    torch.manual_seed(seed)
    return Model3(n_blocks)


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def swap_at(step: int, swap_from: int | None) -> bool:
    return swap_from is not None and step >= swap_from


def train_runtime(rt: object, model: Model3, steps: int, rank: int, world: int, rows: int,
                  swap_from: int | None = None) -> list[float]:
    """The Engine's call sequence on a Stage3Runtime; returns this rank's losses."""
    losses = []
    for step in range(steps):
        model.swap = swap_at(step, swap_from)
        x, y = batch(step, rows * world)
        part = slice(rank * rows, (rank + 1) * rows)
        loss = model(x[part], y[part])
        rt.begin_backward(True)
        loss.backward()
        rt.end_backward()
        rt.step()
        losses.append(float(loss.detach()))
    return losses


def reference(steps: int, rows: int, *, lr: float, wd: float, swap_from: int | None = None,
              n_blocks: int = 3, dtype: torch.dtype = torch.float32) -> tuple[list[float], dict[str, torch.Tensor]]:
    """torch.optim.AdamW on the whole batch (the losses are global means). A parameter that gets no
    gradient is skipped, as AdamW skips a .grad of None. For bf16, the usual mixed-precision loop: a bf16
    model, fp32 master weights stepped by AdamW and copied back; the fp32 masters are returned."""
    model = make_model(n_blocks=n_blocks).to(dtype)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_(True) for _, p in named]
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=wd)
    losses = []
    for step in range(steps):
        model.swap = swap_at(step, swap_from)
        x, y = batch(step, rows)
        loss = model(x, y)
        loss.backward()
        for (_, p), m in zip(named, masters):
            m.grad = p.grad.float() if p.grad is not None else None
            p.grad = None
        opt.step()
        with torch.no_grad():
            for (_, p), m in zip(named, masters):
                p.copy_(m)
        losses.append(float(loss.detach()))
    out = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    out.update({n: m.detach().clone() for (n, _), m in zip(named, masters)})
    return losses, out


def max_rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[str, float]:
    errs = {k: float((got[k].float() - v.float()).norm() / v.float().norm().clamp_min(1e-12)) for k, v in want.items()}
    worst = max(errs, key=errs.get)
    return worst, errs[worst]
