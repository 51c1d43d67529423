"""Stage 3 with the default units where a unit's root forward does not run around its modules.

A unit is gathered around its root's forward. A stack run by `checkpoint_sequential` (which calls
an nn.Sequential's items past its forward) and a root that calls a child's method
(`self.encoder.encode(x)`) ran the child's modules with their unit sharded: the first forward was
refused in one line. Now nn.Sequential stacks are split into their blocks, and a module that runs
without its unit gathers the unit around its own calls (said once). Both train as torch does,
at D = 1 and D = 2, with reentrant and non-reentrant checkpoints.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import zero_offload
from _dist import run_ranks

LR, WD = 1e-2, 0.01
CPU = {"params": "cpu", "optimizer": "cpu", "grads": "cpu"}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stack, self.head = nn.Sequential(*[_Block() for _ in range(4)]), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = checkpoint_sequential(self.stack, 2, x, use_reentrant=self.reentrant)
        return (self.head(h) - y).pow(2).mean()


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode(x)


class _CallsMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.head = _Encoder(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.head(self.encoder.encode(x)) - y).pow(2).mean()


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return _CallsMethod() if kind == "method" else _Checkpointed(reentrant=kind == "reentrant")


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(4, 8, generator=g)
    return x.requires_grad_(), torch.randn(4, 2, generator=g)  # a reentrant checkpoint needs an input with grad


def _reference(model: nn.Module, steps: int) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD)
    for i in range(steps):
        m(*_batch(i)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _train(kind: str, rank: int = 0, world: int = 1) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    engine = zero_offload.initialize(_model(kind), {"stage": 3, "tiers": CPU,
                                                    "optimizer": {"lr": LR, "weight_decay": WD}})
    units = [u.name for u in engine.runtime.units]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            x, y = _batch(i)
            rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()
    got = engine.consolidated_state_dict()
    engine.close()
    return got, units, [str(w.message) for w in caught if str(w.message).startswith("stage 3:")]


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.parametrize("kind", ["plain", "reentrant"])
def test_checkpoint_sequential_trains_with_each_block_a_unit(kind: str) -> None:
    got, units, said = _train(kind)
    assert units == ["stack.0", "stack.1", "stack.2", "stack.3", "head"] and said == []
    _assert_close(got, _reference(_model(kind), 3))


def test_a_root_calling_a_childs_method_trains_and_says_so_once() -> None:
    got, units, said = _train("method")
    assert units == ["encoder", "head"]
    assert len(said) == 1 and "\n" not in said[0]
    assert said[0].startswith("stage 3: 'encoder.a' (Linear) ran while its unit 'encoder' was not gathered")
    _assert_close(got, _reference(_model("method"), 3))


def _two_ranks(rank: int, world: int) -> None:
    got, _, _ = _train("method", rank, world)
    if rank == 0:
        _assert_close(got, _reference(_model("method"), 3))


def test_a_root_calling_a_childs_method_at_two_ranks() -> None:
    run_ranks(_two_ranks, 2, timeout=90)
