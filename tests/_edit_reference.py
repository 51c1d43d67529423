"""The torch reference for tests that edit a model between steps: torch.optim.AdamW, with
`edit(i, model)` applied before step i's forward (what the engine tests do through the engine)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

Batch = Callable[[int], tuple[torch.Tensor, ...]]


def adamw_reference(model: nn.Module, steps: int, edit: Callable[[int, nn.Module], None], batch: Batch,
                    lr: float, weight_decay: float) -> dict[str, torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    for i in range(steps):
        edit(i, model)
        model(*batch(i)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
