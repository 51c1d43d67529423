"""`engine.gathered(...)`: whole parameters outside forward, read or edited, against torch.

At stage 3 a parameter is an empty tensor between passes: printing a weight's norm read 0.0,
`module.state_dict()` returned 0-element tensors (a saved model was empty), and weights loaded
after initialize went nowhere (a review). Inside `engine.gathered` they are whole; with
`modify=True` rank 0's values become the compute copy and the master, moments kept, as a torch
optimizer's state is kept when a weight is edited in place.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

import zero_offload
from _dist import run_ranks
from _edit_reference import adamw_reference

LR, WD = 1e-2, 0.01


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) - y).pow(2).mean()


def _net(seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _batch(i: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    rows = 8 // world
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def _config(params: str, opt: str, tmp_path: Path | str, stage: int = 3, **extra: object) -> dict:
    cfg = dict(stage=stage, tiers={"params": params, "optimizer": opt, "grads": "cpu"}, nvme_paths=[str(tmp_path)],
               optimizer={"lr": LR, "weight_decay": WD}, **extra)
    return cfg | ({"stage3": {"unit_modules": ["Linear"]}} if stage == 3 else {})


def _reference(steps: int, edit: Callable[[int, nn.Module], None]) -> dict[str, torch.Tensor]:
    return adamw_reference(_net(), steps, edit, _batch, LR, WD)


def _load_pretrained(i: int, m: nn.Module) -> None:
    if i == 0:
        m.load_state_dict(_net(seed=7).state_dict())


def _halve_b(i: int, m: nn.Module) -> None:
    if i == 2:
        with torch.no_grad():
            m.b.weight.mul_(0.5)
            m.b.bias.data = torch.full_like(m.b.bias, 0.25)


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)


TIERS = [("cpu", "cpu"), ("nvme", "nvme")]


@pytest.mark.parametrize("edit", [_load_pretrained, _halve_b], ids=["load_state_dict", "edit-mid-run"])
@pytest.mark.parametrize("params,opt", TIERS, ids=[f"{p}-{o}" for p, o in TIERS])
def test_weights_edited_inside_gathered_are_trained_from(params: str, opt: str,
                                                         edit: Callable[[int, nn.Module], None],
                                                         tmp_path: Path) -> None:
    engine = zero_offload.initialize(_net(), _config(params, opt, tmp_path))
    for i in range(4):
        with engine.gathered(modify=True):
            edit(i, engine.module)
        engine.backward(engine(*_batch(i)))
        engine.step()
    got = engine.consolidated_state_dict()
    engine.close()
    _assert_close(got, _reference(4, edit))


def test_reading_weights_between_steps(tmp_path: Path) -> None:
    """Inside the block a weight is whole and equals the master; outside, state_dict() is
    refused in one line instead of returning empty tensors."""
    engine = zero_offload.initialize(_net(), _config("cpu", "cpu", tmp_path))
    engine.backward(engine(*_batch(0)))
    engine.step()
    full = engine.consolidated_state_dict()
    with pytest.raises(RuntimeError, match=r"the model.state_dict\(\) while units .* are sharded would hold empty"):
        engine.module.state_dict()
    with pytest.raises(RuntimeError, match=r"b.state_dict\(\) while units \['b'\] are sharded"):
        engine.module.b.state_dict(prefix="b.")
    with engine.gathered(engine.module.b):
        torch.testing.assert_close(engine.module.b.weight.detach().clone(), full["b.weight"], rtol=0, atol=0)
        assert engine.module.b.state_dict()["bias"].shape == (16,)
    assert engine.module.b.weight.numel() == 0  # released again
    with engine.gathered():
        _assert_close(engine.module.state_dict(), full)
    engine.backward(engine(*_batch(1)))  # training goes on after the units came and went
    engine.step()
    engine.close()


def test_gathering_more_than_the_live_budget_is_refused(tmp_path: Path) -> None:
    cfg = _config("cpu", "cpu", tmp_path)
    cfg["stage3"] = {"unit_modules": ["Linear"], "live_budget_bytes": 1500}
    engine = zero_offload.initialize(_net(), cfg)
    with pytest.raises(RuntimeError, match=r"the units \['a', 'b', 'c'\] need \d+ bytes gathered at once, above "
                                           r"stage3.live_budget_bytes = 1500"):
        with engine.gathered():
            pass
    with engine.gathered([engine.module.a, engine.module.c.bias]):
        assert engine.module.c.weight.numel() == 64
    with pytest.raises(ValueError, match="tensor 0 of the 1 parameters named is not a parameter of the engine's model"):
        with engine.gathered(nn.Parameter(torch.zeros(2))):
            pass
    engine.backward(engine(*_batch(0)))
    engine.step()
    engine.close()


def _rank0_loads(rank: int, world: int, stage: int, nvme_dir: str) -> None:
    engine = zero_offload.initialize(_net(), _config("cpu" if stage == 3 else "device", "cpu", nvme_dir, stage=stage))
    with engine.gathered(modify=True):
        if rank == 0:  # only rank 0 reads the file, as a launcher script often does
            engine.module.load_state_dict(_net(seed=7).state_dict())
    for i in range(3):
        engine.backward(engine(*_batch(i, rank, world)))
        engine.step()
    got = engine.consolidated_state_dict()
    engine.close()
    if rank == 0:
        _assert_close(got, _reference(3, _load_pretrained))


@pytest.mark.parametrize("stage", [2, 3])
def test_rank0s_edits_become_every_ranks(stage: int, tmp_path: Path) -> None:
    run_ranks(_rank0_loads, 2, timeout=90, stage=stage, nvme_dir=str(tmp_path))


def test_nesting_is_refused_and_leaves_the_engine_working(tmp_path: Path) -> None:
    """The inner block's release of read-aheads took the outer block's units away and gave their
    bytes back twice: every later use failed on the budget's assertion, close() too (a review)."""
    engine = zero_offload.initialize(_net(), _config("cpu", "cpu", tmp_path))
    with engine.gathered(engine.module.a):
        with pytest.raises(RuntimeError, match=r"already inside engine.gathered\(\)"):
            with engine.gathered(engine.module.a):
                pass
        assert engine.module.a.weight.numel() == 128  # the outer block's units stay whole
    assert engine.runtime.prefetcher.budget.live == 0
    engine.backward(engine(*_batch(0)))
    engine.step()
    engine.close()


@pytest.mark.parametrize("how", ["data=", "mul_"])
def test_an_edit_outside_gathered_is_refused_and_dropped(how: str, tmp_path: Path) -> None:
    """`p.data = t` (or a parametrization's set_) between passes was overwritten by the next
    gather without a word (a review); an in-place edit of the empty tensor did nothing. Both
    are refused at the gather, the change dropped, and training goes on from the shards."""
    engine = zero_offload.initialize(_net(), _config("cpu", "cpu", tmp_path))
    engine.backward(engine(*_batch(0)))
    engine.step()
    before = engine.consolidated_state_dict()
    with torch.no_grad():
        if how == "data=":
            engine.module.b.weight.data = torch.zeros(16, 16)
        else:
            engine.module.b.weight.mul_(0.5)
    with pytest.raises(RuntimeError, match=r"parameter 'b.weight' \(unit 'b'\) was changed while its unit was "
                                           r"sharded, between passes, and the change is dropped"):
        engine(*_batch(1))
    _assert_close(engine.consolidated_state_dict(), before)
    engine.backward(engine(*_batch(1)))
    engine.step()
    engine.close()


@pytest.mark.parametrize("where", ["model", "block, before initialize", "block, after initialize"])
def test_torch_compile_is_refused_at_stage_3(where: str, tmp_path: Path) -> None:
    """Every form failed deep inside Dynamo or autograd ('modified by an inplace operation'):
    refused in one line instead (stages 0-2 run compiled models)."""
    model = _net()
    if where == "model":
        model = torch.compile(model)
    elif where == "block, before initialize":
        model.b.compile()
    with pytest.raises(RuntimeError, match=r"stage 3 does not run under torch.compile"):
        engine = zero_offload.initialize(model, _config("cpu", "cpu", tmp_path))
        model.b.compile()
        engine(*_batch(0))
    if where == "block, after initialize":
        engine.close()
    assert not [d for d in tmp_path.iterdir()]


def test_autograd_grad_at_stage_3_says_what_is_unsupported(tmp_path: Path) -> None:
    engine = zero_offload.initialize(_net(), _config("cpu", "cpu", tmp_path))
    x, y = _batch(0)
    x.requires_grad_(True)
    with pytest.raises(RuntimeError, match="at stage 3 torch.autograd.grad and double backward"):
        torch.autograd.grad(engine(x, y), x)
    engine.backward(engine(*_batch(0)))  # the engine goes on
    engine.step()
    engine.close()


def test_bad_arguments_and_reshaped_parameters_inside_gathered_are_one_line(tmp_path: Path) -> None:
    engine = zero_offload.initialize(_net(), _config("cpu", "cpu", tmp_path))
    with pytest.raises(TypeError, match="engine.gathered: expected modules or parameters, got str"):
        with engine.gathered(["a"]):
            pass
    with pytest.raises(RuntimeError, match=r"parameter 'b.weight' of unit 'b' was given shape \(2, 2\); it has \(16, 16\)"):
        with engine.gathered(engine.module.b, modify=True):
            engine.module.b.weight.data = torch.zeros(2, 2)
    assert engine.runtime.prefetcher.budget.live == 0
    engine.backward(engine(*_batch(0)))
    engine.step()
    engine.close()
